// Byte-level BPE tokenizer (see tokenizer.h). Behaviour mirrors the Rust `tokenizers`
// crate step by step; the comments name the `tokenizers` source each part follows.
#include "tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cstdio>
#include <array>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <queue>
#include <shared_mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <variant>

#include <nlohmann/json.hpp>

namespace aotgen {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------
// UTF-8
// ---------------------------------------------------------------------------------------

constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// The UTF-8 sequence starting at s[i]: `need` is the length its lead byte announces (0 if
// s[i] cannot start a sequence), `have` how many bytes from i form a valid (prefix of a)
// sequence, checking the restricted second-byte ranges (no overlongs, no surrogates,
// nothing above U+10FFFF). have == need means a complete, valid character.
struct Utf8Seq {
  int need;
  int have;
};

Utf8Seq scan_utf8(std::string_view s, std::size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) return {1, 1};
  int need = 0;
  unsigned char lo = 0x80;
  unsigned char hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 3;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return {0, 0};
  }
  int have = 1;
  while (have < need && i + static_cast<std::size_t>(have) < s.size()) {
    const auto c = static_cast<unsigned char>(s[i + static_cast<std::size_t>(have)]);
    if (c < lo || c > hi) break;
    lo = 0x80;
    hi = 0xBF;
    ++have;
  }
  return {need, have};
}

// Appends `bytes` to `out`, replacing each maximal invalid subpart with U+FFFD: the same
// output as Rust's String::from_utf8_lossy and Python's bytes.decode("utf-8", "replace").
void append_utf8_lossy(std::string& out, std::string_view bytes) {
  std::size_t i = 0;
  while (i < bytes.size()) {
    const Utf8Seq seq = scan_utf8(bytes, i);
    if (seq.need > 0 && seq.have == seq.need) {
      out.append(bytes.substr(i, static_cast<std::size_t>(seq.need)));
      i += static_cast<std::size_t>(seq.need);
    } else {
      out.append(kReplacementChar);
      i += static_cast<std::size_t>(std::max(seq.have, 1));
    }
  }
}

// Offset of the first invalid byte, or npos if `s` is valid UTF-8.
std::size_t find_invalid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const Utf8Seq seq = scan_utf8(s, i);
    if (seq.need == 0 || seq.have != seq.need) return i;
    i += static_cast<std::size_t>(seq.need);
  }
  return std::string_view::npos;
}

// Decodes the (valid) character at s[i]; returns the code point, advances i.
char32_t next_code_point(std::string_view s, std::size_t& i) {
  const auto b = static_cast<unsigned char>(s[i]);
  int len = 1;
  char32_t cp = b;
  if (b >= 0xF0) {
    len = 4;
    cp = b & 0x07u;
  } else if (b >= 0xE0) {
    len = 3;
    cp = b & 0x0Fu;
  } else if (b >= 0xC0) {
    len = 2;
    cp = b & 0x1Fu;
  }
  for (int k = 1; k < len && i + static_cast<std::size_t>(k) < s.size(); ++k) {
    cp = (cp << 6) | (static_cast<unsigned char>(s[i + static_cast<std::size_t>(k)]) & 0x3Fu);
  }
  i += static_cast<std::size_t>(len);
  return cp;
}

std::string encode_utf8(char32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

std::size_t utf8_char_len_at(std::string_view s, std::size_t i) {
  const Utf8Seq seq = scan_utf8(s, i);
  return static_cast<std::size_t>(std::max(seq.have, 1));
}

std::size_t utf8_prev_char_start(std::string_view s, std::size_t end) {
  std::size_t i = end;
  while (i > 0) {
    --i;
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) break;
  }
  return i;
}

// Unicode White_Space, which is what `\s` means in the Rust `regex` crate (used by
// `tokenizers` for the lstrip / rstrip flags of added tokens).
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// ---------------------------------------------------------------------------------------
// GPT-2 byte <-> unicode table (tokenizers/src/pre_tokenizers/byte_level.rs: bytes_char)
// ---------------------------------------------------------------------------------------

struct ByteTable {
  std::array<std::string, 256> byte_to_char;  // UTF-8 spelling of each byte's character
  std::array<int16_t, 512> char_to_byte{};    // code point -> byte, -1 if none

  ByteTable() {
    char_to_byte.fill(-1);
    std::array<char32_t, 256> cp{};
    std::array<bool, 256> printable{};
    for (int b = 0; b < 256; ++b) {
      printable[static_cast<std::size_t>(b)] =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    }
    char32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      const auto idx = static_cast<std::size_t>(b);
      cp[idx] = printable[idx] ? static_cast<char32_t>(b) : 256 + n++;
    }
    for (std::size_t b = 0; b < 256; ++b) {
      byte_to_char[b] = encode_utf8(cp[b]);
      char_to_byte[cp[b]] = static_cast<int16_t>(b);
    }
  }

  std::string map_bytes(std::string_view bytes) const {
    std::string out;
    out.reserve(bytes.size() * 2);
    for (const char c : bytes) out += byte_to_char[static_cast<unsigned char>(c)];
    return out;
  }

  // ByteLevel decoder for one token: every character maps back to a byte; if one does not,
  // the token's own UTF-8 bytes are used (tokenizers: Decoder for ByteLevel).
  std::string unmap_token(std::string_view token) const {
    std::string out;
    out.reserve(token.size());
    std::size_t i = 0;
    while (i < token.size()) {
      const char32_t c = next_code_point(token, i);
      if (c >= char_to_byte.size() || char_to_byte[c] < 0) return std::string(token);
      out.push_back(static_cast<char>(char_to_byte[c]));
    }
    return out;
  }
};

const ByteTable& byte_table() {
  static const ByteTable table;
  return table;
}

// ---------------------------------------------------------------------------------------
// PCRE2 (8-bit, UTF + UCP, JIT when available)
// ---------------------------------------------------------------------------------------

std::string pcre2_message(int code) {
  std::array<PCRE2_UCHAR, 256> buf{};
  pcre2_get_error_message(code, buf.data(), buf.size());
  return reinterpret_cast<const char*>(buf.data());
}

// Oniguruma (which `tokenizers` uses) takes \s as Unicode White_Space; PCRE2 with UCP also
// counts U+180E MONGOLIAN VOWEL SEPARATOR (a format character since Unicode 6.3) as space.
// Patterns are therefore compiled with \s / \S spelled out as White_Space sets. Everything
// else (\p{L}, \p{N}, lookarounds, (?i:...)) means the same in both engines, up to the
// Unicode version of their tables: code points assigned after PCRE2's version (10.42 has
// Unicode 14, the Oniguruma in tokenizers 0.23 has 16) are unassigned to PCRE2 and may split
// differently. (Checked over all code points against tokenizers 0.23.)
constexpr std::string_view kWhiteSpaceSet =
    R"(\t-\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

std::string oniguruma_to_pcre2(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  for (std::size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      if (e == 'Q') {  // \Q...\E is literal text
        const std::size_t end = p.find("\\E", i + 1);
        const std::size_t stop = end == std::string_view::npos ? p.size() : end + 2;
        out.append(p.substr(i - 1, stop - (i - 1)));
        i = stop - 1;
      } else if (e == 's') {
        out += in_class ? std::string(kWhiteSpaceSet) : "[" + std::string(kWhiteSpaceSet) + "]";
      } else if (e == 'S' && !in_class) {
        out += "[^" + std::string(kWhiteSpaceSet) + "]";
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // leading ']' is literal
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:]
      const std::size_t end = p.find(":]", i + 2);
      if (end != std::string_view::npos) {
        out.append(p.substr(i, end + 2 - i));
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

class Regex {
 public:
  explicit Regex(std::string_view pattern, bool literal = false) : pattern_(pattern) {
    int err = 0;
    PCRE2_SIZE err_offset = 0;
    uint32_t options = PCRE2_UTF | PCRE2_UCP;
    if (literal) options |= PCRE2_LITERAL;
    const std::string compiled = literal ? std::string(pattern) : oniguruma_to_pcre2(pattern);
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()),
                                     compiled.size(), options, &err, &err_offset, nullptr);
    if (code == nullptr) {
      throw std::runtime_error("cannot compile regex '" + pattern_ + "' (as '" + compiled +
                               "') at offset " + std::to_string(err_offset) + ": " +
                               pcre2_message(err));
    }
    code_.reset(code);
    // JIT is an optimisation only: without it (or if it fails) pcre2_match interprets.
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  }

  // Every non-overlapping match, left to right, as [start, end) byte offsets. After an empty
  // match the search resumes one character later.
  std::vector<std::pair<std::size_t, std::size_t>> find_all(std::string_view subject) const {
    std::vector<std::pair<std::size_t, std::size_t>> out;
    MatchData md(pcre2_match_data_create_from_pattern(code_.get(), nullptr));
    std::size_t pos = 0;
    while (pos <= subject.size()) {
      if (!run(subject, pos, 0, md.get())) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      const std::size_t start = ov[0];
      const std::size_t end = std::max(ov[1], ov[0]);
      out.emplace_back(start, end);
      if (end > start) {
        pos = end;
      } else {
        if (end >= subject.size()) break;
        pos = end + utf8_char_len_at(subject, end);
      }
    }
    return out;
  }

  // Whether the pattern matches starting exactly at `offset`.
  bool matches_at(std::string_view subject, std::size_t offset) const {
    MatchData md(pcre2_match_data_create_from_pattern(code_.get(), nullptr));
    return run(subject, offset, PCRE2_ANCHORED, md.get());
  }

 private:
  struct CodeFree {
    void operator()(pcre2_code* c) const { pcre2_code_free(c); }
  };
  struct MatchDataFree {
    void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
  };
  using MatchData = std::unique_ptr<pcre2_match_data, MatchDataFree>;

  bool run(std::string_view subject, std::size_t offset, uint32_t options,
           pcre2_match_data* md) const {
    if (md == nullptr) throw std::bad_alloc();
    // Subjects are validated UTF-8 before they get here.
    static constexpr char kEmpty[] = "";
    const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.empty() ? kEmpty : subject.data());
    options |= PCRE2_NO_UTF_CHECK;
    int rc = pcre2_match(code_.get(), data, subject.size(), offset, options, md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // The JIT's default stack is small; the interpreter keeps its frames on the heap.
      rc = pcre2_match(code_.get(), data, subject.size(), offset, options | PCRE2_NO_JIT, md,
                       nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      throw std::runtime_error("regex '" + pattern_ + "' failed: " + pcre2_message(rc));
    }
    return true;  // rc == 0 only means the ovector was too small for all groups
  }

  std::string pattern_;
  std::unique_ptr<pcre2_code, CodeFree> code_;
};

// The GPT-2 pattern that tokenizers' ByteLevel pre-tokenizer applies (use_regex = true).
// Note \s+(?!\S) backtracks one character off a whitespace run that is followed by a
// non-space, so that character goes with the next word: "a   b" -> "a", "  ", " b".
constexpr std::string_view kGpt2Pattern =
    R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)re";

const Regex& gpt2_regex() {
  static const Regex regex(kGpt2Pattern);
  return regex;
}

// ---------------------------------------------------------------------------------------
// Splitting with a delimiter behaviour (tokenizers/src/tokenizer/normalizer.rs: split)
// ---------------------------------------------------------------------------------------

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

SplitBehavior parse_behavior(const std::string& name) {
  if (name == "Removed") return SplitBehavior::Removed;
  if (name == "Isolated") return SplitBehavior::Isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (name == "Contiguous") return SplitBehavior::Contiguous;
  throw std::runtime_error("unknown split behavior '" + name + "'");
}

struct Span {
  std::size_t start;
  std::size_t end;
  bool flag;  // is_match before the behaviour is applied, "remove" after
};

// Splits `piece` at the matches of `regex` and appends the non-empty parts to `out`.
void split_piece(const std::string& piece, const Regex& regex, SplitBehavior behavior,
                 bool invert, std::vector<std::string>& out) {
  // Pattern::find_matches: matches and the gaps between them, covering the whole piece.
  std::vector<Span> spans;
  std::size_t prev = 0;
  for (const auto& [start, end] : regex.find_all(piece)) {
    if (prev != start) spans.push_back({prev, start, invert});
    spans.push_back({start, end, !invert});
    prev = end;
  }
  if (prev != piece.size()) spans.push_back({prev, piece.size(), invert});

  std::vector<Span> parts;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::Isolated:
      for (const Span& s : spans) parts.push_back({s.start, s.end, false});
      break;
    case SplitBehavior::Removed:
      parts = spans;
      break;
    case SplitBehavior::Contiguous:
      for (const Span& s : spans) {
        if (s.flag == previous_match && !parts.empty()) {
          parts.back().end = s.end;
        } else {
          parts.push_back({s.start, s.end, false});
        }
        previous_match = s.flag;
      }
      break;
    case SplitBehavior::MergedWithPrevious:
      for (const Span& s : spans) {
        if (s.flag && !previous_match && !parts.empty()) {
          parts.back().end = s.end;
        } else {
          parts.push_back({s.start, s.end, false});
        }
        previous_match = s.flag;
      }
      break;
    case SplitBehavior::MergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->flag && !previous_match && !parts.empty()) {
          parts.back().start = it->start;
        } else {
          parts.push_back({it->start, it->end, false});
        }
        previous_match = it->flag;
      }
      std::reverse(parts.begin(), parts.end());
      break;
  }
  for (const Span& p : parts) {
    if (!p.flag && p.end > p.start) out.push_back(piece.substr(p.start, p.end - p.start));
  }
}

// ---------------------------------------------------------------------------------------
// Pre-tokenizer
// ---------------------------------------------------------------------------------------

struct SplitStep {
  std::shared_ptr<const Regex> regex;
  SplitBehavior behavior;
  bool invert;
};

struct ByteLevelStep {
  bool add_prefix_space;
  bool use_regex;
};

using PreTokenizerStep = std::variant<SplitStep, ByteLevelStep>;

bool json_bool(const json& obj, const char* key, bool fallback) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  return it->get<bool>();
}

std::string json_type(const json& obj) {
  if (!obj.is_object()) return obj.is_null() ? "null" : obj.type_name();
  const auto it = obj.find("type");
  return it != obj.end() && it->is_string() ? it->get<std::string>() : "<no type>";
}

// obj[key], or null when obj is not an object or has no such key.
const json& field(const json& obj, const char* key) {
  static const json null_value;
  if (!obj.is_object()) return null_value;
  const auto it = obj.find(key);
  return it == obj.end() ? null_value : *it;
}

PreTokenizerStep parse_step(const json& node) {
  const std::string type = json_type(node);
  if (type == "ByteLevel") {
    return ByteLevelStep{json_bool(node, "add_prefix_space", true),
                         json_bool(node, "use_regex", true)};
  }
  if (type == "Digits") {
    // Digits splits on char::is_numeric (general categories Nd, Nl, No).
    static const auto numeric = std::make_shared<const Regex>(R"(\p{N})");
    const bool individual = json_bool(node, "individual_digits", false);
    return SplitStep{numeric,
                     individual ? SplitBehavior::Isolated : SplitBehavior::Contiguous, false};
  }
  if (type == "Split") {
    const json& pattern = node.at("pattern");
    std::shared_ptr<const Regex> regex;
    if (pattern.contains("Regex")) {
      regex = std::make_shared<const Regex>(pattern.at("Regex").get<std::string>());
    } else if (pattern.contains("String")) {
      regex = std::make_shared<const Regex>(pattern.at("String").get<std::string>(), true);
    } else {
      throw std::runtime_error("Split pre-tokenizer without a Regex or String pattern");
    }
    return SplitStep{regex, parse_behavior(node.at("behavior").get<std::string>()),
                     json_bool(node, "invert", false)};
  }
  throw std::runtime_error("unsupported pre-tokenizer step '" + type + "'");
}

// Accepts ByteLevel, or a Sequence of Split / Digits steps that ends with ByteLevel.
std::vector<PreTokenizerStep> parse_pre_tokenizer(const json& node) {
  const std::string type = json_type(node);
  std::vector<PreTokenizerStep> steps;
  if (type == "ByteLevel") {
    steps.push_back(parse_step(node));
  } else if (type == "Sequence") {
    for (const json& child : node.at("pretokenizers")) steps.push_back(parse_step(child));
  } else {
    throw std::runtime_error("unsupported pre_tokenizer '" + type +
                             "': only byte-level BPE tokenizers (ByteLevel pre-tokenizer) are "
                             "supported");
  }
  const auto byte_levels = std::count_if(steps.begin(), steps.end(), [](const auto& s) {
    return std::holds_alternative<ByteLevelStep>(s);
  });
  if (byte_levels != 1 || !std::holds_alternative<ByteLevelStep>(steps.back())) {
    throw std::runtime_error(
        "unsupported pre_tokenizer: expected ByteLevel, or a Sequence of Split/Digits steps "
        "ending with exactly one ByteLevel");
  }
  return steps;
}

// ---------------------------------------------------------------------------------------
// Added tokens (tokenizers/src/tokenizer/added_vocabulary.rs)
// ---------------------------------------------------------------------------------------

struct AddedToken {
  std::string content;
  uint32_t id = 0;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// Leftmost-longest literal matcher over a set of added tokens: a byte trie.
class TokenTrie {
 public:
  void add(std::string_view content, std::size_t token_index) {
    if (content.empty()) return;
    std::size_t node = 0;
    for (const char c : content) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(c);
      auto [it, inserted] = edges_.try_emplace(key, terminal_.size());
      if (inserted) terminal_.push_back(kNone);
      node = it->second;
    }
    terminal_[node] = token_index;
    first_byte_[static_cast<unsigned char>(content.front())] = true;
  }

  bool empty() const { return edges_.empty(); }

  // The longest token starting at `pos`: (token index, length).
  std::optional<std::pair<std::size_t, std::size_t>> longest_at(std::string_view s,
                                                                std::size_t pos) const {
    if (!first_byte_[static_cast<unsigned char>(s[pos])]) return std::nullopt;
    std::optional<std::pair<std::size_t, std::size_t>> best;
    std::size_t node = 0;
    for (std::size_t i = pos; i < s.size(); ++i) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(s[i]);
      const auto it = edges_.find(key);
      if (it == edges_.end()) break;
      node = it->second;
      if (terminal_[node] != kNone) best = std::make_pair(terminal_[node], i + 1 - pos);
    }
    return best;
  }

 private:
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  std::unordered_map<uint64_t, std::size_t> edges_;
  std::vector<std::size_t> terminal_{kNone};  // node 0 is the root
  std::array<bool, 256> first_byte_{};
};

struct Segment {
  std::string_view text;
  std::optional<uint32_t> id;  // set for added tokens
};

// ---------------------------------------------------------------------------------------
// BPE model (tokenizers/src/models/bpe/{model,word}.rs)
// ---------------------------------------------------------------------------------------

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringMap = std::unordered_map<std::string, uint32_t, StringHash, std::equal_to<>>;

uint64_t pair_key(uint32_t a, uint32_t b) { return (static_cast<uint64_t>(a) << 32) | b; }

class WordCache {
 public:
  static constexpr std::size_t kCapacity = 10000;  // same as tokenizers' BPE cache
  static constexpr std::size_t kMaxWordBytes = 256;

  std::optional<std::vector<uint32_t>> get(std::string_view word) const {
    std::shared_lock lock(mutex_);
    const auto it = map_.find(word);
    if (it == map_.end()) return std::nullopt;
    return it->second;
  }

  void put(std::string_view word, const std::vector<uint32_t>& ids) const {
    if (word.size() >= kMaxWordBytes) return;
    std::unique_lock lock(mutex_);
    if (map_.size() >= kCapacity) map_.clear();
    map_.emplace(std::string(word), ids);
  }

 private:
  mutable std::shared_mutex mutex_;
  mutable std::unordered_map<std::string, std::vector<uint32_t>, StringHash, std::equal_to<>>
      map_;
};

struct Bpe {
  StringMap vocab;
  std::unordered_map<uint64_t, std::pair<uint32_t, uint32_t>> merges;  // -> (rank, new id)
  std::array<int64_t, 256> byte_ids{};  // id of each byte's character, -1 if not in vocab
  // SentencePiece-style vocabularies (Metaspace): the word's symbols are its UTF-8
  // characters, and a character missing from the vocab becomes its bytes' "<0xXX>" tokens
  // (byte_fallback) when they all exist.
  bool chars = false;
  bool byte_fallback = false;
  std::array<int64_t, 256> fallback_ids{};  // id of "<0xXX>" per byte, -1 if not in vocab
  std::optional<uint32_t> unk_id;
  bool fuse_unk = false;
  bool ignore_merges = false;
  WordCache cache;

  // BPE of one pre-tokenized piece (raw bytes); appends the ids to `out`.
  void tokenize(std::string_view word, std::vector<int64_t>& out) const {
    if (word.empty()) return;
    if (ignore_merges) {
      const auto it = vocab.find(chars ? std::string(word) : byte_table().map_bytes(word));
      if (it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    std::optional<std::vector<uint32_t>> ids = cache.get(word);
    if (!ids) {
      ids = merge_word(word);
      cache.put(word, *ids);
    }
    out.insert(out.end(), ids->begin(), ids->end());
  }

  std::vector<uint32_t> merge_word(std::string_view word) const {
    struct Symbol {
      uint32_t id;
      int64_t prev;
      int64_t next;
      std::size_t len;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(word.size());
    const auto add = [&symbols](uint32_t id, std::size_t len) {
      const auto n = static_cast<int64_t>(symbols.size());
      if (!symbols.empty()) symbols.back().next = n;
      symbols.push_back({id, n - 1, -1, len});
    };
    // Each byte (byte-level) or UTF-8 character (chars) is one symbol. A character missing
    // from the vocab becomes its byte-fallback tokens, else unk (fused if fuse_unk), else is
    // dropped (BPE::merge_word).
    bool pending_unk = false;
    std::size_t unk_len = 0;
    for (std::size_t i = 0; i < word.size();) {
      const std::size_t len = chars ? utf8_char_len_at(word, i) : 1;
      const std::string_view c = word.substr(i, len);
      i += len;
      int64_t id = -1;
      if (!chars) {
        id = byte_ids[static_cast<unsigned char>(c[0])];
      } else if (const auto it = vocab.find(c); it != vocab.end()) {
        id = it->second;
      }
      if (id >= 0) {
        if (pending_unk) add(*unk_id, unk_len);
        pending_unk = false;
        add(static_cast<uint32_t>(id), len);
        continue;
      }
      if (byte_fallback && std::all_of(c.begin(), c.end(), [this](char b) {
            return fallback_ids[static_cast<unsigned char>(b)] >= 0;
          })) {
        for (const char b : c) add(static_cast<uint32_t>(fallback_ids[static_cast<unsigned char>(b)]), 1);
        continue;
      }
      if (unk_id) {
        if (pending_unk && fuse_unk) {
          unk_len += len;
        } else {
          if (pending_unk) add(*unk_id, unk_len);
          pending_unk = true;
          unk_len = len;
        }
      }
    }
    if (pending_unk) add(*unk_id, unk_len);

    // Word::merge_all: repeatedly apply the lowest-rank merge, leftmost first.
    struct Merge {
      std::size_t pos;
      uint32_t rank;
      uint32_t new_id;
    };
    const auto later = [](const Merge& a, const Merge& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    std::priority_queue<Merge, std::vector<Merge>, decltype(later)> queue(later);
    for (std::size_t i = 0; i + 1 < symbols.size(); ++i) {
      const auto it = merges.find(pair_key(symbols[i].id, symbols[i + 1].id));
      if (it != merges.end()) queue.push({i, it->second.first, it->second.second});
    }
    while (!queue.empty()) {
      const Merge top = queue.top();
      queue.pop();
      Symbol& cur = symbols[top.pos];
      if (cur.len == 0 || cur.next == -1) continue;
      const auto next_pos = static_cast<std::size_t>(cur.next);
      const Symbol right = symbols[next_pos];
      const auto check = merges.find(pair_key(cur.id, right.id));
      if (check == merges.end() || check->second.second != top.new_id) continue;  // stale

      cur.id = top.new_id;
      cur.len += right.len;
      cur.next = right.next;
      symbols[next_pos].len = 0;
      if (right.next > -1 && static_cast<std::size_t>(right.next) < symbols.size()) {
        symbols[static_cast<std::size_t>(right.next)].prev = static_cast<int64_t>(top.pos);
      }
      if (cur.prev >= 0) {
        const auto prev = static_cast<std::size_t>(cur.prev);
        const auto it = merges.find(pair_key(symbols[prev].id, cur.id));
        if (it != merges.end()) queue.push({prev, it->second.first, it->second.second});
      }
      if (cur.next >= 0) {
        const auto next = static_cast<std::size_t>(cur.next);
        const auto it = merges.find(pair_key(cur.id, symbols[next].id));
        if (it != merges.end()) queue.push({top.pos, it->second.first, it->second.second});
      }
    }
    std::vector<uint32_t> ids;
    for (const Symbol& s : symbols) {
      if (s.len != 0) ids.push_back(s.id);
    }
    return ids;
  }
};

uint32_t json_id(const json& value, std::string_view what) {
  if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
      value.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
    throw std::runtime_error("invalid id " + value.dump() + " for " + std::string(what));
  }
  return static_cast<uint32_t>(value.get<int64_t>());
}

// model.vocab and model.merges, taken out of the JSON while it is parsed: as DOM nodes
// (one std::map entry per token) they cost more than the rest of loading put together.
struct BpeTables {
  bool has_vocab = false;
  bool has_merges = false;
  std::vector<std::pair<std::string, uint32_t>> vocab;
  std::vector<std::pair<std::string, std::string>> merges;  // (left, right)
  std::vector<std::string> merge_pair;  // the ["a", "b"] merge being read
};

// Parses tokenizer.json, streaming model.vocab / model.merges into `tables` (and out of
// the returned document); everything else stays a DOM. nlohmann's callback depths: the
// root's members are keys at depth 1, model's at 2, vocab entries / merges at 3.
json parse_tokenizer_json(std::string_view text, BpeTables& tables) {
  std::string root_key;
  std::string model_key;
  std::string vocab_token;
  const auto in_model = [&](const char* key) { return root_key == "model" && model_key == key; };
  const auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    using E = json::parse_event_t;
    if (event == E::key && depth == 1) root_key = parsed.get<std::string>();
    if (event == E::key && depth == 2 && root_key == "model") {
      model_key = parsed.get<std::string>();
    }
    if (depth == 2 && (event == E::object_start || event == E::array_start)) {
      tables.has_vocab |= in_model("vocab") && event == E::object_start;
      tables.has_merges |= in_model("merges") && event == E::array_start;
    }
    if (depth == 3 && in_model("vocab")) {
      if (event == E::key) {  // false: no DOM entry for it (the value event still comes)
        vocab_token = parsed.get<std::string>();
        return false;
      }
      if (event == E::value) {
        const uint32_t id = parsed.is_number_unsigned() && parsed.get<uint64_t>() <= INT32_MAX
                                ? static_cast<uint32_t>(parsed.get<uint64_t>())
                                : json_id(parsed, "vocab entry '" + vocab_token + "'");
        tables.vocab.emplace_back(std::move(vocab_token), id);
        return true;  // the discarded key already keeps it out of the DOM
      }
    }
    if (in_model("merges") && depth >= 3) {
      if (depth == 3 && event == E::value && parsed.is_string()) {
        const auto line = parsed.get<std::string>();
        if (line.starts_with("#version")) return false;
        const auto space = line.find(' ');
        if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
          throw std::runtime_error("merge " + std::to_string(tables.merges.size() + 1) +
                                   " is not 'a b': " + line);
        }
        tables.merges.emplace_back(line.substr(0, space), line.substr(space + 1));
        return false;
      }
      if (depth == 4 && event == E::value && parsed.is_string()) {
        tables.merge_pair.push_back(parsed.get<std::string>());
        return false;
      }
      if (depth == 3 && event == E::array_end && tables.merge_pair.size() == 2) {
        tables.merges.emplace_back(std::move(tables.merge_pair[0]),
                                   std::move(tables.merge_pair[1]));
        tables.merge_pair.clear();
        return false;
      }
      if (depth == 3 && event != E::array_start) {
        throw std::runtime_error("merge " + std::to_string(tables.merges.size() + 1) +
                                 " is malformed: " + parsed.dump());
      }
    }
    return true;
  };
  return json::parse(text, callback);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Tokenizer
// ---------------------------------------------------------------------------------------

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// A SentencePiece-style tokenizer as `aotgen import-gguf` writes one (Metaspace without a
// prefix or split, char-level BPE with byte fallback); anything else is refused.
bool is_metaspace(const json& pre_tokenizer, const json& decoder) {
  if (json_type(pre_tokenizer) != "Metaspace") return false;
  const bool prefix = pre_tokenizer.contains("prepend_scheme")
                          ? pre_tokenizer.at("prepend_scheme").get<std::string>() != "never"
                          : json_bool(pre_tokenizer, "add_prefix_space", true);
  if (pre_tokenizer.value("replacement", std::string()) != kMetaspace || prefix ||
      json_bool(pre_tokenizer, "split", true)) {
    throw std::runtime_error(
        "unsupported pre_tokenizer Metaspace: only replacement U+2581 with prepend_scheme "
        "'never' and split false are supported");
  }
  const json expected = json::parse(R"([{"type": "Replace", "pattern": {"String": "\u2581"},
      "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}])");
  if (json_type(decoder) != "Sequence" || field(decoder, "decoders") != expected) {
    throw std::runtime_error(
        "unsupported decoder for Metaspace: expected Sequence [Replace U+2581 -> ' ', "
        "ByteFallback, Fuse]");
  }
  return true;
}

// "<0xAB>" -> 0xAB (SentencePiece's byte tokens), or -1.
int byte_token_value(std::string_view token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token.back() != '>') return -1;
  int value = 0;
  for (const char c : token.substr(3, 2)) {
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

// What one token decodes to under Metaspace's decoder: its byte, or its text with spaces.
std::string metaspace_token_bytes(std::string_view token) {
  if (const int b = byte_token_value(token); b >= 0) return std::string(1, static_cast<char>(b));
  std::string out;
  for (std::size_t i = 0; i < token.size();) {
    if (token.substr(i).starts_with(kMetaspace)) {
      out += ' ';
      i += kMetaspace.size();
    } else {
      out += token[i++];
    }
  }
  return out;
}

struct Tokenizer::Impl {
  Bpe bpe;
  bool metaspace = false;  // SentencePiece-style: spaces become U+2581, no splitting
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<AddedToken> added;
  StringMap added_by_content;
  TokenTrie raw_trie;         // added tokens with normalized == false
  TokenTrie normalized_trie;  // added tokens with normalized == true
  Regex word_char{R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])"};  // Rust regex \w

  // Per id: the decoded bytes, the vocabulary spelling and flags.
  static constexpr uint8_t kKnown = 1;
  static constexpr uint8_t kSpecial = 2;
  std::vector<std::string> token_bytes;
  std::vector<std::string> token_text;
  std::vector<uint8_t> token_flags;

  Impl(const json& root, const BpeTables& tables);

  bool known(int64_t id) const {
    return id >= 0 && static_cast<std::size_t>(id) < token_flags.size() &&
           (token_flags[static_cast<std::size_t>(id)] & kKnown) != 0;
  }

  std::vector<std::string> pre_tokenize(std::string_view text) const;
  void split_added(std::string_view text, const TokenTrie& trie, bool parse_special,
                   std::vector<Segment>& out) const;
};

Tokenizer::Impl::Impl(const json& root, const BpeTables& tables) {
  if (!root.is_object()) throw std::runtime_error("tokenizer.json is not a JSON object");
  const json& normalizer = field(root, "normalizer");
  const bool no_normalizer =
      normalizer.is_null() ||
      (json_type(normalizer) == "Sequence" && field(normalizer, "normalizers").empty());
  if (!no_normalizer) {
    throw std::runtime_error("unsupported normalizer '" + json_type(normalizer) +
                             "': only byte-level BPE tokenizers without a normalizer are "
                             "supported");
  }
  const json& decoder = field(root, "decoder");
  metaspace = is_metaspace(field(root, "pre_tokenizer"), decoder);
  if (!metaspace) {
    pre_tokenizer = parse_pre_tokenizer(field(root, "pre_tokenizer"));
    if (json_type(decoder) != "ByteLevel") {
      throw std::runtime_error("unsupported decoder '" + json_type(decoder) +
                               "': only the ByteLevel decoder is supported");
    }
  }

  const json& model = root.at("model");
  const std::string model_type = model.value("type", std::string("BPE"));
  if (model_type != "BPE") {
    throw std::runtime_error("unsupported model '" + model_type + "': only BPE is supported");
  }
  if (const json& d = field(model, "dropout"); !d.is_null() && d.get<double>() != 0.0) {
    throw std::runtime_error("BPE dropout is not supported (encoding would be random)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const json& v = field(model, key); !v.is_null() && !v.get<std::string>().empty()) {
      throw std::runtime_error(std::string("BPE ") + key + " is not supported with ByteLevel");
    }
  }
  bpe.chars = metaspace;
  bpe.byte_fallback = json_bool(model, "byte_fallback", false);
  if (bpe.byte_fallback && !metaspace) {
    throw std::runtime_error("BPE byte_fallback is not supported with ByteLevel");
  }
  bpe.fuse_unk = json_bool(model, "fuse_unk", false);
  bpe.ignore_merges = json_bool(model, "ignore_merges", false);

  if (!tables.has_vocab) throw std::runtime_error("model.vocab is missing or not an object");
  if (!tables.has_merges) throw std::runtime_error("model.merges is missing or not an array");
  std::size_t max_id = 0;
  bpe.vocab.reserve(tables.vocab.size());
  for (const auto& [token, id] : tables.vocab) {
    bpe.vocab.insert_or_assign(token, id);
    max_id = std::max<std::size_t>(max_id, id);
  }
  if (const json& unk = field(model, "unk_token"); !unk.is_null()) {
    const auto it = bpe.vocab.find(unk.get<std::string>());
    if (it == bpe.vocab.end()) {
      throw std::runtime_error("unk_token '" + unk.get<std::string>() + "' is not in the vocab");
    }
    bpe.unk_id = it->second;
  }
  const ByteTable& table = byte_table();
  for (std::size_t b = 0; b < 256; ++b) {
    const auto it = bpe.vocab.find(table.byte_to_char[b]);
    bpe.byte_ids[b] = it == bpe.vocab.end() ? -1 : static_cast<int64_t>(it->second);
    char name[7];
    std::snprintf(name, sizeof name, "<0x%02X>", static_cast<unsigned>(b));
    const auto fallback = bpe.vocab.find(std::string_view(name));
    bpe.fallback_ids[b] = fallback == bpe.vocab.end() ? -1 : static_cast<int64_t>(fallback->second);
  }

  // Merges ("a b" strings or ["a", "b"] pairs, split while parsing).
  const auto lookup = [this](const std::string& token) {
    const auto it = bpe.vocab.find(token);
    if (it == bpe.vocab.end()) {
      throw std::runtime_error("merge token '" + token + "' is not in the vocab");
    }
    return it->second;
  };
  bpe.merges.reserve(tables.merges.size());
  uint32_t rank = 0;
  for (const auto& [left, right] : tables.merges) {
    // Later duplicates win, as when tokenizers collects the merges into a map.
    bpe.merges.insert_or_assign(pair_key(lookup(left), lookup(right)),
                                std::make_pair(rank, lookup(left + right)));
    ++rank;
  }

  for (const json& node : field(root, "added_tokens")) {
    AddedToken tok;
    tok.id = json_id(node.at("id"), "added token");
    tok.content = node.at("content").get<std::string>();
    tok.single_word = json_bool(node, "single_word", false);
    tok.lstrip = json_bool(node, "lstrip", false);
    tok.rstrip = json_bool(node, "rstrip", false);
    tok.special = json_bool(node, "special", false);
    tok.normalized = json_bool(node, "normalized", !tok.special);
    if (find_invalid_utf8(tok.content) != std::string::npos) {
      throw std::runtime_error("added token with invalid UTF-8 content");
    }
    max_id = std::max<std::size_t>(max_id, tok.id);
    added_by_content.insert_or_assign(tok.content, tok.id);
    (tok.normalized ? normalized_trie : raw_trie).add(tok.content, added.size());
    added.push_back(std::move(tok));
  }

  // Decoding tables. Added tokens take precedence over the model for the same id.
  const std::size_t n = bpe.vocab.empty() && added.empty() ? 0 : max_id + 1;
  token_bytes.resize(n);
  token_text.resize(n);
  token_flags.assign(n, 0);
  const auto to_bytes = [&](const std::string& token) {
    return metaspace ? metaspace_token_bytes(token) : table.unmap_token(token);
  };
  for (const auto& [token, id] : bpe.vocab) {
    token_text[id] = token;
    token_bytes[id] = to_bytes(token);
    token_flags[id] = kKnown;
  }
  for (const AddedToken& tok : added) {
    token_text[tok.id] = tok.content;
    token_bytes[tok.id] = to_bytes(tok.content);
    token_flags[tok.id] = static_cast<uint8_t>(kKnown | (tok.special ? kSpecial : 0));
  }
}

std::vector<std::string> Tokenizer::Impl::pre_tokenize(std::string_view text) const {
  std::vector<std::string> pieces;
  if (metaspace) {  // one piece, every space replaced
    std::string piece;
    for (const char c : text) {
      if (c == ' ') {
        piece.append(kMetaspace);
      } else {
        piece.push_back(c);
      }
    }
    if (!piece.empty()) pieces.push_back(std::move(piece));
    return pieces;
  }
  if (!text.empty()) pieces.emplace_back(text);
  std::vector<std::string> next;
  for (const PreTokenizerStep& step : pre_tokenizer) {
    next.clear();
    if (const auto* split = std::get_if<SplitStep>(&step)) {
      for (const std::string& piece : pieces) {
        split_piece(piece, *split->regex, split->behavior, split->invert, next);
      }
    } else {
      const auto& byte_level = std::get<ByteLevelStep>(step);
      for (std::string& piece : pieces) {
        if (byte_level.add_prefix_space && !piece.starts_with(' ')) piece.insert(0, 1, ' ');
        if (byte_level.use_regex) {
          split_piece(piece, gpt2_regex(), SplitBehavior::Isolated, false, next);
        } else {
          next.push_back(std::move(piece));
        }
      }
    }
    pieces.swap(next);
  }
  return pieces;
}

// AddedVocabulary::find_matches: cuts the added tokens of `trie` out of `text`.
// With !parse_special, special tokens are not cut out: their text is encoded as text
// (`tokenizers`' encode_special_tokens).
void Tokenizer::Impl::split_added(std::string_view text, const TokenTrie& trie,
                                  bool parse_special, std::vector<Segment>& out) const {
  if (text.empty()) return;
  if (trie.empty()) {
    out.push_back({text, std::nullopt});
    return;
  }
  const auto is_space_at = [&](std::size_t i) {
    std::size_t j = i;
    return is_white_space(next_code_point(text, j));
  };
  std::size_t start_offset = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::optional<std::pair<std::size_t, std::size_t>> found;
    std::size_t start = pos;
    for (; start < text.size(); ++start) {
      if ((found = trie.longest_at(text, start))) break;
    }
    if (!found) break;
    const AddedToken& tok = added[found->first];
    std::size_t stop = start + found->second;
    pos = stop;  // the automaton resumes after the match even if it is discarded below
    if (start < start_offset) continue;
    if (!parse_special && tok.special) continue;
    if (tok.single_word) {
      const bool start_space =
          start == 0 || !word_char.matches_at(text, utf8_prev_char_start(text, start));
      const bool stop_space = stop == text.size() || !word_char.matches_at(text, stop);
      if (!start_space || !stop_space) continue;
    }
    if (tok.lstrip) {
      std::size_t s = start;
      while (s > 0) {
        const std::size_t p = utf8_prev_char_start(text, s);
        if (!is_space_at(p)) break;
        s = p;
      }
      start = std::max(s, start_offset);
    }
    if (tok.rstrip) {
      while (stop < text.size() && is_space_at(stop)) stop += utf8_char_len_at(text, stop);
    }
    if (start_offset < start) out.push_back({text.substr(start_offset, start - start_offset), {}});
    out.push_back({text.substr(start, stop - start), tok.id});
    start_offset = stop;
  }
  if (start_offset < text.size()) out.push_back({text.substr(start_offset), std::nullopt});
}

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Tokenizer Tokenizer::from_json(std::string_view json_text) {
  try {
    BpeTables tables;
    const json root = parse_tokenizer_json(json_text, tables);
    return Tokenizer(std::make_shared<const Impl>(root, tables));
  } catch (const json::exception& e) {
    throw std::runtime_error(std::string("invalid tokenizer.json: ") + e.what());
  }
}

Tokenizer Tokenizer::from_file(const std::string& tokenizer_json) {
  std::ifstream in(tokenizer_json, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open tokenizer file '" + tokenizer_json + "'");
  std::ostringstream buffer;
  buffer << in.rdbuf();
  try {
    return from_json(buffer.str());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(tokenizer_json + ": " + e.what());
  }
}

std::vector<int64_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  if (const auto bad = find_invalid_utf8(text); bad != std::string_view::npos) {
    throw std::invalid_argument("encode: input is not valid UTF-8 (byte offset " +
                                std::to_string(bad) + ")");
  }
  const Impl& impl = *impl_;
  // 1. non-normalized added tokens on the raw text, 2. normalized ones on what is left
  //    (there is no normalizer, so both see the same text).
  std::vector<Segment> first;
  impl.split_added(text, impl.raw_trie, parse_special, first);
  std::vector<Segment> segments;
  for (const Segment& seg : first) {
    if (seg.id) {
      segments.push_back(seg);
    } else {
      impl.split_added(seg.text, impl.normalized_trie, parse_special, segments);
    }
  }
  std::vector<int64_t> ids;
  ids.reserve(text.size() / 3 + 1);
  for (const Segment& seg : segments) {
    if (seg.id) {
      ids.push_back(*seg.id);
      continue;
    }
    for (const std::string& piece : impl.pre_tokenize(seg.text)) impl.bpe.tokenize(piece, ids);
  }
  return ids;
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
  if (const auto bad = find_invalid_utf8(text); bad != std::string_view::npos) {
    throw std::invalid_argument("pre_tokenize: input is not valid UTF-8 (byte offset " +
                                std::to_string(bad) + ")");
  }
  std::vector<std::string> pieces = impl_->pre_tokenize(text);
  if (impl_->metaspace) return pieces;
  for (std::string& piece : pieces) piece = byte_table().map_bytes(piece);
  return pieces;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const int64_t id : ids) {
    if (!impl_->known(id)) continue;
    if (skip_special_tokens && is_special(id)) continue;
    bytes += impl_->token_bytes[static_cast<std::size_t>(id)];
  }
  std::string text;
  text.reserve(bytes.size());
  append_utf8_lossy(text, bytes);
  return text;
}

std::string Tokenizer::decode_token(int64_t id) const {
  return impl_->known(id) ? impl_->token_bytes[static_cast<std::size_t>(id)] : std::string();
}

std::optional<int64_t> Tokenizer::token_id(std::string_view token) const {
  if (const auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) {
    return it->second;
  }
  if (const auto it = impl_->bpe.vocab.find(token); it != impl_->bpe.vocab.end()) {
    return it->second;
  }
  return std::nullopt;
}

std::optional<std::string> Tokenizer::id_to_token(int64_t id) const {
  if (!impl_->known(id)) return std::nullopt;
  return impl_->token_text[static_cast<std::size_t>(id)];
}

bool Tokenizer::is_special(int64_t id) const {
  return impl_->known(id) &&
         (impl_->token_flags[static_cast<std::size_t>(id)] & Impl::kSpecial) != 0;
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->token_flags.size()); }

// ---------------------------------------------------------------------------------------
// StreamDecoder
// ---------------------------------------------------------------------------------------

StreamDecoder::StreamDecoder(Tokenizer tokenizer, bool skip_special_tokens)
    : tokenizer_(std::move(tokenizer)), skip_special_tokens_(skip_special_tokens) {}

std::string StreamDecoder::push(int64_t id) {
  if (skip_special_tokens_ && tokenizer_.is_special(id)) return {};
  return push_bytes(tokenizer_.decode_token(id));
}

std::string StreamDecoder::push_bytes(std::string_view bytes) {
  pending_.append(bytes);
  // Hold back a trailing sequence that is a valid but incomplete character; everything
  // before it decodes the same whatever comes next.
  std::size_t keep_from = pending_.size();
  const std::size_t lead = utf8_prev_char_start(pending_, pending_.size());
  if (lead < pending_.size() && pending_.size() - lead <= 3) {
    const Utf8Seq seq = scan_utf8(pending_, lead);
    if (seq.need > 0 && seq.have < seq.need &&
        static_cast<std::size_t>(seq.have) == pending_.size() - lead) {
      keep_from = lead;
    }
  }
  std::string out;
  append_utf8_lossy(out, std::string_view(pending_).substr(0, keep_from));
  pending_.erase(0, keep_from);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  append_utf8_lossy(out, pending_);
  pending_.clear();
  return out;
}

// ---------------------------------------------------------------------------------------
// ChatML
// ---------------------------------------------------------------------------------------

std::string chatml_prompt(const std::vector<std::pair<std::string, std::string>>& messages,
                          bool add_generation_prompt) {
  std::string out;
  for (const auto& [role, content] : messages) {
    out += "<|im_start|>";
    out += role;
    out += '\n';
    out += content;
    out += "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace aotgen
