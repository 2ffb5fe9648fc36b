// A reasoning budget (aotgen/runtime/reasoning_budget.py, step for step): at most N tokens of
// reasoning, then the reasoning's close is forced (after an optional message) and the model
// answers. The answer's tokens drive the state machine: idle until the text that opens the
// reasoning, counting the budget down until the text that closes it (a close by the model
// keeps what is left for a later reasoning), waiting for a character split across tokens,
// forcing the closing tokens one by one, done.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace aotgen {
class Tokenizer;
}

namespace aotgen::detail {

// The header of a harmony analysis message: gpt-oss's reasoning starts after it.
inline constexpr const char* kAnalysisHeader = "<|channel|>analysis<|message|>";

// The text that opens and closes a model's reasoning, and the ids forced when it is spent.
struct BudgetMarks {
  std::string open, close;
  std::vector<int64_t> forced;
};

enum class BudgetPhase { Idle, Counting, Waiting, Forcing, Done };

struct BudgetState {
  explicit BudgetState(BudgetPhase phase_ = BudgetPhase::Idle, int64_t left_ = 0)
      : phase(phase_), left(left_) {}
  BudgetPhase phase;
  int64_t left;        // budget tokens left
  std::string tail;    // the last bytes, where a tag may be starting
  std::size_t forced = 0;  // tokens of `forced` taken so far (forcing)
  int owed = 0;        // UTF-8 continuation bytes still to come for the last character
};

// The marks of `<think>` tags (harmony false) or gpt-oss's analysis channel; `message` goes
// before the forced close.
BudgetMarks budget_marks(const Tokenizer& tok, bool harmony, const std::string& message);

// Where an answer starts: inside a reasoning the prompt opened (counting, or forcing at
// once for a budget of 0), or idle.
BudgetState budget_start(int64_t budget, bool inside);

class ReasoningBudget {
 public:
  ReasoningBudget(const Tokenizer& tok, BudgetMarks marks, BudgetState start);

  // The one token allowed next, or none: any.
  std::optional<int64_t> forced() const { return forced_in(states_.back()); }
  void advance(const std::vector<int64_t>& tokens);
  void rollback(int64_t count);
  // How many leading `tokens` it takes (none past a forced token they miss), and the forced
  // token of each verify row (row i: after tokens[:i]).
  std::pair<int64_t, std::vector<std::optional<int64_t>>> along(
      const std::vector<int64_t>& tokens) const;
  // The forced token of each tree node's row, after the node's path.
  std::vector<std::optional<int64_t>> over_tree(const std::vector<int64_t>& tokens,
                                                const std::vector<int64_t>& parents) const;

 private:
  BudgetState step(const BudgetState& state, int64_t token) const;
  std::optional<int64_t> forced_in(const BudgetState& state) const;

  const Tokenizer* tok_;
  BudgetMarks marks_;
  std::vector<BudgetState> states_;  // after each taken token, the start first
};

}  // namespace aotgen::detail
