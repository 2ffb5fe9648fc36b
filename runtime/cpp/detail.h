// Internals of the aotgen runtime shared by its .cpp files (not part of the public API).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "aotgen.h"

namespace aotgen::detail {

// ---- package.cpp -------------------------------------------------------------------------

// A private read-only mapping of a whole file.
class Mapping;

// Weights files by path, mapped while they were hashed: binding that same mapping finds
// its pages already faulted in by the hashing threads, not by the first prefill.
using MappedFiles = std::unordered_map<std::string, std::shared_ptr<const Mapping>>;

// Tensors of a safetensors file (`mapping`: the file, already mapped; else it is mapped
// here). Tensors whose data is 64-byte aligned in the file view the mapping (kept alive
// by the tensors); the others are copied into aligned memory, as the Python runtime's
// load_file does.
std::unordered_map<std::string, at::Tensor> load_safetensors(
    const std::filesystem::path& path, std::shared_ptr<const Mapping> mapping = nullptr);

// The sha256 check of the package's weights files that verify_package(..., defer_weights)
// left out; throws PackageError. Returns the verified files, still mapped.
MappedFiles verify_weight_files(const std::string& manifest_text,
                                const std::filesystem::path& root);

// Manifest dtype name ("float32", "bfloat16", ...) -> scalar type; PackageError otherwise.
at::ScalarType dtype_from_name(const std::string& name);

// ---- model_sampling.cpp: aotgen/runtime/model_sampling.py --------------------------------

// generation_config.json's object -> the model's sampling values (Engine::model_sampling).
ModelSampling read_model_sampling(const nlohmann::json& generation_config);

// ---- sampling.cpp: aotgen/runtime/sampling.py and speculative.py, op for op ----------------

// A CPU generator seeded with `seed`, or from std::random_device.
at::Generator make_generator(std::optional<uint64_t> seed);

// [N, V] logits -> [N, V] float32 probabilities after temperature, top-k and top-p
// (greedy: one-hot of the argmax).
at::Tensor logits_to_probs(const at::Tensor& logits, const SamplingParams& params);

// [N, V] probabilities (need not be normalised) -> [N] int64 ids, inverse-CDF sampling.
at::Tensor sample(const at::Tensor& probs, at::Generator& generator);

// Logits of one position ([V] or [1, V]) -> next token id; greedy is a bare argmax.
int64_t select_next(const at::Tensor& logits, const SamplingParams& params,
                    at::Generator& generator);

// Accept draft tokens while they equal the target's argmax, then the target's own token.
// target_logits: [K+1, V].
std::vector<int64_t> verify_greedy(const std::vector<int64_t>& draft,
                                   const at::Tensor& target_logits);

// Speculative sampling: accept draft token i with probability min(1, p/q), on rejection
// sample from max(0, p - q) normalised, after a full accept sample the bonus token from p.
// draft_probs [K, V], target_probs [K+1, V].
std::vector<int64_t> verify_stochastic(const std::vector<int64_t>& draft,
                                       const at::Tensor& draft_probs,
                                       const at::Tensor& target_probs, at::Generator& generator);

// The accepted prefix of a proposal plus one token from the target (speculative.py verify):
// greedy, or speculative sampling against draft_probs [K, V] (undefined for a deterministic
// proposal such as n-gram lookup: one-hot rows). target_logits: [K+1, V].
std::vector<int64_t> verify_proposal(const std::vector<int64_t>& draft,
                                     const at::Tensor& draft_probs,
                                     const at::Tensor& target_logits,
                                     const SamplingParams& params, at::Generator& generator);

// max(0, p_target - p_draft) per row (unnormalised), or p_target where that is all zero.
at::Tensor residual_probs(const at::Tensor& target_probs, const at::Tensor& draft_probs);

// Logprobs of `count` tokens ids[begin..] chosen by logits rows[0..count) (logprobs.py).
void append_logprobs(const at::Tensor& rows, const std::vector<int64_t>& ids, std::size_t begin,
                     int64_t top, std::vector<TokenLogprob>& out);

// A deterministic proposer (n-gram) as a draft distribution: one-hot rows [K, V].
at::Tensor one_hot(const std::vector<int64_t>& tokens, int64_t vocab);

}  // namespace aotgen::detail
