// aotgen/runtime/rules.py's penalties, min_tokens and reasoning budget, op for op, so that a
// request gets Python's tokens.
#include "rules.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "detail.h"

namespace aotgen {

void Penalties::validate() const {
  if (!(std::isfinite(repetition) && repetition > 0)) {
    throw std::invalid_argument("repetition penalty must be > 0 (1 is off), got " +
                                std::to_string(repetition));
  }
  for (const auto& [name, value] : {std::pair{"presence", presence}, {"frequency", frequency}}) {
    if (!(std::isfinite(value) && value >= -2 && value <= 2)) {
      throw std::invalid_argument(std::string(name) + " penalty must be in -2..2 (0 is off), got " +
                                  std::to_string(value));
    }
  }
  for (const auto& [token, bias] : logit_bias) {
    if (!(std::isfinite(bias) && bias >= -100 && bias <= 100)) {
      throw std::invalid_argument("logit bias of token " + std::to_string(token) +
                                  " must be in -100..100, got " + std::to_string(bias));
    }
  }
}

namespace detail {

TokenRules::TokenRules(const Penalties& penalties, const std::vector<int64_t>& prompt,
                       int64_t vocab, std::set<int64_t> eos, int64_t min_tokens,
                       const std::set<int64_t>& ends, std::optional<ReasoningBudget> budget)
    : penalties_(penalties), eos_(std::move(eos)), counts_(at::zeros({vocab})),
      in_prompt_(at::zeros({vocab}, at::kBool)), bias_(at::zeros({vocab})),
      min_tokens_(min_tokens),
      ends_(at::tensor(std::vector<int64_t>(ends.begin(), ends.end()), at::kLong)),
      budget_(std::move(budget)) {
  bool* seen = in_prompt_.data_ptr<bool>();
  for (const int64_t tok : prompt) seen[tok] = true;
  float* bias = bias_.data_ptr<float>();
  for (const auto& [token, value] : penalties_.logit_bias) bias[token] += static_cast<float>(value);
}

namespace {

// Rows ([V] or [n, V]) whose forced token (none: none) is all they allow.
at::Tensor force(const at::Tensor& rows, const std::vector<std::optional<int64_t>>& forced) {
  if (std::none_of(forced.begin(), forced.end(), [](const auto& t) { return t.has_value(); })) {
    return rows;
  }
  at::Tensor flat = rows.reshape({-1, rows.size(-1)}).clone();
  for (std::size_t row = 0; row < forced.size(); ++row) {
    if (!forced[row]) continue;
    const auto r = static_cast<int64_t>(row);
    flat[r].fill_(-std::numeric_limits<double>::infinity());
    flat[r][*forced[row]] = 0.0;
  }
  return flat.reshape(rows.sizes());
}

}  // namespace

at::Tensor TokenRules::restrict(const at::Tensor& logits) const {
  const at::Tensor out = hold_open(penalize(logits, counts_), {taken()});
  return budget_ ? force(out, {budget_->forced()}) : out;
}

void TokenRules::advance(const std::vector<int64_t>& tokens) {
  for (const int64_t tok : tokens) {
    if (is_eos(tok)) return;
    if (budget_) budget_->advance({tok});
    counts_[tok] += 1;
    tokens_.push_back(tok);
  }
}

int64_t TokenRules::takes(const std::vector<int64_t>& tokens) const {
  return budget_ ? budget_->along(tokens).first : static_cast<int64_t>(tokens.size());
}

void TokenRules::rollback(int64_t count) {
  if (budget_) budget_->rollback(count);
  for (int64_t i = 0; i < count; ++i) {
    counts_[tokens_.back()] -= 1;
    tokens_.pop_back();
  }
}

at::Tensor TokenRules::along(const at::Tensor& rows, const std::vector<int64_t>& tokens) const {
  const auto n = static_cast<int64_t>(tokens.size());
  at::Tensor steps = at::zeros({n + 1, counts_.size(0)});  // the counts each row adds
  for (int64_t i = 0; i < n; ++i) steps.slice(0, i + 1).select(1, tokens[i]) += 1;
  std::vector<int64_t> lengths(n + 1);
  for (int64_t i = 0; i <= n; ++i) lengths[i] = taken() + i;
  const at::Tensor out = hold_open(penalize(rows, counts_ + steps), lengths);
  return budget_ ? force(out, budget_->along(tokens).second) : out;
}

at::Tensor TokenRules::over_tree(const at::Tensor& rows, const std::vector<int64_t>& tokens,
                                 const std::vector<int64_t>& parents) const {
  const auto n = static_cast<int64_t>(tokens.size());
  at::Tensor steps = at::zeros({n, counts_.size(0)});  // the counts each node's path adds
  std::vector<int64_t> lengths(n, taken());  // the answer's length after each node's path
  for (int64_t node = 1; node < n; ++node) {
    steps[node].copy_(steps[parents[node]]);
    steps[node][tokens[node]] += 1;
    lengths[node] = lengths[parents[node]] + 1;
  }
  const at::Tensor out = hold_open(penalize(rows, counts_ + steps), lengths);
  return budget_ ? force(out, budget_->over_tree(tokens, parents)) : out;
}

at::Tensor TokenRules::hold_open(const at::Tensor& rows, const std::vector<int64_t>& lengths) const {
  if (taken() >= min_tokens_ || ends_.numel() == 0) return rows;
  const double inf = std::numeric_limits<double>::infinity();
  const at::Tensor flat = rows.reshape({-1, rows.size(-1)});
  const at::Tensor shut = flat.index_fill(1, ends_, -inf);
  const at::Tensor short_rows = at::tensor(lengths, at::kLong) < min_tokens_;
  const at::Tensor held = short_rows & (std::get<0>(shut.max(-1)) > -inf);  // else allowed
  return at::where(held.unsqueeze(1), shut, flat).reshape(rows.sizes());
}

at::Tensor TokenRules::penalize(const at::Tensor& logits, const at::Tensor& counts) const {
  at::Tensor out = logits.to(at::kFloat) + bias_;
  if (penalties_.repetition != 1.0) {
    const at::Tensor seen = in_prompt_ | (counts > 0);
    const double rep = penalties_.repetition;
    out = at::where(seen, at::where(out > 0, out / rep, out * rep), out);
  }
  return out - counts * penalties_.frequency - (counts > 0).to(at::kFloat) * penalties_.presence;
}

std::optional<TokenRules> make_rules(const GenerationConfig& config,
                                     const std::vector<int64_t>& prompt, int64_t vocab,
                                     const std::vector<int64_t>& eos_ids,
                                     std::optional<ReasoningBudget> budget) {
  std::set<int64_t> ends(config.stop_token_ids.begin(), config.stop_token_ids.end());
  if (!config.ignore_eos) ends.insert(eos_ids.begin(), eos_ids.end());
  const bool holds = config.min_tokens > 0 && !ends.empty();  // else min_tokens is a no-op
  if (!config.penalties.active() && !holds && !budget) return std::nullopt;
  std::set<int64_t> eos;  // the eos ids that end the answer: none under ignore_eos
  if (!config.ignore_eos) eos.insert(eos_ids.begin(), eos_ids.end());
  return TokenRules(config.penalties, prompt, vocab, eos, config.min_tokens, ends,
                    std::move(budget));
}

int64_t select(const at::Tensor& logits, const SamplingParams& params, at::Generator& gen,
               std::optional<TokenRules>& rules) {
  if (!rules) return select_next(logits, params, gen);
  const int64_t tok = select_next(rules->restrict(logits), params, gen);
  rules->advance({tok});
  return tok;
}

}  // namespace detail
}  // namespace aotgen
