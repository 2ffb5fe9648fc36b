// n-gram counts that outlive a request: aotgen/runtime/lookup_cache.py rule for rule (its
// evidence thresholds, halving past max_ngrams), the same llama.cpp-format files, sorted.
#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>

#include "aotgen.h"

namespace aotgen {
namespace {

constexpr int64_t kMaxN = 4;  // llama.cpp's LLAMA_NGRAM_MAX: token slots per n-gram in a file
// Occurrences and the top follower's share by n (1, 2, 3, 4): llama.cpp's strict thresholds
// but for the 3- and 4-grams' occurrences (lookup_cache.py MIN_OCCURRENCES).
constexpr std::array<int64_t, 4> kMinOccurrences = {4, 3, 1, 1};
constexpr std::array<int64_t, 4> kMinPercent = {75, 66, 66, 66};
constexpr int64_t kCountMax = std::numeric_limits<int32_t>::max();

bool convincing(const std::vector<NgramProposer::Follower>& followers, int64_t n) {
  if (followers.empty()) return false;
  int64_t total = 0;
  for (const auto& f : followers) total += f.count;
  const auto i = static_cast<std::size_t>(n - 1);
  return total >= kMinOccurrences[i] && 100 * followers.front().count >= kMinPercent[i] * total;
}

int32_t read_i32(const std::string& data, std::size_t offset) {
  int32_t v = 0;
  std::memcpy(&v, data.data() + offset, sizeof v);  // little-endian, as the file is
  return v;
}

void append_i32(std::string& out, int32_t v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

std::string tokens_str(const std::vector<int32_t>& tokens) {
  std::string s = "[";
  for (std::size_t i = 0; i < tokens.size(); ++i) s += (i ? ", " : "") + std::to_string(tokens[i]);
  return s + "]";
}

}  // namespace

LookupCache::LookupCache(int64_t max_ngrams) : max_ngrams_(max_ngrams) {
  if (max_ngrams < 1) throw std::invalid_argument("max_ngrams must be >= 1");
}

void LookupCache::add(const std::vector<int64_t>& tokens) {
  const auto len = static_cast<int64_t>(tokens.size());
  for (int64_t n = 1; n <= kMaxN; ++n) {
    for (int64_t i = n; i < len; ++i) {
      std::vector<int32_t> key(tokens.begin() + (i - n), tokens.begin() + i);
      int32_t& count = table_[std::move(key)][static_cast<int32_t>(tokens[i])];
      if (count < kCountMax) ++count;
    }
  }
  while (static_cast<int64_t>(table_.size()) > max_ngrams_) age();
}

void LookupCache::age() {
  for (auto it = table_.begin(); it != table_.end();) {
    auto& part = it->second;
    for (auto f = part.begin(); f != part.end();) {
      f->second /= 2;
      f = f->second == 0 ? part.erase(f) : std::next(f);
    }
    it = part.empty() ? table_.erase(it) : std::next(it);
  }
}

std::vector<NgramProposer::Follower> LookupCache::candidates(const std::vector<int64_t>& context,
                                                             int64_t min_n, int64_t max_n) const {
  const auto len = static_cast<int64_t>(context.size());
  for (int64_t n = std::min({max_n, kMaxN, len}); n >= min_n && n >= 1; --n) {
    const std::vector<int32_t> key(context.end() - n, context.end());
    const auto found = table_.find(key);
    if (found == table_.end()) continue;
    std::vector<NgramProposer::Follower> ranked;
    for (const auto& [token, count] : found->second) ranked.push_back({token, count, -1});
    std::stable_sort(ranked.begin(), ranked.end(),  // map order: lowest id first on a tie
                     [](const auto& a, const auto& b) { return a.count > b.count; });
    if (convincing(ranked, n)) return ranked;
  }
  return {};
}

void LookupCache::save(const std::filesystem::path& path) const {
  std::string out;
  for (const auto& [key, part] : table_) {
    for (int64_t i = 0; i < kMaxN; ++i) {
      append_i32(out, i < static_cast<int64_t>(key.size()) ? key[static_cast<std::size_t>(i)] : -1);
    }
    append_i32(out, static_cast<int32_t>(part.size()));
    for (const auto& [token, count] : part) {
      append_i32(out, token);
      append_i32(out, count);
    }
  }
  auto tmp = path;
  tmp += ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    if (!f.flush()) {
      std::filesystem::remove(tmp);
      throw LookupCacheError("lookup cache " + path.string() + ": cannot write it");
    }
  }
  std::filesystem::rename(tmp, path);
}

LookupCache LookupCache::open(const std::filesystem::path& path, int64_t vocab_size) {
  return std::filesystem::exists(path) ? load(path, vocab_size) : LookupCache();
}

LookupCache LookupCache::load(const std::filesystem::path& path, int64_t vocab_size,
                              int64_t max_ngrams) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw LookupCacheError("lookup cache " + path.string() + ": cannot open it");
  const std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  LookupCache cache(max_ngrams);
  constexpr std::size_t kHead = (kMaxN + 1) * 4, kPair = 8;
  std::size_t offset = 0;
  const auto bad = [&](const std::string& what) {
    return LookupCacheError("lookup cache " + path.string() + ": " + what + " at byte " +
                            std::to_string(offset) +
                            "; it is not an n-gram cache of this model (llama.cpp's "
                            "lookup-cache format): delete it or pass another file");
  };
  while (offset < data.size()) {
    if (offset + kHead > data.size()) throw bad("the file ends inside an n-gram");
    std::vector<int32_t> slots(kMaxN);
    for (std::size_t i = 0; i < kMaxN; ++i) slots[i] = read_i32(data, offset + 4 * i);
    const int32_t followers = read_i32(data, offset + 4 * kMaxN);
    const auto n = static_cast<std::size_t>(std::find(slots.begin(), slots.end(), -1) - slots.begin());
    if (n == 0 || std::any_of(slots.begin() + static_cast<std::ptrdiff_t>(n), slots.end(),
                              [](int32_t t) { return t != -1; })) {
      throw bad("n-gram " + tokens_str(slots) + " has no tokens or a gap");
    }
    slots.resize(n);
    if (followers < 1) {
      throw bad("n-gram " + tokens_str(slots) + " has " + std::to_string(followers) + " followers");
    }
    const std::size_t end = offset + kHead + static_cast<std::size_t>(followers) * kPair;
    if (end > data.size()) {
      throw bad("the file ends inside the followers of n-gram " + tokens_str(slots));
    }
    auto& part = cache.table_[slots];
    for (std::size_t p = offset + kHead; p < end; p += kPair) {
      const int32_t token = read_i32(data, p), count = read_i32(data, p + 4);
      if (count < 1) {
        throw bad("follower " + std::to_string(token) + " has count " + std::to_string(count));
      }
      int32_t& held = part[token];
      held = static_cast<int32_t>(std::min<int64_t>(int64_t{held} + count, kCountMax));
    }
    std::vector<int32_t> tokens = slots;
    for (const auto& [token, _] : part) tokens.push_back(token);
    for (const int32_t t : tokens) {
      if (t < 0 || t >= vocab_size) {
        throw bad("token " + std::to_string(t) + " lies outside the vocabulary (0.." +
                  std::to_string(vocab_size - 1) + ")");
      }
    }
    offset = end;
  }
  while (static_cast<int64_t>(cache.table_.size()) > cache.max_ngrams_) cache.age();
  return cache;
}

}  // namespace aotgen
