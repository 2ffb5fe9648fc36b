// A request's penalties, min_tokens and reasoning budget and their state
// (aotgen/runtime/rules.py without the grammar, which the C++ runtime does not take): what it
// does to the logits before each token is chosen.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "aotgen.h"
#include "reasoning_budget.h"

namespace aotgen::detail {

// One request's penalties and the answer's token counts, which advance with each accepted
// token (eos, none under ignore_eos, is never taken). While the answer is shorter than
// min_tokens, the tokens that would end it (`ends`: eos unless ignored, stop token ids) are
// refused; where a spent reasoning budget forces its close, only the forced token is allowed.
// Speculative decoding applies them to each verify row as they stand after the proposal
// tokens before it (along), and to each tree node's row after its path (over_tree); drafters
// apply them while drafting and roll back.
class TokenRules {
 public:
  TokenRules(const Penalties& penalties, const std::vector<int64_t>& prompt, int64_t vocab,
             std::set<int64_t> eos, int64_t min_tokens, const std::set<int64_t>& ends,
             std::optional<ReasoningBudget> budget = std::nullopt);

  // One row ([V] or [1, V]) with the rules as they stand now.
  at::Tensor restrict(const at::Tensor& logits) const;
  // Take a step's tokens, chosen under these rules, up to eos.
  void advance(const std::vector<int64_t>& tokens);
  void rollback(int64_t count);
  int64_t taken() const { return static_cast<int64_t>(tokens_.size()); }
  bool is_eos(int64_t token) const { return eos_.count(token) > 0; }
  // Verify rows [n + 1, V] for a proposal of n tokens: row i as they stand after tokens[:i].
  at::Tensor along(const at::Tensor& rows, const std::vector<int64_t>& tokens) const;
  // Tree rows: node i's as they stand after its path (node 0, the root: as they stand now).
  at::Tensor over_tree(const at::Tensor& rows, const std::vector<int64_t>& tokens,
                       const std::vector<int64_t>& parents) const;
  // How many leading proposal tokens the rules take (a spent budget forces another).
  int64_t takes(const std::vector<int64_t>& tokens) const;

 private:
  // Bias and penalties with the answer's token `counts` (broadcast over rows).
  at::Tensor penalize(const at::Tensor& logits, const at::Tensor& counts) const;
  // min_tokens: the ending tokens at -inf in rows whose answer (`lengths`, per row) is
  // still short.
  at::Tensor hold_open(const at::Tensor& rows, const std::vector<int64_t>& lengths) const;

  Penalties penalties_;
  std::set<int64_t> eos_;
  at::Tensor counts_;     // [V] float32: the answer's tokens
  at::Tensor in_prompt_;  // [V] bool
  at::Tensor bias_;       // [V] float32
  int64_t min_tokens_;
  at::Tensor ends_;  // [n] int64: the tokens that end an answer
  std::vector<int64_t> tokens_;
  std::optional<ReasoningBudget> budget_;
};

// The rules of a request, none without penalties, min_tokens or a budget (Engine::rules in
// engine.py).
std::optional<TokenRules> make_rules(const GenerationConfig& config,
                                     const std::vector<int64_t>& prompt, int64_t vocab,
                                     const std::vector<int64_t>& eos_ids,
                                     std::optional<ReasoningBudget> budget);
// select_next under the request's rules, which then take the chosen token.
int64_t select(const at::Tensor& logits, const SamplingParams& params, at::Generator& gen,
               std::optional<TokenRules>& rules);

}  // namespace aotgen::detail
