// Continuous batching over the batched graphs: aotgen/runtime/batch_engine.py, scheduler.py
// and sequence.py, step for step, so that a request gets the ids it gets there (and alone).
#include <algorithm>
#include <chrono>
#include <deque>
#include <iterator>
#include <mutex>
#include <set>

#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>

#include "detail.h"
#include "proposers.h"
#include "rules.h"
#include "runner.h"
#include "sink.h"

namespace aotgen {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// A request: its slot in the KV cache and how far it has got (sequence.py Sequence). `pos`
// counts the tokens in the cache. While prefilling, the prompt goes in by chunks; after that
// `pending` is the last sampled token, not yet in the cache (the next step's input at pos).
struct Request {
  Request(int64_t id, const std::vector<int64_t>& prompt, const GenerationConfig& config,
          detail::TokenSink sink, DoneCallback on_done)
      : id(id), prompt(prompt), config(config), sink(std::move(sink)),
        on_done(std::move(on_done)), gen(detail::make_generator(config.sampling.seed)),
        history(prompt) {
    if (config.speculative != Speculative::None) spec.emplace();
    if (config.logprobs) logprobs.emplace();
  }

  bool prefilling() const { return pos < static_cast<int64_t>(prompt.size()); }
  // Only the prompt's last token is left to run: it runs in the step's decode, beside the
  // requests decoding, and chooses the first new token.
  bool last_prompt_token() const {
    return pos == static_cast<int64_t>(prompt.size()) - 1 && config.max_new_tokens > 0;
  }
  // The token a decode step runs at `pos`.
  int64_t decode_input() const { return prefilling() ? prompt.back() : pending; }
  bool done() const { return sink.done(); }

  // One step's tokens, and the logits rows that chose them: the last token becomes the next
  // step's input.
  void accept(const std::vector<int64_t>& tokens, const at::Tensor& rows) {
    if (!first_token) first_token = Clock::now();
    pending = tokens.back();
    history.insert(history.end(), tokens.begin(), tokens.end());
    const std::size_t before = sink.ids().size();
    sink.add(tokens);
    if (logprobs) detail::append_logprobs(rows, sink.ids(), before, *config.logprobs, *logprobs);
  }

  GenerationResult result() const {
    GenerationResult r;
    r.text = sink.text();
    r.token_ids = sink.ids();
    r.prompt_tokens = static_cast<int64_t>(prompt.size());
    r.finish_reason = sink.finish_reason();
    r.stop_string = sink.stop_string();
    r.stop_token = sink.stop_token();
    const auto first = first_token.value_or(finished);
    r.prefill_s = seconds(submitted, first);  // time to first token, queueing included
    r.decode_s = seconds(first, finished);
    r.spec = spec;
    r.error = error;
    r.cached_tokens = cached_tokens;
    r.logprobs = logprobs;
    return r;
  }

  int64_t id;
  std::vector<int64_t> prompt;
  GenerationConfig config;
  detail::TokenSink sink;
  DoneCallback on_done;
  at::Generator gen;
  // Made the first time the request decodes; none for a draft that drafts in a batch
  // (draft_batch) without lookup.
  std::unique_ptr<detail::Proposer> proposer;
  std::vector<int64_t> history;  // prompt + accepted tokens
  std::optional<SpecStats> spec;
  std::optional<std::vector<TokenLogprob>> logprobs;
  std::optional<detail::TokenRules> rules;  // its penalties, none without
  int64_t slot = -1;
  int64_t pos = 0;
  int64_t cached_tokens = 0;  // prompt tokens its slot already held
  int64_t pending = 0;
  bool cancelled = false;
  std::string error;
  Clock::time_point submitted = Clock::now();
  std::optional<Clock::time_point> first_token;
  Clock::time_point finished;
};

// A request whose step (or prefix copy) failed ends with the error; the engine goes on.
void fail(Request& r, const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  r.error = c10_error ? c10_error->what_without_backtrace() : e.what();
  r.sink.close("error");
}

using RequestPtr = std::shared_ptr<Request>;

// [B, T] int64 from rows of equal length.
at::Tensor long_tensor(const std::vector<std::vector<int64_t>>& rows) {
  const auto b = static_cast<int64_t>(rows.size());
  const auto t = static_cast<int64_t>(rows.front().size());
  at::Tensor out = at::empty({b, t}, at::kLong);
  auto* p = out.data_ptr<int64_t>();
  for (const auto& row : rows) p = std::copy(row.begin(), row.end(), p);
  return out;
}

}  // namespace

struct BatchEngine::Impl {
  Impl(Engine engine_, detail::EngineState& state, const BatchOptions& options)
      : engine(std::move(engine_)), e(state), target(*state.target),
        max_queue(options.max_queue), prefill_step(std::max<int64_t>(1, options.prefill_step)) {
    for (int64_t s = 0; s < target.slots(); ++s) free.push_back(s);
  }

  // ---- the scheduler (scheduler.py), under `mutex` -----------------------------------------
  // Gives free slots to waiting requests, oldest first: each the slot whose cache row holds
  // the longest prefix of its prompt, which it then skips (without one, the slot freed
  // longest ago).
  void admit() {
    while (!waiting.empty() && !free.empty()) {
      RequestPtr r = waiting.front();
      waiting.pop_front();
      r->slot = free.front();
      if (r->config.reuse_prefix) {
        r->slot = target.cached().best_slot(free, r->prompt);
        r->pos = r->cached_tokens = target.cached().reusable(r->slot, r->prompt);
      }
      free.erase(std::find(free.begin(), free.end(), r->slot));
      running.push_back(r);
    }
  }

  // A finished or cancelled request leaves: its slot is free for the next step.
  void release(const RequestPtr& r) {
    r->finished = Clock::now();
    if (const auto it = std::find(running.begin(), running.end(), r); it != running.end()) {
      running.erase(it);
      free.push_back(r->slot);
    } else if (const auto w = std::find(waiting.begin(), waiting.end(), r); w != waiting.end()) {
      waiting.erase(w);
    }
    r->slot = -1;
  }

  // ---- model steps (outside the lock) -----------------------------------------------------
  // Before a request's prompt starts, copies into its row the longest prefix of it that any
  // row holds: rows written since it took its slot (a request ahead of it, still running, with
  // the same system prompt) may hold more than its own. Oldest first, up to the first with more
  // than its last token to run, returned: its chunk runs this step. Those left with their last
  // token join the step's decode.
  RequestPtr share_prefixes(const std::vector<RequestPtr>& prefilling) {
    for (const auto& r : prefilling) {
      if (r->pos == r->cached_tokens && r->config.reuse_prefix) {  // not started
        int64_t held = 0;
        try {
          // Without the last token: the row goes on at most there, where its logits pick
          // the first new token, so the ring's window is checked at that position.
          held = target.share_prefix(
              r->slot, std::vector<int64_t>(r->prompt.begin(), r->prompt.end() - 1));
        } catch (const std::exception& e) {  // a failed copy ends its request, not the engine
          fail(*r, e);
          continue;
        }
        r->pos = r->cached_tokens = std::min<int64_t>(held, r->prompt.size() - 1);
      }
      if (!r->last_prompt_token()) return r;
    }
    return nullptr;
  }

  // The next chunk of r's prompt; after the last, its first token.
  void prefill(Request& r, bool others_decoding) {
    const int64_t limit = others_decoding ? prefill_step : target.prefill_chunk();
    const auto begin = r.prompt.begin() + r.pos;
    const auto n = std::min<int64_t>(limit, r.prompt.end() - begin);
    const std::vector<int64_t> chunk(begin, begin + n);
    const at::Tensor logits = target.forward(chunk, r.pos, false, r.slot);
    r.pos += n;
    if (!r.prefilling()) {
      r.accept({detail::select(logits, r.config.sampling, r.gen, r.rules)}, logits.unsqueeze(0));
    }
  }

  // Every request past its prompt moves on by one decode or one verify.
  void decode(const std::vector<RequestPtr>& seqs) {
    std::vector<detail::Proposal> proposals = propose(seqs);
    // Under a spent reasoning budget: cut where the forced token is missed.
    for (std::size_t i = 0; i < seqs.size(); ++i) detail::fit(proposals[i], seqs[i]->rules);
    std::vector<RequestPtr> plain, verifying;
    std::vector<detail::Proposal> props;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      if (proposals[i].tokens.empty()) {
        plain.push_back(seqs[i]);
      } else {
        verifying.push_back(seqs[i]);
        props.push_back(std::move(proposals[i]));
      }
    }
    if (!plain.empty()) {
      const at::Tensor logits = decode_logits(plain);
      for (std::size_t i = 0; i < plain.size(); ++i) {
        Request& r = *plain[i];
        if (r.spec && !r.prefilling()) r.spec->steps += 1;  // it found nothing to propose
        r.pos += 1;
        const at::Tensor row = logits[static_cast<int64_t>(i)];
        accepted(r, {detail::select(row, r.config.sampling, r.gen, r.rules)}, row.unsqueeze(0));
      }
    }
    if (!verifying.empty()) {
      const auto all_logits = verify_logits(verifying, props);
      for (std::size_t i = 0; i < verifying.size(); ++i) {
        Request& r = *verifying[i];
        // Under penalties row j takes them as they stand after the proposal's first j tokens.
        const at::Tensor scored =
            r.rules ? r.rules->along(all_logits[i], props[i].tokens) : all_logits[i];
        const auto tokens = detail::verify(props[i], scored, r.config.sampling, r.gen);
        if (r.rules) r.rules->advance(tokens);
        r.spec->steps += 1;
        r.spec->lookup_steps += props[i].looked_up;
        r.spec->drafted += static_cast<int64_t>(props[i].tokens.size());
        r.spec->accepted += static_cast<int64_t>(tokens.size()) - 1;
        r.pos += static_cast<int64_t>(tokens.size());
        accepted(r, tokens, all_logits[i].slice(0, 0, static_cast<int64_t>(tokens.size())));
      }
    }
  }

  // A step's tokens (and the logits rows that chose them), once r.pos counts the positions
  // its cache now holds.
  static void accepted(Request& r, const std::vector<int64_t>& tokens, const at::Tensor& rows) {
    if (r.proposer) r.proposer->accepted(r.pos);
    r.accept(tokens, rows);
  }

  // Each request's proposal (empty: none, or not speculating). Requests whose draft runs on
  // the target's cache draft together through the draft's batched graph (draft_batch), after
  // n-gram lookup for draft+ngram; the others through their own proposer, made the first
  // time they decode: n-gram lookup, their draft in their cache row, or both.
  std::vector<detail::Proposal> propose(const std::vector<RequestPtr>& seqs) {
    const bool together = detail::can_draft_in_batch(e.draft.get());
    std::vector<detail::Proposal> out(seqs.size());
    std::vector<std::size_t> drafting;
    std::vector<detail::DraftRequest> requests;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      Request& r = *seqs[i];
      const GenerationConfig& c = r.config;
      // A request's first token (its prompt's last token runs here) comes unproposed.
      if (c.speculative == Speculative::None || r.prefilling()) continue;
      int64_t k = std::min(c.k.value_or(e.verify_k), e.verify_k);
      k = std::min(k, e.max_seq_len + e.verify_k - r.pos);
      if (!together || !detail::uses_draft(c.speculative)) {
        if (!r.proposer) {
          r.proposer = detail::make_proposer(e.draft.get(), r.prompt, c, r.gen, r.slot, &r.rules,
                                             e.lookup_cache.get());
        }
        out[i] = r.proposer->propose(r.history, k);
        continue;
      }
      if (!r.proposer && c.speculative == Speculative::DraftNgram) {
        r.proposer = std::make_unique<detail::LookupProposer>(detail::ngram_min(c), c.ngram_max,
                                                              e.lookup_cache.get());
      }
      if (r.proposer) out[i] = r.proposer->propose(r.history, k);
      if (out[i].tokens.empty() && k > 0) {
        drafting.push_back(i);
        const auto last = static_cast<int64_t>(r.history.size()) - 1;
        requests.push_back({r.history.back(), last, r.slot, k, c.sampling, r.gen, r.rules});
      }
    }
    if (!drafting.empty()) {
      auto drafts = detail::draft_batch(*e.draft, requests);
      for (std::size_t j = 0; j < drafting.size(); ++j) out[drafting[j]] = std::move(drafts[j]);
    }
    return out;
  }

  // [B, V]: the batched graph for two or more requests, else the decode graph.
  at::Tensor decode_logits(const std::vector<RequestPtr>& seqs) {
    if (seqs.size() == 1 || !target.has_batch_decode()) {
      std::vector<at::Tensor> rows;
      for (const auto& r : seqs) rows.push_back(target.decode(r->decode_input(), r->pos, r->slot));
      return at::stack(rows);
    }
    std::vector<std::vector<int64_t>> tokens, positions, slots(1);
    for (const auto& r : seqs) {
      tokens.push_back({r->decode_input()});
      positions.push_back({r->pos});
      slots[0].push_back(r->slot);
    }
    return target.batch(long_tensor(tokens), long_tensor(positions), long_tensor(slots)[0])
        .select(1, 0);
  }

  // Each request's [k + 1, V] logits for its pending token and its proposal. Rows are padded
  // to the graph's width by repeating the last token: the padded positions are written past
  // the proposal and never read before they are overwritten.
  std::vector<at::Tensor> verify_logits(const std::vector<RequestPtr>& seqs,
                                        const std::vector<detail::Proposal>& proposals) {
    std::vector<std::vector<int64_t>> rows;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const auto& tokens = proposals[i].tokens;
      rows.push_back({seqs[i]->pending});
      rows.back().insert(rows.back().end(), tokens.begin(), tokens.end());
    }
    std::vector<at::Tensor> out;
    if (seqs.size() == 1 || !target.has_batch_verify()) {
      for (std::size_t i = 0; i < seqs.size(); ++i) {
        out.push_back(target.forward(rows[i], seqs[i]->pos, true, seqs[i]->slot));
      }
      return out;
    }
    const int64_t width = target.verify_len();
    std::vector<std::vector<int64_t>> tokens, positions, slots(1);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      tokens.push_back(rows[i]);
      tokens.back().resize(width, rows[i].back());
      auto& p = positions.emplace_back();
      for (int64_t j = 0; j < width; ++j) p.push_back(seqs[i]->pos + j);
      slots[0].push_back(seqs[i]->slot);
    }
    const at::Tensor logits =
        target.batch(long_tensor(tokens), long_tensor(positions), long_tensor(slots)[0]);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      out.push_back(logits[static_cast<int64_t>(i)].narrow(0, 0, rows[i].size()));
    }
    return out;
  }

  Engine engine;
  detail::EngineState& e;
  detail::ModelRunner& target;
  int64_t max_queue;
  int64_t prefill_step;
  mutable std::mutex mutex;  // the scheduler's state: submit / cancel from any thread
  std::deque<int64_t> free;
  std::deque<RequestPtr> waiting;
  std::vector<RequestPtr> running;
  int64_t next_id = 0;
};

BatchEngine::BatchEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BatchEngine::BatchEngine(BatchEngine&&) noexcept = default;
BatchEngine& BatchEngine::operator=(BatchEngine&&) noexcept = default;
BatchEngine::~BatchEngine() = default;

BatchEngine BatchEngine::load(const std::filesystem::path& package_dir, const LoadOptions& options,
                              const BatchOptions& batch) {
  Engine engine = Engine::load(package_dir, options, batch.slots);
  detail::EngineState& state = *engine.impl_;
  return BatchEngine(std::make_unique<Impl>(std::move(engine), state, batch));
}

int64_t BatchEngine::submit(const std::vector<int64_t>& prompt_ids, const GenerationConfig& config,
                            TextCallback on_text, DoneCallback on_done) {
  Impl& b = *impl_;
  if (config.tree || config.adaptive_k) {
    throw GenerationError(
        "the batch engine drafts chains of a fixed length: tree drafting and adaptive k serve "
        "one request at a time (Engine)");
  }
  detail::check_request(b.e, prompt_ids, config);
  detail::TokenSink sink(*b.e.tokenizer, config, b.e.eos_ids, std::move(on_text));
  const std::lock_guard<std::mutex> lock(b.mutex);
  // Requests a free slot takes at the next step do not count: only those beyond the slots wait.
  const int64_t queued =
      static_cast<int64_t>(b.waiting.size()) - static_cast<int64_t>(b.free.size());
  if (queued >= b.max_queue) {
    throw QueueFull(std::to_string(queued) + " requests are already waiting for a slot (max_queue=" +
                    std::to_string(b.max_queue) + "); retry later");
  }
  const int64_t id = b.next_id++;
  auto request =
      std::make_shared<Request>(id, prompt_ids, config, std::move(sink), std::move(on_done));
  request->rules = detail::make_rules(config, prompt_ids, b.target.vocab_size(), b.e.eos_ids,
                                     detail::reasoning_budget(b.e, config, prompt_ids));
  b.waiting.push_back(std::move(request));
  return id;
}

void BatchEngine::cancel(int64_t request_id) {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  for (const auto& r : impl_->running) r->cancelled |= r->id == request_id;
  for (const auto& r : impl_->waiting) r->cancelled |= r->id == request_id;
}

bool BatchEngine::step() {
  Impl& b = *impl_;
  RequestPtr prefill;
  std::vector<RequestPtr> decoding, finished;
  const auto finish = [&](const RequestPtr& r) {
    b.release(r);
    finished.push_back(r);
  };
  {
    const std::lock_guard<std::mutex> lock(b.mutex);
    std::vector<RequestPtr> all(b.running.begin(), b.running.end());
    all.insert(all.end(), b.waiting.begin(), b.waiting.end());
    for (const auto& r : all) {
      if (!r->cancelled) continue;
      r->sink.close("cancelled");
      finish(r);
    }
    b.admit();
  }
  // The running list changes in this thread only, under the lock: read here without it.
  std::vector<RequestPtr> prefilling;
  std::copy_if(b.running.begin(), b.running.end(), std::back_inserter(prefilling),
               [](const RequestPtr& r) { return r->prefilling(); });
  prefill = b.share_prefixes(prefilling);
  for (const auto& r : b.running) {
    if ((!r->prefilling() || r->last_prompt_token()) && !r->done()) decoding.push_back(r);
  }
  const bool work = prefill || !decoding.empty();
  if (work) {
    try {
      if (prefill) b.prefill(*prefill, !decoding.empty());
      if (!decoding.empty()) b.decode(decoding);
    } catch (const std::exception& e) {  // a failed step ends the requests in it, not the engine
      if (prefill) decoding.push_back(prefill);
      for (const auto& r : decoding) fail(*r, e);
    }
  }
  {
    const std::lock_guard<std::mutex> lock(b.mutex);
    for (const auto& r : std::vector<RequestPtr>(b.running)) {
      if (r->done()) finish(r);
    }
  }
  for (const auto& r : finished) {  // outside the lock: a callback may submit
    if (r->sink.finish_reason() != "error") b.e.learn(r->prompt, r->sink.ids());
    if (r->on_done) r->on_done(r->id, r->result());
  }
  return work || !finished.empty();
}

std::vector<GenerationResult> BatchEngine::generate_many(
    const std::vector<std::vector<int64_t>>& prompts,
    const std::vector<GenerationConfig>& configs) {
  if (configs.size() != prompts.size() && configs.size() != 1) {
    throw std::invalid_argument("give one config, or one per prompt");
  }
  std::vector<GenerationResult> results(prompts.size());
  std::size_t done = 0;
  std::vector<int64_t> ids;
  try {
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      ids.push_back(submit(prompts[i], configs[configs.size() == 1 ? 0 : i], {},
                           [&results, &done, i](int64_t, const GenerationResult& r) {
                             results[i] = r;
                             ++done;
                           }));
    }
  } catch (...) {  // the queued ones refer to `results`: end them before it goes
    for (const auto id : ids) cancel(id);
    while (done < ids.size() && step()) {
    }
    throw;
  }
  while (done < prompts.size()) {
    if (!step() && done < prompts.size()) throw std::logic_error("requests left unserved");
  }
  return results;
}

int64_t BatchEngine::slots() const { return impl_->target.slots(); }

int64_t BatchEngine::free_slots() const {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  return static_cast<int64_t>(impl_->free.size());
}

int64_t BatchEngine::waiting() const {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  return static_cast<int64_t>(impl_->waiting.size());
}

int64_t BatchEngine::running() const {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  return static_cast<int64_t>(impl_->running.size());
}

const Engine& BatchEngine::engine() const { return impl_->engine; }
void BatchEngine::set_lookup_cache(std::shared_ptr<LookupCache> cache) {
  impl_->engine.set_lookup_cache(std::move(cache));
}

}  // namespace aotgen
