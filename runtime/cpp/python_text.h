// Python's idea of whitespace in UTF-8 text (str.isspace, what `\s` matches and str.strip()
// drops), for the answer splits (reasoning.cpp, harmony.cpp) to part text exactly as
// aotgen/runtime/reasoning.py and aotgen/runtime/harmony.py do.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace aotgen::python_text {

// Length of the UTF-8 character at text[i] when it is whitespace, else 0.
inline std::size_t space_at(std::string_view text, std::size_t i) {
  const auto byte = static_cast<unsigned char>(text[i]);
  if ((byte >= 0x09 && byte <= 0x0d) || (byte >= 0x1c && byte <= 0x20)) return 1;
  if (byte < 0xc2) return 0;
  const std::size_t n = byte < 0xe0 ? 2 : byte < 0xf0 ? 3 : 4;
  if (i + n > text.size()) return 0;
  uint32_t cp = byte & (0xff >> (n + 1));
  for (std::size_t k = 1; k < n; ++k) {
    cp = cp << 6 | (static_cast<unsigned char>(text[i + k]) & 0x3f);
  }
  static constexpr std::array<uint32_t, 8> kSingles = {0x85,   0xa0,   0x1680, 0x2028,
                                                       0x2029, 0x202f, 0x205f, 0x3000};
  if (std::find(kSingles.begin(), kSingles.end(), cp) != kSingles.end()) return n;
  return cp >= 0x2000 && cp <= 0x200a ? n : 0;
}

// str.lstrip().
inline std::string_view lstrip(std::string_view text) {
  while (!text.empty()) {
    const auto n = space_at(text, 0);
    if (n == 0) break;
    text.remove_prefix(n);
  }
  return text;
}

// str.rstrip().
inline std::string_view rstrip(std::string_view text) {
  while (!text.empty()) {  // back to the last character's first byte
    std::size_t start = text.size() - 1;
    while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xc0) == 0x80) --start;
    if (space_at(text, start) != text.size() - start) break;
    text.remove_suffix(text.size() - start);
  }
  return text;
}

// str.strip().
inline std::string_view strip(std::string_view text) { return rstrip(lstrip(text)); }

}  // namespace aotgen::python_text
