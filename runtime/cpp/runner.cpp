// Graphs, weights and KV caches: ModelRunner and CompiledGraph of aotgen/runtime/engine.py.
#include "runner.h"

#include <algorithm>
#include <fstream>
#include <mutex>
#include <new>
#include <set>
#include <system_error>

#include <sys/mman.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include "tree.h"

namespace aotgen::detail {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Spans a graph that takes key_pos attends over: powers of two from 128, then the whole cache
// (engine.py MIN_KEY_SPAN, key_span).
constexpr int64_t kMinKeySpan = 128;

// A zero tensor on fresh anonymous pages, which the kernel zero-fills when first written.
// KV caches start zeroed, as with at::zeros, but are written only as far as the context
// reaches. at::zeros writes all cache_len positions at load, in a parallel fill whose
// threads spun against the hashing threads (perf: about a third of the CPU samples while
// hashing, on 2 cores).
at::Tensor zeros_on_demand(const std::vector<int64_t>& shape, at::ScalarType dtype) {
  std::size_t bytes = c10::elementSize(dtype);
  for (const auto d : shape) bytes *= static_cast<std::size_t>(d);
  // A latent-attention layer's values (model/mla.py): empty, and mmap takes no zero length.
  if (bytes == 0) return at::zeros(shape, at::TensorOptions().dtype(dtype));
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) throw std::bad_alloc();
  return at::from_blob(
      data, shape, [bytes](void* p) { ::munmap(p, bytes); }, at::TensorOptions().dtype(dtype));
}

using Shapes = std::vector<std::vector<int64_t>>;

// The KV caches a graph takes: 2 * layers tensors of kv_cache's shapes, with as many rows as
// the batched graphs serve (their `batch.max`).
void check_signature(const std::string& name, const json& signature, int64_t layers,
                     Shapes shapes) {
  if (signature.contains("batch")) {
    for (auto& shape : shapes) shape.at(0) = signature["batch"].at("max").get<int64_t>();
  }
  for (const auto& input : signature.value("inputs", json::array())) {
    if (input.value("name", "") != "kv_caches") continue;
    if (input.value("count", int64_t{-1}) != 2 * layers ||
        static_cast<int64_t>(shapes.size()) != 2 * layers ||
        input.value("shapes", Shapes{}) != shapes) {
      throw PackageError("graph " + name + " expects other KV caches than kv_cache describes");
    }
  }
}

// kv_cache.ring's (cells, window): sliding layers keep position p in cell p % cells, and
// some layer is that long; (0, 0) without a ring.
std::pair<int64_t, int64_t> ring_of(const json& kv, const Shapes& shapes) {
  if (!kv.contains("ring") || kv["ring"].is_null()) return {0, 0};
  const json& ring = kv["ring"];
  const auto positive = [&](const char* key) {
    return ring.is_object() && ring.contains(key) && ring[key].is_number_integer() &&
           ring[key].get<int64_t>() > 0;
  };
  if (!positive("cells") || !positive("window") ||
      std::none_of(shapes.begin(), shapes.end(), [&](const std::vector<int64_t>& s) {
        return s.size() == 4 && s[2] == ring["cells"].get<int64_t>();
      })) {
    throw PackageError("kv_cache.ring needs positive cells (a layer's length) and window");
  }
  return {ring["cells"].get<int64_t>(), ring["window"].get<int64_t>()};
}

// torch's loader extracts a graph's library into a fresh $TMPDIR/aotinductor_XXXXXX/ and removes
// it only in its destructor, so a process killed with its package loaded left it behind. On a
// CPU nothing there is read once the library is mapped (aotgen/runtime/graph_loader.py).
std::set<fs::path> mapped_extractions() {
  std::set<fs::path> found;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    const auto path = line.find(" /");
    // Most lines are torch's and the system's own libraries.
    if (path == std::string::npos || line.find("/aotinductor_") == std::string::npos) continue;
    for (fs::path dir = fs::path(line.substr(path + 1)).parent_path(); dir.has_relative_path();
         dir = dir.parent_path()) {
      const std::string name = dir.filename().string();
      if (name.rfind("aotinductor_", 0) == 0 && name.size() == sizeof("aotinductor_XXXXXX") - 1) {
        found.insert(dir);
      }
    }
  }
  return found;
}

std::unique_ptr<torch::inductor::AOTIModelPackageLoader> open_loader(const fs::path& pt2,
                                                                      const std::string& name,
                                                                      const at::Device& device) {
  // (path, model name, run single-threaded, runners, device index): -1 is CPU. On a GPU
  // single-threaded, so that a call can be captured as a CUDA graph (the container's
  // multi-threaded run synchronises on an event, which a capture refuses).
  const auto open = [&] {
    try {
      return std::make_unique<torch::inductor::AOTIModelPackageLoader>(
          pt2.string(), name, device.is_cuda(), 1, device.is_cuda() ? device.index() : -1);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      if (what.find("temporary directory") == std::string::npos) throw;
      throw PackageError("cannot extract graph " + name + " of " + pt2.filename().string() +
                         " into the temp dir (" + what.substr(0, what.find('\n')) +
                         "): set TMPDIR to a writable directory");
    }
  };
  if (device.is_cuda()) return open();  // its kernels' cubins are read from there at first call
  static std::mutex opening;  // a loader's new mappings are its own, not another thread's
  const std::lock_guard<std::mutex> lock(opening);
  const auto before = mapped_extractions();
  auto loader = open();
  for (const auto& dir : mapped_extractions()) {
    std::error_code ignored;
    if (before.count(dir) == 0) fs::remove_all(dir, ignored);
  }
  return loader;
}

}  // namespace

// ---- Graph -------------------------------------------------------------------------------

Graph::Graph(const fs::path& pt2, const json& signature, int64_t vocab, const at::Device& device,
             bool cuda_graphs)
    : name_(signature.at("package_model").get<std::string>()),
      min_tokens_(signature.at("tokens").at("min").get<int64_t>()),
      max_tokens_(signature.at("tokens").at("max").get<int64_t>()),
      min_batch_(signature.value("batch", json{{"min", 1}, {"max", 1}}).at("min").get<int64_t>()),
      max_batch_(signature.value("batch", json{{"min", 1}, {"max", 1}}).at("max").get<int64_t>()),
      vocab_(vocab),
      // A number: the logits' rows whatever T is (the prefill graph's last row); "T": one per token.
      logit_rows_(signature.at("outputs").at(0).at("shape").at(1).is_number_integer()
                      ? signature["outputs"][0]["shape"][1].get<int64_t>()
                      : -1),
      device_(device),
      loader_(open_loader(pt2, name_, device)) {
  if (signature.value("attention", "") == "key_pos") {
    for (const auto& input : signature.at("inputs")) {
      if (input.value("name", "") == "kv_caches") {
        key_pos_ = at::arange(input.at("shapes").at(0).at(2).get<int64_t>(),
                              at::TensorOptions().dtype(at::kLong).device(device));
      }
    }
    if (!key_pos_.defined()) throw PackageError("graph " + name_ + " takes no KV caches");
    // Batched calls are not replayed (their rows' positions differ per call).
    if (device.is_cuda() && cuda_graphs && !signature.contains("batch")) {
      replays_ = std::make_unique<CudaReplays>();
    }
  }
}

Graph::~Graph() = default;

void Graph::bind(const std::unordered_map<std::string, at::Tensor>& weights) {
  std::unordered_map<std::string, at::Tensor> constants;
  std::string missing;
  for (const auto& name : loader_->get_constant_fqns()) {
    const auto it = weights.find(name);
    if (it == weights.end()) {
      missing += (missing.empty() ? "" : ", ") + name;
    } else {
      constants.emplace(name, it->second);
    }
  }
  if (!missing.empty()) {
    throw PackageError("graph " + name_ + " needs weights missing from the package: " + missing);
  }
  loader_->load_constants(constants, /*use_inactive=*/false, /*check_full_update=*/true,
                          /*user_managed=*/true);
}

at::Tensor Graph::operator()(const at::Tensor& tokens, const at::Tensor& input_pos,
                             const std::vector<at::Tensor>& caches, const at::Tensor& extra,
                             int64_t attend) {
  const int64_t b = tokens.size(0), t = tokens.size(1);
  if (t < min_tokens_ || t > max_tokens_) {
    throw std::logic_error(name_ + " takes " + std::to_string(min_tokens_) + ".." +
                           std::to_string(max_tokens_) + " tokens, got " + std::to_string(t));
  }
  if (b < min_batch_ || b > max_batch_) {
    throw std::logic_error(name_ + " takes " + std::to_string(min_batch_) + ".." +
                           std::to_string(max_batch_) + " sequences, got " + std::to_string(b));
  }
  std::vector<at::Tensor> inputs{tokens.to(device_), input_pos.to(device_)};
  if (extra.defined()) inputs.push_back(extra.to(device_));
  const int64_t keys = key_pos_.defined() ? span(attend) : 0;
  at::Tensor logits =
      replays_ ? (*replays_)(inputs, caches.at(0).data_ptr(), keys,
                             [&](const std::vector<at::Tensor>& in, int64_t s) {
                               return run(in, caches, s);
                             })
               : run(inputs, caches, keys);
  if (logits.dim() != 3 || logits.size(0) != b ||
      logits.size(1) != (logit_rows_ > 0 ? logit_rows_ : t) || logits.size(2) != vocab_ ||
      logits.scalar_type() != at::kFloat) {
    throw PackageError("graph " + name_ + " returned no float32 [B, rows, vocab] logits");
  }
  // A replay's logits live in its capture's memory: copied out before the next step.
  return logits.to(at::kCPU);
}

at::Tensor Graph::run(const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& caches, int64_t span) {
  std::vector<at::Tensor> all;
  all.reserve(inputs.size() + caches.size() + 1);
  all.insert(all.end(), inputs.begin(), inputs.begin() + 2);  // tokens, input_pos
  all.insert(all.end(), caches.begin(), caches.end());
  all.insert(all.end(), inputs.begin() + 2, inputs.end());  // tree_mask or slots
  if (key_pos_.defined()) all.push_back(key_pos_.narrow(0, 0, span));
  auto outputs = loader_->boxed_run(std::move(all));
  if (outputs.empty()) throw PackageError("graph " + name_ + " returned nothing");
  return outputs[0];
}

int64_t Graph::span(int64_t attend) const {
  const int64_t cache_len = key_pos_.size(0);
  if (attend < 0) return cache_len;
  int64_t span = kMinKeySpan;
  while (span < attend) span *= 2;
  return std::min(span, cache_len);
}

// ---- CachedTokens ------------------------------------------------------------------------

CachedTokens::CachedTokens(int64_t slots, int64_t ring_cells, int64_t ring_window)
    : rows_(slots), ring_cells_(std::max<int64_t>(ring_cells, 0)), ring_window_(ring_window),
      cells_(ring_cells_ > 0 ? slots : 0, std::vector<int64_t>(ring_cells_, -1)) {}

void CachedTokens::clear() {
  for (auto& row : rows_) row.clear();
}

void CachedTokens::forget(int64_t slot, int64_t start) {
  auto& row = rows_.at(slot);
  if (start < static_cast<int64_t>(row.size())) row.resize(start);
}

void CachedTokens::wrote(int64_t slot, int64_t start, const int64_t* tokens, int64_t count) {
  auto& row = rows_.at(slot);
  if (start == static_cast<int64_t>(row.size())) row.insert(row.end(), tokens, tokens + count);
  place(slot, start, count, true);
}

void CachedTokens::overwrote(int64_t slot, int64_t start, int64_t count) {
  forget(slot, start);
  place(slot, start, count, false);
}

void CachedTokens::copy_cells(int64_t donor, int64_t slot) {
  if (!cells_.empty()) cells_.at(slot) = cells_.at(donor);
}

void CachedTokens::place(int64_t slot, int64_t start, int64_t count, bool known) {
  if (cells_.empty()) return;
  auto& cells = cells_.at(slot);
  for (int64_t p = start; p < start + count; ++p) cells[p % ring_cells_] = known ? p : -1;
}

int64_t CachedTokens::prefix(int64_t slot, const std::vector<int64_t>& tokens) const {
  return prefix_of(slot, tokens.data(), tokens.size());
}

int64_t CachedTokens::prefix_of(int64_t slot, const int64_t* tokens, std::size_t count) const {
  const auto& row = rows_.at(slot);
  const std::size_t n = std::min(row.size(), count);
  return resumable(slot, std::mismatch(row.begin(), row.begin() + n, tokens).first - row.begin());
}

int64_t CachedTokens::resumable(int64_t slot, int64_t n) const {
  if (cells_.empty() || n == 0) return n;
  const auto& cells = cells_.at(slot);
  const int64_t size = ring_cells_, window = ring_window_;
  const int64_t lo = std::max<int64_t>(0, n - size - window);
  std::vector<int64_t> runs(n - lo);  // [q - lo]: consecutive held positions ending at q
  int64_t run = 0;
  for (int64_t q = lo; q < n; ++q) {
    run = cells[q % size] == q ? run + 1 : 0;
    runs[q - lo] = run;
  }
  for (int64_t b = n; b > std::max<int64_t>(0, n - size); --b) {
    if (runs[b - 1 - lo] >= std::min(window - 1, b)) return b;
  }
  return 0;
}

int64_t CachedTokens::reusable(int64_t slot, const std::vector<int64_t>& prompt) const {
  return prompt.empty() ? 0 : prefix_of(slot, prompt.data(), prompt.size() - 1);
}

int64_t CachedTokens::best_slot(const std::deque<int64_t>& free,
                                const std::vector<int64_t>& prompt) const {
  int64_t best = free.front(), held = prefix(best, prompt);
  for (const int64_t slot : free) {
    if (const int64_t n = prefix(slot, prompt); n > held) best = slot, held = n;
  }
  return best;
}

std::pair<int64_t, int64_t> CachedTokens::holder(const std::vector<int64_t>& tokens) const {
  int64_t best = 0, held = prefix(0, tokens);
  for (int64_t slot = 1; slot < static_cast<int64_t>(rows_.size()); ++slot) {
    if (const int64_t n = prefix(slot, tokens); n > held) best = slot, held = n;
  }
  return {best, held};
}

// ---- ModelRunner -------------------------------------------------------------------------

ModelRunner::ModelRunner(const fs::path& pt2, const json& entry, const ModelRunner* target,
                         int64_t slots, const at::Device& device, bool cuda_graphs)
    : vocab_size_(entry.at("config").at("vocab_size").get<int64_t>()), device_(device) {
  const auto& kv = entry.at("kv_cache");
  const auto layers = kv.at("layers").get<int64_t>();
  auto shapes = kv.at("shapes").get<Shapes>();
  cache_len_ = kv.at("cache_len").get<int64_t>();
  for (const auto& s : shapes) {  // width 0: a latent-attention layer's values (model/mla.py)
    if (s.size() != 4 || s[0] <= 0 || s[1] <= 0 || s[2] <= 0 || s[3] < 0) {
      throw PackageError("kv_cache needs 4-D `shapes` of sizes above 0 (widths 0 or more)");
    }
  }
  const auto [ring_cells, ring_window] = ring_of(kv, shapes);
  const auto& graphs = entry.at("graphs");
  for (const auto& [name, signature] : graphs.items()) {
    check_signature(name, signature, layers, shapes);
  }
  if (!graphs.contains("decode")) throw PackageError("the package has no decode graph");
  const auto load = [&](const char* name, bool wanted = true) {
    return graphs.contains(name) && wanted
               ? std::make_unique<Graph>(pt2, graphs[name], vocab_size_, device_, cuda_graphs)
               : nullptr;
  };
  // A draft on the target's cache only ever decodes: it is built without a prefill graph.
  prefill_ = load("prefill");
  decode_ = load("decode");
  verify_ = load("verify");
  tree_ = load("tree");
  // The batched graphs serve a cache of exactly their batch.max rows (engine.py _cache_slots).
  batch_decode_ = load("batch_decode", slots > 1);
  batch_verify_ = load("batch_verify", slots > 1);
  // Each tensor's dtype: `dtype`, or `dtypes` where some differ (a linear-attention layer's
  // float32 states in a bfloat16 cache).
  std::vector<at::ScalarType> dtypes(shapes.size(), dtype_from_name(kv.at("dtype")));
  if (kv.contains("dtypes")) {
    const auto& named = kv["dtypes"];
    if (!named.is_array() || named.size() != shapes.size()) {
      throw PackageError("kv_cache.dtypes must name a dtype for each of its shapes");
    }
    for (std::size_t i = 0; i < shapes.size(); ++i) dtypes[i] = dtype_from_name(named[i]);
  }
  shares_cache_ = kv.value("shared_with", "") == "target";
  if (shares_cache_) {
    // The first layers of the target's cache (all its slots), checked: the draft must read
    // exactly the tensors the target writes.
    const auto& theirs = target ? target->caches_ : caches_;
    bool fits = static_cast<int64_t>(theirs.size()) >= 2 * layers;
    for (int64_t i = 0; fits && i < 2 * layers; ++i) {
      const auto& c = theirs[i];
      const auto& shape = shapes[i];
      fits = c.dim() == static_cast<int64_t>(shape.size()) && c.size(0) == slots &&
             c.sizes().slice(1).vec() == std::vector(shape.begin() + 1, shape.end()) &&
             c.scalar_type() == dtypes[i];
    }
    if (!fits) {
      throw PackageError(
          "the draft is built to share the target's KV cache, but the target's cache layout "
          "differs from the draft's; rebuild the package");
    }
    caches_.assign(theirs.begin(), theirs.begin() + 2 * layers);
    cached_ = target ? target->cached_
                     : std::make_shared<CachedTokens>(slots, ring_cells, ring_window);
  } else {
    cached_ = std::make_shared<CachedTokens>(slots, ring_cells, ring_window);
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      auto shape = shapes[i];
      shape.at(0) = slots;
      caches_.push_back(
          device_.is_cpu() ? zeros_on_demand(shape, dtypes[i])
                           : at::zeros(shape, at::TensorOptions().dtype(dtypes[i]).device(device_)));
    }
  }
  if (slots == 1) {
    slot_caches_.push_back(caches_);
  } else {
    for (int64_t s = 0; s < slots; ++s) {
      auto& rows = slot_caches_.emplace_back();
      for (const auto& c : caches_) rows.push_back(c.narrow(0, s, 1));
    }
  }
  prefill_chunk_ = prefill_ ? prefill_->max_tokens() : 1;
  verify_len_ = verify_ ? verify_->max_tokens() : 0;
}

ModelRunner::~ModelRunner() = default;

void ModelRunner::bind_weights(const fs::path& root, const json& entry, const MappedFiles& mapped) {
  const fs::path file = root / entry.at("weights").at("file").get<std::string>();
  const auto it = mapped.find(file.string());
  weights_ = load_safetensors(file, it == mapped.end() ? nullptr : it->second);
  if (!device_.is_cpu()) {
    for (auto& [name, tensor] : weights_) tensor = tensor.to(device_);
  }
  const json aliases = entry.at("weights").value("aliases", json::object());
  for (const auto& [alias, name] : aliases.items()) {
    const auto it = weights_.find(name.get<std::string>());
    if (it == weights_.end()) throw PackageError("weight alias " + alias + " -> missing tensor");
    const at::Tensor tensor = it->second;
    weights_.insert_or_assign(alias, tensor);
  }
  for (Graph* g : {prefill_.get(), decode_.get(), verify_.get(), tree_.get(), batch_decode_.get(),
                   batch_verify_.get()}) {
    if (g) g->bind(weights_);
  }
}

int64_t ModelRunner::tree_len() const { return tree_ ? tree_->max_tokens() : 0; }

at::Tensor ModelRunner::tree_forward(const Tree& tree, int64_t start) {
  const int64_t n = tree.size(), width = tree_len();
  if (n < 1 || n > width || start + width > cache_len_) {
    throw GenerationError("a tree of " + std::to_string(n) + " nodes at " +
                          std::to_string(start) + " does not fit the tree graph");
  }
  at::Tensor ids = at::full({1, width}, tree.tokens.back(), at::kLong);
  at::Tensor positions = at::full({width}, start, at::kLong);
  const auto depths = tree.depths();
  for (int64_t i = 0; i < n; ++i) {
    ids[0][i] = tree.tokens[i];
    positions[i] = start + depths[i];
  }
  cached_->overwrote(0, start, width);  // node i sits at start + i: not a sequence
  return (*tree_)(ids, positions, caches(), tree.mask(width), start + width)[0].narrow(0, 0, n);
}

void ModelRunner::wrote(int64_t slot, int64_t start, const int64_t* tokens, int64_t count) {
  if (shares_cache_) {
    cached_->overwrote(slot, start, count);  // the draft's own keys, not the target's
  } else {
    cached_->wrote(slot, start, tokens, count);
  }
}

int64_t ModelRunner::share_prefix(int64_t slot, const std::vector<int64_t>& tokens) {
  const int64_t own = cached_->prefix(slot, tokens);
  const auto [donor, held] = cached_->holder(tokens);
  if (held <= own) return own;
  for (auto& cache : caches_) {  // [slots, kv_heads, cache_len or ring cells, head_dim]
    at::Tensor to = cache.select(0, slot), from = cache.select(0, donor);
    // A ring layer's cells hold positions of any age: the donor's whole row.
    if (cache.size(2) >= cache_len_) to = to.slice(1, own, held), from = from.slice(1, own, held);
    to.copy_(from);
  }
  cached_->forget(slot, own);
  cached_->wrote(slot, own, tokens.data() + own, held - own);
  cached_->copy_cells(donor, slot);  // last: the ring layers are now the donor's, cell for cell
  return held;
}

void ModelRunner::prefill_reusing(const std::vector<int64_t>& tokens, int64_t slot, bool reuse) {
  const int64_t start = reuse ? share_prefix(slot, tokens) : 0;
  if (start < static_cast<int64_t>(tokens.size())) {
    forward(std::vector<int64_t>(tokens.begin() + start, tokens.end()), start, false, slot);
  }
}

at::Tensor ModelRunner::forward(const std::vector<int64_t>& tokens, int64_t start_pos,
                                bool all_logits, int64_t slot) {
  const auto count = static_cast<int64_t>(tokens.size());
  const int64_t end = start_pos + count;
  if (count == 0) throw std::logic_error("forward needs at least one token");
  if (end > cache_len_) {
    throw GenerationError("position " + std::to_string(end) + " is past the KV cache (" +
                          std::to_string(cache_len_) + ")");
  }
  const auto& caches = slot_caches_.at(slot);
  // The prefill graph returns its last row only: every row's logits come from the verify
  // graph, verify_len_ tokens a call (decode where it would run past the cache).
  const int64_t step = all_logits ? std::max<int64_t>(verify_len_, 1) : prefill_chunk_;
  std::vector<at::Tensor> outs;
  for (int64_t pos = start_pos; pos < end;) {
    const int64_t want = std::min(end - pos, step);
    const int64_t width = graph_width(want, pos, all_logits);
    const int64_t n = std::min(want, width);
    Graph& graph = width == 1 ? *decode_ : (width == verify_len_ ? *verify_ : *prefill_);
    at::Tensor chunk = at::empty({1, width}, at::kLong);
    auto* ids = chunk.data_ptr<int64_t>();
    std::copy_n(tokens.begin() + (pos - start_pos), n, ids);
    std::fill(ids + n, ids + width, ids[n - 1]);
    cached_->forget(slot, pos);
    at::Tensor logits =
        graph(chunk, at::arange(pos, pos + width, at::kLong), caches, {}, pos + width)[0];
    wrote(slot, pos, ids, width);
    logits = logits.narrow(0, 0, std::min(n, logits.size(0)));  // prefill: one row
    outs.push_back(all_logits ? logits : logits.narrow(0, logits.size(0) - 1, 1));
    pos += n;
  }
  return all_logits ? at::cat(outs) : outs.back()[0];
}

at::Tensor ModelRunner::decode(int64_t token, int64_t pos, int64_t slot) {
  cached_->forget(slot, pos);
  at::Tensor logits = (*decode_)(at::full({1, 1}, token, at::kLong),
                                 at::full({1}, pos, at::kLong), slot_caches_.at(slot), {}, pos + 1);
  wrote(slot, pos, &token, 1);
  return logits[0][0];
}

at::Tensor ModelRunner::batch(const at::Tensor& tokens, const at::Tensor& positions,
                              const at::Tensor& slots) {
  Graph* graph = tokens.size(1) == 1 ? batch_decode_.get() : batch_verify_.get();
  if (!graph) throw std::logic_error("the package has no batched graph for this call");
  // Each row's record, from the host copies of its tokens, start and slot.
  const at::Tensor ids = tokens.cpu().contiguous();
  const at::Tensor starts = positions.select(1, 0).cpu().contiguous();
  const at::Tensor rows = slots.cpu().contiguous();
  const int64_t width = ids.size(1);
  const int64_t *id = ids.data_ptr<int64_t>(), *start = starts.data_ptr<int64_t>(),
                *slot = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows.numel(); ++b) cached_->forget(slot[b], start[b]);
  at::Tensor logits = (*graph)(tokens, positions, caches_, slots);
  for (int64_t b = 0; b < rows.numel(); ++b) wrote(slot[b], start[b], id + b * width, width);
  return logits;
}

int64_t ModelRunner::graph_width(int64_t n, int64_t pos, bool all_logits) const {
  if (n > 1 && n < verify_len_ && pos + verify_len_ <= cache_len_) return verify_len_;
  if (all_logits && n != verify_len_) return 1;  // the prefill graph returns its last row only
  return n;
}

}  // namespace aotgen::detail
