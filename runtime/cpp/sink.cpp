// StopText and TokenSink: aotgen/runtime/sequence.py.
#include "sink.h"

#include <algorithm>

namespace aotgen::detail {

StopText::StopText(const std::vector<std::string>& stops) {
  for (const auto& s : stops) {
    if (!s.empty()) stops_.push_back(s);
  }
  for (const auto& s : stops_) hold_ = std::max(hold_, s.size() - 1);
}

std::string StopText::add(std::string_view piece) {
  text_ += piece;
  for (const auto& s : stops_) {
    const auto i = text_.find(s, emitted_ > s.size() ? emitted_ - s.size() : 0);
    if (i != std::string::npos) {
      text_.resize(i);
      stopped_ = true;
      return flush();
    }
  }
  std::size_t safe = text_.size() > hold_ ? text_.size() - hold_ : 0;
  while (safe > emitted_ && safe < text_.size() && (text_[safe] & 0xC0) == 0x80) --safe;
  if (safe <= emitted_) return {};
  auto out = text_.substr(emitted_, safe - emitted_);
  emitted_ = safe;
  return out;
}

std::string StopText::flush() {
  auto out = text_.substr(std::min(emitted_, text_.size()));
  emitted_ = text_.size();
  return out;
}

TokenSink::TokenSink(const Tokenizer& tokenizer, std::set<int64_t> eos, int64_t max_new_tokens,
                     const std::vector<std::string>& stop, TextCallback on_text)
    : eos_(std::move(eos)),
      stream_(tokenizer),
      stop_(stop),
      max_new_tokens_(max_new_tokens),
      on_text_(std::move(on_text)) {}

bool TokenSink::add(const std::vector<int64_t>& tokens) {
  for (const auto tok : tokens) {
    if (done()) break;
    if (eos_.contains(tok)) {
      finish_reason_ = "eos";
      break;
    }
    ids_.push_back(tok);
    emit(stop_.add(stream_.push(tok)));
    if (stop_.stopped()) {
      finish_reason_ = "stop";
    } else if (static_cast<int64_t>(ids_.size()) >= max_new_tokens_) {
      finish_reason_ = "length";
    }
  }
  if (done() && !stop_.stopped()) flush();
  return done();
}

void TokenSink::close(const std::string& reason) {
  if (done()) return;
  finish_reason_ = reason;
  flush();
}

void TokenSink::flush() { emit(stop_.add(stream_.flush()) + stop_.flush()); }

void TokenSink::emit(const std::string& piece) const {
  if (!piece.empty() && on_text_) on_text_(piece);
}

}  // namespace aotgen::detail
