// Draft-model proposers (aotgen/runtime/proposers.py) and batched drafting (batch_draft.py).
#include "proposers.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>

#include "runner.h"

namespace aotgen::detail {
namespace {

// The draft's next token from its logits [V]: the argmax, or sampled with the request's
// generator, its distribution kept in `rows` for the lossless acceptance rule. Under the
// request's rules, which then take the token (the drafter rolls back once it has drafted).
int64_t draft_token(const at::Tensor& input, const SamplingParams& params, at::Generator& gen,
                    std::vector<at::Tensor>& rows, std::optional<TokenRules>& rules) {
  const at::Tensor logits = rules ? rules->restrict(input) : input;
  int64_t tok = 0;
  if (params.greedy()) {
    tok = logits.argmax().item<int64_t>();
  } else {
    rows.push_back(logits_to_probs(logits.unsqueeze(0), params)[0]);
    tok = sample(rows.back().unsqueeze(0), gen).item<int64_t>();
  }
  if (rules) rules->advance({tok});
  return tok;
}

// Under rules, a draft stops at eos (nothing after it is verified).
bool ends(const std::optional<TokenRules>& rules, int64_t token) {
  return rules && rules->is_eos(token);
}

// [n] or [n, 1] int64 from values.
at::Tensor long_tensor(const std::vector<int64_t>& values, bool column) {
  const auto n = static_cast<int64_t>(values.size());
  at::Tensor out = column ? at::empty({n, 1}, at::kLong) : at::empty({n}, at::kLong);
  std::copy(values.begin(), values.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

DraftProposer::DraftProposer(ModelRunner& draft, const std::vector<int64_t>& prompt,
                             const SamplingParams& params, at::Generator& gen, int64_t slot,
                             bool reuse_prefix, std::optional<TokenRules>* rules)
    : draft_(draft), params_(params), gen_(gen), slot_(slot),
      pos_(static_cast<int64_t>(prompt.size())), rules_(rules) {
  // A draft that shares the target's cache finds every accepted position already written by
  // the target (prefill, then each verify): it never prefills and never catches up.
  if (!draft_.shares_cache()) draft_.prefill_reusing(prompt, slot_, reuse_prefix);
}

Proposal DraftProposer::propose(const std::vector<int64_t>& history, int64_t k) {
  // Catch the draft cache up on accepted tokens it has not seen, then draft. A shared cache
  // lacks only tok: the verify that follows overwrites the draft's entries.
  if (draft_.shares_cache()) pos_ = static_cast<int64_t>(history.size()) - 1;
  const std::vector<int64_t> pending(history.begin() + pos_, history.end());
  at::Tensor logits = draft_.forward(pending, pos_, false, slot_);
  pos_ += static_cast<int64_t>(pending.size());
  Proposal proposal;
  std::vector<at::Tensor> rows;
  std::optional<TokenRules> none;
  std::optional<TokenRules>& rules = rules_ ? *rules_ : none;
  const int64_t start = rules ? rules->taken() : 0;
  for (int64_t i = 0; i < k; ++i) {
    proposal.tokens.push_back(draft_token(logits, params_, gen_, rows, rules));
    if (i + 1 == k || ends(rules, proposal.tokens.back())) break;
    logits = draft_.decode(proposal.tokens.back(), pos_++, slot_);
  }
  if (rules) rules->rollback(rules->taken() - start);
  if (!rows.empty()) proposal.probs = at::stack(rows);
  return proposal;
}

std::unique_ptr<Proposer> make_proposer(ModelRunner* draft, const std::vector<int64_t>& prompt,
                                        const GenerationConfig& config, at::Generator& gen,
                                        int64_t slot, std::optional<TokenRules>* rules,
                                        const LookupCache* shared) {
  LookupProposer lookup(ngram_min(config), config.ngram_max, shared);
  if (!uses_draft(config.speculative)) return std::make_unique<LookupProposer>(lookup);
  DraftProposer drafted(*draft, prompt, config.sampling, gen, slot, config.reuse_prefix, rules);
  if (config.speculative == Speculative::DraftNgram) {
    return std::make_unique<DraftOrLookupProposer>(lookup, std::move(drafted));
  }
  return std::make_unique<DraftProposer>(std::move(drafted));
}

bool can_draft_in_batch(const ModelRunner* draft) {
  return draft && draft->shares_cache() && draft->has_batch_decode();
}

std::vector<Proposal> draft_batch(ModelRunner& draft, const std::vector<DraftRequest>& requests) {
  const std::size_t n = requests.size();
  std::vector<Proposal> out(n);
  std::vector<std::vector<at::Tensor>> rows(n);
  std::vector<int64_t> last(n), pos(n), todo(n), start(n);
  for (std::size_t i = 0; i < n; ++i) {
    last[i] = requests[i].last;
    pos[i] = requests[i].pos;
    todo[i] = requests[i].k;
    start[i] = requests[i].rules ? requests[i].rules->taken() : 0;
  }
  while (std::any_of(todo.begin(), todo.end(), [](int64_t t) { return t > 0; })) {
    std::vector<std::size_t> active;
    std::vector<int64_t> tokens, positions, slots;
    for (std::size_t i = 0; i < n; ++i) {
      if (todo[i] <= 0) continue;
      active.push_back(i);
      tokens.push_back(last[i]);
      positions.push_back(pos[i]);
      slots.push_back(requests[i].slot);
    }
    // [len(active), V]: the batched graph for two or more, else one decode.
    const at::Tensor logits =
        active.size() == 1
            ? draft.decode(tokens[0], positions[0], slots[0]).unsqueeze(0)
            : draft.batch(long_tensor(tokens, true), long_tensor(positions, true),
                          long_tensor(slots, false))
                  .select(1, 0);
    for (std::size_t j = 0; j < active.size(); ++j) {
      const std::size_t i = active[j];
      const DraftRequest& r = requests[i];
      const int64_t next =
          draft_token(logits[static_cast<int64_t>(j)], r.params, r.gen, rows[i], r.rules);
      out[i].tokens.push_back(next);
      last[i] = next;
      pos[i] += 1;
      todo[i] = ends(r.rules, next) ? 0 : todo[i] - 1;
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (requests[i].rules) requests[i].rules->rollback(requests[i].rules->taken() - start[i]);
    if (!rows[i].empty()) out[i].probs = at::stack(rows[i]);
  }
  return out;
}

void fit(Proposal& proposal, const std::optional<TokenRules>& rules) {
  if (!rules) return;
  const int64_t n = rules->takes(proposal.tokens);
  if (n == static_cast<int64_t>(proposal.tokens.size())) return;
  proposal.tokens.resize(static_cast<std::size_t>(n));
  if (proposal.probs.defined()) proposal.probs = proposal.probs.slice(0, 0, n);
  proposal.looked_up = proposal.looked_up && n > 0;
}

}  // namespace aotgen::detail
