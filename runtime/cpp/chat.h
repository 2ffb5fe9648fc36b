// Chat prompts: a checkpoint's own jinja chat template rendered in C++ (minja), and chat
// prompts encoded so that message content is only ever text. The C++ side of
// aotgen/runtime/tokenizer.py (chat_prompt, encode_chat): both give the same ids.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer.h"

namespace aotgen {

// A chat message: (role, content).
using ChatMessage = std::pair<std::string, std::string>;

class ChatTemplate {
 public:
  // A template that does not parse is kept, and render() throws: a package whose template
  // the C++ runtime cannot read still loads and runs plain prompts.
  ChatTemplate(std::string source, std::string bos_token, std::string eos_token);

  // The template of a tokenizer directory: chat_template.jinja (newer transformers) or
  // tokenizer_config.json's chat_template (its "default" entry when it names several), with
  // that file's bos_token / eos_token; nullopt when there is none.
  static std::optional<ChatTemplate> from_dir(const std::filesystem::path& dir);

  // What transformers' apply_chat_template renders: the template over `messages`,
  // `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, `strftime_now`.
  // Throws std::runtime_error when the template does not parse or raises.
  // `kwargs`: a JSON object's text whose keys are more template variables (vLLM's
  // chat_template_kwargs, e.g. {"enable_thinking": false}); empty: none.
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true,
                     const std::string& kwargs = "") const;

  // llama.cpp's test for its built-in ChatML formatter: "<|im_start|>" in the template.
  bool is_chatml() const;
  // The model reasons before it answers (the template holds "<think>", reasoning.h).
  bool takes_reasoning() const;
  // gpt-oss's harmony format: the answer's channels (the template holds "<|channel|>" and
  // "<|message|>", harmony.h).
  bool takes_harmony() const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// Prompt text for a chat. A ChatML template without a system message or `kwargs` gives plain
// ChatML: templates such as SmolLM2's and Qwen2.5's inject a default system turn, llama.cpp
// adds none. Every other case renders the template.
std::string chat_prompt(const ChatTemplate& tmpl, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt = true, const std::string& kwargs = "");

// Ids of a chat prompt. Special tokens come from the template alone: content that would
// encode to a control token ("<|im_start|>system") is encoded as text, piece by piece, so a
// user cannot open a turn of another role. Content free of special-token text is encoded
// with the rest of the prompt in one piece (the ids llama.cpp gives).
std::vector<int64_t> encode_chat(const Tokenizer& tok, const ChatTemplate& tmpl,
                                 const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt = true,
                                 const std::string& kwargs = "");

// `kwargs` checked as render() takes it: a JSON object without the names the template's own
// variables use; std::invalid_argument naming the problem otherwise.
void check_template_kwargs(const std::string& kwargs);

}  // namespace aotgen
