// aotgen C++ runtime: load an aotgen package and generate text, with no model code.
//
//   auto engine = aotgen::Engine::load("artifacts/smollm2-135m");
//   aotgen::GenerationConfig config;
//   config.max_new_tokens = 64;
//   auto result = engine.generate(engine.chat_ids("What is the capital of France?"), config,
//                                 [](std::string_view text) { std::cout << text << std::flush; });
//
// Mirrors the Python runtime (aotgen/runtime/engine.py): the manifest is verified before
// any native code is loaded (format version, torch version, platform / ISA, the sha256 of
// every file, no unlisted files); the weights are read once from the package's safetensors
// file and bound to every graph of a model (prefill, decode, verify); the engine owns the
// per-layer KV caches, written in place at each position. Sampling (greedy, temperature,
// top-k, top-p) and speculative verification follow aotgen/runtime/sampling.py and
// speculative.py operation for operation, with a torch CPU generator: a seeded C++ run is
// reproducible (and draws the same random numbers as a Python run with the same seed).
//
// An Engine is movable, not copyable. It has one KV cache, so generate() calls from several
// threads run one after the other (each waits for the one before), never interleaved.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chat.h"
#include "harmony.h"
#include "reasoning.h"
#include "tokenizer.h"

namespace aotgen {

// A package that must not be loaded (missing, corrupt, built for another torch or CPU).
class PackageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A request the package cannot serve (too long for its context, no draft model, ...).
class GenerationError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// How to pick the next token; applied in this order (as in HF): temperature, top-k, top-p,
// min-p.
struct SamplingParams {
  double temperature = 0.0;  // < 1e-5 -> greedy (argmax)
  int64_t top_k = 0;         // 0 -> off
  double top_p = 1.0;        // 1 -> off
  std::optional<uint64_t> seed;  // none -> seeded from std::random_device
  double min_p = 0.0;  // 0 -> off; else drop tokens below min_p x the top token's probability

  bool greedy() const { return temperature < 1e-5; }
  // Throws std::invalid_argument for values sampling.py rejects too.
  void validate() const;
};

// A model's own sampling values: the package's generation_config.json, read as transformers
// reads it (`do_sample: false` decodes greedily whatever the temperature says, `do_sample:
// true` without a temperature samples at 1; aotgen/runtime/model_sampling.py). `aotgen-run`
// and `aotgen-batch` take them where the command line (and a request) gives none. A value the
// file leaves out is none, and so is one the runtime refuses, listed in `refused` as
// "key=value (why)".
struct ModelSampling {
  std::optional<double> temperature;
  std::optional<int64_t> top_k;
  std::optional<double> top_p;
  std::optional<double> min_p;
  std::optional<double> repetition_penalty;
  std::vector<std::string> refused;
};

// DraftNgram: n-gram lookup proposes when it finds a match, the draft model otherwise.
enum class Speculative { None, Ngram, Draft, DraftNgram };

// Tree drafting (llama.cpp's n_parallel / p_split): sequences drafted at once, and the
// probability an alternative needs to open a branch. best_first: shape the tree by path
// probability instead (the chain and one-token leaves beside it, docs/speculative.md).
// Needs a package with a tree graph.
struct TreeParams {
  int64_t n_parallel = 4;
  double p_split = 0.1;
  bool best_first = false;
};

// Penalties on repeated tokens (OpenAI's presence and frequency, HF's and vLLM's repetition)
// and OpenAI's logit bias, applied before sampling in this order (aotgen/runtime/rules.py):
// bias; repetition over the prompt and the answer (a positive logit divided by it, a
// negative one multiplied); minus frequency x count and presence over the answer.
struct Penalties {
  double repetition = 1.0;  // > 1 discourages tokens of the prompt and the answer; 1 -> off
  double presence = 0.0;    // -2..2
  double frequency = 0.0;   // -2..2
  std::vector<std::pair<int64_t, double>> logit_bias;  // (token, added to its logit, -100..100)

  bool active() const {
    return repetition != 1.0 || presence != 0.0 || frequency != 0.0 || !logit_bias.empty();
  }
  // Throws std::invalid_argument for values rules.py rejects too.
  void validate() const;
};

struct GenerationConfig {
  int64_t max_new_tokens = 256;
  SamplingParams sampling;
  Penalties penalties;
  std::vector<std::string> stop;  // stop strings (not part of the returned text)
  std::vector<int64_t> stop_token_ids;  // end the answer like eos (finish_reason "stop")
  bool ignore_eos = false;
  // No eos, stop token or stop string before this many tokens (vLLM's min_tokens); a
  // grammar-free request, so nothing else can force the end sooner.
  int64_t min_tokens = 0;
  Speculative speculative = Speculative::None;
  std::optional<int64_t> k;  // draft length; default (and maximum): the package's verify_k
  bool adaptive_k = false;   // HF schedule: +2 after a full accept, else -1
  // Shortest n-gram match that makes a proposal; default 1 for Ngram, 3 for DraftNgram
  // (engine.py NGRAM_MIN: a shorter match is mostly a worse guess than the draft's).
  std::optional<int64_t> ngram_min;
  int64_t ngram_max = 4;
  std::optional<TreeParams> tree;  // tree speculation; none: a chain
  // Run only the prompt past the prefix the KV cache already holds from an earlier request
  // (the next turn of a chat, a shared system prompt); false: every prompt runs whole.
  bool reuse_prefix = true;
  // Each generated token's log-probability and its N likeliest alternatives' (0..20);
  // none: off (aotgen/runtime/logprobs.py).
  std::optional<int64_t> logprobs;
  // At most this many tokens of reasoning (`<think>`, gpt-oss's analysis channel), then its
  // close is forced after `reasoning_budget_message` (aotgen/runtime/reasoning_budget.py);
  // GenerationError on a package whose chat template has no reasoning.
  std::optional<int64_t> reasoning_budget;
  std::string reasoning_budget_message;
};

// A fill-in-the-middle prompt and the tokens that end its answer (Engine::infill).
struct Infill {
  std::vector<int64_t> prompt_ids;
  std::vector<int64_t> end_ids;  // the FIM pad, repo and file-separator tokens
};

// A generated token, its log-probability under the model's own distribution (the log-softmax
// of the logits row that chose it, before temperature, top-k and top-p) and the likeliest
// tokens in its position with theirs, most likely first.
struct TokenLogprob {
  int64_t token = 0;
  double logprob = 0;
  std::vector<std::pair<int64_t, double>> top;
};

struct SpecStats {
  int64_t drafted = 0;
  int64_t accepted = 0;
  int64_t steps = 0;
  int64_t lookup_steps = 0;  // steps whose proposal came from n-gram lookup, not the draft
  int64_t tree_nodes = 0;    // drafted tree nodes (tree speculation: drafted counts depths)
  int64_t branch_steps = 0;  // tree steps whose accepted path left the main chain
  double acceptance_rate() const { return drafted ? double(accepted) / double(drafted) : 0.0; }
  // Tokens emitted per verify step: accepted drafts plus the target's own token.
  double mean_accepted_length() const {
    return steps ? double(accepted + steps) / double(steps) : 0.0;
  }
};

struct GenerationResult {
  std::string text;
  std::vector<int64_t> token_ids;
  int64_t prompt_tokens = 0;
  // "eos" | "stop" | "length"; in a BatchEngine also "cancelled" or "error" (see `error`)
  std::string finish_reason;
  // finish_reason "stop": the stop string or stop token id that ended the answer
  // (GenerationResult.stop_reason in Python, vLLM's stop_reason).
  std::optional<std::string> stop_string;
  std::optional<int64_t> stop_token;
  double prefill_s = 0;       // generate() start to the first token
  double decode_s = 0;        // first token to the end
  std::optional<SpecStats> spec;
  std::string error;  // finish_reason "error": what failed
  int64_t cached_tokens = 0;  // prompt tokens found in the KV cache, not run again
  std::optional<std::vector<TokenLogprob>> logprobs;  // per token, with config.logprobs

  // Prompt tokens run, over the time to the first token.
  double prefill_tok_s() const {
    return prefill_s > 0 ? double(prompt_tokens - cached_tokens) / prefill_s : 0;
  }
  // Tokens after the first one, over the time spent producing them.
  double decode_tok_s() const {
    const auto n = static_cast<double>(token_ids.size()) - 1;
    return n > 0 && decode_s > 0 ? n / decode_s : 0;
  }
};

struct LoadOptions {
  int threads = 0;            // intra-op threads (at::set_num_threads); 0 -> torch's default
  bool verify_hashes = true;  // sha256 of every file; false only for trusted, huge packages
  bool cuda_graphs = true;    // a CUDA package's fixed-width graphs replayed as CUDA graphs
};

// Receives generated text as soon as it is final (complete UTF-8, past any stop string).
using TextCallback = std::function<void(std::string_view)>;

class LookupCache;  // n-gram counts of earlier requests (below)

class Engine {
 public:
  // Verifies the package (before loading any .so), then loads graphs, weights, tokenizer.
  // Throws PackageError with the reason and what to do.
  static Engine load(const std::filesystem::path& package_dir, const LoadOptions& options = {});

  Engine(Engine&&) noexcept;
  Engine& operator=(Engine&&) noexcept;
  ~Engine();

  // Generates from token ids, streaming text through on_text. Throws GenerationError for
  // requests the package cannot serve (empty prompt, prompt + max_new_tokens > max_seq_len,
  // draft speculation without a draft model) and std::invalid_argument for bad sampling.
  GenerationResult generate(const std::vector<int64_t>& prompt_ids,
                            const GenerationConfig& config = {},
                            const TextCallback& on_text = {});

  // Prompt ids for one user turn, rendered by the checkpoint's chat template (chat.h: a
  // ChatML template without a system message gives plain ChatML, no injected system turn, as
  // the Python runtime and llama.cpp do). std::runtime_error when the package has no chat
  // template, or the template raises.
  std::vector<int64_t> chat_ids(const std::string& user,
                                const std::optional<std::string>& system = {}) const;
  // Prompt ids for a conversation: (role, content) messages, e.g. system, user, assistant,
  // user, then the assistant's turn. Sent again with each new message, its earlier turns are
  // found in the KV cache (GenerationConfig::reuse_prefix).
  std::vector<int64_t> chat_ids(const std::vector<ChatMessage>& messages) const;
  // The same with `template_kwargs` (as set_chat_template_kwargs takes them) for this chat
  // alone, e.g. one request's of many; std::invalid_argument as there.
  std::vector<int64_t> chat_ids(const std::vector<ChatMessage>& messages,
                                const std::string& template_kwargs) const;
  // More variables for the chat template, a JSON object's text (vLLM's chat_template_kwargs,
  // e.g. {"enable_thinking": false}), for every chat_ids after it; std::invalid_argument
  // naming the problem when it is not a JSON object or sets the chat's own variables.
  void set_chat_template_kwargs(const std::string& kwargs);
  // Where the answer to a chat prompt starts (reasoning.h): inside its reasoning (true), free
  // to open one (false), or with none (nullopt: the template has no reasoning, or the prompt
  // closed it). Split the answer with split_reasoning / ReasoningStream.
  std::optional<bool> thinking(const std::vector<int64_t>& prompt_ids) const;
  // The head of the answer to a chat prompt in gpt-oss's harmony format (harmony.h
  // answer_head: `assistant` after a generation prompt), or nullopt: the template is not
  // harmony. Split the answer with split_harmony / HarmonyStream.
  std::optional<std::string> harmony_head(const std::vector<int64_t>& prompt_ids) const;

  // A plain-text prompt's ids, led by bos when the checkpoint says so (`add_bos_token` in
  // tokenizer_config.json, e.g. Gemma), as the Python runtime's Tokenizer.prompt_ids.
  std::vector<int64_t> prompt_ids(const std::string& text) const;
  // Fill in the middle (aotgen/runtime/infill.py): the prompt asking a code model for the
  // text between `prefix` and `suffix` in its FIM tokens, in at most `room` tokens (the
  // context less max_new_tokens), and the ids that end an infill (add them to
  // stop_token_ids). GenerationError where the model has no FIM tokens.
  Infill infill(const std::string& prefix, const std::string& suffix, int64_t room) const;

  const Tokenizer& tokenizer() const;
  const std::vector<int64_t>& eos_ids() const;
  const ModelSampling& model_sampling() const;  // the model's sampling values
  int64_t max_seq_len() const;
  int64_t verify_k() const;
  int64_t vocab_size() const;  // the model's logits width
  bool has_draft() const;
  double load_s() const;  // wall time of load(), verification included
  const std::filesystem::path& root() const;
  // n-gram lookup also drafts from `cache` (earlier requests' counts), and every request's
  // text is added to it when it ends; nullptr: none. Shared: one cache may serve engines in
  // turn, not at once.
  void set_lookup_cache(std::shared_ptr<LookupCache> cache);
  const std::shared_ptr<LookupCache>& lookup_cache() const;

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  // `slots` KV-cache rows of the target (and of a draft with its own cache), one per
  // sequence (BatchEngine).
  static Engine load(const std::filesystem::path& package_dir, const LoadOptions& options,
                     int64_t slots);
  std::unique_ptr<Impl> impl_;
  friend class BatchEngine;
};

// ---- Continuous batching (aotgen/runtime/batch_engine.py) --------------------------------

// submit() when max_queue requests already wait beyond the free slots: retry later.
class QueueFull : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct BatchOptions {
  // KV-cache rows, one per running request. 0: the package's max_batch, which its batched
  // graphs are compiled for (4 for a package without batched graphs: its requests take turns).
  int64_t slots = 0;
  int64_t max_queue = 64;     // waiting requests (beyond the slots) before submit refuses
  int64_t prefill_step = 64;  // prompt tokens per step while other requests decode
};

// Receives a request's result once it has finished (also when cancelled or failed).
using DoneCallback = std::function<void(int64_t request_id, const GenerationResult&)>;

// Many requests on one package at once. Each request holds a slot, one row of the target's
// KV cache; a step() runs, in order: one prefill chunk of the oldest request still
// prefilling (at most prefill_step tokens while others decode); one decode for every request
// past its prompt (the batch_decode graph for two or more, the decode graph for one); with
// speculation (n-gram lookup, the draft model, or both), the requests with a proposal verify
// it in one batch_verify call instead and each accepts its own prefix. A draft on the
// target's cache drafts for all drafting requests together, one batch_decode call of the
// draft per draft step; a draft with its own cache drafts per request in the request's row.
// Sampling, seeds, stop strings and max_new_tokens are per request, so a request's output is
// the one it gets alone (and Python's BatchEngine's). submit() and cancel() may be called
// from any thread; step() runs in one thread at a time (the caller's loop).
class BatchEngine {
 public:
  // Engine::load with a KV-cache row per slot.
  static BatchEngine load(const std::filesystem::path& package_dir,
                          const LoadOptions& options = {}, const BatchOptions& batch = {});

  BatchEngine(BatchEngine&&) noexcept;
  BatchEngine& operator=(BatchEngine&&) noexcept;
  ~BatchEngine();

  // Queues a request; returns its id. on_text streams its text as it becomes final, on_done
  // gets its result, both called from step(). Throws GenerationError for a request the
  // package cannot serve (as Engine::generate; tree drafting and adaptive k too) and
  // QueueFull when max_queue requests already wait beyond the free slots.
  int64_t submit(const std::vector<int64_t>& prompt_ids, const GenerationConfig& config = {},
                 TextCallback on_text = {}, DoneCallback on_done = {});
  // Stops a request (e.g. its client went away): it finishes with "cancelled" and its slot
  // is free at the next step. Unknown or finished ids are ignored.
  void cancel(int64_t request_id);
  // One engine step; false when there was nothing to do.
  bool step();
  // Serves prompts together (steps run here) and returns their results in order.
  std::vector<GenerationResult> generate_many(const std::vector<std::vector<int64_t>>& prompts,
                                              const std::vector<GenerationConfig>& configs);

  int64_t slots() const;
  int64_t free_slots() const;
  int64_t waiting() const;  // queued requests without a slot
  int64_t running() const;  // requests holding a slot
  const Engine& engine() const;  // tokenizer, chat_ids, prompt_ids, limits
  // Engine::set_lookup_cache for every request; call before step() runs.
  void set_lookup_cache(std::shared_ptr<LookupCache> cache);

 private:
  struct Impl;
  explicit BatchEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- Pieces exposed for tests and embedding ---------------------------------------------

// Reads and checks manifest.json (format, torch version, platform, ISA and, if
// check_hashes, every file's size and sha256, refusing unlisted files); returns its text.
// Throws PackageError. Engine::load calls this before loading any native code.
// defer_weights: leave the hashes of the weights (*.safetensors: data, not code) to
// detail::verify_weight_files, which Engine::load runs while the graphs load.
std::string verify_package(const std::filesystem::path& package_dir, bool check_hashes = true,
                           bool defer_weights = false);

// Lowercase hex sha256 (OpenSSL EVP) of each `chunk_bytes` piece of a file, the pieces
// hashed on all cores (manifest.py sha256_chunks).
std::vector<std::string> sha256_chunks(const std::filesystem::path& path,
                                       std::size_t chunk_bytes);

// The CPU capability torch dispatches to here ("DEFAULT", "AVX2", "AVX512", ...) and the
// platform string the manifest uses ("linux-x86_64").
std::string cpu_capability();
std::string platform_string();

// n-gram lookup proposals (aotgen/runtime/ngram.py, rule for rule): for n = 1..max_n, how
// often each token followed every n-gram of the text so far. Drafts the most frequent (then
// most recent) follower of the longest convincing suffix n-gram, one token at a time, each
// looked up with the tokens drafted before it, for as long as the evidence holds; where the
// text convinces of nothing, asks `shared` (earlier requests' counts) when given.
class NgramProposer {
 public:
  struct Follower {
    int64_t token, count, last;  // last: position of its latest occurrence
  };

  explicit NgramProposer(int64_t min_n = 1, int64_t max_n = 4,
                         const LookupCache* shared = nullptr);
  // Up to k tokens to follow history (prompt + output); fewer, or none, when the evidence
  // runs out. The index grows with history while history extends what it has seen.
  std::vector<int64_t> propose(const std::vector<int64_t>& history, int64_t k);
  // The ranked followers of the longest convincing suffix n-gram of context, as indexed so
  // far; empty when none convinces. Several of them are branches for tree drafting.
  std::vector<Follower> candidates(const std::vector<int64_t>& context) const;

 private:
  void sync(const std::vector<int64_t>& history);
  std::vector<Follower> followers(const std::vector<int64_t>& context, int64_t n) const;

  int64_t min_n_, max_n_;
  const LookupCache* shared_;
  std::vector<int64_t> tokens_;
  // tables_[n - 1]: n-gram -> {next token -> {count, last position}}
  std::vector<std::map<std::vector<int64_t>, std::map<int64_t, std::array<int64_t, 2>>>> tables_;
};

// A lookup-cache file that cannot be read: what is wrong, and what to do.
class LookupCacheError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// n-gram counts that outlive a request (aotgen/runtime/lookup_cache.py, rule for rule):
// llama.cpp's dynamic lookup cache. Counts the followers of every 1..4-gram of each text
// added (a finished request's prompt and answer); NgramProposer asks it, by llama.cpp's
// strict rule (but a 3- or 4-gram seen once convinces), where a request's own text
// convinces of nothing. Files in llama.cpp's format
// (common_ngram_cache_save), written sorted: equal caches are equal files, in either runtime.
class LookupCache {
 public:
  static constexpr int64_t kMaxNgrams = 500000;  // past this, counts halve (zeros go)

  explicit LookupCache(int64_t max_ngrams = kMaxNgrams);
  // Reads a cache file (aotgen's or llama.cpp's) for a model of vocab_size tokens; throws
  // LookupCacheError naming the first thing wrong in it.
  static LookupCache load(const std::filesystem::path& path, int64_t vocab_size,
                          int64_t max_ngrams = kMaxNgrams);
  // load(), or a new cache where there is no file yet (it is written on save()).
  static LookupCache open(const std::filesystem::path& path, int64_t vocab_size);
  // Writes through a temporary file renamed into place; throws LookupCacheError.
  void save(const std::filesystem::path& path) const;
  void add(const std::vector<int64_t>& tokens);
  // The ranked followers (most frequent, then lowest id) of the longest suffix n-gram of
  // context, n from min(max_n, 4) down to min_n, that convinces (lookup_cache.py's rule).
  std::vector<NgramProposer::Follower> candidates(const std::vector<int64_t>& context,
                                                  int64_t min_n, int64_t max_n) const;
  std::size_t size() const { return table_.size(); }

 private:
  void age();
  int64_t max_ngrams_;
  std::map<std::vector<int32_t>, std::map<int32_t, int32_t>> table_;
};

}  // namespace aotgen
