// n-gram lookup proposals: aotgen/runtime/ngram.py rule for rule (longest convincing match
// first, the most frequent then most recent follower, drafting while the evidence holds, then
// the shared LookupCache), so both runtimes draft the same tokens.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "aotgen.h"

namespace aotgen {
namespace {

// Evidence an n-gram needs before its most frequent follower is drafted, by n (1, 2, 3, 4+):
// occurrences of the n-gram, and the winner's share of its followers in percent (ngram.py).
constexpr std::array<int64_t, 4> kMinOccurrences = {2, 2, 1, 1};
constexpr std::array<int64_t, 4> kMinPercent = {66, 50, 50, 50};

bool convincing(const std::vector<NgramProposer::Follower>& followers, int64_t n) {
  if (followers.empty()) return false;
  int64_t total = 0;
  for (const auto& f : followers) total += f.count;
  const auto i = static_cast<std::size_t>(std::min<int64_t>(n, kMinOccurrences.size()) - 1);
  return total >= kMinOccurrences[i] && 100 * followers.front().count >= kMinPercent[i] * total;
}

}  // namespace

NgramProposer::NgramProposer(int64_t min_n, int64_t max_n, const LookupCache* shared)
    : min_n_(min_n), max_n_(max_n), shared_(shared),
      tables_(max_n > 0 ? static_cast<std::size_t>(max_n) : 0) {
  if (min_n < 1 || min_n > max_n) {
    throw std::invalid_argument("need 1 <= ngram_min <= ngram_max, got " + std::to_string(min_n) +
                                " and " + std::to_string(max_n));
  }
}

void NgramProposer::sync(const std::vector<int64_t>& history) {
  if (history.size() < tokens_.size() ||
      !std::equal(tokens_.begin(), tokens_.end(), history.begin())) {
    tokens_.clear();
    for (auto& table : tables_) table.clear();
  }
  for (std::size_t pos = tokens_.size(); pos < history.size(); ++pos) {
    const int64_t token = history[pos];
    const auto p = static_cast<int64_t>(pos);
    for (int64_t n = 1; n <= std::min(max_n_, p); ++n) {
      std::vector<int64_t> key(tokens_.end() - n, tokens_.end());
      auto [it, fresh] = tables_[n - 1][std::move(key)].try_emplace(token,
                                                                    std::array<int64_t, 2>{0, p});
      it->second[0] += 1;
      it->second[1] = p;
    }
    tokens_.push_back(token);
  }
}

std::vector<NgramProposer::Follower> NgramProposer::followers(
    const std::vector<int64_t>& context, int64_t n) const {
  if (n > static_cast<int64_t>(context.size())) return {};
  const std::vector<int64_t> key(context.end() - n, context.end());
  const auto& table = tables_[n - 1];
  const auto found = table.find(key);
  if (found == table.end()) return {};
  std::vector<Follower> ranked;
  for (const auto& [token, counts] : found->second) ranked.push_back({token, counts[0], counts[1]});
  std::sort(ranked.begin(), ranked.end(), [](const Follower& a, const Follower& b) {
    return a.count != b.count ? a.count > b.count : a.last > b.last;
  });
  return ranked;
}

std::vector<NgramProposer::Follower> NgramProposer::candidates(
    const std::vector<int64_t>& context) const {
  for (int64_t n = max_n_; n >= min_n_; --n) {
    auto ranked = followers(context, n);
    if (convincing(ranked, n)) return ranked;
  }
  return shared_ ? shared_->candidates(context, min_n_, max_n_) : std::vector<Follower>{};
}

std::vector<int64_t> NgramProposer::propose(const std::vector<int64_t>& history, int64_t k) {
  sync(history);
  const auto keep = std::min<std::size_t>(history.size(), static_cast<std::size_t>(max_n_));
  std::vector<int64_t> context(history.end() - static_cast<std::ptrdiff_t>(keep), history.end());
  std::vector<int64_t> draft;
  while (static_cast<int64_t>(draft.size()) < k) {
    const auto ranked = candidates(context);
    if (ranked.empty()) break;
    draft.push_back(ranked.front().token);
    context.push_back(ranked.front().token);
    if (static_cast<int64_t>(context.size()) > max_n_) context.erase(context.begin());
  }
  return draft;
}

}  // namespace aotgen
