// The experts of a mixture-of-experts layer on CPU: out [T, d] = sum over each token's k routed
// experts e of w * down_e(act(gate_e(x), up_e(x))), each projection optionally biased (gpt-oss).
// Compiled into each graph's .so by AOTInductor as the C shim of `aotgen::moe_experts`
// (kernels/moe.py, whose eager reference defines it).
//
// Why: an exported graph has fixed shapes, so without a kernel it must either run every expert
// on every token (E / k times the work) or gather k weight matrices per token (one weight read
// per token and expert). Here the tokens are grouped by expert (a counting sort of the routing
// ids) and each routed expert runs once, as two matmuls over its tokens: its weights are read
// once per step. Experts run in parallel, one thread each.
//
// x [T, d] float32 or bfloat16 (the output's dtype); weights [T, k] float32 and ids [T, k] int64:
// each token's experts and their routing weights; gate_up [E, 2f, d] (the gate's rows, then the
// up projection's) and down [E, d, f], contiguous: float32, bfloat16, or int8 with float32 scales
// per row (`moe_experts_int8`); other than float32, each routed expert is converted per call
// into a float32 buffer, a block of rows at a time, and every product and sum is float32
// (bfloat16 activations with bfloat16 weights excepted: run_bf16). The matmuls go to ATen's
// CPU mm (MKL / oneDNN) through the C shim API; the grouping, SwiGLU and weighted sum are plain
// loops.
// Each token's output sums its experts in ascending order, as transformers does.
//
// Biases (optional, each on its own): gate_up_bias [E, 2f] (gate, then up) and down_bias [E, d],
// contiguous, float32 or bfloat16 whatever the weights are (int8 experts keep theirs float);
// each is added in float32 to its matmul's output (a bfloat16 matmul's rounded output). The
// activation act(g, u) is silu(g) * u with limit 0, else gpt-oss's clamped SwiGLU:
// (min(max(u, -limit), limit) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit). Without
// biases and with limit 0 every value is computed as before they existed.
//
// Panels (`moe_experts_panels`, CPU packages with packed linears): gate_up [E, 2f / 16, d, 16]
// and down [E, d / 16, f, 16], float32, bfloat16, or int8 with row scales, each expert's
// weights in packed.cpp's panels of 16 outputs; each routed expert's projections run
// packed.cpp's register tiles on them in float32, which read each weight vector once for all
// the expert's rows and widen int8 and bfloat16 weights in registers (no float32 copy).
//
// GGUF blocks (kernels/moe_gguf.py, `quantize: {gguf: keep}`): gate_up and down are the file's
// blocks in gguf_blocks.cpp's panels, stacked by expert ([E, panels, ...] codes, group and
// super-block scales); each routed expert's projections run gguf_blocks.cpp's kernel on its
// panels (`moe_experts_gguf`: gguf's dequantized weights bit for bit, float32 activations) or
// gguf_dot.cpp's (`moe_experts_gguf_dot`: llama.cpp's integer numerics).
// On panels (packed.cpp's or GGUF blocks) with fewer routed experts than threads (decode),
// the experts run one after another, each projection threaded over its panels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace aotgen_gguf {  // gguf_blocks.cpp, linked into the same .so
void linear_any(int qtype, const float* x, int64_t ldx, int64_t M, int64_t K,
                const uint8_t* codes, const uint16_t* groups, const uint16_t* supers, int64_t N,
                float* out, int rows, int panels);
}
namespace aotgen_packed {  // packed.cpp, likewise
void linear_any(int bits, const float* x, int64_t ldx, int64_t M, int64_t K, const void* w,
                const float* scale, int64_t N, float* out, int rows, int panels);
}
namespace aotgen_gguf_idot {  // gguf_dot.cpp, likewise
void dot_any(int qtype, const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes,
             const uint16_t* groups, const uint16_t* supers, int64_t N, float* out, int rows,
             int panels);
}

#pragma GCC push_options
#pragma GCC optimize("O3")

namespace aotgen_moe {

// A [rows, cols] view of `data` (float32 or bfloat16) with the given row and column strides.
static AOTITorchError view(void* data, int32_t dtype, int64_t rows, int64_t cols,
                           int64_t row_stride, int64_t col_stride, AtenTensorHandle* out) {
  const int64_t sizes[2] = {rows, cols}, strides[2] = {row_stride, col_stride};
  return aoti_torch_create_tensor_from_blob(data, 2, sizes, strides, 0, dtype,
                                            aoti_torch_device_type_cpu(), 0, out);
}

// out [n, m] = a [n, K] @ b^T, b's rows at `b` ([m, K] contiguous), all of `dtype`; out's rows
// `ldo` apart (m: contiguous).
static AOTITorchError matmul_t(void* a, int64_t n, int64_t K, void* b, int64_t m, void* out,
                               int32_t dtype, int64_t ldo) {
  AtenTensorHandle ha, hb, ho;
  AOTI_TORCH_ERROR_CODE_CHECK(view(a, dtype, n, K, K, 1, &ha));
  AOTI_TORCH_ERROR_CODE_CHECK(view(b, dtype, K, m, 1, K, &hb));
  AOTI_TORCH_ERROR_CODE_CHECK(view(out, dtype, n, m, ldo, 1, &ho));
  const AOTITorchError rc = aoti_torch_mm_out(ho, ha, hb);
  aoti_torch_delete_tensor_object(ha);
  aoti_torch_delete_tensor_object(hb);
  aoti_torch_delete_tensor_object(ho);
  return rc;
}

// How the weights are stored: rows [E, N, K] of float32, bfloat16 or int8, packed.cpp's
// panels of float32, bfloat16 or int8, or GGUF blocks.
enum class Kind { f32, bf16, i8, f32_panels, bf16_panels, i8_panels, gguf };

inline int panel_bits(Kind kind) {  // packed.cpp's weight bits; 0: not its panels
  if (kind == Kind::f32_panels) return 32;
  if (kind == Kind::bf16_panels) return 16;
  return kind == Kind::i8_panels ? 8 : 0;
}

inline bool on_panels(Kind kind) { return panel_bits(kind) || kind == Kind::gguf; }

// packed.cpp's tile for an expert's n rows: up to 8 rows by 3 panels with AVX-512's 16 lanes,
// 6 by 1 with AVX2's 8 (the widest tiles whose accumulators fit the registers); one or two
// rows stream as many panels as fit. On a Zen 3 (AVX2) within 15 % of the best tile at 16
// rows and at 4 int8 rows, 25 % behind it at 4 float32 rows (2 x 3 there; docs/moe.md).
#ifdef __AVX512F__
constexpr int kExpertRows = 8;
#else
constexpr int kExpertRows = 6;
#endif

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as PyTorch does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return 0x7fc0;  // NaN
  return uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// Rows [r0, r0 + count) of expert e's weights ([rows, cols]) as float32 in `dst`: bfloat16
// widened, or int8 codes times their row's scale.
static void convert_rows(const void* all, Kind kind, const float* scales, int64_t e,
                         int64_t rows, int64_t cols, int64_t r0, int64_t count,
                         float* __restrict dst) {
  const int64_t at = (e * rows + r0) * cols;
  if (kind == Kind::bf16) {
    const uint16_t* __restrict w = (const uint16_t*)all + at;
    for (int64_t i = 0; i < count * cols; i++) dst[i] = bf16_to_float(w[i]);
    return;
  }
  for (int64_t r = 0; r < count; r++) {  // restrict: an int8 store may alias anything
    const int8_t* __restrict q = (const int8_t*)all + at + r * cols;
    float* __restrict out = dst + r * cols;
    const float scale = scales[e * rows + r0 + r];
    for (int64_t c = 0; c < cols; c++) out[c] = float(q[c]) * scale;
  }
}

// One projection's GGUF blocks, every expert's panels `*_stride` elements after the last one's
// (gguf_blocks.cpp's layout; supers null for the legacy types); `integer`: gguf_dot.cpp's
// numerics.
struct Blocks {
  bool integer;
  int qtype;
  const uint8_t* codes;
  const uint16_t *groups, *supers;
  int64_t codes_stride, groups_stride, supers_stride;
};

// Weight rows converted per block: a block is multiplied while it is still in the core's L2,
// rather than the whole expert written out to memory and read back by the matmul. 256-512 KB
// measured alike; smaller blocks pay ATen's per-call cost (64 KB: slower than the whole).
constexpr int64_t kBlockBytes = 256 * 1024;

// out [n, rows] = a [n, cols] @ W_e^T in float32, expert e's weights W_e [rows, cols] read in
// place (float32) or converted a block of rows at a time into `buffer`.
static AOTITorchError project(const void* all, Kind kind, const float* scales,
                              const Blocks& blocks, int64_t e, int64_t rows, int64_t cols,
                              float* a, int64_t n, float* out, std::vector<float>& buffer) {
  const int32_t f32 = aoti_torch_dtype_float32();
  if (kind == Kind::gguf) {  // rows a multiple of 16 (the shim checks): no padding outputs
    const Blocks& b = blocks;
    // Up to 4 rows decode each weight unit in registers once for all of them; more run on
    // panels dequantized once per call (gguf_blocks.cpp `linear`).
    const auto run = b.integer ? aotgen_gguf_idot::dot_any : aotgen_gguf::linear_any;
    run(b.qtype, a, cols, n, cols, b.codes + e * b.codes_stride, b.groups + e * b.groups_stride,
        b.supers ? b.supers + e * b.supers_stride : nullptr, rows, out,
        (int)std::min<int64_t>(n, 4), 8);
    return AOTI_TORCH_SUCCESS;
  }
  if (kind == Kind::f32)
    return matmul_t(a, n, cols, (float*)all + e * rows * cols, rows, out, f32, rows);
  if (const int bits = panel_bits(kind)) {  // rows: whole panels
    const void* w = (const char*)all + e * rows * cols * (bits / 8);
    const float* scale = bits == 8 ? scales + e * rows : nullptr;
    aotgen_packed::linear_any(bits, a, cols, n, cols, w, scale, rows, out,
                              (int)std::min<int64_t>(n, kExpertRows), 8);
    return AOTI_TORCH_SUCCESS;
  }
  const int64_t block = std::max<int64_t>(1, kBlockBytes / (4 * cols));
  buffer.resize(std::min(block, rows) * cols);
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t count = std::min(block, rows - r0);
    convert_rows(all, kind, scales, e, rows, cols, r0, count, buffer.data());
    AOTI_TORCH_ERROR_CODE_CHECK(matmul_t(a, n, cols, buffer.data(), count, out + r0, f32, rows));
  }
  return AOTI_TORCH_SUCCESS;
}

// One bias tensor ([E, width] float32 or bfloat16), or none (data null).
struct Bias {
  const void* data;
  bool bf16;
  // v plus element i of the bias (v itself when there is none).
  float plus(float v, int64_t i) const {
    if (!data) return v;
    return v + (bf16 ? bf16_to_float(((const uint16_t*)data)[i]) : ((const float*)data)[i]);
  }
};

struct Expert {  // what every routed expert's run reads
  const void *x;
  bool x_bf16;
  const void *gate_up, *down;
  Kind kind;
  const float *gate_up_scale, *down_scale;
  Blocks gate_up_blocks, down_blocks;  // Kind::gguf
  Bias gate_up_bias, down_bias;
  float limit, alpha;  // the activation's
  int64_t k, d, f;
};

struct Scratch {  // one thread's buffers, reused across its experts
  std::vector<float> rows, hidden, act, weights;
  std::vector<uint16_t> rows16, hidden16, act16, y16;
};

inline float silu_mul(float g, float u) { return g / (1.f + std::exp(-g)) * u; }

// The activation of gate g and up u (kernels/moe.py, `swiglu`, in its order of operations).
inline float activate(float g, float u, float limit, float alpha) {
  if (limit <= 0.f) return silu_mul(g, u);
  g = std::min(g, limit);  // std::min / std::max keep a NaN g or u, as torch.clamp does
  u = std::min(std::max(u, -limit), limit);
  return (u + 1.f) * (g * (1.f / (1.f + std::exp(-(g * alpha)))));
}

// Expert e on its n rows (pairs: token * k + slot) in float32: out_rows [n, d].
static AOTITorchError run_f32(const Expert& job, int64_t e, const int64_t* pairs, int64_t n,
                              float* out_rows, Scratch& s) {
  const int64_t d = job.d, f = job.f;
  s.rows.resize(n * d);
  s.hidden.resize(n * 2 * f);
  s.act.resize(n * f);
  for (int64_t r = 0; r < n; r++) {
    const int64_t at = (pairs[r] / job.k) * d;
    float* dst = s.rows.data() + r * d;
    if (job.x_bf16) {
      for (int64_t j = 0; j < d; j++) dst[j] = bf16_to_float(((const uint16_t*)job.x)[at + j]);
    } else {
      std::copy((const float*)job.x + at, (const float*)job.x + at + d, dst);
    }
  }
  AOTI_TORCH_ERROR_CODE_CHECK(project(job.gate_up, job.kind, job.gate_up_scale,
                                      job.gate_up_blocks, e, 2 * f, d, s.rows.data(), n,
                                      s.hidden.data(), s.weights));
  const Bias& gb = job.gate_up_bias;
  for (int64_t r = 0; r < n; r++) {
    const float* g = s.hidden.data() + r * 2 * f;
    for (int64_t j = 0; j < f; j++) {
      const float gate = gb.plus(g[j], e * 2 * f + j), up = gb.plus(g[f + j], e * 2 * f + f + j);
      s.act[r * f + j] = activate(gate, up, job.limit, job.alpha);
    }
  }
  AOTI_TORCH_ERROR_CODE_CHECK(project(job.down, job.kind, job.down_scale, job.down_blocks, e,
                                      d, f, s.act.data(), n, out_rows, s.weights));
  if (job.down_bias.data)
    for (int64_t i = 0; i < n * d; i++)
      out_rows[i] = job.down_bias.plus(out_rows[i], e * d + i % d);
  return AOTI_TORCH_SUCCESS;
}

// The same in bfloat16 (activations and weights both): ATen's bfloat16 matmuls on the weights
// in place, the biases and SwiGLU in float32 rounded back, as an eager bfloat16 model computes
// it (within its roundings).
static AOTITorchError run_bf16(const Expert& job, int64_t e, const int64_t* pairs, int64_t n,
                               float* out_rows, Scratch& s) {
  const int64_t d = job.d, f = job.f;
  const int32_t bf16 = aoti_torch_dtype_bfloat16();
  s.rows16.resize(n * d);
  s.hidden16.resize(n * 2 * f);
  s.act16.resize(n * f);
  s.y16.resize(n * d);
  for (int64_t r = 0; r < n; r++) {
    const uint16_t* src = (const uint16_t*)job.x + (pairs[r] / job.k) * d;
    std::copy(src, src + d, s.rows16.data() + r * d);
  }
  uint16_t* w = (uint16_t*)job.gate_up + e * 2 * f * d;
  AOTI_TORCH_ERROR_CODE_CHECK(
      matmul_t(s.rows16.data(), n, d, w, 2 * f, s.hidden16.data(), bf16, 2 * f));
  const Bias& gb = job.gate_up_bias;
  for (int64_t r = 0; r < n; r++) {
    const uint16_t* g = s.hidden16.data() + r * 2 * f;
    for (int64_t j = 0; j < f; j++) {
      const float gate = gb.plus(bf16_to_float(g[j]), e * 2 * f + j);
      const float up = gb.plus(bf16_to_float(g[f + j]), e * 2 * f + f + j);
      s.act16[r * f + j] = float_to_bf16(activate(gate, up, job.limit, job.alpha));
    }
  }
  w = (uint16_t*)job.down + e * d * f;
  AOTI_TORCH_ERROR_CODE_CHECK(matmul_t(s.act16.data(), n, f, w, d, s.y16.data(), bf16, d));
  for (int64_t i = 0; i < n * d; i++)
    out_rows[i] = job.down_bias.plus(bf16_to_float(s.y16[i]), e * d + i % d);
  return AOTI_TORCH_SUCCESS;
}

// x and out are bfloat16 when x_bf16, else float32; the weighted sum is float32.
static AOTITorchError experts(const void* x, bool x_bf16, const float* weights,
                              const int64_t* ids, const void* gate_up, const void* down, Kind kind,
                              const float* gate_up_scale, const float* down_scale,
                              const Blocks& gate_up_blocks, const Blocks& down_blocks,
                              Bias gate_up_bias, Bias down_bias, float limit, float alpha,
                              void* out, int64_t T, int64_t k, int64_t E, int64_t d, int64_t f) {
  // Counting sort of the (token, slot) pairs by expert.
  std::vector<int64_t> start(E + 1, 0), order(T * k);
  for (int64_t i = 0; i < T * k; i++) {
    if (ids[i] < 0 || ids[i] >= E) return AOTI_TORCH_FAILURE;
    start[ids[i] + 1]++;
  }
  for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < T * k; i++) order[fill[ids[i]]++] = i;

  // The routed experts in parallel, one thread per expert (ATen's mm runs single-threaded
  // inside the region), each writing its rows' outputs to y in the sorted pairs' order.
  std::vector<int64_t> hit;
  for (int64_t e = 0; e < E; e++)
    if (start[e + 1] > start[e]) hit.push_back(e);
  std::vector<float> y(T * k * d);
  const Expert job{x, x_bf16, gate_up, down, kind, gate_up_scale, down_scale, gate_up_blocks,
                   down_blocks, gate_up_bias, down_bias, limit, alpha, k, d, f};
  AOTITorchError rc = AOTI_TORCH_SUCCESS;
  // The panel kernels thread over their panels: experts one after another when too few to
  // give every thread one (a region that is not parallel lets the kernel's own be).
#ifdef _OPENMP
  const bool by_expert = !on_panels(kind) || (int64_t)hit.size() >= omp_get_max_threads();
#else
  const bool by_expert = true;
#endif
#pragma omp parallel if (by_expert)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (size_t h = 0; h < hit.size(); h++) {
      const int64_t e = hit[h], n = start[e + 1] - start[e];
      const int64_t* pairs = order.data() + start[e];
      float* out_rows = y.data() + start[e] * d;
      const AOTITorchError got = x_bf16 && kind == Kind::bf16
                                     ? run_bf16(job, e, pairs, n, out_rows, scratch)
                                     : run_f32(job, e, pairs, n, out_rows, scratch);
      if (got != AOTI_TORCH_SUCCESS) rc = got;
    }
  }
  if (rc != AOTI_TORCH_SUCCESS) return rc;
  // The weighted sum, experts in ascending order as transformers adds them.
  std::vector<float> sums(x_bf16 ? T * d : 0);
  float* acc = x_bf16 ? sums.data() : (float*)out;
  for (int64_t i = 0; i < T * d; i++) acc[i] = 0.f;
  for (int64_t p = 0; p < T * k; p++) {
    const float w = weights[order[p]];
    float* dst = acc + (order[p] / k) * d;
    const float* src = y.data() + p * d;
    for (int64_t j = 0; j < d; j++) dst[j] += src[j] * w;
  }
  if (x_bf16)
    for (int64_t i = 0; i < T * d; i++) ((uint16_t*)out)[i] = float_to_bf16(acc[i]);
  return AOTI_TORCH_SUCCESS;
}

}  // namespace aotgen_moe

#pragma GCC pop_options

// Hidden: the shims stay inside the graph's .so (export/shims.py links them in).
#pragma GCC visibility push(hidden)
// An optional bias (AOTInductor passes a `Tensor?` as a pointer to its handle, null for None):
// [E, width], contiguous, float32 or bfloat16.
static AOTITorchError aotgen_moe_bias(AtenTensorHandle* handle, int64_t E, int64_t width,
                                      aotgen_moe::Bias* out) {
  *out = {nullptr, false};
  if (!handle || !*handle) return AOTI_TORCH_SUCCESS;
  int64_t dim, *sizes;
  int32_t dtype;
  bool contiguous = false;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(*handle, &dim));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(*handle, &sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(*handle, &dtype));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_is_contiguous(*handle, &contiguous));
  const int32_t f32 = aoti_torch_dtype_float32(), bf16 = aoti_torch_dtype_bfloat16();
  if (dim != 2 || sizes[0] != E || sizes[1] != width || !contiguous ||
      (dtype != f32 && dtype != bf16))
    return AOTI_TORCH_FAILURE;
  void* data;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(*handle, &data));
  *out = {data, dtype == bf16};
  return AOTI_TORCH_SUCCESS;
}

// x [T, d] float32 or bfloat16, weights [T, k] float32, ids [T, k] int64, gate_up [E, 2f, d],
// down [E, d, f]: float32, bfloat16, or int8 with float32 row scales gate_up_scale [E, 2f],
// down_scale [E, d] (else null); the optional biases and the activation's limit and alpha.
// `panels`: gate_up [E, 2f / 16, d, 16] and down [E, d / 16, f, 16], float32, bfloat16, or
// int8 with scales.
static AOTITorchError aotgen_moe_shim(bool panels, AtenTensorHandle x, AtenTensorHandle weights,
                                      AtenTensorHandle ids, AtenTensorHandle gate_up,
                                      AtenTensorHandle gate_up_scale, AtenTensorHandle down,
                                      AtenTensorHandle down_scale, AtenTensorHandle* gate_up_bias,
                                      AtenTensorHandle* down_bias, double limit, double alpha,
                                      AtenTensorHandle* ret0) {
  int64_t *x_sizes, *w_sizes, *gu_sizes, *down_sizes;
  void *x_data, *w_data, *id_data, *gu_data, *down_data, *out_data;
  void *gu_scale = nullptr, *down_scale_data = nullptr;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(x, &x_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(weights, &w_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(gate_up, &gu_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(down, &down_sizes));
  for (AtenTensorHandle t : {x, weights, ids, gate_up, down, gate_up_scale, down_scale}) {
    bool contiguous = false;
    if (!t) continue;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_is_contiguous(t, &contiguous));
    if (!contiguous) return AOTI_TORCH_FAILURE;
  }
  const int64_t T = x_sizes[0], d = x_sizes[1], k = w_sizes[1], E = gu_sizes[0];
  const int64_t f = down_sizes[2], p = panels ? 16 : 1;  // outputs a panel
  int64_t gu_dim, down_dim;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(gate_up, &gu_dim));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(down, &down_dim));
  if (gu_dim != 3 + panels || down_dim != 3 + panels || gu_sizes[1] * p != 2 * f ||
      gu_sizes[2] != d || down_sizes[0] != E || down_sizes[1] * p != d ||
      (panels && (gu_sizes[3] != 16 || down_sizes[3] != 16)))
    return AOTI_TORCH_FAILURE;
  aotgen_moe::Bias gu_bias, down_bias_of;
  AOTI_TORCH_ERROR_CODE_CHECK(aotgen_moe_bias(gate_up_bias, E, 2 * f, &gu_bias));
  AOTI_TORCH_ERROR_CODE_CHECK(aotgen_moe_bias(down_bias, E, d, &down_bias_of));
  int32_t x_dtype, w_dtype;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(x, &x_dtype));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(gate_up, &w_dtype));
  const int32_t f32 = aoti_torch_dtype_float32(), bf16 = aoti_torch_dtype_bfloat16();
  if (x_dtype != f32 && x_dtype != bf16) return AOTI_TORCH_FAILURE;
  using aotgen_moe::Kind;
  const Kind kind = gate_up_scale     ? (panels ? Kind::i8_panels : Kind::i8)
                    : w_dtype == bf16 ? (panels ? Kind::bf16_panels : Kind::bf16)
                                      : (panels ? Kind::f32_panels : Kind::f32);
  if (!gate_up_scale && w_dtype != f32 && w_dtype != bf16) return AOTI_TORCH_FAILURE;
  if (panels && gate_up_scale && w_dtype != aoti_torch_dtype_int8()) return AOTI_TORCH_FAILURE;
  const int64_t out_sizes[2] = {T, d}, out_strides[2] = {d, 1};
  AtenTensorHandle out;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(
      2, out_sizes, out_strides, x_dtype, aoti_torch_device_type_cpu(), 0, &out));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(x, &x_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(weights, &w_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(ids, &id_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(gate_up, &gu_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(down, &down_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(out, &out_data));
  if (gate_up_scale) {
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(gate_up_scale, &gu_scale));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(down_scale, &down_scale_data));
  }
  const AOTITorchError rc = aotgen_moe::experts(
      x_data, x_dtype == bf16, (const float*)w_data, (const int64_t*)id_data, gu_data, down_data,
      kind, (const float*)gu_scale, (const float*)down_scale_data, {}, {}, gu_bias, down_bias_of,
      float(limit), float(alpha), out_data, T, k, E, d, f);
  if (rc != AOTI_TORCH_SUCCESS) {
    aoti_torch_delete_tensor_object(out);
    return rc;
  }
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}

// The ops' schemas (kernels/moe.py) in order: `Tensor?` as AtenTensorHandle* and `float` as
// double, as AOTInductor's C++ wrapper passes them.
AOTITorchError aoti_torch_cpu_moe_experts(AtenTensorHandle x, AtenTensorHandle weights,
                                          AtenTensorHandle ids, AtenTensorHandle gate_up,
                                          AtenTensorHandle down, AtenTensorHandle* gate_up_bias,
                                          AtenTensorHandle* down_bias, double limit,
                                          double alpha, AtenTensorHandle* ret0) {
  return aotgen_moe_shim(false, x, weights, ids, gate_up, nullptr, down, nullptr, gate_up_bias,
                         down_bias, limit, alpha, ret0);
}

AOTITorchError aoti_torch_cpu_moe_experts_int8(AtenTensorHandle x, AtenTensorHandle weights,
                                               AtenTensorHandle ids, AtenTensorHandle gate_up,
                                               AtenTensorHandle gate_up_scale,
                                               AtenTensorHandle down, AtenTensorHandle down_scale,
                                               AtenTensorHandle* gate_up_bias,
                                               AtenTensorHandle* down_bias, double limit,
                                               double alpha, AtenTensorHandle* ret0) {
  return aotgen_moe_shim(false, x, weights, ids, gate_up, gate_up_scale, down, down_scale,
                         gate_up_bias, down_bias, limit, alpha, ret0);
}

AOTITorchError aoti_torch_cpu_moe_experts_panels(
    AtenTensorHandle x, AtenTensorHandle weights, AtenTensorHandle ids, AtenTensorHandle gate_up,
    AtenTensorHandle* gate_up_scale, AtenTensorHandle down, AtenTensorHandle* down_scale,
    AtenTensorHandle* gate_up_bias, AtenTensorHandle* down_bias, double limit, double alpha,
    AtenTensorHandle* ret0) {
  const bool scaled = gate_up_scale && *gate_up_scale;
  if (scaled != (down_scale && *down_scale)) return AOTI_TORCH_FAILURE;
  return aotgen_moe_shim(true, x, weights, ids, gate_up, scaled ? *gate_up_scale : nullptr, down,
                         scaled ? *down_scale : nullptr, gate_up_bias, down_bias, limit, alpha,
                         ret0);
}

// One projection's GGUF blocks (kernels/gguf_blocks.py `pack`, stacked by expert): codes
// [E, P, units, unit bytes] uint8, groups and optional supers [E, P, ...] float16, contiguous;
// `outputs` = 16 P.
static AOTITorchError aotgen_moe_blocks(AtenTensorHandle codes, AtenTensorHandle groups,
                                        AtenTensorHandle* supers, int64_t qtype, bool integer,
                                        int64_t E, aotgen_moe::Blocks* out, int64_t* outputs) {
  int64_t dim, *sizes;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(codes, &dim));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(codes, &sizes));
  if (dim != 4 || sizes[0] != E || E <= 0 || qtype < 0 || qtype > 7) return AOTI_TORCH_FAILURE;
  *outputs = sizes[1] * 16;
  const AtenTensorHandle parts[3] = {codes, groups, supers ? *supers : nullptr};
  void* data[3] = {nullptr, nullptr, nullptr};
  int64_t stride[3] = {0, 0, 0};
  for (int i = 0; i < 3; i++) {
    if (!parts[i]) continue;
    bool contiguous = false;
    int64_t numel;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_is_contiguous(parts[i], &contiguous));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_numel(parts[i], &numel));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(parts[i], &data[i]));
    if (!contiguous || numel % E) return AOTI_TORCH_FAILURE;
    stride[i] = numel / E;
  }
  *out = {integer, (int)qtype, (const uint8_t*)data[0], (const uint16_t*)data[1],
          (const uint16_t*)data[2], stride[0], stride[1], stride[2]};
  return AOTI_TORCH_SUCCESS;
}

// x [T, d] float32, weights [T, k] float32, ids [T, k] int64; gate_up's blocks (2f outputs of
// d inputs, the gate's then the up projection's) and down's (d outputs of f inputs), each a
// multiple of 16 outputs; the optional biases and the activation, as `moe_experts`.
static AOTITorchError aotgen_moe_gguf_shim(
    bool integer, AtenTensorHandle x, AtenTensorHandle weights, AtenTensorHandle ids,
    AtenTensorHandle gate_up_codes, AtenTensorHandle gate_up_groups,
    AtenTensorHandle* gate_up_supers, int64_t gate_up_qtype, AtenTensorHandle down_codes,
    AtenTensorHandle down_groups, AtenTensorHandle* down_supers, int64_t down_qtype,
    AtenTensorHandle* gate_up_bias, AtenTensorHandle* down_bias, double limit, double alpha,
    AtenTensorHandle* ret0) {
  int64_t *x_sizes, *w_sizes, *c_sizes;
  int32_t x_dtype;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(x, &x_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(weights, &w_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(gate_up_codes, &c_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(x, &x_dtype));
  for (AtenTensorHandle t : {x, weights, ids}) {
    bool contiguous = false;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_is_contiguous(t, &contiguous));
    if (!contiguous) return AOTI_TORCH_FAILURE;
  }
  const int64_t T = x_sizes[0], d = x_sizes[1], k = w_sizes[1], E = c_sizes[0];
  aotgen_moe::Blocks gu, down;
  int64_t gu_outputs, down_outputs;
  AOTI_TORCH_ERROR_CODE_CHECK(aotgen_moe_blocks(gate_up_codes, gate_up_groups, gate_up_supers,
                                                gate_up_qtype, integer, E, &gu, &gu_outputs));
  AOTI_TORCH_ERROR_CODE_CHECK(aotgen_moe_blocks(down_codes, down_groups, down_supers,
                                                down_qtype, integer, E, &down, &down_outputs));
  const int64_t f = gu_outputs / 2;
  if (x_dtype != aoti_torch_dtype_float32() || down_outputs != d)
    return AOTI_TORCH_FAILURE;
  aotgen_moe::Bias gu_bias, down_bias_of;
  AOTI_TORCH_ERROR_CODE_CHECK(aotgen_moe_bias(gate_up_bias, E, 2 * f, &gu_bias));
  AOTI_TORCH_ERROR_CODE_CHECK(aotgen_moe_bias(down_bias, E, d, &down_bias_of));
  const int64_t out_sizes[2] = {T, d}, out_strides[2] = {d, 1};
  AtenTensorHandle out;
  void *x_data, *w_data, *id_data, *out_data;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(
      2, out_sizes, out_strides, x_dtype, aoti_torch_device_type_cpu(), 0, &out));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(x, &x_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(weights, &w_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(ids, &id_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(out, &out_data));
  const AOTITorchError rc = aotgen_moe::experts(
      x_data, false, (const float*)w_data, (const int64_t*)id_data, nullptr, nullptr,
      aotgen_moe::Kind::gguf, nullptr, nullptr, gu, down, gu_bias, down_bias_of, float(limit),
      float(alpha), out_data, T, k, E, d, f);
  if (rc != AOTI_TORCH_SUCCESS) {
    aoti_torch_delete_tensor_object(out);
    return rc;
  }
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}

// The ops' schemas (kernels/moe_gguf.py), as above.
AOTITorchError aoti_torch_cpu_moe_experts_gguf(
    AtenTensorHandle x, AtenTensorHandle weights, AtenTensorHandle ids,
    AtenTensorHandle gate_up_codes, AtenTensorHandle gate_up_groups,
    AtenTensorHandle* gate_up_supers, int64_t gate_up_qtype, AtenTensorHandle down_codes,
    AtenTensorHandle down_groups, AtenTensorHandle* down_supers, int64_t down_qtype,
    AtenTensorHandle* gate_up_bias, AtenTensorHandle* down_bias, double limit, double alpha,
    AtenTensorHandle* ret0) {
  return aotgen_moe_gguf_shim(false, x, weights, ids, gate_up_codes, gate_up_groups,
                              gate_up_supers, gate_up_qtype, down_codes, down_groups,
                              down_supers, down_qtype, gate_up_bias, down_bias, limit, alpha,
                              ret0);
}

AOTITorchError aoti_torch_cpu_moe_experts_gguf_dot(
    AtenTensorHandle x, AtenTensorHandle weights, AtenTensorHandle ids,
    AtenTensorHandle gate_up_codes, AtenTensorHandle gate_up_groups,
    AtenTensorHandle* gate_up_supers, int64_t gate_up_qtype, AtenTensorHandle down_codes,
    AtenTensorHandle down_groups, AtenTensorHandle* down_supers, int64_t down_qtype,
    AtenTensorHandle* gate_up_bias, AtenTensorHandle* down_bias, double limit, double alpha,
    AtenTensorHandle* ret0) {
  return aotgen_moe_gguf_shim(true, x, weights, ids, gate_up_codes, gate_up_groups,
                              gate_up_supers, gate_up_qtype, down_codes, down_groups,
                              down_supers, down_qtype, gate_up_bias, down_bias, limit, alpha,
                              ret0);
}
#pragma GCC visibility pop
