// Best-first token trees (aotgen/runtime/tree_shape.py, rule for rule): which nodes of the
// chain and of the leaves beside it go into the tree graph's rows, and the acceptance
// estimates that value them. Internal to the runtime.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tree.h"

namespace aotgen::detail {

constexpr int64_t kMaxSiblings = 7;  // candidates tried per position, as llama.cpp's f = 1..7

// A one-token branch beside the chain token at `depth` (tree_shape.py Leaf).
struct Leaf {
  double value;
  int64_t depth, rank, token;
  double p;
};

// How often verification accepted a drafted node, by kind (chain pick or leaf) and draft
// probability, over the rounds so far (tree_shape.py Calibration).
class Calibration {
 public:
  static constexpr int kBins = 10;  // acceptance tracked per tenth of draft probability

  // The bin's rate, shrunk towards the kind's rate over all bins (itself shrunk towards p).
  double estimate(double p, bool leaf) const;
  // The tree just proposed, with (leaf, draft probability) per node after the root.
  void drafted(const Tree& tree, std::vector<std::pair<bool, double>> scores);
  // The path verification accepted in it: counts the nodes whose parent is on the path.
  void verified(const std::vector<int64_t>& path);

 private:
  int64_t reached_[2][kBins] = {};
  int64_t accepted_[2][kBins] = {};
  std::vector<int64_t> parents_;
  std::vector<std::pair<bool, double>> scores_;
};

// The candidates beside the chain token at `depth` (probs/tokens ranked, best first), valued
// parent_value * calibration.estimate(p).
void add_ranked_leaves(std::vector<Leaf>& leaves, const std::vector<double>& probs,
                       const std::vector<int64_t>& tokens, int64_t chain_token, int64_t depth,
                       double parent_value, const Calibration& calibration);

// (leaf, draft probability) per node of a tree of `kept` chain nodes and `leaves`.
std::vector<std::pair<bool, double>> node_scores(const std::vector<double>& chain_p,
                                                 int64_t kept, const std::vector<Leaf>& leaves);

// The chain nodes to keep (a prefix) and the leaves: the budget - 1 most valuable nodes, at
// most n_parallel - 1 of them leaves (by depth, then rank); ties go to chain nodes, then
// shallower ones.
std::pair<int64_t, std::vector<Leaf>> best_first(const std::vector<double>& chain_values,
                                                 const std::vector<Leaf>& all_leaves,
                                                 int64_t budget, int64_t n_parallel);

// Whether the chain's next node could not be kept (tree_shape.py chain_is_done).
bool chain_is_done(const std::vector<double>& chain_values, const std::vector<Leaf>& leaves,
                   int64_t budget, int64_t n_parallel);

// The tree of a chain prefix and leaves (chain nodes first, at indices equal to depths).
Tree assemble(int64_t root, const std::vector<std::pair<int64_t, at::Tensor>>& chain,
              int64_t kept, const std::vector<Leaf>& leaves);

}  // namespace aotgen::detail
