// gpt-oss's answers in OpenAI's harmony format, read apart into reasoning, content and tool
// calls as aotgen/runtime/harmony.py reads them: the same split, whole or streamed, for the
// same text.
//
// A harmony answer is a run of messages, each `<|start|>assistant` (the generation prompt
// ends with it), a header naming its channel and perhaps a recipient, `<|message|>`, the body,
// and `<|end|>` (more follows), `<|call|>` or `<|return|>` (generation ends). The `analysis`
// channel is the model's reasoning; `final`, and `commentary` addressed to no one (a
// preamble), are the answer; a message to ` to=functions.NAME` is a tool call, the body its
// JSON arguments, and one to a built-in tool (` to=browser.search`, ` to=python`) reasoning.
// The markers are special tokens the answer's text keeps (Tokenizer::decode skips none).
//
// Python reads the header with Unicode-aware regexes (`\bto=([^\s<]+)`, `<|channel|>(\w+)`).
// Here a recipient ends at whitespace as Python's `\s` has it (str.isspace, Unicode
// included), but `\w` (a channel's name, the word boundary before `to=`) is ASCII letters,
// digits and `_`: the names gpt-oss writes are ASCII, and Unicode's word characters would
// need its whole category tables.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reasoning.h"

namespace aotgen {

// A chat template that writes harmony (holds "<|channel|>" and "<|message|>").
bool takes_harmony(std::string_view chat_template);

// The part of the answer's first message the prompt already wrote (the text after its last
// `<|start|>`): `assistant` after a generation prompt, more where the prompt continues a
// message; empty when that message is already closed.
std::string answer_head(std::string_view prompt_text);

struct HarmonySplit {
  std::string reasoning;  // analysis messages' bodies, joined with "\n"
  std::string content;
  std::vector<std::pair<std::string, std::string>> calls;  // (name, JSON arguments)
};

// Reasoning, content and calls of the answer `text` after its `head` (answer_head); unless
// `final`, only what cannot change as more text comes (nothing of a marker that may be
// forming, no call before its message ends). An answer that never opens a message body (a
// model that does not write harmony) is all content.
HarmonySplit split_harmony(std::string_view text, std::string_view head = "assistant",
                           bool final = true);

// A streamed harmony answer split into (reasoning, content) deltas as its text arrives;
// together they add up to split_harmony of the whole, whose calls finish() leaves in calls().
// Pieces are whole UTF-8 characters (StreamDecoder's).
class HarmonyStream {
 public:
  explicit HarmonyStream(std::string head = "assistant") : head_(std::move(head)) {}
  // The (reasoning, content) that may go out now.
  std::pair<std::string, std::string> feed(std::string_view piece);
  std::pair<std::string, std::string> finish();
  const std::vector<std::pair<std::string, std::string>>& calls() const { return calls_; }

 private:
  std::pair<std::string, std::string> deltas(bool final);
  std::string head_, text_;
  SentParts sent_;
  std::vector<std::pair<std::string, std::string>> calls_;
};

}  // namespace aotgen
