// One request's output (aotgen/runtime/sequence.py): accepted token ids in, streamed text
// out, and when it ends. Engine::generate and each request of the BatchEngine feed their
// model steps' tokens through a TokenSink, so eos, stop strings, max_new_tokens and
// streaming behave the same alone and in a batch. Internal (not installed).
#pragma once

#include <cstdint>
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
  bool stopped() const { return stopped_; }
  const std::string& text() const { return text_; }

 private:
  std::vector<std::string> stops_;
  std::size_t hold_ = 0;
  std::string text_;
  std::size_t emitted_ = 0;
  bool stopped_ = false;
};

// Accepts generated ids until eos, a stop string or max_new_tokens; streams the text.
class TokenSink {
 public:
  TokenSink(const Tokenizer& tokenizer, std::set<int64_t> eos, int64_t max_new_tokens,
            const std::vector<std::string>& stop, TextCallback on_text);

  // One step's accepted tokens (those past the end are dropped); true when done.
  bool add(const std::vector<int64_t>& tokens);
  // Ends early (cancelled, or the step failed): flushes what is held back.
  void close(const std::string& reason);

  bool done() const { return !finish_reason_.empty(); }
  const std::string& finish_reason() const { return finish_reason_; }
  const std::vector<int64_t>& ids() const { return ids_; }
  const std::string& text() const { return stop_.text(); }

 private:
  void emit(const std::string& piece) const;
  void flush();

  std::set<int64_t> eos_;
  StreamDecoder stream_;
  StopText stop_;
  int64_t max_new_tokens_;
  TextCallback on_text_;
  std::vector<int64_t> ids_;
  std::string finish_reason_;  // "eos" | "stop" | "length" (or "cancelled" | "error") once done
};

}  // namespace aotgen::detail
