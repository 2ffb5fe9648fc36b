// aotgen-tokenize: line-oriented front end to aotgen::Tokenizer, for tests and debugging.
//
//   aotgen-tokenize TOKENIZER_JSON [MODE] [--skip-special-tokens] [--no-generation-prompt]
//
// Every stdin line is one JSON value; every input line gives one JSON output line:
//   (default)       "text"               -> [ids...]              Tokenizer::encode
//   --decode        [ids...]             -> "text"                Tokenizer::decode
//   --stream        [ids...]             -> ["chunk", ...]        StreamDecoder::push per id,
//                                                                 then flush() as last chunk
//   --pre-tokenize  "text"               -> ["piece", ...]        byte-level spelling
//   --chatml        [[role, content]...] -> "prompt"              chatml_prompt
//   --chat          [[role, content]...] -> {"prompt", "ids"}     chat_prompt, encode_chat with
//                                           or {"error": "..."}   the template of the tokenizer's
//                                                                 directory (chat.h)
//   --reasoning     [text, thinking]     -> {"reasoning", "content", split_reasoning (reasoning.h),
//                                           "deltas", "opens"}       ReasoningStream fed one
//                                                                 character at a time, then
//                                                                 finish(); opens_reasoning
//   --harmony       [text, head]         -> {"reasoning", "content", split_harmony (harmony.h),
//                                           "calls", "deltas",       HarmonyStream fed one
//                                           "streamed_calls",        character at a time, then
//                                           "head", "takes"}         finish(); answer_head and
//                                                                 takes_harmony of `text`
// Exits 1 with a message on stderr at the first bad line or tokenizer error; --chat reports
// a template that fails on a conversation as that line's "error" and goes on.
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat.h"
#include "harmony.h"
#include "reasoning.h"
#include "tokenizer.h"

namespace {

using json = nlohmann::json;

enum class Mode { Encode, Decode, Stream, PreTokenize, ChatML, Chat, Reasoning, Harmony };

int usage() {
  std::cerr << "usage: aotgen-tokenize TOKENIZER_JSON [--decode | --stream | --pre-tokenize | "
               "--chatml | --chat | --reasoning | --harmony] [--skip-special-tokens] "
               "[--no-generation-prompt]\n"
               "  reads one JSON value per stdin line, writes one JSON value per line\n";
  return 2;
}

std::string dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::vector<int64_t> parse_ids(const json& value) {
  if (!value.is_array()) throw std::invalid_argument("expected a JSON array of token ids");
  return value.get<std::vector<int64_t>>();
}

std::vector<aotgen::ChatMessage> parse_messages(const json& value) {
  std::vector<aotgen::ChatMessage> messages;
  for (const json& message : value) {
    messages.emplace_back(message.at(0).get<std::string>(), message.at(1).get<std::string>());
  }
  return messages;
}

std::string parse_text(const json& value) {
  if (!value.is_string()) throw std::invalid_argument("expected a JSON string");
  return value.get<std::string>();
}

json optional_json(const auto& value) { return value ? json(*value) : json(nullptr); }

// The (reasoning, content) deltas of `text` fed to `stream` one UTF-8 character a piece, and
// its finish.
json streamed(auto& stream, std::string_view text) {
  json deltas = json::array();
  for (std::size_t i = 0, n = 1; i < text.size(); i += n) {
    const auto lead = static_cast<unsigned char>(text[i]);
    n = lead < 0xc0 ? 1 : lead < 0xe0 ? 2 : lead < 0xf0 ? 3 : 4;
    const auto [r, c] = stream.feed(text.substr(i, n));
    deltas.push_back({r, c});
  }
  const auto [r, c] = stream.finish();
  deltas.push_back({r, c});
  return deltas;
}

// --reasoning: the whole split, the streamed deltas (one UTF-8 character a piece) and
// whether `text` as a prompt opens the reasoning.
json reasoning(const json& input) {
  const std::string text = parse_text(input.at(0));
  const bool thinking = input.at(1).get<bool>();
  const auto whole = aotgen::split_reasoning(text, thinking);
  aotgen::ReasoningStream stream(thinking);
  const json deltas = streamed(stream, text);
  return {{"reasoning", optional_json(whole.reasoning)},
          {"content", whole.content},
          {"deltas", deltas},
          {"opens", optional_json(aotgen::opens_reasoning(text))}};
}

// --harmony: the whole split of the answer `text` after `head`, the streamed deltas (one
// UTF-8 character a piece) and calls, and `text` read as a prompt (answer_head) and as a
// chat template (takes_harmony).
json harmony(const json& input) {
  const std::string text = parse_text(input.at(0));
  const std::string head = parse_text(input.at(1));
  const auto whole = aotgen::split_harmony(text, head);
  aotgen::HarmonyStream stream(head);
  const json deltas = streamed(stream, text);
  return {{"reasoning", whole.reasoning}, {"content", whole.content},
          {"calls", whole.calls},         {"deltas", deltas},
          {"streamed_calls", stream.calls()}, {"head", aotgen::answer_head(text)},
          {"takes", aotgen::takes_harmony(text)}};
}

}  // namespace

int main(int argc, char** argv) {
  std::string path;
  Mode mode = Mode::Encode;
  bool skip_special = false;
  bool generation_prompt = true;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--decode") {
      mode = Mode::Decode;
    } else if (arg == "--stream") {
      mode = Mode::Stream;
    } else if (arg == "--pre-tokenize") {
      mode = Mode::PreTokenize;
    } else if (arg == "--chatml") {
      mode = Mode::ChatML;
    } else if (arg == "--chat") {
      mode = Mode::Chat;
    } else if (arg == "--reasoning") {
      mode = Mode::Reasoning;
    } else if (arg == "--harmony") {
      mode = Mode::Harmony;
    } else if (arg == "--skip-special-tokens") {
      skip_special = true;
    } else if (arg == "--no-generation-prompt") {
      generation_prompt = false;
    } else if (arg == "-h" || arg == "--help") {
      usage();
      return 0;
    } else if (arg.starts_with("-") || !path.empty()) {
      return usage();
    } else {
      path = arg;
    }
  }
  if (path.empty() && mode != Mode::ChatML && mode != Mode::Reasoning && mode != Mode::Harmony) {
    return usage();
  }

  std::size_t line_no = 0;
  try {
    std::optional<aotgen::Tokenizer> tokenizer;
    if (!path.empty()) tokenizer = aotgen::Tokenizer::from_file(path);
    std::optional<aotgen::ChatTemplate> chat_template;
    if (mode == Mode::Chat) {
      chat_template = aotgen::ChatTemplate::from_dir(std::filesystem::path(path).parent_path());
      if (!chat_template) throw std::invalid_argument("no chat template beside " + path);
    }
    std::string line;
    while (std::getline(std::cin, line)) {
      ++line_no;
      const json input = json::parse(line);
      json output;
      switch (mode) {
        case Mode::Encode:
          output = tokenizer->encode(parse_text(input));
          break;
        case Mode::Decode:
          output = tokenizer->decode(parse_ids(input), skip_special);
          break;
        case Mode::Stream: {
          aotgen::StreamDecoder stream(*tokenizer, skip_special);
          output = json::array();
          for (const int64_t id : parse_ids(input)) output.push_back(stream.push(id));
          output.push_back(stream.flush());
          break;
        }
        case Mode::PreTokenize:
          output = tokenizer->pre_tokenize(parse_text(input));
          break;
        case Mode::ChatML:
          output = aotgen::chatml_prompt(parse_messages(input), generation_prompt);
          break;
        case Mode::Reasoning:
          output = reasoning(input);
          break;
        case Mode::Harmony:
          output = harmony(input);
          break;
        case Mode::Chat: {
          const auto messages = parse_messages(input);
          try {
            output = {{"prompt", aotgen::chat_prompt(*chat_template, messages, generation_prompt)},
                      {"ids", aotgen::encode_chat(*tokenizer, *chat_template, messages,
                                                  generation_prompt)}};
          } catch (const std::runtime_error& e) {
            output = {{"error", e.what()}};
          }
          break;
        }
      }
      std::cout << dump(output) << '\n' << std::flush;
    }
  } catch (const std::exception& e) {
    std::cerr << "aotgen-tokenize: ";
    if (line_no > 0) std::cerr << "line " << line_no << ": ";
    std::cerr << e.what() << '\n';
    return 1;
  }
  return EXIT_SUCCESS;
}
