// Sampling and speculative verification: aotgen/runtime/sampling.py and speculative.py with
// the same ATen operations in the same order, so that results (and the random numbers drawn
// from a seeded generator) are the same as in Python.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/rsub.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <limits>
#include <random>

#include "detail.h"

namespace aotgen {

namespace {

constexpr int64_t kTopPHead = 256;  // top-p first looks at this many most likely tokens

std::string shortest(double value) {  // 0.9, not 0.900000
  std::array<char, 32> buf{};
  const auto end = std::to_chars(buf.data(), buf.data() + buf.size(), value).ptr;
  return {buf.data(), end};
}

}  // namespace

void SamplingParams::validate() const {
  if (!std::isfinite(temperature) || temperature < 0) {
    throw std::invalid_argument("temperature must be a finite number >= 0, got " +
                                shortest(temperature));
  }
  if (top_k < 0) {
    throw std::invalid_argument("top_k must be >= 0 (0 disables it), got " +
                                std::to_string(top_k));
  }
  if (!(top_p > 0.0 && top_p <= 1.0)) {
    throw std::invalid_argument("top_p must be in (0, 1] (1 disables it), got " +
                                shortest(top_p));
  }
  if (!(min_p >= 0.0 && min_p <= 1.0)) {
    throw std::invalid_argument("min_p must be in [0, 1] (0 disables it), got " +
                                shortest(min_p));
  }
}

namespace detail {

at::Generator make_generator(std::optional<uint64_t> seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed ? *seed : std::random_device{}());
}

namespace {

// Keep the smallest most-likely set reaching top_p mass, renormalised (sampling.py _top_p).
at::Tensor top_p_filter(const at::Tensor& probs, double top_p, int64_t head) {
  const int64_t vocab = probs.size(-1);
  int64_t width = std::min(std::max<int64_t>(head, 1), vocab);
  at::Tensor values;
  at::Tensor indices;
  at::Tensor cumulative;
  while (true) {
    std::tie(values, indices) = at::topk(probs, width, -1);  // sorted, descending
    cumulative = values.cumsum(-1);
    if (width == vocab || (cumulative.select(-1, -1) >= top_p).all().item<bool>()) break;
    width = std::min(width * 8, vocab);
  }
  values = values.masked_fill(cumulative - values >= top_p, 0.0);
  const at::Tensor kept = at::zeros_like(probs).scatter_(-1, indices, values);
  return kept / kept.sum(-1, /*keepdim=*/true);
}

}  // namespace

at::Tensor residual_probs(const at::Tensor& target_probs, const at::Tensor& draft_probs) {
  const at::Tensor residual = (target_probs - draft_probs).clamp_(0.0);
  const at::Tensor empty = residual.sum(-1, /*keepdim=*/true) <= 0;
  return at::where(empty, target_probs, residual);
}

at::Tensor logits_to_probs(const at::Tensor& input, const SamplingParams& params) {
  at::Tensor logits = input.to(at::kFloat);
  if (params.greedy()) {
    return at::zeros_like(logits).scatter_(-1, logits.argmax(-1, /*keepdim=*/true), 1.0);
  }
  logits = logits / params.temperature;
  if (params.top_k > 0 && params.top_k < logits.size(-1)) {
    const at::Tensor kth = std::get<0>(at::topk(logits, params.top_k, -1)).narrow(-1, -1, 1);
    // Ties with the k-th largest stay in.
    logits = logits.masked_fill(logits < kth, -std::numeric_limits<double>::infinity());
  }
  at::Tensor probs = at::softmax(logits, -1);
  if (params.top_p < 1.0) {
    probs = top_p_filter(probs, params.top_p, params.top_k ? params.top_k : kTopPHead);
  }
  if (params.min_p > 0.0) {
    const at::Tensor floor = params.min_p * probs.amax(-1, /*keepdim=*/true);
    probs = probs.masked_fill(probs < floor, 0.0);
    probs = probs / probs.sum(-1, /*keepdim=*/true);
  }
  return probs;
}

at::Tensor sample(const at::Tensor& probs, at::Generator& generator) {
  // u in (0, total]: the first index with cdf >= u never has zero probability.
  const at::Tensor cdf = probs.to(at::kFloat).cumsum(-1);
  const at::Tensor total = cdf.narrow(-1, -1, 1);
  const at::Tensor u = at::rsub(at::rand(total.sizes(), generator), 1.0) * total;
  return at::searchsorted(cdf, u).squeeze(-1);
}

int64_t select_next(const at::Tensor& logits, const SamplingParams& params,
                    at::Generator& generator) {
  if (logits.numel() != logits.size(-1)) {
    throw std::invalid_argument("select_next takes logits for one position");
  }
  if (params.greedy()) return logits.argmax().item<int64_t>();
  return sample(logits_to_probs(logits.reshape({1, -1}), params), generator).item<int64_t>();
}

void append_logprobs(const at::Tensor& rows, const std::vector<int64_t>& ids, std::size_t begin,
                     int64_t top, std::vector<TokenLogprob>& out) {
  const auto count = static_cast<int64_t>(ids.size() - begin);
  if (count == 0) return;
  const at::Tensor logp = rows.slice(0, 0, count).to(at::kFloat).log_softmax(-1).contiguous();
  at::Tensor values, indices;
  if (top > 0) std::tie(values, indices) = logp.topk(top, -1);
  for (int64_t i = 0; i < count; ++i) {
    TokenLogprob lp;
    lp.token = ids[begin + static_cast<std::size_t>(i)];
    lp.logprob = logp[i][lp.token].item<double>();
    for (int64_t j = 0; j < top; ++j) {
      lp.top.emplace_back(indices[i][j].item<int64_t>(), values[i][j].item<double>());
    }
    out.push_back(std::move(lp));
  }
}

std::vector<int64_t> verify_greedy(const std::vector<int64_t>& draft,
                                   const at::Tensor& target_logits) {
  const auto k = static_cast<int64_t>(draft.size());
  TORCH_CHECK(target_logits.dim() == 2 && target_logits.size(0) == k + 1,
              "target_logits must be [K+1, V]");
  const at::Tensor predicted = target_logits.argmax(-1).contiguous();
  const int64_t* pred = predicted.data_ptr<int64_t>();
  int64_t accepted = 0;
  while (accepted < k && draft[accepted] == pred[accepted]) ++accepted;
  std::vector<int64_t> out(draft.begin(), draft.begin() + accepted);
  out.push_back(pred[accepted]);
  return out;
}

std::vector<int64_t> verify_stochastic(const std::vector<int64_t>& draft,
                                       const at::Tensor& draft_probs_in,
                                       const at::Tensor& target_probs_in,
                                       at::Generator& generator) {
  const auto k = static_cast<int64_t>(draft.size());
  TORCH_CHECK(k > 0, "verify_stochastic needs at least one draft token");
  TORCH_CHECK(draft_probs_in.dim() == 2 && draft_probs_in.size(0) == k,
              "draft_probs must be [K, V]");
  TORCH_CHECK(target_probs_in.dim() == 2 && target_probs_in.size(0) == k + 1 &&
                  target_probs_in.size(1) == draft_probs_in.size(1),
              "target_probs must be [K+1, V] with the draft's vocabulary");
  // speculative.py rejection_sample with a batch of one.
  const at::Tensor draft_probs = draft_probs_in.to(at::kFloat).unsqueeze(0);
  const at::Tensor target_probs = target_probs_in.to(at::kFloat).unsqueeze(0);
  const at::Tensor tokens = at::tensor(draft, at::kLong).reshape({1, k}).unsqueeze(-1);
  const at::Tensor p_target = target_probs.narrow(1, 0, k).gather(-1, tokens).squeeze(-1);
  const at::Tensor p_draft = draft_probs.gather(-1, tokens).squeeze(-1);
  const at::Tensor uniform = at::rand({1, k}, generator);
  const at::Tensor accepted = uniform * p_draft < p_target;
  const int64_t n = accepted.to(at::kLong).cumprod(-1).sum(-1).item<int64_t>();
  // First rejection at i < K: sample from the residual max(0, p_target[i] - p_draft[i]).
  // All K accepted: the bonus token from p_target[K] (a residual against zero).
  const at::Tensor draft_row =
      draft_probs.select(1, std::min(n, k - 1)) * static_cast<double>(n < k);
  const at::Tensor next_probs = residual_probs(target_probs.select(1, n), draft_row);
  std::vector<int64_t> out(draft.begin(), draft.begin() + n);
  out.push_back(sample(next_probs, generator).item<int64_t>());
  return out;
}

at::Tensor one_hot(const std::vector<int64_t>& tokens, int64_t vocab) {
  at::Tensor q = at::zeros({static_cast<int64_t>(tokens.size()), vocab});
  for (std::size_t i = 0; i < tokens.size(); ++i) q[static_cast<int64_t>(i)][tokens[i]] = 1.0;
  return q;
}

std::vector<int64_t> verify_proposal(const std::vector<int64_t>& draft,
                                     const at::Tensor& draft_probs,
                                     const at::Tensor& target_logits,
                                     const SamplingParams& params, at::Generator& generator) {
  if (params.greedy()) return verify_greedy(draft, target_logits);
  if (draft.empty()) return {select_next(target_logits[0], params, generator)};
  const at::Tensor q = draft_probs.defined() ? draft_probs : one_hot(draft, target_logits.size(-1));
  return verify_stochastic(draft, q, logits_to_probs(target_logits, params), generator);
}

}  // namespace detail
}  // namespace aotgen
