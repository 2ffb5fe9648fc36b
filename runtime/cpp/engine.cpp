// The engine: loading a package and the generation loops of aotgen/runtime/engine.py
// (Engine.generate, _token_steps, _speculative_steps) and the proposers of
// aotgen/runtime/proposers.py. Graphs and KV caches: runner.cpp.
#include <algorithm>
#include <chrono>
#include <fstream>
#include <future>
#include <iterator>
#include <mutex>
#include <set>

#include <ATen/Parallel.h>
#include <ATen/ops/stack.h>
#include <nlohmann/json.hpp>

#include "detail.h"
#include "proposers.h"
#include "rules.h"
#include "runner.h"
#include "sink.h"
#include "tree.h"

namespace aotgen {
namespace fs = std::filesystem;
using json = nlohmann::json;

using detail::ModelRunner;
using detail::ngram_min;
using detail::Proposal;
using detail::Proposer;
using detail::uses_draft;

namespace {

using Clock = std::chrono::steady_clock;

// KV-cache slots of a package without batched graphs: its requests take turns step by step.
constexpr int64_t kDefaultSlots = 4;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}


json read_json_if_present(const fs::path& path) {
  if (!fs::is_regular_file(path)) return json::object();
  std::ifstream in(path);
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw PackageError(path.string() + " is not valid JSON: " + e.what());
  }
}

// An int, a list of ints, or null -> ids.
void add_ids(const json& value, std::set<int64_t>& ids) {
  if (value.is_number_integer()) {
    ids.insert(value.get<int64_t>());
  } else if (value.is_array()) {
    for (const auto& v : value) ids.insert(v.get<int64_t>());
  }
}

// tokenizer_config stores special tokens as a string or as an AddedToken object.
std::optional<std::string> token_str(const json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content")) return value["content"].get<std::string>();
  return std::nullopt;
}

// Draft-length schedule of HF assisted generation: +2 after a full accept, else -1.
struct AdaptiveK {
  int64_t k, k_min, k_max;
  void update(int64_t drafted, int64_t accepted) {
    if (drafted > 0) k = std::clamp(k + (accepted >= drafted ? 2 : -1), k_min, k_max);
  }
};

// The draft model as tree drafting sees it (tree.h).
class DraftCalls final : public detail::DraftModel {
 public:
  DraftCalls(ModelRunner& runner, bool reuse_prefix) : runner_(runner), reuse_(reuse_prefix) {}
  at::Tensor forward(const std::vector<int64_t>& tokens, int64_t start) override {
    return runner_.forward(tokens, start);
  }
  at::Tensor decode(int64_t token, int64_t pos) override { return runner_.decode(token, pos); }
  bool shares_cache() const override { return runner_.shares_cache(); }
  void prefill(const std::vector<int64_t>& prompt) override {
    runner_.prefill_reusing(prompt, 0, reuse_);
  }

 private:
  ModelRunner& runner_;
  bool reuse_;
};

}  // namespace


namespace {

// Yields the newly accepted tokens, one list per model step (engine.py _token_steps); the
// prompt runs from position `cached` on (the tokens before it are in the cache).
class TokenSteps {
 public:
  TokenSteps(ModelRunner& target, ModelRunner* draft, int64_t max_seq_len, int64_t verify_k,
             const std::vector<int64_t>& prompt, int64_t cached, const GenerationConfig& config,
             std::optional<SpecStats>& spec, std::optional<detail::TokenRules> rules,
             const LookupCache* lookup_cache)
      : target_(target), draft_(draft), max_seq_len_(max_seq_len), max_k_(verify_k),
        prompt_(prompt), cached_(cached), config_(config), params_(config.sampling),
        spec_(spec), gen_(detail::make_generator(config.sampling.seed)),
        rules_(std::move(rules)), lookup_cache_(lookup_cache) {}

  std::vector<int64_t> next() {
    if (!started_) {
      started_ = true;
      const std::vector<int64_t> rest(prompt_.begin() + cached_, prompt_.end());
      rows_ = target_.forward(rest, cached_).unsqueeze(0);
      tok_ = detail::select(rows_, params_, gen_, rules_);
      pos_ = static_cast<int64_t>(prompt_.size());  // position of tok_, not yet cached
      return {tok_};
    }
    if (config_.speculative == Speculative::None) {
      rows_ = target_.decode(tok_, pos_).unsqueeze(0);
      tok_ = detail::select(rows_, params_, gen_, rules_);
      ++pos_;
      return {tok_};
    }
    if (!spec_started_) start_speculative();
    return config_.tree ? tree_round() : speculative_round();
  }

  // The logits rows that chose the tokens next() returned last.
  const at::Tensor& rows() const { return rows_; }

 private:
  void start_speculative() {
    spec_started_ = true;
    k_ = std::min(config_.k.value_or(max_k_), max_k_);
    if (config_.adaptive_k) adaptive_ = AdaptiveK{std::clamp<int64_t>(k_, 1, max_k_), 1, max_k_};
    history_ = prompt_;
    history_.push_back(tok_);
    if (config_.tree) {
      if (draft_) draft_calls_.emplace(*draft_, config_.reuse_prefix);
      tree_proposer_ = detail::make_tree_proposer(
          config_.speculative, draft_calls_ ? &*draft_calls_ : nullptr, prompt_, params_, gen_,
          *config_.tree, ngram_min(config_), config_.ngram_max, lookup_cache_);
    } else {
      proposer_ = detail::make_proposer(draft_, prompt_, config_, gen_, 0, &rules_, lookup_cache_);
    }
  }

  // Propose a tree -> score it in one tree-graph call -> keep one path (tree_draft.py).
  std::vector<int64_t> tree_round() {
    const int64_t budget = target_.tree_len();
    const int64_t k = std::min(config_.k.value_or(max_k_), budget - 1);
    const detail::Tree tree = tree_proposer_->propose(history_, k, budget);
    const at::Tensor logits = tree.size() == 1 ? target_.decode(tok_, pos_).unsqueeze(0)
                                               : target_.tree_forward(tree, pos_);
    // Under penalties each node's row takes them as they stand after its path.
    const at::Tensor scored = rules_ ? rules_->over_tree(logits, tree.tokens, tree.parents) : logits;
    const auto verdict = detail::verify_tree(tree, scored, params_, gen_);
    tree_proposer_->verified(verdict.path);
    const int64_t moved = detail::commit_path(target_.caches(), pos_, verdict.path);
    std::vector<int64_t> path;  // the root and the accepted nodes, now at pos_.. as a chain
    for (const int64_t node : verdict.path) path.push_back(tree.tokens[node]);
    target_.cached().wrote(0, pos_, path.data(), static_cast<int64_t>(path.size()));
    std::vector<int64_t> accepted(path.begin() + 1, path.end());
    accepted.push_back(verdict.next);
    if (rules_) rules_->advance(accepted);
    spec_->drafted += tree.depth();
    spec_->accepted += static_cast<int64_t>(verdict.path.size()) - 1;
    spec_->steps += 1;
    spec_->lookup_steps += tree.looked_up;
    spec_->tree_nodes += tree.size() - 1;
    spec_->branch_steps += moved > 0;
    pos_ += static_cast<int64_t>(verdict.path.size());
    tree_proposer_->accepted(pos_);
    history_.insert(history_.end(), accepted.begin(), accepted.end());
    tok_ = accepted.back();
    // The row of each path node chose the token after it.
    std::vector<at::Tensor> path_rows;
    for (const int64_t node : verdict.path) path_rows.push_back(logits[node]);
    rows_ = at::stack(path_rows);
    return accepted;
  }

  // Propose -> verify -> accept: one verify step.
  std::vector<int64_t> speculative_round() {
    int64_t k = adaptive_ ? adaptive_->k : k_;
    k = std::min(k, max_seq_len_ + max_k_ - pos_);
    Proposal proposal = proposer_->propose(history_, k);
    detail::fit(proposal, rules_);
    const auto n = static_cast<int64_t>(proposal.tokens.size());
    // Score tok + proposal: row i predicts the token after history[:pos+i+1].
    std::vector<int64_t> block{tok_};
    block.insert(block.end(), proposal.tokens.begin(), proposal.tokens.end());
    const at::Tensor logits = target_.forward(block, pos_, /*all_logits=*/true);
    // Under penalties row i takes them as they stand after the proposal's first i tokens.
    const at::Tensor scored = rules_ ? rules_->along(logits, proposal.tokens) : logits;
    const std::vector<int64_t> accepted = detail::verify(proposal, scored, params_, gen_);
    if (rules_) rules_->advance(accepted);
    const auto n_acc = static_cast<int64_t>(accepted.size()) - 1;
    spec_->drafted += n;
    spec_->accepted += n_acc;
    spec_->steps += 1;
    spec_->lookup_steps += proposal.looked_up;
    if (adaptive_) adaptive_->update(n, n_acc);
    pos_ += n_acc + 1;
    proposer_->accepted(pos_);
    history_.insert(history_.end(), accepted.begin(), accepted.end());
    tok_ = accepted.back();
    rows_ = logits.slice(0, 0, n_acc + 1);
    return accepted;
  }

  ModelRunner& target_;
  ModelRunner* draft_;
  int64_t max_seq_len_;
  int64_t max_k_;
  const std::vector<int64_t>& prompt_;
  int64_t cached_;
  const GenerationConfig& config_;
  const SamplingParams& params_;
  std::optional<SpecStats>& spec_;
  at::Generator gen_;
  bool started_ = false;
  bool spec_started_ = false;
  int64_t tok_ = 0;
  int64_t pos_ = 0;
  int64_t k_ = 0;
  std::optional<AdaptiveK> adaptive_;
  std::vector<int64_t> history_;
  std::unique_ptr<Proposer> proposer_;
  std::optional<DraftCalls> draft_calls_;
  std::unique_ptr<detail::TreeProposer> tree_proposer_;
  at::Tensor rows_;  // the logits rows that chose the last step's tokens
  std::optional<detail::TokenRules> rules_;  // the request's penalties, none without
  const LookupCache* lookup_cache_;  // earlier requests' n-gram counts, or none
};

// The target cache's rows (engine.py _cache_slots): `slots`, or for 0 the package's
// max_batch (its batched graphs are compiled for exactly that many).
int64_t cache_slots(const json& target, int64_t slots) {
  const int64_t max_batch = target.at("graphs")
                                .value("batch_decode", json::object())
                                .value("batch", json::object())
                                .value("max", int64_t{0});
  if (slots < 0) throw PackageError("slots must be >= 0, got " + std::to_string(slots));
  if (slots == 0) return max_batch ? max_batch : kDefaultSlots;
  if (max_batch && slots != 1 && slots != max_batch) {
    throw PackageError("the package's batched graphs serve a cache of " +
                       std::to_string(max_batch) + " slots, not " + std::to_string(slots) +
                       ": use " + std::to_string(max_batch) + " (or 0 for the package's own)");
  }
  return slots;
}

}  // namespace

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::Engine(Engine&&) noexcept = default;
Engine& Engine::operator=(Engine&&) noexcept = default;
Engine::~Engine() = default;

Engine Engine::load(const fs::path& package_dir, const LoadOptions& options) {
  return load(package_dir, options, 1);
}

Engine Engine::load(const fs::path& package_dir, const LoadOptions& options, int64_t slots) {
  const auto t0 = Clock::now();
  auto impl = std::make_unique<Impl>();
  impl->root = package_dir;
  const std::string manifest_text =
      verify_package(package_dir, options.verify_hashes, /*defer_weights=*/true);
  impl->manifest = json::parse(manifest_text);
  const auto& m = impl->manifest;
  // The weights' hashes are checked on other threads while the (verified) graph code loads;
  // nothing is bound or run before they pass.
  std::future<detail::MappedFiles> weights_verified = std::async(std::launch::async, [&] {
    return options.verify_hashes ? detail::verify_weight_files(manifest_text, package_dir)
                                 : detail::MappedFiles{};
  });
  try {
    if (m.value("world_size", 1) != 1) {
      throw PackageError(package_dir.string() + " is a tensor-parallel package (" +
                         m["world_size"].dump() +
                         " ranks); the C++ runtime runs single-process packages: launch it "
                         "with `aotgen run` (Python) or torchrun");
    }
    if (options.threads > 0) at::set_num_threads(options.threads);
    const fs::path tok_dir = package_dir / m.at("tokenizer").at("dir").get<std::string>();
    impl->tokenizer = Tokenizer::from_file((tok_dir / "tokenizer.json").string());
    const fs::path pt2 = package_dir / m.at("package").get<std::string>();
    const auto& models = m.at("models");
    // A batch engine's caches have a row per sequence, the draft's too (on the target's
    // cache: the same rows).
    const int64_t rows = cache_slots(models.at("target"), slots);
    // Weights, caches and graphs on the package's device (check_compatible admitted it).
    const at::Device device = m.at("target").value("device", std::string("cpu")) == "cuda"
                                  ? at::Device(at::kCUDA, 0)
                                  : at::Device(at::kCPU);
    impl->target = std::make_unique<ModelRunner>(pt2, models.at("target"), nullptr, rows, device,
                                                 options.cuda_graphs);
    if (models.contains("draft")) {
      impl->draft = std::make_unique<ModelRunner>(pt2, models.at("draft"), impl->target.get(),
                                                  rows, device, options.cuda_graphs);
    }
    const detail::MappedFiles mapped = weights_verified.get();  // rethrows a hash mismatch
    impl->target->bind_weights(package_dir, models.at("target"), mapped);
    if (impl->draft) impl->draft->bind_weights(package_dir, models.at("draft"), mapped);
    const json tok_config = read_json_if_present(tok_dir / "tokenizer_config.json");
    const json gen_config = read_json_if_present(tok_dir / "generation_config.json");
    const json model_config = read_json_if_present(tok_dir / "config.json");
    std::set<int64_t> eos;
    add_ids(gen_config.value("eos_token_id", json()), eos);
    add_ids(model_config.value("eos_token_id", json()), eos);
    if (const auto eos_token = token_str(tok_config.value("eos_token", json()))) {
      if (const auto id = impl->tokenizer->token_id(*eos_token)) eos.insert(*id);
    }
    impl->eos_ids.assign(eos.begin(), eos.end());
    impl->model_sampling = detail::read_model_sampling(gen_config);
    if (tok_config.value("add_bos_token", json()) == json(true)) {  // tokenizer.py prompt_ids
      std::set<int64_t> bos;
      const json gen_bos = gen_config.value("bos_token_id", json());
      add_ids(gen_bos.is_null() ? model_config.value("bos_token_id", json()) : gen_bos, bos);
      if (!bos.empty()) {
        impl->bos_id = *bos.begin();
      } else if (const auto bos_token = token_str(tok_config.value("bos_token", json()))) {
        impl->bos_id = impl->tokenizer->token_id(*bos_token);
      }
    }
    try {
      impl->chat_template = ChatTemplate::from_dir(tok_dir);
    } catch (const std::runtime_error& e) {
      throw PackageError(e.what());
    }

    impl->max_seq_len = m.at("max_seq_len").get<int64_t>();
    impl->verify_k = m.at("verify_k").get<int64_t>();
  } catch (const json::exception& e) {
    throw PackageError(package_dir.string() + "/manifest.json is malformed (" + e.what() +
                       "); rebuild the package");
  }
  impl->load_s = seconds_since(t0);
  return Engine(std::move(impl));
}

void detail::check_request(const detail::EngineState& e, const std::vector<int64_t>& prompt_ids,
                           const GenerationConfig& config) {
  config.sampling.validate();
  config.penalties.validate();
  if (prompt_ids.empty()) throw GenerationError("empty prompt: give at least one token");
  if (config.max_new_tokens < 1) {
    throw GenerationError("max_new_tokens must be >= 1, got " +
                          std::to_string(config.max_new_tokens));
  }
  if (config.min_tokens < 0 || config.min_tokens > config.max_new_tokens) {
    throw GenerationError("min_tokens must be a whole number in 0..max_new_tokens (" +
                          std::to_string(config.max_new_tokens) + "), got " +
                          std::to_string(config.min_tokens));
  }
  const auto vocab = e.target->vocab_size();
  for (const auto token : config.stop_token_ids) {
    if (token < 0 || token >= vocab) {
      throw GenerationError("stop token ids must be in 0.." + std::to_string(vocab - 1));
    }
  }
  for (const auto& [token, _] : config.penalties.logit_bias) {
    if (token < 0 || token >= vocab) {
      throw GenerationError("logit_bias token " + std::to_string(token) + " is outside 0.." +
                            std::to_string(vocab - 1));
    }
  }
  for (const auto id : prompt_ids) {
    if (id < 0 || id >= vocab) {
      throw GenerationError("prompt token id " + std::to_string(id) + " is outside the model's "
                            "vocabulary (0.." + std::to_string(vocab - 1) + ")");
    }
  }
  const auto prompt_len = static_cast<int64_t>(prompt_ids.size());
  if (prompt_len + config.max_new_tokens > e.max_seq_len) {
    throw GenerationError(
        "prompt (" + std::to_string(prompt_len) + " tokens) + max_new_tokens (" +
        std::to_string(config.max_new_tokens) + ") = " +
        std::to_string(prompt_len + config.max_new_tokens) +
        " exceeds the package context of " + std::to_string(e.max_seq_len) +
        " tokens; shorten the prompt, lower max_new_tokens, or rebuild with a larger "
        "max_seq_len");
  }
  if (uses_draft(config.speculative) && !e.draft) {
    throw GenerationError(e.root.string() +
                          " has no draft model; build with a `speculative: draft:` recipe or "
                          "use n-gram lookup (--lookup ngram)");
  }
  if (config.logprobs && (*config.logprobs < 0 || *config.logprobs > 20)) {
    throw GenerationError("logprobs must be a whole number in 0..20 (the most likely tokens to "
                          "list beside each one), got " + std::to_string(*config.logprobs));
  }
  if (config.k && *config.k < 1) {
    throw GenerationError("k (the draft length) must be >= 1, got " + std::to_string(*config.k));
  }
  if (config.reasoning_budget && *config.reasoning_budget < 0) {
    throw GenerationError("reasoning_budget must be a whole number >= 0 (tokens of reasoning), "
                          "got " + std::to_string(*config.reasoning_budget));
  }
  if (config.speculative != Speculative::None) {
    if (ngram_min(config) < 1 || ngram_min(config) > config.ngram_max) {
      throw GenerationError("need 1 <= ngram_min <= ngram_max");
    }
  }
  if (config.tree) {
    if (config.speculative == Speculative::None) {
      throw GenerationError("tree drafting needs a speculative mode (draft or ngram)");
    }
    if (e.target->tree_len() == 0) {
      throw GenerationError(e.root.string() +
                            " has no tree verify graph: rebuild it with `tree_nodes: N` in the "
                            "recipe, or draft a chain (no --draft-parallel)");
    }
    if (config.adaptive_k) {
      throw GenerationError("adaptive k drafts chains only: drop it with tree drafting");
    }
    if (config.tree->n_parallel < 1 || config.tree->p_split < 0 || config.tree->p_split > 1) {
      throw GenerationError("tree drafting needs n_parallel >= 1 and p_split in 0..1");
    }
  }
}

GenerationResult Engine::generate(const std::vector<int64_t>& prompt_ids,
                                  const GenerationConfig& config, const TextCallback& on_text) {
  Impl& e = *impl_;
  detail::check_request(e, prompt_ids, config);
  const std::lock_guard<std::mutex> one_at_a_time(e.generate_mutex);
  detail::TokenSink sink(*e.tokenizer, config, e.eos_ids, on_text);
  GenerationResult result;
  result.prompt_tokens = static_cast<int64_t>(prompt_ids.size());
  if (config.speculative != Speculative::None) result.spec.emplace();
  if (config.logprobs) result.logprobs.emplace();
  result.cached_tokens = config.reuse_prefix ? e.target->cached().reusable(0, prompt_ids) : 0;

  const auto t0 = Clock::now();
  std::optional<Clock::time_point> t_first;
  TokenSteps steps(*e.target, e.draft.get(), e.max_seq_len, e.verify_k, prompt_ids,
                   result.cached_tokens, config, result.spec,
                   detail::make_rules(config, prompt_ids, e.target->vocab_size(), e.eos_ids,
                                      detail::reasoning_budget(e, config, prompt_ids)),
                   e.lookup_cache.get());
  while (true) {
    const auto new_tokens = steps.next();
    if (!t_first) t_first = Clock::now();
    const std::size_t before = sink.ids().size();
    const bool done = sink.add(new_tokens);
    if (result.logprobs) {
      detail::append_logprobs(steps.rows(), sink.ids(), before, *config.logprobs, *result.logprobs);
    }
    if (done) break;
  }
  const auto t_end = Clock::now();
  result.token_ids = sink.ids();
  result.text = sink.text();
  result.finish_reason = sink.finish_reason();
  result.stop_string = sink.stop_string();
  result.stop_token = sink.stop_token();
  result.prefill_s = std::chrono::duration<double>(*t_first - t0).count();
  result.decode_s = std::chrono::duration<double>(t_end - *t_first).count();
  e.learn(prompt_ids, result.token_ids);
  return result;
}

std::vector<int64_t> Engine::chat_ids(const std::string& user,
                                      const std::optional<std::string>& system) const {
  std::vector<ChatMessage> messages;
  if (system) messages.push_back({"system", *system});
  messages.push_back({"user", user});
  return chat_ids(messages);
}

std::vector<int64_t> Engine::chat_ids(const std::vector<ChatMessage>& messages) const {
  return chat_ids(messages, impl_->template_kwargs);
}

std::vector<int64_t> Engine::chat_ids(const std::vector<ChatMessage>& messages,
                                      const std::string& template_kwargs) const {
  if (!impl_->chat_template) {
    throw std::runtime_error(impl_->root.string() +
                             ": the package has no chat template: pass the prompt with --prompt");
  }
  return encode_chat(*impl_->tokenizer, *impl_->chat_template, messages, true, template_kwargs);
}

void Engine::set_chat_template_kwargs(const std::string& kwargs) {
  check_template_kwargs(kwargs);
  impl_->template_kwargs = kwargs;
}

std::optional<bool> detail::thinking_of(const EngineState& e,
                                        const std::vector<int64_t>& prompt_ids) {
  if (!e.chat_template || !e.chat_template->takes_reasoning()) return std::nullopt;
  // The last 32 ids: enough for the tags, even spelled byte by byte.
  const auto tail = prompt_ids.size() > 32 ? prompt_ids.end() - 32 : prompt_ids.begin();
  return opens_reasoning(e.tokenizer->decode({tail, prompt_ids.end()}));
}

std::optional<std::string> detail::harmony_head_of(const EngineState& e,
                                                   const std::vector<int64_t>& prompt_ids) {
  if (!e.chat_template || !e.chat_template->takes_harmony()) return std::nullopt;
  // From the last message's start (a long one included), as aotgen/runtime/harmony.py head_of.
  auto tail = prompt_ids.size() > 64 ? prompt_ids.end() - 64 : prompt_ids.begin();
  if (const auto start = e.tokenizer->token_id("<|start|>")) {
    const auto last = std::find(prompt_ids.rbegin(), prompt_ids.rend(), *start);
    if (last != prompt_ids.rend()) tail = std::prev(last.base());
  }
  return answer_head(e.tokenizer->decode({tail, prompt_ids.end()}));
}

std::optional<detail::ReasoningBudget> detail::reasoning_budget(
    const EngineState& e, const GenerationConfig& config, const std::vector<int64_t>& prompt_ids) {
  if (!config.reasoning_budget) return std::nullopt;
  const bool harmony = e.chat_template && e.chat_template->takes_harmony();
  if (!harmony && !(e.chat_template && e.chat_template->takes_reasoning())) {
    throw GenerationError(
        "this package's chat template has no reasoning (<think> tags or gpt-oss's analysis "
        "channel) for a reasoning budget to bound; leave the budget out");
  }
  const int64_t budget = *config.reasoning_budget;
  BudgetState start(BudgetPhase::Done, budget);  // the prompt closed the reasoning
  if (harmony) {  // inside when the prompt continues an analysis message
    const auto head = harmony_head_of(e, prompt_ids);
    start = budget_start(budget, head->find(kAnalysisHeader) != std::string::npos);
  } else if (const auto thinking = thinking_of(e, prompt_ids)) {
    start = budget_start(budget, *thinking);
  }
  BudgetMarks marks = budget_marks(*e.tokenizer, harmony, config.reasoning_budget_message);
  return ReasoningBudget(*e.tokenizer, std::move(marks), std::move(start));
}

std::optional<bool> Engine::thinking(const std::vector<int64_t>& prompt_ids) const {
  return detail::thinking_of(*impl_, prompt_ids);
}

std::optional<std::string> Engine::harmony_head(const std::vector<int64_t>& prompt_ids) const {
  return detail::harmony_head_of(*impl_, prompt_ids);
}

std::vector<int64_t> Engine::prompt_ids(const std::string& text) const {
  std::vector<int64_t> ids = impl_->tokenizer->encode(text);
  if (impl_->bos_id) ids.insert(ids.begin(), *impl_->bos_id);
  return ids;
}

const Tokenizer& Engine::tokenizer() const { return *impl_->tokenizer; }
const std::vector<int64_t>& Engine::eos_ids() const { return impl_->eos_ids; }
const ModelSampling& Engine::model_sampling() const { return impl_->model_sampling; }
int64_t Engine::max_seq_len() const { return impl_->max_seq_len; }
int64_t Engine::verify_k() const { return impl_->verify_k; }
int64_t Engine::vocab_size() const { return impl_->target->vocab_size(); }
bool Engine::has_draft() const { return impl_->draft != nullptr; }
double Engine::load_s() const { return impl_->load_s; }
const fs::path& Engine::root() const { return impl_->root; }
void Engine::set_lookup_cache(std::shared_ptr<LookupCache> cache) {
  impl_->lookup_cache = std::move(cache);
}
const std::shared_ptr<LookupCache>& Engine::lookup_cache() const { return impl_->lookup_cache; }

}  // namespace aotgen
