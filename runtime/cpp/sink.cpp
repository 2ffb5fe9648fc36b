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
    std::size_t from = emitted_ > s.size() ? emitted_ - s.size() : 0;
    if (armed_at_ >= s.size()) from = std::max(from, armed_at_ - s.size() + 1);
    const auto i = text_.find(s, from);
    if (i != std::string::npos) {
      text_.resize(i);
      matched_ = s;
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

TokenSink::TokenSink(const Tokenizer& tokenizer, const GenerationConfig& config,
                     const std::vector<int64_t>& eos_ids, TextCallback on_text)
    : stop_ids_(config.stop_token_ids.begin(), config.stop_token_ids.end()),
      stream_(tokenizer),
      stop_(config.stop),
      max_new_tokens_(config.max_new_tokens),
      min_tokens_(config.min_tokens),
      on_text_(std::move(on_text)) {
  if (!config.ignore_eos) eos_.insert(eos_ids.begin(), eos_ids.end());
}

bool TokenSink::add(const std::vector<int64_t>& tokens) {
  for (const auto tok : tokens) {
    if (done()) break;
    if (eos_.contains(tok) || stop_ids_.contains(tok)) {
      finish_reason_ = eos_.contains(tok) ? "eos" : "stop";
      if (!eos_.contains(tok)) stop_token_ = tok;
      break;
    }
    ids_.push_back(tok);
    const std::string piece = stream_.push(tok);
    if (static_cast<int64_t>(ids_.size()) <= min_tokens_) {
      stop_.arm_after(stop_.text().size() + piece.size());
    }
    emit(stop_.add(piece));
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
