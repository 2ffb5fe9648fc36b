// Best-first token trees: aotgen/runtime/tree_shape.py, with the same values in double
// precision and the same tie-breaking, so both runtimes build the same trees.
#include "tree_shape.h"

#include <algorithm>
#include <tuple>

namespace aotgen::detail {

namespace {

constexpr double kPrior = 2.0;  // pseudo-observations at the draft's probability

int bin(double p) {
  return std::min(static_cast<int>(p * Calibration::kBins), Calibration::kBins - 1);
}

}  // namespace

double Calibration::estimate(double p, bool leaf) const {
  int64_t seen = 0, hits = 0;
  for (int b = 0; b < kBins; ++b) {
    seen += reached_[leaf][b];
    hits += accepted_[leaf][b];
  }
  const double pooled = (static_cast<double>(hits) + kPrior * p) /
                        (static_cast<double>(seen) + kPrior);
  const int b = bin(p);
  return (static_cast<double>(accepted_[leaf][b]) + kPrior * pooled) /
         (static_cast<double>(reached_[leaf][b]) + kPrior);
}

void Calibration::drafted(const Tree& tree, std::vector<std::pair<bool, double>> scores) {
  parents_ = tree.parents;
  scores_ = std::move(scores);
}

void Calibration::verified(const std::vector<int64_t>& path) {
  const auto on_path = [&](int64_t n) {
    return std::find(path.begin(), path.end(), n) != path.end();
  };
  for (std::size_t node = 1; node <= scores_.size(); ++node) {
    if (!on_path(parents_[node])) continue;
    const auto [leaf, p] = scores_[node - 1];
    reached_[leaf][bin(p)] += 1;
    accepted_[leaf][bin(p)] += on_path(static_cast<int64_t>(node));
  }
  scores_.clear();
}

void add_ranked_leaves(std::vector<Leaf>& leaves, const std::vector<double>& probs,
                       const std::vector<int64_t>& tokens, int64_t chain_token, int64_t depth,
                       double parent_value, const Calibration& calibration) {
  int64_t rank = 0;
  for (std::size_t i = 0; i < probs.size() && rank < kMaxSiblings; ++i) {
    if (tokens[i] != chain_token) {
      leaves.push_back({parent_value * calibration.estimate(probs[i], true), depth, rank++,
                        tokens[i], probs[i]});
    }
  }
}

std::vector<std::pair<bool, double>> node_scores(const std::vector<double>& chain_p,
                                                 int64_t kept, const std::vector<Leaf>& leaves) {
  std::vector<std::pair<bool, double>> scores;
  for (int64_t d = 0; d < kept; ++d) scores.emplace_back(false, chain_p[d]);
  for (const auto& f : leaves) scores.emplace_back(true, f.p);
  return scores;
}

namespace {

// The n_parallel - 1 best leaves, best first.
std::vector<Leaf> best_leaves(std::vector<Leaf> leaves, int64_t n_parallel) {
  std::stable_sort(leaves.begin(), leaves.end(), [](const Leaf& a, const Leaf& b) {
    return std::tie(b.value, a.depth, a.rank) < std::tie(a.value, b.depth, b.rank);
  });
  leaves.resize(std::min<std::size_t>(leaves.size(), static_cast<std::size_t>(n_parallel - 1)));
  return leaves;
}

}  // namespace

std::pair<int64_t, std::vector<Leaf>> best_first(const std::vector<double>& chain_values,
                                                 const std::vector<Leaf>& all_leaves,
                                                 int64_t budget, int64_t n_parallel) {
  const auto leaves = best_leaves(all_leaves, n_parallel);
  struct Candidate {
    double value;
    int64_t is_chain, neg_depth, neg_rank;
    const Leaf* leaf;
  };
  std::vector<Candidate> all;
  for (std::size_t d = 0; d < chain_values.size(); ++d) {
    all.push_back({chain_values[d], 1, -static_cast<int64_t>(d + 1), 0, nullptr});
  }
  for (const auto& f : leaves) all.push_back({f.value, 0, -f.depth, -f.rank, &f});
  std::stable_sort(all.begin(), all.end(), [](const Candidate& a, const Candidate& b) {
    return std::tie(b.value, b.is_chain, b.neg_depth, b.neg_rank) <
           std::tie(a.value, a.is_chain, a.neg_depth, a.neg_rank);
  });
  all.resize(std::min<std::size_t>(all.size(), static_cast<std::size_t>(budget - 1)));
  int64_t kept = 0;
  std::vector<Leaf> chosen;
  for (const auto& c : all) {
    if (c.leaf == nullptr) {
      ++kept;
    } else {
      chosen.push_back(*c.leaf);
    }
  }
  std::sort(chosen.begin(), chosen.end(), [](const Leaf& a, const Leaf& b) {
    return std::tie(a.depth, a.rank) < std::tie(b.depth, b.rank);
  });
  return {kept, chosen};
}

bool chain_is_done(const std::vector<double>& chain_values, const std::vector<Leaf>& leaves,
                   int64_t budget, int64_t n_parallel) {
  const double last = chain_values.back();
  int64_t above = 0;
  for (const auto& f : leaves) above += f.value > last;
  return static_cast<int64_t>(chain_values.size()) + std::min(above, n_parallel - 1) >=
         budget - 1;
}

Tree assemble(int64_t root, const std::vector<std::pair<int64_t, at::Tensor>>& chain,
              int64_t kept, const std::vector<Leaf>& leaves) {
  Tree tree = Tree::root(root);
  for (int64_t d = 0; d < kept; ++d) tree.add(tree.size() - 1, chain[d].first, chain[d].second);
  for (const auto& f : leaves) tree.add(f.depth - 1, f.token);
  return tree;
}

}  // namespace aotgen::detail
