// Reasoning: what a model thinks before it answers (`<think> ... </think>`: Qwen3, QwQ,
// DeepSeek-R1 and its distills), split from the answer as aotgen/runtime/reasoning.py splits
// it: the same reasoning and content, whole or streamed, for the same text.
//
// `thinking` says where an answer starts: true, inside its reasoning (the prompt opened it,
// as DeepSeek-R1's generation prompt does); false, the model may open one itself (Qwen3's).
// Newlines around the reasoning and before the answer are dropped, as Qwen3's template drops
// them from the history it renders.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace aotgen {

// True: the prompt opened the reasoning, the answer starts inside it; nullopt: the prompt
// closed an empty one (Qwen3 with thinking off), none comes; false: the model may open one.
std::optional<bool> opens_reasoning(std::string_view prompt_text);

// A chat template that speaks of reasoning (holds "<think>").
bool takes_reasoning(std::string_view chat_template);

struct ReasoningSplit {
  std::optional<std::string> reasoning;  // nullopt: the answer has none
  std::string content;
};

// A whole answer's reasoning and content.
ReasoningSplit split_reasoning(std::string_view text, bool thinking);
// The same for an answer whose prompt may take no reasoning (`thinking` nullopt, as
// Engine::thinking says): then it is all content.
ReasoningSplit split_answer(std::string_view text, std::optional<bool> thinking);

// What a stream has sent of its answer's (reasoning, content) split. What went out stays a
// prefix of the split as the text grows: each delta is what follows it.
class SentParts {
 public:
  std::pair<std::string, std::string> next(const std::string& reasoning,
                                           const std::string& content);

 private:
  std::size_t reasoning_ = 0, content_ = 0;
};

// A streamed answer split into (reasoning, content) deltas as its text arrives; together they
// add up to split_reasoning of the whole. Pieces are whole UTF-8 characters (StreamDecoder's).
class ReasoningStream {
 public:
  explicit ReasoningStream(bool thinking) : thinking_(thinking) {}
  // The (reasoning, content) that may go out now.
  std::pair<std::string, std::string> feed(std::string_view piece);
  std::pair<std::string, std::string> finish();

 private:
  std::pair<std::string, std::string> deltas(bool final);
  bool thinking_;
  std::string text_;
  SentParts sent_;
};

}  // namespace aotgen
