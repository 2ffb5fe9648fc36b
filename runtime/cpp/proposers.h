// Proposers: where the draft tokens of a speculative step come from (aotgen/runtime/
// proposers.py), and drafting for several requests at once through the draft's batched graph
// (batch_draft.py). Shared by Engine::generate (engine.cpp) and BatchEngine (batch_engine.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "aotgen.h"
#include "detail.h"
#include "rules.h"

namespace aotgen::detail {

class ModelRunner;

inline bool uses_draft(Speculative mode) {
  return mode == Speculative::Draft || mode == Speculative::DraftNgram;
}

// The shortest n-gram match lookup proposes from (engine.py NGRAM_MIN).
inline int64_t ngram_min(const GenerationConfig& config) {
  return config.ngram_min.value_or(config.speculative == Speculative::DraftNgram ? 3 : 1);
}

// The draft tokens of one verify step.
struct Proposal {
  std::vector<int64_t> tokens;
  // [K, V]: the distribution each token was drawn from (a sampled draft); undefined for a
  // deterministic proposal (a greedy draft, n-gram lookup).
  at::Tensor probs;
  bool looked_up = false;  // from n-gram lookup, not the draft model
};

// The proposal cut to what the rules take (rules.py fit): none past a token a spent
// reasoning budget does not force.
void fit(Proposal& proposal, const std::optional<TokenRules>& rules);

// propose: up to k tokens to follow history (prompt + output; its last token sits at position
// history.size() - 1, not yet in the target's cache). accepted: after verification, positions
// < pos of the target's cache hold accepted tokens.
class Proposer {
 public:
  virtual ~Proposer() = default;
  virtual Proposal propose(const std::vector<int64_t>& history, int64_t k) = 0;
  virtual void accepted(int64_t /*pos*/) {}
};

// n-gram lookup in the prompt + output (NgramProposer), then in earlier requests' texts
// (`shared`) when given: no model, deterministic. One per request: its index grows with the
// request's text.
class LookupProposer final : public Proposer {
 public:
  LookupProposer(int64_t min_n, int64_t max_n, const LookupCache* shared = nullptr)
      : ngram_(min_n, max_n, shared) {}

  Proposal propose(const std::vector<int64_t>& history, int64_t k) override {
    Proposal proposal;
    proposal.tokens = ngram_.propose(history, k);
    proposal.looked_up = !proposal.tokens.empty();
    return proposal;
  }

 private:
  NgramProposer ngram_;
};

// k tokens from the draft model, greedy or sampled, in the draft's cache row `slot`; sampling
// keeps each token's distribution for speculative sampling. pos_ is the first position
// missing from the draft's cache.
class DraftProposer final : public Proposer {
 public:
  // Drafts under the request's `rules` (penalties) when it has them, rolled back after.
  DraftProposer(ModelRunner& draft, const std::vector<int64_t>& prompt,
                const SamplingParams& params, at::Generator& gen, int64_t slot = 0,
                bool reuse_prefix = true, std::optional<TokenRules>* rules = nullptr);

  Proposal propose(const std::vector<int64_t>& history, int64_t k) override;

  // The draft cache is valid up to the accepted prefix; later positions are stale and get
  // overwritten next round (position overwrite: no rollback). After a full accept the last
  // proposal is not in it yet: it is fed with the next round.
  void accepted(int64_t pos) override { pos_ = std::min(pos_, pos); }

 private:
  ModelRunner& draft_;
  const SamplingParams& params_;
  at::Generator& gen_;
  int64_t slot_;
  int64_t pos_;
  std::optional<TokenRules>* rules_;
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

// The proposer of config.speculative (Ngram, Draft or DraftNgram; Engine.proposer): a draft
// runs in the cache row `slot`; lookup asks `shared` too. `config`, `gen` and `shared` must
// outlive it.
std::unique_ptr<Proposer> make_proposer(ModelRunner* draft, const std::vector<int64_t>& prompt,
                                        const GenerationConfig& config, at::Generator& gen,
                                        int64_t slot = 0,
                                        std::optional<TokenRules>* rules = nullptr,
                                        const LookupCache* shared = nullptr);

// The accepted prefix of the proposal plus one token from the target (speculative.py verify).
inline std::vector<int64_t> verify(const Proposal& proposal, const at::Tensor& target_logits,
                                   const SamplingParams& params, at::Generator& gen) {
  return verify_proposal(proposal.tokens, proposal.probs, target_logits, params, gen);
}

// ---- Drafting for several requests at once (batch_draft.py) -------------------------------

// A draft on the target's cache with a batch_decode graph drafts for a batch of requests.
bool can_draft_in_batch(const ModelRunner* draft);

// One request's draft round: k tokens after `last`, which sits at position `pos` of cache row
// `slot` (the target has written every position before it).
struct DraftRequest {
  int64_t last, pos, slot, k;
  const SamplingParams& params;
  at::Generator& gen;
  std::optional<TokenRules>& rules;
};

// Each request's proposal, all stepping together: one batch_decode call of the draft per draft
// step (the decode graph when one request is left), tokens chosen as DraftProposer chooses
// them, drawn step by step in request order.
std::vector<Proposal> draft_batch(ModelRunner& draft, const std::vector<DraftRequest>& requests);

}  // namespace aotgen::detail
