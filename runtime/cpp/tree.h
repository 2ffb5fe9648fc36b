// Tree speculation (aotgen/runtime/tree.py and tree_draft.py, op for op): a token tree, its
// verification, the KV fix-up of the winning path, and tree drafting. Internal to the runtime.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "aotgen.h"

namespace aotgen::detail {

// Node 0 is the current token (not yet in the target's cache); parents[i] < i, and the main
// draft chain sits at node indices equal to its depths.
struct Tree {
  std::vector<int64_t> tokens;
  std::vector<int64_t> parents;
  std::vector<at::Tensor> probs;  // the draft distribution a node was drawn from; undefined: fixed
  bool looked_up = false;         // from n-gram lookup, not the draft model

  static Tree root(int64_t token);
  int64_t add(int64_t parent, int64_t token, const at::Tensor& probs = at::Tensor());
  int64_t size() const { return static_cast<int64_t>(tokens.size()); }
  std::vector<int64_t> depths() const;
  int64_t depth() const;
  std::vector<int64_t> children(int64_t node) const;
  // [size, size] bool: row i sees its ancestors and itself; padding rows the root and itself.
  at::Tensor mask(int64_t size) const;
};

// The accepted path (node indices, root first) and the target's token after it.
struct TreeVerdict {
  std::vector<int64_t> path;
  int64_t next = 0;
};

// Greedy: follow the target's argmax. Sampled: SpecInfer's multi-step speculative sampling.
// logits: [tree.size(), V].
TreeVerdict verify_tree(const Tree& tree, const at::Tensor& logits, const SamplingParams& params,
                        at::Generator& generator);

// Copy the path's keys/values from slot start + node to start + depth (a ring layer: their
// cells); returns the count.
int64_t commit_path(const std::vector<at::Tensor>& caches, int64_t start,
                    const std::vector<int64_t>& path);

// What tree drafting needs of the draft model (engine.cpp's ModelRunner).
class DraftModel {
 public:
  virtual ~DraftModel() = default;
  virtual at::Tensor forward(const std::vector<int64_t>& tokens, int64_t start) = 0;  // [V]
  virtual at::Tensor decode(int64_t token, int64_t pos) = 0;                          // [V]
  virtual bool shares_cache() const = 0;
  // Puts the prompt in the draft's own cache (what it already holds of it is kept).
  virtual void prefill(const std::vector<int64_t>& prompt) = 0;
};

class TreeProposer {
 public:
  virtual ~TreeProposer() = default;
  // A tree of at most `budget` nodes and depth k to follow history.
  virtual Tree propose(const std::vector<int64_t>& history, int64_t k, int64_t budget) = 0;
  // The path verification accepted in the tree just proposed (node indices, root first).
  virtual void verified(const std::vector<int64_t>& /*path*/) {}
  virtual void accepted(int64_t /*pos*/) {}
};

// The tree proposer of a speculative mode (tree_draft.py tree_proposer); draft may be null
// for Speculative::Ngram.
std::unique_ptr<TreeProposer> make_tree_proposer(Speculative mode, DraftModel* draft,
                                                 const std::vector<int64_t>& prompt,
                                                 const SamplingParams& params,
                                                 at::Generator& generator, const TreeParams& tree,
                                                 int64_t ngram_min, int64_t ngram_max,
                                                 const LookupCache* shared = nullptr);

}  // namespace aotgen::detail
