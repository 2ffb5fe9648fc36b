// One request's output (aotgen/runtime/sequence.py): accepted token ids in, streamed text
// out, and when it ends. Engine::generate and each request of the BatchEngine feed their
// model steps' tokens through a TokenSink, so eos, stop strings, max_new_tokens and
// streaming behave the same alone and in a batch. Internal (not installed).
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "aotgen.h"

namespace aotgen::detail {

// Streams text while holding back anything that could still become a stop string.
// Works on UTF-8 bytes and only ever cuts at character boundaries.
class StopText {
 public:
  explicit StopText(const std::vector<std::string>& stops);
  std::string add(std::string_view piece);
  std::string flush();
  bool stopped() const { return matched_.has_value(); }
  // The stop string that ended the text.
  const std::optional<std::string>& matched() const { return matched_; }
  const std::string& text() const { return text_; }
  // A stop string counts only if it ends past the text so far (min_tokens not reached).
  void arm_after(std::size_t bytes) { armed_at_ = bytes; }

 private:
  std::vector<std::string> stops_;
  std::size_t hold_ = 0;
  std::string text_;
  std::size_t emitted_ = 0;
  std::size_t armed_at_ = 0;
  std::optional<std::string> matched_;
};

// Accepts generated ids until eos, a stop string or stop token, or max_new_tokens; streams
// the text. A stop token, like eos, ends the answer without joining it. Stop strings count
// from the min_tokens-th token's text on (the rules keep eos and stop tokens out until then).
class TokenSink {
 public:
  // A request's sink: its length, stop strings and tokens, `eos_ids` unless ignored.
  TokenSink(const Tokenizer& tokenizer, const GenerationConfig& config,
            const std::vector<int64_t>& eos_ids, TextCallback on_text);

  // One step's accepted tokens (those past the end are dropped); true when done.
  bool add(const std::vector<int64_t>& tokens);
  // Ends early (cancelled, or the step failed): flushes what is held back.
  void close(const std::string& reason);

  bool done() const { return !finish_reason_.empty(); }
  const std::string& finish_reason() const { return finish_reason_; }
  const std::vector<int64_t>& ids() const { return ids_; }
  const std::string& text() const { return stop_.text(); }
  // What ended a "stop": the stop string, or the stop token.
  const std::optional<std::string>& stop_string() const { return stop_.matched(); }
  std::optional<int64_t> stop_token() const { return stop_token_; }

 private:
  void emit(const std::string& piece) const;
  void flush();

  std::set<int64_t> eos_;
  std::set<int64_t> stop_ids_;
  StreamDecoder stream_;
  StopText stop_;
  int64_t max_new_tokens_;
  int64_t min_tokens_;
  TextCallback on_text_;
  std::vector<int64_t> ids_;
  std::optional<int64_t> stop_token_;
  std::string finish_reason_;  // "eos" | "stop" | "length" (or "cancelled" | "error") once done
};

}  // namespace aotgen::detail
