// Tree speculation: aotgen/runtime/tree.py, tree_draft.py and tree_shape.py, with the same
// random draws in the same order, so both runtimes give the same ids (tests/test_tree.py).
#include "tree.h"

#include <algorithm>
#include <tuple>

#include <ATen/ops/eye.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>

#include "detail.h"
#include "tree_shape.h"

namespace aotgen::detail {

namespace {

struct Branch {
  int64_t depth, token;
  at::Tensor probs;
};

// The branches to open, shallowest first: options[j - 1] beside the chain token at depth j.
std::vector<Branch> plan_branches(const std::vector<std::vector<Branch>>& options,
                                  const TreeParams& params, int64_t room) {
  const int64_t limit = std::min(params.n_parallel - 1, room);
  std::vector<Branch> picked;
  for (const auto& opts : options) {
    for (const auto& b : opts) {
      if (static_cast<int64_t>(picked.size()) >= limit) return picked;
      picked.push_back(b);
    }
  }
  return picked;
}

std::vector<double> to_doubles(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kDouble).contiguous();
  return {c.data_ptr<double>(), c.data_ptr<double>() + c.numel()};
}

std::vector<int64_t> to_longs(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

class TreeDraftProposer final : public TreeProposer {
 public:
  TreeDraftProposer(DraftModel& draft, const std::vector<int64_t>& prompt,
                    const SamplingParams& params, at::Generator& gen, const TreeParams& tree)
      : draft_(draft), params_(params), gen_(gen), tree_(tree),
        pos_(static_cast<int64_t>(prompt.size())) {
    if (!draft_.shares_cache()) draft_.prefill(prompt);
  }

  Tree propose(const std::vector<int64_t>& history, int64_t k, int64_t budget) override {
    const auto start = static_cast<int64_t>(history.size()) - 1;
    if (draft_.shares_cache()) pos_ = start;
    at::Tensor logits =
        draft_.forward(std::vector<int64_t>(history.begin() + pos_, history.end()), pos_);
    if (tree_.best_first) return best_first_tree(history.back(), logits, start, k, budget);
    Tree tree = Tree::root(history.back());
    std::vector<at::Tensor> chain_logits;
    int64_t node = 0;
    for (int64_t depth = 1; depth <= k && tree.size() < budget; ++depth) {  // the main chain
      chain_logits.push_back(logits);
      const auto [tok, q] = pick(logits);
      node = tree.add(node, tok, q);
      if (depth < k && tree.size() < budget) logits = draft_.decode(tok, start + depth);
    }
    pos_ = start + tree.size() - 1;
    if (tree_.n_parallel == 1) return tree;
    std::vector<std::vector<Branch>> options;
    for (std::size_t j = 1; j <= chain_logits.size(); ++j) {
      options.push_back(alternatives(chain_logits[j - 1], tree.probs[j], tree.tokens[j],
                                     static_cast<int64_t>(j)));
    }
    const auto branches = plan_branches(options, tree_, budget - tree.size());
    if (branches.empty()) return tree;
    std::vector<std::pair<int64_t, int64_t>> firsts;  // (depth, node)
    for (const auto& b : branches) firsts.emplace_back(b.depth, tree.add(b.depth - 1, b.token, b.probs));
    int64_t shallowest = firsts.front().first;
    std::sort(firsts.rbegin(), firsts.rend());  // deepest first (tree_draft.py)
    for (const auto& [j, b] : firsts) {
      shallowest = std::min(shallowest, j);
      if (j < k && tree.size() < budget) {
        extend(tree, b, draft_.decode(tree.tokens[b], start + j), start + j, j, k, budget);
      }
    }
    pos_ = std::min(pos_, start + shallowest);
    return tree;
  }

  void accepted(int64_t pos) override { pos_ = std::min(pos_, pos); }

 private:
  // The chain while its next node could still be kept, then the best nodes of it and of the
  // leaves beside it (tree_draft.py _best_first).
  Tree best_first_tree(int64_t root, at::Tensor logits, int64_t start, int64_t k,
                       int64_t budget) {
    std::vector<std::pair<int64_t, at::Tensor>> picks;
    std::vector<double> values, chain_p;
    std::vector<Leaf> leaves;
    for (int64_t depth = 1; depth <= std::min(k, budget - 1); ++depth) {
      const auto [tok, q] = pick(logits);
      const at::Tensor probs = q.defined() ? q : at::softmax(logits.to(at::kFloat), -1);
      const auto [top_values, top_indices] = at::topk(probs, kMaxSiblings + 1);
      const double parent = values.empty() ? 1.0 : values.back();
      add_ranked_leaves(leaves, to_doubles(top_values), to_longs(top_indices), tok, depth,
                        parent, calibration_);
      picks.emplace_back(tok, q);
      chain_p.push_back(static_cast<double>(probs[tok].item<float>()));
      values.push_back(parent * calibration_.estimate(chain_p.back(), false));
      if (depth == k || chain_is_done(values, leaves, budget, tree_.n_parallel)) break;
      logits = draft_.decode(tok, start + depth);
    }
    pos_ = start + static_cast<int64_t>(picks.size());
    const auto [kept, chosen] = best_first(values, leaves, budget, tree_.n_parallel);
    if (!chosen.empty()) pos_ = std::min(pos_, start + chosen.front().depth);
    Tree tree = assemble(root, picks, kept, chosen);
    calibration_.drafted(tree, node_scores(chain_p, kept, chosen));
    return tree;
  }

 public:
  void verified(const std::vector<int64_t>& path) override { calibration_.verified(path); }

 private:

  std::pair<int64_t, at::Tensor> pick(const at::Tensor& logits) {
    if (params_.greedy()) return {logits.argmax().item<int64_t>(), at::Tensor()};
    at::Tensor q = logits_to_probs(logits.unsqueeze(0), params_)[0];
    return {sample(q.unsqueeze(0), gen_).item<int64_t>(), q};
  }

  std::vector<Branch> alternatives(const at::Tensor& logits, const at::Tensor& q, int64_t token,
                                   int64_t depth) {
    std::vector<Branch> out;
    if (!q.defined()) {
      const auto [values, indices] = at::topk(at::softmax(logits.to(at::kFloat), -1), kMaxSiblings + 1);
      for (int64_t i = 0; i <= kMaxSiblings; ++i) {
        const int64_t t = indices[i].item<int64_t>();
        if (t != token && values[i].item<float>() > tree_.p_split &&
            static_cast<int64_t>(out.size()) < kMaxSiblings) {
          out.push_back({depth, t, at::Tensor()});
        }
      }
      return out;
    }
    const at::Tensor ranked = std::get<0>(at::topk(q, kMaxSiblings + 1)).narrow(0, 1, kMaxSiblings);
    const int64_t count = ranked.gt(tree_.p_split).sum().item<int64_t>();
    for (int64_t i = 0; i < count; ++i) {
      out.push_back({depth, sample(q.unsqueeze(0), gen_).item<int64_t>(), q});
    }
    return out;
  }

  void extend(Tree& tree, int64_t node, at::Tensor logits, int64_t pos, int64_t depth, int64_t k,
              int64_t budget) {
    while (depth < k && tree.size() < budget) {
      const auto [tok, q] = pick(logits);
      node = tree.add(node, tok, q);
      ++depth;
      if (depth < k && tree.size() < budget) logits = draft_.decode(tok, ++pos);
    }
  }

  DraftModel& draft_;
  const SamplingParams& params_;
  at::Generator& gen_;
  TreeParams tree_;
  int64_t pos_;
  Calibration calibration_;
};

class TreeLookupProposer final : public TreeProposer {
 public:
  TreeLookupProposer(int64_t min_n, int64_t max_n, const TreeParams& tree,
                     const LookupCache* shared)
      : ngram_(min_n, max_n, shared), max_n_(max_n), tree_(tree) {}

  Tree propose(const std::vector<int64_t>& history, int64_t k, int64_t budget) override {
    const auto chain = ngram_.propose(history, std::min(k, budget - 1));
    Tree tree = Tree::root(history.back());
    for (const auto tok : chain) tree.add(tree.size() - 1, tok);
    tree.looked_up = !chain.empty();
    if (chain.empty() || tree_.n_parallel == 1) return tree;
    const auto keep = std::min<std::size_t>(history.size(), static_cast<std::size_t>(max_n_));
    const std::vector<int64_t> tail(history.end() - static_cast<std::ptrdiff_t>(keep),
                                    history.end());
    if (tree_.best_first) return best_first_tree(history.back(), tail, chain, budget);
    std::vector<std::vector<Branch>> options;
    for (std::size_t j = 1; j <= chain.size(); ++j) {
      std::vector<int64_t> context = tail;
      context.insert(context.end(), chain.begin(), chain.begin() + (j - 1));
      const auto ranked = ngram_.candidates(context);
      int64_t total = 0;
      for (const auto& f : ranked) total += f.count;
      std::vector<Branch> opts;
      for (std::size_t i = 0; i < ranked.size() && i <= kMaxSiblings; ++i) {
        if (ranked[i].token != chain[j - 1] &&
            static_cast<double>(ranked[i].count) > tree_.p_split * static_cast<double>(total)) {
          opts.push_back({static_cast<int64_t>(j), ranked[i].token, at::Tensor()});
        }
      }
      options.push_back(std::move(opts));
    }
    std::vector<std::pair<int64_t, int64_t>> firsts;  // (depth, node): each gets its row
    for (const auto& b : plan_branches(options, tree_, budget - tree.size())) {
      firsts.emplace_back(b.depth, tree.add(b.depth - 1, b.token));
    }
    for (auto [depth, node] : firsts) {
      std::vector<int64_t> context = tail;
      context.insert(context.end(), chain.begin(), chain.begin() + (depth - 1));
      context.push_back(tree.tokens[node]);
      const auto rest = follow(context, k - depth);
      const int64_t room = budget - tree.size();
      for (int64_t i = 0; i < std::min<int64_t>(room, static_cast<int64_t>(rest.size())); ++i) {
        node = tree.add(node, rest[i]);
      }
    }
    return tree;
  }

 private:
  // The chain and the other followers at each of its positions as leaves, valued by the
  // acceptance estimates of the followers' shares along the path (tree_draft.py _best_first).
  Tree best_first_tree(int64_t root, const std::vector<int64_t>& tail,
                       const std::vector<int64_t>& chain, int64_t budget) {
    std::vector<double> values, chain_p;
    std::vector<Leaf> leaves;
    std::vector<std::pair<int64_t, at::Tensor>> picks;
    for (std::size_t j = 1; j <= chain.size(); ++j) {
      std::vector<int64_t> context = tail;
      context.insert(context.end(), chain.begin(), chain.begin() + (j - 1));
      const auto ranked = ngram_.candidates(context);
      double total = 0;
      for (const auto& f : ranked) total += static_cast<double>(f.count);
      std::vector<double> shares;
      std::vector<int64_t> tokens;
      double share = 0.0;
      for (std::size_t i = 0; i < ranked.size() && i <= kMaxSiblings; ++i) {
        shares.push_back(static_cast<double>(ranked[i].count) / total);
        tokens.push_back(ranked[i].token);
        if (ranked[i].token == chain[j - 1] && share == 0.0) share = shares.back();
      }
      const double parent = values.empty() ? 1.0 : values.back();
      add_ranked_leaves(leaves, shares, tokens, chain[j - 1], static_cast<int64_t>(j), parent,
                        calibration_);
      chain_p.push_back(share);
      values.push_back(parent * calibration_.estimate(share, false));
      picks.emplace_back(chain[j - 1], at::Tensor());
    }
    const auto [kept, chosen] = best_first(values, leaves, budget, tree_.n_parallel);
    Tree tree = assemble(root, picks, kept, chosen);
    tree.looked_up = true;
    calibration_.drafted(tree, node_scores(chain_p, kept, chosen));
    return tree;
  }

 public:
  void verified(const std::vector<int64_t>& path) override { calibration_.verified(path); }

 private:

  std::vector<int64_t> follow(std::vector<int64_t> context, int64_t n) const {
    std::vector<int64_t> out;
    while (static_cast<int64_t>(out.size()) < n) {
      const auto ranked = ngram_.candidates(context);
      if (ranked.empty()) break;
      out.push_back(ranked.front().token);
      context.push_back(ranked.front().token);
    }
    return out;
  }

  NgramProposer ngram_;
  int64_t max_n_;
  TreeParams tree_;
  Calibration calibration_;
};

class TreeDraftOrLookup final : public TreeProposer {
 public:
  TreeDraftOrLookup(std::unique_ptr<TreeProposer> lookup, std::unique_ptr<TreeProposer> draft)
      : lookup_(std::move(lookup)), draft_(std::move(draft)) {}

  Tree propose(const std::vector<int64_t>& history, int64_t k, int64_t budget) override {
    Tree tree = lookup_->propose(history, k, budget);
    looked_up_ = tree.size() > 1;
    return looked_up_ ? tree : draft_->propose(history, k, budget);
  }

  void verified(const std::vector<int64_t>& path) override {
    (looked_up_ ? lookup_ : draft_)->verified(path);
  }

  void accepted(int64_t pos) override { draft_->accepted(pos); }

 private:
  std::unique_ptr<TreeProposer> lookup_, draft_;
  bool looked_up_ = false;
};

TreeVerdict verify_greedy_tree(const Tree& tree, const at::Tensor& logits) {
  const at::Tensor predicted = logits.argmax(-1).contiguous();
  const int64_t* pred = predicted.data_ptr<int64_t>();
  TreeVerdict v{{0}, 0};
  int64_t node = 0;
  while (true) {
    int64_t next = -1;
    for (const auto c : tree.children(node)) {
      if (tree.tokens[c] == pred[node]) {
        next = c;
        break;
      }
    }
    if (next < 0) {
      v.next = pred[node];
      return v;
    }
    node = next;
    v.path.push_back(node);
  }
}

// SpecInfer's multi-step speculative sampling (tree.py verify_tree_stochastic).
TreeVerdict verify_sampled_tree(const Tree& tree, const at::Tensor& target_probs,
                                at::Generator& gen) {
  const int64_t vocab = target_probs.size(-1);
  TreeVerdict v{{0}, 0};
  int64_t node = 0;
  while (true) {
    at::Tensor r = target_probs[node].to(at::kFloat);
    bool moved = false;
    for (const auto child : tree.children(node)) {
      const int64_t x = tree.tokens[child];
      at::Tensor q = tree.probs[child];
      if (!q.defined()) {
        q = at::zeros({vocab});
        q[x] = 1.0;
      }
      const double u = at::rand({}, gen).item<float>();
      if (u * static_cast<double>(q[x].item<float>()) < static_cast<double>(r[x].item<float>())) {
        node = child;
        v.path.push_back(child);
        moved = true;
        break;
      }
      r = residual_probs(r.unsqueeze(0), q.unsqueeze(0).to(at::kFloat))[0];
      r = r.div(r.sum());
    }
    if (!moved) {
      v.next = sample(r.unsqueeze(0), gen).item<int64_t>();
      return v;
    }
  }
}

}  // namespace

Tree Tree::root(int64_t token) {
  Tree tree;
  tree.add(-1, token);
  return tree;
}

int64_t Tree::add(int64_t parent, int64_t token, const at::Tensor& p) {
  tokens.push_back(token);
  parents.push_back(parent);
  probs.push_back(p);
  return size() - 1;
}

std::vector<int64_t> Tree::depths() const {
  std::vector<int64_t> d(parents.size(), 0);
  for (std::size_t i = 1; i < parents.size(); ++i) d[i] = d[parents[i]] + 1;
  return d;
}

int64_t Tree::depth() const {
  const auto d = depths();
  return *std::max_element(d.begin(), d.end());
}

std::vector<int64_t> Tree::children(int64_t node) const {
  std::vector<int64_t> out;
  for (std::size_t i = 1; i < parents.size(); ++i) {
    if (parents[i] == node) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

at::Tensor Tree::mask(int64_t n) const {
  at::Tensor m = at::eye(n, at::kBool);
  auto a = m.accessor<bool, 2>();
  for (int64_t i = 0; i < n; ++i) a[i][0] = true;
  for (std::size_t i = 1; i < parents.size(); ++i) {
    for (int64_t j = 0; j < n; ++j) a[i][j] = a[i][j] || a[parents[i]][j];
  }
  return m;
}

TreeVerdict verify_tree(const Tree& tree, const at::Tensor& logits, const SamplingParams& params,
                        at::Generator& generator) {
  if (params.greedy()) return verify_greedy_tree(tree, logits);
  return verify_sampled_tree(tree, logits_to_probs(logits, params), generator);
}

int64_t commit_path(const std::vector<at::Tensor>& caches, int64_t start,
                    const std::vector<int64_t>& path) {
  std::vector<int64_t> src, dst;
  for (std::size_t i = 0; i < path.size(); ++i) {
    if (path[i] != static_cast<int64_t>(i)) {
      src.push_back(start + path[i]);
      dst.push_back(start + static_cast<int64_t>(i));
    }
  }
  if (src.empty()) return 0;
  const at::Tensor s = at::tensor(src, at::kLong), d = at::tensor(dst, at::kLong);
  for (const auto& cache : caches) {
    at::Tensor c = cache;  // the same storage: written in place
    // A ring layer keeps position p in cell p % its cells (a full-length layer: p).
    const int64_t cells = c.size(2);
    c.index_copy_(2, d.remainder(cells), c.index_select(2, s.remainder(cells)));
  }
  return static_cast<int64_t>(src.size());
}

std::unique_ptr<TreeProposer> make_tree_proposer(Speculative mode, DraftModel* draft,
                                                 const std::vector<int64_t>& prompt,
                                                 const SamplingParams& params,
                                                 at::Generator& generator, const TreeParams& tree,
                                                 int64_t ngram_min, int64_t ngram_max,
                                                 const LookupCache* shared) {
  auto lookup = std::make_unique<TreeLookupProposer>(ngram_min, ngram_max, tree, shared);
  if (mode == Speculative::Ngram) return lookup;
  auto drafted = std::make_unique<TreeDraftProposer>(*draft, prompt, params, generator, tree);
  if (mode == Speculative::DraftNgram) {
    return std::make_unique<TreeDraftOrLookup>(std::move(lookup), std::move(drafted));
  }
  return drafted;
}

}  // namespace aotgen::detail
