// aotgen/runtime/reasoning_budget.py's state machine, step for step, so that a request gets
// Python's tokens.
#include "reasoning_budget.h"

#include <algorithm>

#include "tokenizer.h"

namespace aotgen::detail {
namespace {

constexpr const char* kHarmonyClose = "<|end|><|start|>assistant<|channel|>final<|message|>";

// The last bytes of `data` that may start `tag`.
std::string tail_of(const std::string& data, const std::string& tag) {
  const std::size_t keep = tag.size() - 1;
  return data.size() > keep ? data.substr(data.size() - keep) : data;
}

// The bytes after `tag` if it ends within `data` (tail before it), and the new tail.
std::pair<std::optional<std::string>, std::string> find_tag(const std::string& tag,
                                                            const std::string& tail,
                                                            const std::string& data) {
  const std::string window = tail + data;
  const std::size_t at = window.find(tag);
  if (at == std::string::npos) return {std::nullopt, tail_of(window, tag)};
  std::string after = window.substr(at + tag.size());
  std::string next = tail_of(after, tag);
  return {std::move(after), std::move(next)};
}

// UTF-8 continuation bytes still owed after `data`.
int owed_after(int owed, const std::string& data) {
  for (const char c : data) {
    const auto byte = static_cast<unsigned char>(c);
    if ((byte & 0xC0) == 0x80) {
      owed = std::max(owed - 1, 0);
    } else if (byte >= 0xF0) {
      owed = 3;
    } else if (byte >= 0xE0) {
      owed = 2;
    } else if (byte >= 0xC0) {
      owed = 1;
    } else {
      owed = 0;
    }
  }
  return owed;
}

std::vector<int64_t> joined(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

BudgetMarks budget_marks(const Tokenizer& tok, bool harmony, const std::string& message) {
  if (harmony) {
    return {kAnalysisHeader, "<|end|>", joined(tok.encode(message), tok.encode(kHarmonyClose))};
  }
  const std::string lead = message.empty() ? "\n" : message + "\n";
  return {"<think>", "</think>", tok.encode(lead + "</think>")};
}

BudgetState budget_start(int64_t budget, bool inside) {
  if (!inside) return BudgetState(BudgetPhase::Idle, budget);
  if (budget <= 0) return BudgetState(BudgetPhase::Forcing);
  return BudgetState(BudgetPhase::Counting, budget);
}

ReasoningBudget::ReasoningBudget(const Tokenizer& tok, BudgetMarks marks, BudgetState start)
    : tok_(&tok), marks_(std::move(marks)), states_{std::move(start)} {}

std::optional<int64_t> ReasoningBudget::forced_in(const BudgetState& state) const {
  if (state.phase != BudgetPhase::Forcing) return std::nullopt;
  return marks_.forced[state.forced];
}

BudgetState ReasoningBudget::step(const BudgetState& state, int64_t token) const {
  BudgetState next = state;
  switch (state.phase) {
    case BudgetPhase::Idle: {
      auto [after, tail] = find_tag(marks_.open, state.tail, tok_->decode_token(token));
      if (after) return budget_start(state.left, true);
      next.tail = std::move(tail);
      return next;
    }
    case BudgetPhase::Counting:
    case BudgetPhase::Waiting: {
      const std::string data = tok_->decode_token(token);
      auto [after, tail] = find_tag(marks_.close, state.tail, data);
      if (after) {  // the model closed it: the rest of the budget stays
        BudgetState idle(BudgetPhase::Idle, state.left);
        idle.tail = tail_of(*after, marks_.open);
        return idle;
      }
      next.owed = owed_after(state.owed, data);
      next.tail = std::move(tail);
      next.left = state.left - (state.phase == BudgetPhase::Counting ? 1 : 0);
      if (next.left <= 0) {
        next.left = 0;
        next.phase = next.owed == 0 ? BudgetPhase::Forcing : BudgetPhase::Waiting;
      }
      return next;
    }
    case BudgetPhase::Forcing:
      if (state.forced + 1 == marks_.forced.size()) return BudgetState(BudgetPhase::Done);
      next.forced += 1;
      return next;
    case BudgetPhase::Done:
      break;
  }
  return next;
}

void ReasoningBudget::advance(const std::vector<int64_t>& tokens) {
  for (const int64_t token : tokens) states_.push_back(step(states_.back(), token));
}

void ReasoningBudget::rollback(int64_t count) {
  states_.resize(states_.size() - static_cast<std::size_t>(count));
}

std::pair<int64_t, std::vector<std::optional<int64_t>>> ReasoningBudget::along(
    const std::vector<int64_t>& tokens) const {
  BudgetState state = states_.back();
  std::vector<std::optional<int64_t>> rows{forced_in(state)};
  for (const int64_t token : tokens) {
    if (rows.back() && token != *rows.back()) break;
    state = step(state, token);
    rows.push_back(forced_in(state));
  }
  return {static_cast<int64_t>(rows.size()) - 1, std::move(rows)};
}

std::vector<std::optional<int64_t>> ReasoningBudget::over_tree(
    const std::vector<int64_t>& tokens, const std::vector<int64_t>& parents) const {
  std::vector<BudgetState> states{states_.back()};
  for (std::size_t node = 1; node < parents.size(); ++node) {
    states.push_back(step(states[static_cast<std::size_t>(parents[node])], tokens[node]));
  }
  std::vector<std::optional<int64_t>> rows;
  for (const auto& state : states) rows.push_back(forced_in(state));
  return rows;
}

}  // namespace aotgen::detail
