// The engine: graphs, weights, KV caches and the generation loops of
// aotgen/runtime/engine.py (ModelRunner, Engine.generate, _token_steps, _speculative_steps)
// and the proposers of aotgen/runtime/proposers.py.
#include <algorithm>
#include <chrono>
#include <fstream>
#include <future>
#include <mutex>
#include <new>
#include <set>

#include <sys/mman.h>

#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/stack.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include "detail.h"
#include "tree.h"

namespace aotgen {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A zero tensor on fresh anonymous pages, which the kernel zero-fills when first written.
// KV caches start zeroed, as with at::zeros, but are written only as far as the context
// reaches. at::zeros writes all cache_len positions at load, in a parallel fill whose
// threads spun against the hashing threads (perf: about a third of the CPU samples while
// hashing, on 2 cores).
at::Tensor zeros_on_demand(const std::vector<int64_t>& shape, at::ScalarType dtype) {
  std::size_t bytes = c10::elementSize(dtype);
  for (const auto d : shape) bytes *= static_cast<std::size_t>(d);
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) throw std::bad_alloc();
  return at::from_blob(
      data, shape, [bytes](void* p) { ::munmap(p, bytes); }, at::TensorOptions().dtype(dtype));
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

// One AOTInductor graph; checks the token count it was compiled for and its output.
class Graph {
 public:
  Graph(const fs::path& pt2, const json& signature, int64_t vocab)
      : name_(signature.at("package_model").get<std::string>()),
        min_tokens_(signature.at("tokens").at("min").get<int64_t>()),
        max_tokens_(signature.at("tokens").at("max").get<int64_t>()),
        vocab_(vocab),
        // (path, model name, run single-threaded, runners, device index): -1 is CPU.
        loader_(std::make_unique<torch::inductor::AOTIModelPackageLoader>(pt2.string(), name_,
                                                                          false, 1, -1)) {}

  int64_t min_tokens() const { return min_tokens_; }
  int64_t max_tokens() const { return max_tokens_; }

  // user_managed: the graph uses our tensors in place, so all graphs share one copy.
  void bind(const std::unordered_map<std::string, at::Tensor>& weights) {
    std::unordered_map<std::string, at::Tensor> constants;
    std::string missing;
    for (const auto& name : loader_->get_constant_fqns()) {
      const auto it = weights.find(name);
      if (it == weights.end()) {
        missing += (missing.empty() ? "" : ", ") + name;
      } else {
        constants.emplace(name, it->second);
      }
    }
    if (!missing.empty()) {
      throw PackageError("graph " + name_ + " needs weights missing from the package: " +
                         missing);
    }
    loader_->load_constants(constants, /*use_inactive=*/false, /*check_full_update=*/true,
                            /*user_managed=*/true);
  }

  // tokens [1, T], input_pos [T] -> logits [T, V]; the caches are updated in place. The
  // tree graph also takes tree_mask [T, T] (bool), after the caches.
  at::Tensor operator()(const at::Tensor& tokens, const at::Tensor& input_pos,
                        const std::vector<at::Tensor>& caches,
                        const at::Tensor& tree_mask = at::Tensor()) {
    const int64_t t = tokens.size(1);
    if (t < min_tokens_ || t > max_tokens_) {
      throw std::logic_error(name_ + " takes " + std::to_string(min_tokens_) + ".." +
                             std::to_string(max_tokens_) + " tokens, got " + std::to_string(t));
    }
    std::vector<at::Tensor> inputs;
    inputs.reserve(2 + caches.size());
    inputs.push_back(tokens);
    inputs.push_back(input_pos);
    inputs.insert(inputs.end(), caches.begin(), caches.end());
    if (tree_mask.defined()) inputs.push_back(tree_mask);
    auto outputs = loader_->boxed_run(std::move(inputs));
    if (outputs.empty() || outputs[0].dim() != 3 || outputs[0].size(0) != 1 ||
        outputs[0].size(1) != t || outputs[0].size(2) != vocab_ ||
        outputs[0].scalar_type() != at::kFloat) {
      throw PackageError("graph " + name_ + " returned no float32 [1, T, vocab] logits");
    }
    return outputs[0][0];
  }

 private:
  std::string name_;
  int64_t min_tokens_;
  int64_t max_tokens_;
  int64_t vocab_;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
};

// One model of a package: its graphs, weights bound once, and its KV cache: its own, or the
// target's for a draft built with kv_cache.shared_with: target.
class ModelRunner {
 public:
  // Loads the graphs' code; the weights come later, in bind_weights. `target` is the target's
  // runner when this is a draft (it may share the target's cache).
  ModelRunner(const fs::path& pt2, const json& entry, const ModelRunner* target = nullptr)
      : vocab_size_(entry.at("config").at("vocab_size").get<int64_t>()) {
    const auto& kv = entry.at("kv_cache");
    const auto layers = kv.at("layers").get<int64_t>();
    const auto shape = kv.at("shape").get<std::vector<int64_t>>();
    cache_len_ = kv.at("cache_len").get<int64_t>();
    const auto& graphs = entry.at("graphs");
    for (const auto& [name, signature] : graphs.items()) {
      check_signature(name, signature, layers, shape);
    }
    if (!graphs.contains("decode")) throw PackageError("the package has no decode graph");
    // A draft on the target's cache only ever decodes: it is built without a prefill graph.
    if (graphs.contains("prefill")) {
      prefill_ = std::make_unique<Graph>(pt2, graphs["prefill"], vocab_size_);
    }
    decode_ = std::make_unique<Graph>(pt2, graphs["decode"], vocab_size_);
    if (graphs.contains("verify")) {
      verify_ = std::make_unique<Graph>(pt2, graphs["verify"], vocab_size_);
    }
    if (graphs.contains("tree")) tree_ = std::make_unique<Graph>(pt2, graphs["tree"], vocab_size_);
    const auto dtype = detail::dtype_from_name(kv.at("dtype"));
    shares_cache_ = kv.value("shared_with", "") == "target";
    if (shares_cache_) {
      // The first layers of the target's cache, checked: the draft must read exactly the
      // tensors the target writes.
      const bool fits = target && static_cast<int64_t>(target->caches_.size()) >= 2 * layers &&
                        std::all_of(target->caches_.begin(), target->caches_.begin() + 2 * layers,
                                    [&](const at::Tensor& c) {
                                      return c.sizes().vec() == shape && c.scalar_type() == dtype;
                                    });
      if (!fits) {
        throw PackageError(
            "the draft is built to share the target's KV cache, but the target's cache layout "
            "differs from the draft's; rebuild the package");
      }
      caches_.assign(target->caches_.begin(), target->caches_.begin() + 2 * layers);
    } else {
      for (int64_t i = 0; i < 2 * layers; ++i) caches_.push_back(zeros_on_demand(shape, dtype));
    }
    prefill_chunk_ = prefill_ ? prefill_->max_tokens() : 1;
    verify_len_ = verify_ ? verify_->max_tokens() : 0;
  }

  // Binds the weights file to every graph, once its hashes are verified; `mapped` holds the
  // mapping the hashes were read through (absent with --no-verify: mapped here).
  void bind_weights(const fs::path& root, const json& entry, const detail::MappedFiles& mapped) {
    const fs::path file = root / entry.at("weights").at("file").get<std::string>();
    const auto it = mapped.find(file.string());
    weights_ = detail::load_safetensors(file, it == mapped.end() ? nullptr : it->second);
    const json aliases = entry.at("weights").value("aliases", json::object());
    for (const auto& [alias, name] : aliases.items()) {
      const auto it = weights_.find(name.get<std::string>());
      if (it == weights_.end()) throw PackageError("weight alias " + alias + " -> missing tensor");
      const at::Tensor tensor = it->second;
      weights_.insert_or_assign(alias, tensor);
    }
    for (Graph* g : {prefill_.get(), decode_.get(), verify_.get(), tree_.get()}) {
      if (g) g->bind(weights_);
    }
  }

  int64_t vocab_size() const { return vocab_size_; }
  bool shares_cache() const { return shares_cache_; }
  int64_t tree_len() const { return tree_ ? tree_->max_tokens() : 0; }
  const std::vector<at::Tensor>& caches() const { return caches_; }

  // Scores a token tree rooted at position start in one tree-graph call (padded to its
  // rows): logits [tree.size(), V]; node i's keys/values land in slot start + i.
  at::Tensor tree_forward(const detail::Tree& tree, int64_t start) {
    const int64_t n = tree.size(), width = tree_len();
    if (n < 1 || n > width || start + width > cache_len_) {
      throw GenerationError("a tree of " + std::to_string(n) + " nodes at " +
                            std::to_string(start) + " does not fit the tree graph");
    }
    at::Tensor ids = at::full({1, width}, tree.tokens.back(), at::kLong);
    at::Tensor positions = at::full({width}, start, at::kLong);
    const auto depths = tree.depths();
    for (int64_t i = 0; i < n; ++i) {
      ids[0][i] = tree.tokens[i];
      positions[i] = start + depths[i];
    }
    return (*tree_)(ids, positions, caches_, tree.mask(width)).narrow(0, 0, n);
  }

  // Runs tokens at positions start_pos.. through the fitting graph(s): logits [T, V] for
  // every position if all_logits, else [V] for the last one.
  at::Tensor forward(const std::vector<int64_t>& tokens, int64_t start_pos,
                     bool all_logits = false) {
    const auto count = static_cast<int64_t>(tokens.size());
    const int64_t end = start_pos + count;
    if (count == 0) throw std::logic_error("forward needs at least one token");
    if (end > cache_len_) {
      throw GenerationError("position " + std::to_string(end) + " is past the KV cache (" +
                            std::to_string(cache_len_) + ")");
    }
    std::vector<at::Tensor> outs;
    for (int64_t pos = start_pos; pos < end;) {
      const int64_t n = std::min(end - pos, prefill_chunk_);
      const int64_t width = graph_width(n, pos);
      Graph& graph = width == 1 ? *decode_ : (width == verify_len_ ? *verify_ : *prefill_);
      at::Tensor chunk = at::empty({1, width}, at::kLong);
      auto* ids = chunk.data_ptr<int64_t>();
      std::copy_n(tokens.begin() + (pos - start_pos), n, ids);
      std::fill(ids + n, ids + width, ids[n - 1]);
      at::Tensor logits =
          graph(chunk, at::arange(pos, pos + width, at::kLong), caches_).narrow(0, 0, n);
      outs.push_back(all_logits ? logits : logits.narrow(0, n - 1, 1));
      pos += n;
    }
    return all_logits ? at::cat(outs) : outs.back()[0];
  }

  // The per-token hot path: one decode call, logits [V].
  at::Tensor decode(int64_t token, int64_t pos) {
    return (*decode_)(at::full({1, 1}, token, at::kLong), at::full({1}, pos, at::kLong),
                      caches_)[0];
  }

 private:
  // Positions to run for n tokens at pos: ModelRunner._graph_width in engine.py (a few
  // tokens go through the verify graph, padded: the prefill graph is slowest there).
  int64_t graph_width(int64_t n, int64_t pos) const {
    if (n > 1 && n < verify_len_ && pos + verify_len_ <= cache_len_) return verify_len_;
    return n;
  }

  static void check_signature(const std::string& name, const json& signature, int64_t layers,
                              const std::vector<int64_t>& shape) {
    for (const auto& input : signature.value("inputs", json::array())) {
      if (input.value("name", "") != "kv_caches") continue;
      if (input.value("count", int64_t{-1}) != 2 * layers ||
          input.value("shape", std::vector<int64_t>{}) != shape) {
        throw PackageError("graph " + name + " expects other KV caches than kv_cache describes");
      }
    }
  }

  int64_t vocab_size_;
  std::unordered_map<std::string, at::Tensor> weights_;  // the graphs use these in place
  std::unique_ptr<Graph> prefill_, decode_, verify_, tree_;
  std::vector<at::Tensor> caches_;
  bool shares_cache_ = false;
  int64_t cache_len_ = 0;
  int64_t prefill_chunk_ = 0;
  int64_t verify_len_ = 0;
};

// Streams text while holding back anything that could still become a stop string.
// Works on UTF-8 bytes and only ever cuts at character boundaries.
class StopText {
 public:
  explicit StopText(const std::vector<std::string>& stops) {
    for (const auto& s : stops) {
      if (!s.empty()) stops_.push_back(s);
    }
    for (const auto& s : stops_) hold_ = std::max(hold_, s.size() - 1);
  }

  std::string add(std::string_view piece) {
    text_ += piece;
    for (const auto& s : stops_) {
      const auto i = text_.find(s, emitted_ > s.size() ? emitted_ - s.size() : 0);
      if (i != std::string::npos) {
        text_.resize(i);
        stopped_ = true;
        return flush();
      }
    }
    std::size_t safe = text_.size() > hold_ ? text_.size() - hold_ : 0;
    while (safe > emitted_ && safe < text_.size() && (text_[safe] & 0xC0) == 0x80) --safe;
    if (safe <= emitted_) return {};
    auto out = text_.substr(emitted_, safe - emitted_);
    emitted_ = safe;
    return out;
  }

  std::string flush() {
    auto out = text_.substr(std::min(emitted_, text_.size()));
    emitted_ = text_.size();
    return out;
  }

  bool stopped() const { return stopped_; }
  const std::string& text() const { return text_; }

 private:
  std::vector<std::string> stops_;
  std::size_t hold_ = 0;
  std::string text_;
  std::size_t emitted_ = 0;
  bool stopped_ = false;
};

bool uses_draft(Speculative mode) {
  return mode == Speculative::Draft || mode == Speculative::DraftNgram;
}

int64_t ngram_min(const GenerationConfig& config) {
  return config.ngram_min.value_or(config.speculative == Speculative::DraftNgram ? 3 : 1);
}

// Draft-length schedule of HF assisted generation: +2 after a full accept, else -1.
struct AdaptiveK {
  int64_t k, k_min, k_max;
  void update(int64_t drafted, int64_t accepted) {
    if (drafted > 0) k = std::clamp(k + (accepted >= drafted ? 2 : -1), k_min, k_max);
  }
};

// ---- Proposers: where the draft tokens of a speculative step come from (proposers.py) ----

// The draft tokens of one verify step.
struct Proposal {
  std::vector<int64_t> tokens;
  // [K, V]: the distribution each token was drawn from (a sampled draft); undefined for a
  // deterministic proposal (a greedy draft, n-gram lookup).
  at::Tensor probs;
  bool looked_up = false;  // from n-gram lookup, not the draft model
};

// propose: up to k tokens to follow history (prompt + output; its last token sits at position
// history.size() - 1, not yet in the target's cache). accepted: after verification, positions
// < pos of the target's cache hold accepted tokens.
class Proposer {
 public:
  virtual ~Proposer() = default;
  virtual Proposal propose(const std::vector<int64_t>& history, int64_t k) = 0;
  virtual void accepted(int64_t /*pos*/) {}
};

// n-gram lookup in the prompt + output (NgramProposer): no model, deterministic. One per
// request: its index grows with the request's text.
class LookupProposer final : public Proposer {
 public:
  LookupProposer(int64_t min_n, int64_t max_n) : ngram_(min_n, max_n) {}

  Proposal propose(const std::vector<int64_t>& history, int64_t k) override {
    Proposal proposal;
    proposal.tokens = ngram_.propose(history, k);
    proposal.looked_up = !proposal.tokens.empty();
    return proposal;
  }

 private:
  NgramProposer ngram_;
};

// k tokens from the draft model, greedy or sampled; sampling keeps each token's distribution
// for speculative sampling. pos_ is the first position missing from the draft's cache.
class DraftProposer final : public Proposer {
 public:
  DraftProposer(ModelRunner& draft, const std::vector<int64_t>& prompt,
                const SamplingParams& params, at::Generator& gen)
      : draft_(draft), params_(params), gen_(gen), pos_(static_cast<int64_t>(prompt.size())) {
    // A draft that shares the target's cache finds every accepted position already written
    // by the target (prefill, then each verify): it never prefills and never catches up.
    if (!draft_.shares_cache()) draft_.forward(prompt, 0);
  }

  Proposal propose(const std::vector<int64_t>& history, int64_t k) override {
    // Catch the draft cache up on accepted tokens it has not seen, then draft. A shared
    // cache lacks only tok: the verify that follows overwrites the draft's entries.
    if (draft_.shares_cache()) pos_ = static_cast<int64_t>(history.size()) - 1;
    const std::vector<int64_t> pending(history.begin() + pos_, history.end());
    at::Tensor logits = draft_.forward(pending, pos_);
    pos_ += static_cast<int64_t>(pending.size());
    Proposal proposal;
    std::vector<at::Tensor> rows;
    for (int64_t i = 0; i < k; ++i) {
      int64_t next;
      if (params_.greedy()) {
        next = logits.argmax().item<int64_t>();
      } else {
        rows.push_back(detail::logits_to_probs(logits.unsqueeze(0), params_)[0]);
        next = detail::sample(rows.back().unsqueeze(0), gen_).item<int64_t>();
      }
      proposal.tokens.push_back(next);
      if (i + 1 < k) logits = draft_.decode(next, pos_++);
    }
    if (!rows.empty()) proposal.probs = at::stack(rows);
    return proposal;
  }

  // The draft cache is valid up to the accepted prefix; later positions are stale and get
  // overwritten next round (position overwrite: no rollback). After a full accept the last
  // proposal is not in it yet: it is fed with the next round.
  void accepted(int64_t pos) override { pos_ = std::min(pos_, pos); }

 private:
  ModelRunner& draft_;
  const SamplingParams& params_;
  at::Generator& gen_;
  int64_t pos_;
};

// DraftNgram: a long enough match in the prompt + output costs nothing to propose; the draft
// runs only when there is none.
class DraftOrLookupProposer final : public Proposer {
 public:
  DraftOrLookupProposer(LookupProposer lookup, DraftProposer draft)
      : lookup_(std::move(lookup)), draft_(std::move(draft)) {}

  Proposal propose(const std::vector<int64_t>& history, int64_t k) override {
    Proposal proposal = lookup_.propose(history, k);
    return proposal.tokens.empty() ? draft_.propose(history, k) : proposal;
  }

  void accepted(int64_t pos) override { draft_.accepted(pos); }

 private:
  LookupProposer lookup_;
  DraftProposer draft_;
};

// The accepted prefix of the proposal plus one token from the target (speculative.py verify).
std::vector<int64_t> verify(const Proposal& proposal, const at::Tensor& target_logits,
                            const SamplingParams& params, at::Generator& gen) {
  if (params.greedy()) return detail::verify_greedy(proposal.tokens, target_logits);
  if (proposal.tokens.empty()) return {detail::select_next(target_logits[0], params, gen)};
  const at::Tensor draft_probs =
      proposal.probs.defined() ? proposal.probs
                               : detail::one_hot(proposal.tokens, target_logits.size(-1));
  return detail::verify_stochastic(proposal.tokens, draft_probs,
                                   detail::logits_to_probs(target_logits, params), gen);
}

// The draft model as tree drafting sees it (tree.h).
class DraftCalls final : public detail::DraftModel {
 public:
  explicit DraftCalls(ModelRunner& runner) : runner_(runner) {}
  at::Tensor forward(const std::vector<int64_t>& tokens, int64_t start) override {
    return runner_.forward(tokens, start);
  }
  at::Tensor decode(int64_t token, int64_t pos) override { return runner_.decode(token, pos); }
  bool shares_cache() const override { return runner_.shares_cache(); }

 private:
  ModelRunner& runner_;
};

}  // namespace

struct Engine::Impl {
  fs::path root;
  json manifest;
  std::optional<Tokenizer> tokenizer;  // always set once loaded
  std::vector<int64_t> eos_ids;
  std::optional<int64_t> bos_id;  // led plain prompts when the checkpoint asks (add_bos_token)
  std::optional<std::string> chat_template;
  std::unique_ptr<ModelRunner> target;
  std::unique_ptr<ModelRunner> draft;
  int64_t max_seq_len = 0;
  int64_t verify_k = 0;
  double load_s = 0;
  std::mutex generate_mutex;  // one KV cache: one request at a time
};

namespace {

// Yields the newly accepted tokens, one list per model step (engine.py _token_steps).
class TokenSteps {
 public:
  TokenSteps(ModelRunner& target, ModelRunner* draft, int64_t max_seq_len, int64_t verify_k,
             const std::vector<int64_t>& prompt, const GenerationConfig& config,
             std::optional<SpecStats>& spec)
      : target_(target), draft_(draft), max_seq_len_(max_seq_len), max_k_(verify_k),
        prompt_(prompt), config_(config), params_(config.sampling), spec_(spec),
        gen_(detail::make_generator(config.sampling.seed)) {}

  std::vector<int64_t> next() {
    if (!started_) {
      started_ = true;
      tok_ = detail::select_next(target_.forward(prompt_, 0), params_, gen_);
      pos_ = static_cast<int64_t>(prompt_.size());  // position of tok_, not yet cached
      return {tok_};
    }
    if (config_.speculative == Speculative::None) {
      tok_ = detail::select_next(target_.decode(tok_, pos_), params_, gen_);
      ++pos_;
      return {tok_};
    }
    if (!spec_started_) start_speculative();
    return config_.tree ? tree_round() : speculative_round();
  }

 private:
  void start_speculative() {
    spec_started_ = true;
    k_ = std::min(config_.k.value_or(max_k_), max_k_);
    if (config_.adaptive_k) adaptive_ = AdaptiveK{std::clamp<int64_t>(k_, 1, max_k_), 1, max_k_};
    history_ = prompt_;
    history_.push_back(tok_);
    if (config_.tree) {
      if (draft_) draft_calls_.emplace(*draft_);
      tree_proposer_ = detail::make_tree_proposer(
          config_.speculative, draft_calls_ ? &*draft_calls_ : nullptr, prompt_, params_, gen_,
          *config_.tree, ngram_min(config_), config_.ngram_max);
    } else {
      proposer_ = make_proposer();
    }
  }

  // Propose a tree -> score it in one tree-graph call -> keep one path (tree_draft.py).
  std::vector<int64_t> tree_round() {
    const int64_t budget = target_.tree_len();
    const int64_t k = std::min(config_.k.value_or(max_k_), budget - 1);
    const detail::Tree tree = tree_proposer_->propose(history_, k, budget);
    const at::Tensor logits = tree.size() == 1 ? target_.decode(tok_, pos_).unsqueeze(0)
                                               : target_.tree_forward(tree, pos_);
    const auto verdict = detail::verify_tree(tree, logits, params_, gen_);
    const int64_t moved = detail::commit_path(target_.caches(), pos_, verdict.path);
    std::vector<int64_t> accepted;
    for (std::size_t i = 1; i < verdict.path.size(); ++i) {
      accepted.push_back(tree.tokens[verdict.path[i]]);
    }
    accepted.push_back(verdict.next);
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
    return accepted;
  }

  // The proposer of config.speculative: Ngram, Draft or DraftNgram.
  std::unique_ptr<Proposer> make_proposer() {
    LookupProposer lookup(ngram_min(config_), config_.ngram_max);
    if (!uses_draft(config_.speculative)) return std::make_unique<LookupProposer>(lookup);
    DraftProposer draft(*draft_, prompt_, params_, gen_);
    if (config_.speculative == Speculative::DraftNgram) {
      return std::make_unique<DraftOrLookupProposer>(lookup, std::move(draft));
    }
    return std::make_unique<DraftProposer>(std::move(draft));
  }

  // Propose -> verify -> accept: one verify step.
  std::vector<int64_t> speculative_round() {
    int64_t k = adaptive_ ? adaptive_->k : k_;
    k = std::min(k, max_seq_len_ + max_k_ - pos_);
    const Proposal proposal = proposer_->propose(history_, k);
    const auto n = static_cast<int64_t>(proposal.tokens.size());
    // Score tok + proposal: row i predicts the token after history[:pos+i+1].
    std::vector<int64_t> block{tok_};
    block.insert(block.end(), proposal.tokens.begin(), proposal.tokens.end());
    const at::Tensor logits = target_.forward(block, pos_, /*all_logits=*/true);
    const std::vector<int64_t> accepted = verify(proposal, logits, params_, gen_);
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
    return accepted;
  }

  ModelRunner& target_;
  ModelRunner* draft_;
  int64_t max_seq_len_;
  int64_t max_k_;
  const std::vector<int64_t>& prompt_;
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
};

}  // namespace

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::Engine(Engine&&) noexcept = default;
Engine& Engine::operator=(Engine&&) noexcept = default;
Engine::~Engine() = default;

Engine Engine::load(const fs::path& package_dir, const LoadOptions& options) {
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
    impl->target = std::make_unique<ModelRunner>(pt2, models.at("target"));
    if (models.contains("draft")) {
      impl->draft = std::make_unique<ModelRunner>(pt2, models.at("draft"), impl->target.get());
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
    const json& template_value = tok_config.value("chat_template", json());
    if (template_value.is_string()) {
      impl->chat_template = template_value.get<std::string>();
    } else if (template_value.is_array()) {  // named templates: [{"name", "template"}]
      for (const auto& t : template_value) {
        if (t.value("name", "") == "default") impl->chat_template = t.value("template", "");
      }
    }
    if (fs::is_regular_file(tok_dir / "chat_template.jinja")) {
      std::ifstream in(tok_dir / "chat_template.jinja");
      impl->chat_template = std::string(std::istreambuf_iterator<char>(in), {});
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

GenerationResult Engine::generate(const std::vector<int64_t>& prompt_ids,
                                  const GenerationConfig& config, const TextCallback& on_text) {
  Impl& e = *impl_;
  config.sampling.validate();
  if (prompt_ids.empty()) throw GenerationError("empty prompt: give at least one token");
  if (config.max_new_tokens < 1) {
    throw GenerationError("max_new_tokens must be >= 1, got " +
                          std::to_string(config.max_new_tokens));
  }
  const auto vocab = e.target->vocab_size();
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
  if (config.k && *config.k < 1) {
    throw GenerationError("k (the draft length) must be >= 1, got " + std::to_string(*config.k));
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

  const std::lock_guard<std::mutex> one_at_a_time(e.generate_mutex);
  std::set<int64_t> eos;
  if (!config.ignore_eos) eos.insert(e.eos_ids.begin(), e.eos_ids.end());
  StreamDecoder stream(*e.tokenizer);
  StopText stop(config.stop);
  GenerationResult result;
  result.prompt_tokens = prompt_len;
  if (config.speculative != Speculative::None) result.spec.emplace();
  std::string finish = "length";
  auto& out = result.token_ids;

  const auto t0 = Clock::now();
  std::optional<Clock::time_point> t_first;
  TokenSteps steps(*e.target, e.draft.get(), e.max_seq_len, e.verify_k, prompt_ids, config,
                   result.spec);
  while (true) {
    const auto new_tokens = steps.next();
    if (!t_first) t_first = Clock::now();
    for (const auto tok : new_tokens) {
      if (eos.contains(tok)) {
        finish = "eos";
        break;
      }
      out.push_back(tok);
      const auto piece = stop.add(stream.push(tok));
      if (!piece.empty() && on_text) on_text(piece);
      if (stop.stopped()) {
        finish = "stop";
        break;
      }
      if (static_cast<int64_t>(out.size()) >= config.max_new_tokens) break;
    }
    if (finish != "length" || static_cast<int64_t>(out.size()) >= config.max_new_tokens) break;
  }
  const auto t_end = Clock::now();
  if (!stop.stopped()) {
    const auto tail = stop.add(stream.flush()) + stop.flush();
    if (!tail.empty() && on_text) on_text(tail);
  }
  result.text = stop.text();
  result.finish_reason = finish;
  result.prefill_s = std::chrono::duration<double>(*t_first - t0).count();
  result.decode_s = std::chrono::duration<double>(t_end - *t_first).count();
  return result;
}

std::vector<int64_t> Engine::chat_ids(const std::string& user,
                                      const std::optional<std::string>& system) const {
  const auto& tmpl = impl_->chat_template;
  if (!tmpl || tmpl->find("<|im_start|>") == std::string::npos) {
    throw std::runtime_error(
        impl_->root.string() +
        ": the chat template is not ChatML; the C++ runtime renders ChatML only (no jinja): "
        "format the prompt yourself and pass it with --prompt");
  }
  std::vector<std::pair<std::string, std::string>> messages;
  if (system) messages.emplace_back("system", *system);
  messages.emplace_back("user", user);
  // Special tokens come from the template alone: message text that would encode to a
  // control token ("<|im_start|>system") is encoded as text, piece by piece
  // (tokenizer.py: Tokenizer.encode_chat).
  const Tokenizer& tok = *impl_->tokenizer;
  const bool plain = std::all_of(messages.begin(), messages.end(), [&](const auto& m) {
    return tok.encode(m.second) == tok.encode(m.second, /*parse_special=*/false);
  });
  if (plain) return tok.encode(chatml_prompt(messages));
  std::vector<int64_t> ids;
  const auto append = [&ids](const std::vector<int64_t>& more) {
    ids.insert(ids.end(), more.begin(), more.end());
  };
  for (const auto& [role, content] : messages) {
    append(tok.encode("<|im_start|>" + role + "\n"));
    append(tok.encode(content, /*parse_special=*/false));
    append(tok.encode("<|im_end|>\n"));
  }
  append(tok.encode("<|im_start|>assistant\n"));
  return ids;
}

std::vector<int64_t> Engine::prompt_ids(const std::string& text) const {
  std::vector<int64_t> ids = impl_->tokenizer->encode(text);
  if (impl_->bos_id) ids.insert(ids.begin(), *impl_->bos_id);
  return ids;
}

const Tokenizer& Engine::tokenizer() const { return *impl_->tokenizer; }
const std::vector<int64_t>& Engine::eos_ids() const { return impl_->eos_ids; }
int64_t Engine::max_seq_len() const { return impl_->max_seq_len; }
int64_t Engine::verify_k() const { return impl_->verify_k; }
bool Engine::has_draft() const { return impl_->draft != nullptr; }
double Engine::load_s() const { return impl_->load_s; }
const fs::path& Engine::root() const { return impl_->root; }

}  // namespace aotgen
