// Register-tiled matmuls for linears with float32, bfloat16 or int8 (per output channel)
// weights and float32 activations: out [M, N] = x [M, K] @ W^T. Compiled into each graph's .so
// by AOTInductor as the C shims of `aotgen::packed_linear[_bf16|_int8]` (kernels/packed.py).
//
// Layout: the weight in panels of 16 output features, [N / 16][K][16]: input k of a panel's 16
// outputs is one 64-byte vector (int8: 16 bytes; bfloat16: 32 bytes, outputs in the order
// 0, 8, 1, 9, ..., 7, 15, so that one 256-bit load gives outputs 0-7 as its 32-bit lanes
// shifted left by 16 and outputs 8-15 as the lanes with their low halves cleared). A tile of
// RM activation rows x RN panels keeps RM * RN vector accumulators in registers; each step
// over k loads RN weight vectors once and multiplies them into every row (one broadcast per
// row), so a weight is read once per step whatever the number of rows, and no horizontal sums
// are needed at the end. One row (decode) is the same loop with RN independent accumulators
// streaming RN panels side by side.
//
// Vectors: GCC vector extensions, 16 lanes where the CPU has AVX-512, else 8 (AVX2: two per
// panel row; a 16-lane type on AVX2 is split by GCC through the stack, ~10x slower).
// Threads: each takes an equal share of the panels (the output features) and streams its own
// part of the weight; all read all of x.
#include <algorithm>
#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#pragma GCC push_options
// AOTInductor builds its wrapper (and this, export/shims.py) at -O1, and on AVX-512 CPUs with
// -ffp-contract=off (export/aoti.py), which would split every multiply-add in two.
#pragma GCC optimize("O3", "fp-contract=fast")

namespace aotgen_packed {

constexpr int64_t kPanel = 16;
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
constexpr int kVecs = kPanel / kLanes;  // vectors per panel row
typedef float vf __attribute__((vector_size(4 * kLanes)));
constexpr int64_t kPrefetchBytes = 1024;  // 512-2048 measured alike

typedef float vf_unaligned __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef int8_t vi8_unaligned __attribute__((vector_size(kLanes), aligned(1)));
typedef uint32_t vbf16_pairs __attribute__((vector_size(32), aligned(2)));  // a bf16 panel row
typedef float vf8 __attribute__((vector_size(32)));

// One bfloat16 panel row (16 weights, stored as outputs 0, 8, 1, 9, ...) as float32 vectors in
// output order: a bfloat16 is the top half of its float32.
__attribute__((always_inline)) inline void load_bf16(const uint16_t* w, vf out[kVecs]) {
  const vbf16_pairs pairs = *(const vbf16_pairs*)w;
  const vf8 lo = (vf8)(pairs << 16), hi = (vf8)(pairs & 0xffff0000u);
#ifdef __AVX512F__
  out[0] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  out[0] = lo;
  out[1] = hi;
#endif
}

template <typename W>
__attribute__((always_inline)) inline vf load(const W* w) {  // no memcpy: it may use the stack
  if constexpr (sizeof(W) == 4)
    return *(const vf_unaligned*)w;
  else
#if defined(__AVX512F__)  // GCC's __builtin_convertvector widens int8 lane by lane
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)w)));
#else
    return __builtin_convertvector(*(const vi8_unaligned*)w, vf);
#endif
}

// RM rows of x (stride ldx) x RN panels at w -> out (stride ldo), times scale[n] if given.
template <int RM, int RN, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t K, const float* scale,
                 float* out, int64_t ldo) {
  constexpr int V = RN * kVecs;
  vf acc[RM][V];
#pragma GCC unroll 64
  for (int m = 0; m < RM; m++)
#pragma GCC unroll 64
    for (int v = 0; v < V; v++) acc[m][v] = (vf){};
  // Prefetch each panel kPrefetchBytes ahead, once per cache line. Where the loop spends long
  // on each line (several rows; int8 or bfloat16 widened in registers) the hardware prefetcher
  // alone lets streams from memory stall: measured 10-15 % off a 7-row step, 25 % off a 1-row
  // int8 step, 3-5 % off a 1-row bfloat16 one.
  // One float32 row streams fast enough without (there it measured 1-2 % slower).
  constexpr bool kPrefetch = RM > 1 || sizeof(W) < 4;
  constexpr int64_t kLineK = 64 / (kPanel * sizeof(W));
  constexpr int64_t kAheadK = kPrefetchBytes / (kPanel * sizeof(W));
  for (int64_t k = 0; k < K; k++) {
    const W* wk = w + k * kPanel;
    if (kPrefetch && k % kLineK == 0)
#pragma GCC unroll 8
      for (int r = 0; r < RN; r++) __builtin_prefetch(wk + r * K * kPanel + kAheadK * kPanel, 0, 2);
    if constexpr (sizeof(W) == 2) {  // bfloat16: widened once per step, kept for every row
      vf wv[V];
#pragma GCC unroll 8
      for (int r = 0; r < RN; r++) load_bf16(wk + r * K * kPanel, wv + r * kVecs);
#pragma GCC unroll 64
      for (int m = 0; m < RM; m++) {
        const float xv = x[m * ldx + k];
#pragma GCC unroll 64
        for (int v = 0; v < V; v++) acc[m][v] += wv[v] * xv;
      }
    } else {
#pragma GCC unroll 64
      for (int m = 0; m < RM; m++) {
        const float xv = x[m * ldx + k];  // the weight vectors are reloaded per row from L1:
#pragma GCC unroll 64                     // registers hold the accumulators and one broadcast
        for (int v = 0; v < V; v++) acc[m][v] += load(wk + (v / kVecs) * K * kPanel + (v % kVecs) * kLanes) * xv;
      }
    }
  }
#pragma GCC unroll 64
  for (int m = 0; m < RM; m++)
#pragma GCC unroll 64
    for (int v = 0; v < V; v++) {
      vf r = acc[m][v];
      if (scale) r *= load(scale + v * kLanes);
      *(vf_unaligned*)(out + m * ldo + v * kLanes) = r;
    }
}

// Accumulator vectors a tile may hold: the register file (32 zmm / 16 ymm), less loads and
// broadcasts; the autotune measures which fitting tile is fastest.
constexpr int kMaxAcc = kLanes == 16 ? 28 : 14;

constexpr int max_panels(int rm) { return kMaxAcc / (rm * kVecs) > 0 ? kMaxAcc / (rm * kVecs) : 1; }

// The widest instantiated tile of at most `want` panels that fits `rm` rows.
inline int tile_panels(int want, int rm) {
  const int allowed[] = {8, 6, 4, 3, 2, 1};
  for (int a : allowed)
    if (a <= want && a <= max_panels(rm)) return a;
  return 1;
}

template <int RM, int RN, typename W>
inline void tile_if_fits(const float* x, int64_t ldx, const W* w, int64_t K, const float* scale,
                         float* out, int64_t ldo) {
  if constexpr (RN <= max_panels(RM)) tile<RM, RN>(x, ldx, w, K, scale, out, ldo);
}

template <int RM, typename W>
inline void tile_rows(int rn, const float* x, int64_t ldx, const W* w, int64_t K,
                      const float* scale, float* out, int64_t ldo) {
  switch (rn) {
    case 1: return tile_if_fits<RM, 1>(x, ldx, w, K, scale, out, ldo);
    case 2: return tile_if_fits<RM, 2>(x, ldx, w, K, scale, out, ldo);
    case 3: return tile_if_fits<RM, 3>(x, ldx, w, K, scale, out, ldo);
    case 4: return tile_if_fits<RM, 4>(x, ldx, w, K, scale, out, ldo);
    case 6: return tile_if_fits<RM, 6>(x, ldx, w, K, scale, out, ldo);
    default: return tile_if_fits<RM, 8>(x, ldx, w, K, scale, out, ldo);
  }
}

template <typename W>
inline void tile_any(int rm, int rn, const float* x, int64_t ldx, const W* w, int64_t K,
                     const float* scale, float* out, int64_t ldo) {
  switch (rm) {
    case 1: return tile_rows<1>(rn, x, ldx, w, K, scale, out, ldo);
    case 2: return tile_rows<2>(rn, x, ldx, w, K, scale, out, ldo);
    case 3: return tile_rows<3>(rn, x, ldx, w, K, scale, out, ldo);
    case 4: return tile_rows<4>(rn, x, ldx, w, K, scale, out, ldo);
    case 5: return tile_rows<5>(rn, x, ldx, w, K, scale, out, ldo);
    case 6: return tile_rows<6>(rn, x, ldx, w, K, scale, out, ldo);
    case 7: return tile_rows<7>(rn, x, ldx, w, K, scale, out, ldo);
    default: return tile_rows<8>(rn, x, ldx, w, K, scale, out, ldo);
  }
}

// out [M, N] (N a multiple of 16) = x [M, K] (row stride ldx) @ W^T, in tiles of up to
// `rows` x `panels` (from the build's autotune; narrowed to what fits the registers).
template <typename W>
inline void linear(const float* x, int64_t ldx, int64_t M, int64_t K, const W* w,
                   const float* scale, int64_t N, float* out, int rows, int panels) {
  rows = std::clamp(rows, 1, 8);
  panels = tile_panels(panels, rows);
  const int64_t total = N / kPanel;
#pragma omp parallel
  {
#ifdef _OPENMP
    const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t thread = 0, threads = 1;
#endif
    // Each thread streams an equal share of the panels. Whole groups of `panels` dealt out in
    // turn would leave one thread up to a group more: 36 panels in groups of 4 split 20 / 16.
    const int64_t end = total * (thread + 1) / threads;
    for (int64_t p = total * thread / threads; p < end;) {
      const int rn = tile_panels((int)std::min<int64_t>(panels, end - p), rows);
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int rm = (int)std::min<int64_t>(rows, M - m0);
        tile_any<W>(rm, rn, x + m0 * ldx, ldx, w + p * K * kPanel, K,
                    scale ? scale + p * kPanel : nullptr, out + m0 * N + p * kPanel, N);
      }
      p += rn;
    }
  }
}

// `linear` by the weight's bits: 32 float32, 16 bfloat16, 8 int8 with `scale`. Not inline:
// moe.cpp's experts on panels call it from their own object (in the same .so).
__attribute__((visibility("hidden"))) void linear_any(int bits, const float* x, int64_t ldx,
                                                      int64_t M, int64_t K, const void* w,
                                                      const float* scale, int64_t N, float* out,
                                                      int rows, int panels) {
  if (bits == 8)
    linear(x, ldx, M, K, (const int8_t*)w, scale, N, out, rows, panels);
  else if (bits == 16)
    linear(x, ldx, M, K, (const uint16_t*)w, nullptr, N, out, rows, panels);
  else
    linear(x, ldx, M, K, (const float*)w, nullptr, N, out, rows, panels);
}

}  // namespace aotgen_packed

#pragma GCC pop_options

#ifdef AOTGEN_PACKED_STANDALONE
// For tests and the build's autotune: the kernel without AOTInductor's tensor handles.
extern "C" void aotgen_packed_linear(int bits, const float* x, int64_t M, int64_t K,
                                     const void* weight, const float* scale, int64_t N,
                                     float* out, int rows, int panels) {
  aotgen_packed::linear_any(bits, x, K, M, K, weight, scale, N, out, rows, panels);
}
#else
// Hidden: the shims stay inside the graph's .so (export/shims.py links them in).
#pragma GCC visibility push(hidden)
// The C shims AOTInductor calls: x [M, K] float32 (rows may be strided), the packed weight
// [N / 16, K, 16] of `bits` (and int8 scales [N]) -> a new float32 [M, N].
static AOTITorchError aotgen_packed_shim(int bits, AtenTensorHandle x, AtenTensorHandle weight,
                                         AtenTensorHandle scale, int64_t rows, int64_t panels,
                                         AtenTensorHandle* ret0) {
  int64_t *x_sizes, *x_strides, *w_sizes;
  void *x_data, *w_data, *s_data = nullptr, *o_data;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(x, &x_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(x, &x_strides));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(weight, &w_sizes));
  if (x_strides[1] != 1) return AOTI_TORCH_FAILURE;
  const int64_t M = x_sizes[0], K = x_sizes[1], N = w_sizes[0] * aotgen_packed::kPanel;
  int64_t out_sizes[2] = {M, N}, out_strides[2] = {N, 1};
  AtenTensorHandle out;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(2, out_sizes, out_strides,
                                                       aoti_torch_dtype_float32(),
                                                       aoti_torch_device_type_cpu(), 0, &out));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(x, &x_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(weight, &w_data));
  if (scale) AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(scale, &s_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(out, &o_data));
  aotgen_packed::linear_any(bits, (const float*)x_data, x_strides[0], M, K, w_data,
                            (const float*)s_data, N, (float*)o_data, (int)rows, (int)panels);
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}

AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                            int64_t rows, int64_t panels,
                                            AtenTensorHandle* ret0) {
  return aotgen_packed_shim(32, x, weight, nullptr, rows, panels, ret0);
}

AOTITorchError aoti_torch_cpu_packed_linear_bf16(AtenTensorHandle x, AtenTensorHandle weight,
                                                 int64_t rows, int64_t panels,
                                                 AtenTensorHandle* ret0) {
  return aotgen_packed_shim(16, x, weight, nullptr, rows, panels, ret0);
}

AOTITorchError aoti_torch_cpu_packed_linear_int8(AtenTensorHandle x,
                                                 AtenTensorHandle weight,
                                                 AtenTensorHandle scale, int64_t rows,
                                                 int64_t panels, AtenTensorHandle* ret0) {
  return aotgen_packed_shim(8, x, weight, scale, rows, panels, ret0);
}
#pragma GCC visibility pop
#endif
