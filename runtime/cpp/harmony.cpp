#include "harmony.h"

#include "python_text.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>

namespace aotgen {
namespace {

using python_text::space_at;
using python_text::strip;

constexpr std::string_view kStart = "<|start|>", kChannel = "<|channel|>",
                           kMessage = "<|message|>", kConstrain = "<|constrain|>";
constexpr std::array<std::string_view, 3> kEnds = {"<|end|>", "<|call|>", "<|return|>"};
constexpr std::array<std::string_view, 7> kMarkers = {kStart,   kChannel, kMessage, kConstrain,
                                                      kEnds[0], kEnds[1], kEnds[2]};
constexpr std::string_view kFunctions = "functions.", kTo = "to=";

// `\w`, ASCII only (harmony.h).
bool is_word(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// The first `\bto=([^\s<]+)` in a header: the recipient.
std::optional<std::string_view> recipient(std::string_view header) {
  for (auto at = header.find(kTo); at != std::string_view::npos; at = header.find(kTo, at + 1)) {
    if (at > 0 && is_word(header[at - 1])) continue;
    std::size_t end = at + kTo.size();
    while (end < header.size() && header[end] != '<' && space_at(header, end) == 0) ++end;
    if (end > at + kTo.size()) return header.substr(at + kTo.size(), end - at - kTo.size());
  }
  return std::nullopt;
}

// The first `<|channel|>(\w+)` in a header: the channel's name.
std::optional<std::string_view> channel(std::string_view header) {
  for (auto at = header.find(kChannel); at != std::string_view::npos;
       at = header.find(kChannel, at + 1)) {
    std::size_t end = at + kChannel.size();
    while (end < header.size() && is_word(header[end])) ++end;
    if (end > at + kChannel.size()) {
      return header.substr(at + kChannel.size(), end - at - kChannel.size());
    }
  }
  return std::nullopt;
}

// Bytes at the end that may begin a marker (held back until they cannot). The markers are
// ASCII, so these bytes are as many characters as Python's count.
std::size_t pending(std::string_view text) {
  std::size_t longest = 0;
  for (const auto marker : kMarkers) longest = std::max(longest, marker.size());
  for (std::size_t size = std::min(longest - 1, text.size()); size > 0; --size) {
    const auto tail = text.substr(text.size() - size);
    for (const auto marker : kMarkers) {
      if (marker.starts_with(tail)) return size;
    }
  }
  return 0;
}

// Python's str.split(separator): every piece, empty ones too.
std::vector<std::string_view> split_on(std::string_view text, std::string_view separator) {
  std::vector<std::string_view> pieces;
  for (std::size_t from = 0;;) {
    const auto at = text.find(separator, from);
    if (at == std::string_view::npos) {
      pieces.push_back(text.substr(from));
      return pieces;
    }
    pieces.push_back(text.substr(from, at - from));
    from = at + separator.size();
  }
}

}  // namespace

bool takes_harmony(std::string_view chat_template) {
  return chat_template.find(kChannel) != std::string_view::npos &&
         chat_template.find(kMessage) != std::string_view::npos;
}

std::string answer_head(std::string_view prompt_text) {
  const auto start = prompt_text.rfind(kStart);
  const auto head = start == std::string_view::npos ? prompt_text
                                                     : prompt_text.substr(start + kStart.size());
  for (const auto end : kEnds) {
    if (head.find(end) != std::string_view::npos) return "";
  }
  return std::string(head);
}

HarmonySplit split_harmony(std::string_view text, std::string_view head, bool final) {
  HarmonySplit split;
  const std::string whole = std::string(head) + std::string(text);
  const auto messages = split_on(whole, kStart);
  for (std::size_t index = 0; index < messages.size(); ++index) {
    const auto message = messages[index];
    const auto body_at = message.find(kMessage);
    if (body_at == std::string_view::npos) continue;  // a header still coming, or text between
    const auto header = message.substr(0, body_at);
    auto body = message.substr(body_at + kMessage.size());
    auto end = std::string_view::npos;
    for (const auto e : kEnds) end = std::min(end, body.find(e));
    const bool ended = end != std::string_view::npos;
    const bool done = ended || index + 1 < messages.size() || final;
    if (ended) body = body.substr(0, end);
    const auto to = recipient(header);
    if (to && to->starts_with(kFunctions)) {
      if (done) {
        split.calls.emplace_back(std::string(to->substr(kFunctions.size())),
                                 std::string(strip(body)));
      }
      continue;
    }
    if (!done) body.remove_suffix(pending(body));
    // A built-in tool's message (browser.search, python: no request declares one) is reasoning.
    if (const auto name = channel(header); to || (name && *name == "analysis")) {
      if (!split.reasoning.empty()) split.reasoning += '\n';
      split.reasoning += body;
    } else {
      split.content += body;
    }
  }
  if (final && whole.find(kMessage) == std::string::npos) split.content = std::string(text);
  return split;
}

std::pair<std::string, std::string> HarmonyStream::feed(std::string_view piece) {
  text_ += piece;
  return deltas(false);
}

std::pair<std::string, std::string> HarmonyStream::finish() { return deltas(true); }

std::pair<std::string, std::string> HarmonyStream::deltas(bool final) {
  auto split = split_harmony(text_, head_, final);
  calls_ = std::move(split.calls);
  return sent_.next(split.reasoning, split.content);
}

}  // namespace aotgen
