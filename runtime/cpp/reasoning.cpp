#include "reasoning.h"

#include "python_text.h"

#include <algorithm>

namespace aotgen {
namespace {

using python_text::lstrip;

constexpr std::string_view kOpen = "<think>", kClose = "</think>";

std::string_view strip_newlines(std::string_view text, bool left, bool right) {
  while (left && !text.empty() && text.front() == '\n') text.remove_prefix(1);
  while (right && !text.empty() && text.back() == '\n') text.remove_suffix(1);
  return text;
}

// (reasoning, content) of `text`; unless `final`, only what cannot change as more text comes
// (nothing of a tag that may be forming, no newline that may end the reasoning).
std::pair<std::string, std::string> split(std::string_view text, bool thinking, bool final) {
  if (!thinking) {
    const auto stripped = lstrip(text);
    if (!stripped.starts_with(kOpen)) {
      const bool undecided = !final && kOpen.starts_with(stripped);
      return {"", undecided ? "" : std::string(text)};
    }
    text = stripped.substr(kOpen.size());
  }
  const auto close = text.find(kClose);
  if (close != std::string_view::npos) {
    return {std::string(strip_newlines(text.substr(0, close), true, true)),
            std::string(strip_newlines(text.substr(close + kClose.size()), true, false))};
  }
  auto reasoning = text;
  if (!final) {
    for (std::size_t n = kClose.size() - 1; n > 0; --n) {  // a closing tag that may be forming
      if (text.ends_with(kClose.substr(0, n))) {
        reasoning.remove_suffix(n);
        break;
      }
    }
    reasoning = strip_newlines(reasoning, false, true);
  }
  return {std::string(strip_newlines(reasoning, true, true)), ""};
}

}  // namespace

std::optional<bool> opens_reasoning(std::string_view prompt_text) {
  prompt_text = python_text::rstrip(prompt_text);
  if (prompt_text.ends_with(kOpen)) return true;
  if (prompt_text.ends_with(kClose)) return std::nullopt;
  return false;
}

bool takes_reasoning(std::string_view chat_template) {
  return chat_template.find(kOpen) != std::string_view::npos;
}

ReasoningSplit split_reasoning(std::string_view text, bool thinking) {
  auto [reasoning, content] = split(text, thinking, true);
  const bool opened = thinking || lstrip(text).starts_with(kOpen);
  return {opened ? std::optional<std::string>(std::move(reasoning)) : std::nullopt,
          std::move(content)};
}

ReasoningSplit split_answer(std::string_view text, std::optional<bool> thinking) {
  if (!thinking) return {std::nullopt, std::string(text)};
  return split_reasoning(text, *thinking);
}

std::pair<std::string, std::string> ReasoningStream::feed(std::string_view piece) {
  text_ += piece;
  return deltas(false);
}

std::pair<std::string, std::string> ReasoningStream::finish() { return deltas(true); }

std::pair<std::string, std::string> SentParts::next(const std::string& reasoning,
                                                    const std::string& content) {
  std::pair<std::string, std::string> out{reasoning.substr(std::min(reasoning_, reasoning.size())),
                                          content.substr(std::min(content_, content.size()))};
  reasoning_ = reasoning.size();
  content_ = content.size();
  return out;
}

std::pair<std::string, std::string> ReasoningStream::deltas(bool final) {
  const auto [reasoning, content] = split(text_, thinking_, final);
  return sent_.next(reasoning, content);
}

}  // namespace aotgen
