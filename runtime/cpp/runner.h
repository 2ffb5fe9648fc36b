// Internals shared by engine.cpp and batch_engine.cpp (not part of the public API): one
// AOTInductor graph, one model of a package with its KV cache (ModelRunner in
// aotgen/runtime/engine.py), and the loaded engine's state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "aotgen.h"
#include "cuda_graph.h"
#include "detail.h"
#include "reasoning_budget.h"

namespace torch::inductor {
class AOTIModelPackageLoader;
}

namespace aotgen::detail {

struct Tree;

// Which tokens each row (slot) of a KV cache holds from position 0 on, so that a request runs
// only the prompt past the prefix its row already holds (aotgen/runtime/cached_tokens.py).
// Kept truthful rather than complete: a write at `start` first forgets everything from there,
// a write it cannot name (a draft's keys in the target's layers, a tree's nodes) is only
// forgotten, and a write past the recorded end records nothing.
// With a ring (kv_cache.ring: sliding layers keep position p in cell p % cells) it also keeps
// the position each cell of each row holds (-1: none or unknown), and a row goes on at a
// position only where its cells still hold the window before it.
class CachedTokens {
 public:
  explicit CachedTokens(int64_t slots, int64_t ring_cells = 0, int64_t ring_window = 0);
  void clear();
  void forget(int64_t slot, int64_t start);
  // tokens now sit at positions start.. of `slot` (after forget(slot, start)).
  void wrote(int64_t slot, int64_t start, const int64_t* tokens, int64_t count);
  // Positions (or tree slots) start.. of `slot` now hold keys that are not the record's:
  // forgotten, and their ring cells unknown.
  void overwrote(int64_t slot, int64_t start, int64_t count);
  // `slot`'s ring layers were copied whole from `donor`'s row.
  void copy_cells(int64_t donor, int64_t slot);
  // How many leading tokens the row holds such that it can go on after them.
  int64_t prefix(int64_t slot, const std::vector<int64_t>& tokens) const;
  // All that the row holds of the prompt but its last token, whose logits pick the first.
  int64_t reusable(int64_t slot, const std::vector<int64_t>& prompt) const;
  // The free slot holding the longest prefix of the prompt (the first on a tie).
  int64_t best_slot(const std::deque<int64_t>& free, const std::vector<int64_t>& prompt) const;
  // The row holding the longest prefix of tokens, free or running, and that prefix's length.
  std::pair<int64_t, int64_t> holder(const std::vector<int64_t>& tokens) const;

 private:
  int64_t prefix_of(int64_t slot, const int64_t* tokens, std::size_t count) const;
  void place(int64_t slot, int64_t start, int64_t count, bool known);
  // The largest b <= n at which the row's cells still hold the window before b (n without a
  // ring); 0 where none within a ring's length of n does.
  int64_t resumable(int64_t slot, int64_t n) const;

  std::vector<std::vector<int64_t>> rows_;
  int64_t ring_cells_ = 0, ring_window_ = 0;
  std::vector<std::vector<int64_t>> cells_;  // [slot][cell]: the position it holds, or -1
};

// One AOTInductor graph; checks the token count (and batch size) it was compiled for and
// its output. On a GPU its inputs go to the device and its logits come back to the CPU; a
// fixed-width graph that takes the cache positions it attends (`"attention": "key_pos"`)
// is replayed as a CUDA graph there unless `cuda_graphs` is off.
class Graph {
 public:
  Graph(const std::filesystem::path& pt2, const nlohmann::json& signature, int64_t vocab,
        const at::Device& device, bool cuda_graphs);
  ~Graph();

  int64_t min_tokens() const { return min_tokens_; }
  int64_t max_tokens() const { return max_tokens_; }

  // user_managed: the graph uses our tensors in place, so all graphs share one copy.
  void bind(const std::unordered_map<std::string, at::Tensor>& weights);

  // tokens [B, T], input_pos ([T] for a single-sequence graph, [B, T] for a batched one)
  // -> logits [B, T, V] on the CPU ([1, 1, V] from the prefill graph); the caches are updated
  // in place. The tree graph also takes tree_mask [T, T] (bool), a batched graph the cache
  // rows `slots` [B], after the caches. The call reads cache positions below `attend`
  // (-1: the whole cache).
  at::Tensor operator()(const at::Tensor& tokens, const at::Tensor& input_pos,
                        const std::vector<at::Tensor>& caches, const at::Tensor& extra = {},
                        int64_t attend = -1);

 private:
  // One call on inputs already on the device; a key_pos graph attends `span` positions.
  at::Tensor run(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& caches,
                 int64_t span);
  // The span of keys for a call that reads positions below `attend` (engine.py key_span).
  int64_t span(int64_t attend) const;

  std::string name_;
  int64_t min_tokens_, max_tokens_, min_batch_, max_batch_, vocab_, logit_rows_;
  at::Device device_;
  at::Tensor key_pos_;  // arange(cache_len) on the device, for graphs that take key_pos
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
  std::unique_ptr<CudaReplays> replays_;
};

// One model of a package: its graphs, weights bound once, and its KV cache: its own, or the
// target's for a draft built with kv_cache.shared_with: target. The target's cache has
// `slots` rows per layer ([slots, kv_heads, cache_len, head_dim]); a row is a [1, ...] view
// that the single-sequence graphs run on in place, and the batched graphs (loaded only when
// slots > 1) take all of them. A sliding layer of a ring cache (kv_cache.ring) has the ring's
// cells in place of cache_len.
class ModelRunner {
 public:
  // Loads the graphs' code; the weights come later, in bind_weights. `target` is the target's
  // runner when this is a draft (it may share the target's cache).
  ModelRunner(const std::filesystem::path& pt2, const nlohmann::json& entry,
              const ModelRunner* target = nullptr, int64_t slots = 1,
              const at::Device& device = at::kCPU, bool cuda_graphs = true);
  ~ModelRunner();

  // Binds the weights file to every graph, once its hashes are verified; `mapped` holds the
  // mapping the hashes were read through (absent with --no-verify: mapped here).
  void bind_weights(const std::filesystem::path& root, const nlohmann::json& entry,
                    const MappedFiles& mapped);

  int64_t vocab_size() const { return vocab_size_; }
  bool shares_cache() const { return shares_cache_; }
  int64_t tree_len() const;
  int64_t prefill_chunk() const { return prefill_chunk_; }
  int64_t verify_len() const { return verify_len_; }
  int64_t slots() const { return static_cast<int64_t>(slot_caches_.size()); }
  bool has_batch_decode() const { return batch_decode_ != nullptr; }
  bool has_batch_verify() const { return batch_verify_ != nullptr; }
  // Slot 0's cache rows: all of the cache when there is one slot.
  const std::vector<at::Tensor>& caches() const { return slot_caches_[0]; }
  // What the cache rows hold: the target's record for a draft on the target's cache.
  CachedTokens& cached() { return *cached_; }

  // How many leading tokens row `slot` holds, after copying into it what another row holds
  // of them beyond its own (ModelRunner.share_prefix in engine.py): a prefix shared by
  // requests running at once runs once.
  int64_t share_prefix(int64_t slot, const std::vector<int64_t>& tokens);

  // Makes row `slot` hold tokens from position 0, running only those past the prefix some
  // row already holds (copied; all of them without `reuse`): a draft's prompt.
  void prefill_reusing(const std::vector<int64_t>& tokens, int64_t slot, bool reuse);

  // Scores a token tree rooted at position start in one tree-graph call (padded to its
  // rows): logits [tree.size(), V]; node i's keys/values land in slot start + i.
  at::Tensor tree_forward(const Tree& tree, int64_t start);

  // Runs tokens at positions start_pos.. through the fitting graph(s) in the cache of
  // `slot`: logits [T, V] for every position if all_logits, else [V] for the last one.
  at::Tensor forward(const std::vector<int64_t>& tokens, int64_t start_pos,
                     bool all_logits = false, int64_t slot = 0);

  // The per-token hot path: one decode call, logits [V].
  at::Tensor decode(int64_t token, int64_t pos, int64_t slot = 0);

  // One batched-graph call (batch_decode, or batch_verify when T > 1): tokens, positions
  // [B, T] in cache rows slots [B]; logits [B, T, V].
  at::Tensor batch(const at::Tensor& tokens, const at::Tensor& positions,
                   const at::Tensor& slots);

 private:
  // Positions to run for n tokens at pos: ModelRunner._graph_width in engine.py (a few
  // tokens go through the verify graph, padded: the prefill graph is slowest there; every
  // row's logits never through prefill, which returns its last row only).
  int64_t graph_width(int64_t n, int64_t pos, bool all_logits = false) const;

  int64_t vocab_size_;
  at::Device device_;  // of the weights and caches; logits come back to the CPU
  std::unordered_map<std::string, at::Tensor> weights_;  // the graphs use these in place
  std::unique_ptr<Graph> prefill_, decode_, verify_, tree_, batch_decode_, batch_verify_;
  std::vector<at::Tensor> caches_;                    // all slots
  std::vector<std::vector<at::Tensor>> slot_caches_;  // [slot][layer]: [1, ...] rows
  // A draft on the target's cache only makes the target's record forget what it writes (and
  // its ring cells unknown).
  void wrote(int64_t slot, int64_t start, const int64_t* tokens, int64_t count);

  std::shared_ptr<CachedTokens> cached_;
  bool shares_cache_ = false;
  int64_t cache_len_ = 0;
  int64_t prefill_chunk_ = 0;
  int64_t verify_len_ = 0;
};

// A request's checks before it runs (Engine::generate's and BatchEngine::submit's): throws
// GenerationError / std::invalid_argument with the reason.
struct EngineState;
void check_request(const EngineState& e, const std::vector<int64_t>& prompt_ids,
                   const GenerationConfig& config);

// A request's reasoning budget, from where its prompt leaves the reasoning (Engine.rules in
// engine.py); none without one. Throws GenerationError when the template has no reasoning.
std::optional<ReasoningBudget> reasoning_budget(const EngineState& e,
                                                const GenerationConfig& config,
                                                const std::vector<int64_t>& prompt_ids);
// Engine::thinking and Engine::harmony_head.
std::optional<bool> thinking_of(const EngineState& e, const std::vector<int64_t>& prompt_ids);
std::optional<std::string> harmony_head_of(const EngineState& e,
                                           const std::vector<int64_t>& prompt_ids);

// The loaded package behind an Engine.
struct EngineState {
  std::filesystem::path root;
  nlohmann::json manifest;
  std::optional<Tokenizer> tokenizer;  // always set once loaded
  std::vector<int64_t> eos_ids;
  ModelSampling model_sampling;  // generation_config.json's sampling values
  std::optional<int64_t> bos_id;  // led plain prompts when the checkpoint asks (add_bos_token)
  std::optional<ChatTemplate> chat_template;
  std::string template_kwargs;  // JSON object text: more chat template variables
  std::unique_ptr<ModelRunner> target;
  std::unique_ptr<ModelRunner> draft;
  int64_t max_seq_len = 0;
  int64_t verify_k = 0;
  double load_s = 0;
  std::mutex generate_mutex;  // one KV cache: one request at a time
  std::shared_ptr<LookupCache> lookup_cache;  // what n-gram lookup learnt from earlier requests

  // Adds a finished request's text to the lookup cache, if there is one.
  void learn(const std::vector<int64_t>& prompt, const std::vector<int64_t>& answer) {
    if (!lookup_cache) return;
    std::vector<int64_t> text(prompt);
    text.insert(text.end(), answer.begin(), answer.end());
    lookup_cache->add(text);
  }
};

}  // namespace aotgen::detail

namespace aotgen {
struct Engine::Impl : detail::EngineState {};
}  // namespace aotgen
