// BPE tokenizer that reads a Hugging Face `tokenizer.json`: GPT-2 style byte-level BPE, or
// SentencePiece-style BPE (a Metaspace pre-tokenizer without prefix or split, characters as
// symbols, "<0xXX>" byte fallback: what `aotgen import-gguf` writes for `llama` GGUF
// vocabularies such as Gemma's).
//
// Encoding follows the `tokenizers` pipeline step by step, so ids match
// `tokenizers.Tokenizer.encode(text, add_special_tokens=False).ids`:
//   1. added tokens (`added_tokens`) are cut out of the text verbatim, leftmost-longest,
//      honouring their single_word / lstrip / rstrip flags; they are never split further;
//   2. every other stretch goes through the pre-tokenizer: `ByteLevel` (GPT-2 regex), or a
//      `Sequence` of `Split` (regex or literal) / `Digits` steps ending in `ByteLevel`, or
//      `Metaspace` (spaces become U+2581, the stretch stays one piece);
//   3. each piece is mapped byte -> unicode (GPT-2 table) and merged by BPE rank, with a
//      cache for repeated words (Metaspace: its characters are merged, a character missing
//      from the vocab becomes its "<0xXX>" byte tokens).
// Decoding maps token characters back to bytes (ByteLevel decoder; Metaspace: U+2581 to a
// space, byte tokens to their byte) and replaces invalid UTF-8 with U+FFFD, as `tokenizers`
// does. Anything else (other models, normalizers,
// decoders, pre-tokenizers) is rejected with std::runtime_error when loading.
//
// A Tokenizer is cheap to copy (the loaded state is shared and immutable) and all const
// methods are safe to call from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace aotgen {

class Tokenizer {
 public:
  // Loads a `tokenizer.json` file. Throws std::runtime_error if the file cannot be read,
  // is not valid JSON, or describes a tokenizer other than the two kinds above.
  static Tokenizer from_file(const std::string& tokenizer_json);
  // Same as from_file, from the JSON text itself.
  static Tokenizer from_json(std::string_view json_text);

  // Text (UTF-8) -> token ids. Throws std::invalid_argument if `text` is not valid UTF-8.
  // With parse_special false, special-token text ("<|im_start|>") is encoded as plain text,
  // as `tokenizers` does with `encode_special_tokens = True`: for text from users.
  std::vector<int64_t> encode(std::string_view text, bool parse_special = true) const;

  // Token ids -> text. Unknown ids are skipped (as `tokenizers` does); invalid UTF-8 in the
  // joined bytes becomes U+FFFD. Special tokens are kept unless skip_special_tokens is set.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;

  // Raw bytes of one token (may be a partial UTF-8 sequence); empty for unknown ids.
  std::string decode_token(int64_t id) const;

  // Id of a token given in its vocabulary spelling ("<|im_end|>", "Ġthe"); added tokens win.
  std::optional<int64_t> token_id(std::string_view token) const;

  // Vocabulary spelling of an id (the inverse of token_id).
  std::optional<std::string> id_to_token(int64_t id) const;

  // True for ids of added tokens marked "special" in tokenizer.json.
  bool is_special(int64_t id) const;

  // One more than the largest id of the vocabulary or the added tokens.
  int64_t vocab_size() const;

  // The pre-tokenizer alone (no added-token handling), pieces in byte-level spelling, like
  // `tokenizer.pre_tokenizer.pre_tokenize_str(text)` in Python. For debugging and tests.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

// Turns a stream of token ids into text, emitting only complete UTF-8 characters: bytes of a
// character split across tokens are held back until the character is complete. A byte
// sequence that can no longer become valid UTF-8 is emitted as U+FFFD, so the concatenation
// of all push() results and flush() equals Tokenizer::decode of the same ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(Tokenizer tokenizer, bool skip_special_tokens = false);

  // Adds one token; returns the text that became complete (often empty or one token).
  std::string push(int64_t id);
  // Adds raw bytes (e.g. from Tokenizer::decode_token); returns the text that became complete.
  std::string push_bytes(std::string_view bytes);
  // Returns whatever is still held back (an incomplete character becomes U+FFFD) and resets.
  std::string flush();
  // Drops anything held back.
  void reset() { pending_.clear(); }
  // Bytes currently held back waiting for the rest of a character (0 to 3).
  std::size_t pending_bytes() const { return pending_.size(); }

 private:
  Tokenizer tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;
};

// ChatML prompt: "<|im_start|>{role}\n{content}<|im_end|>\n" per (role, content) message,
// then "<|im_start|>assistant\n" if add_generation_prompt. No default system message.
std::string chatml_prompt(const std::vector<std::pair<std::string, std::string>>& messages,
                          bool add_generation_prompt = true);

}  // namespace aotgen
