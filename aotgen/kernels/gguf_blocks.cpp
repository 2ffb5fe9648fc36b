// Linears on GGUF quantization blocks kept as the file had them, float32 activations:
// out [M, N] = x [M, K] @ W^T, W dequantized in registers to exactly the values
// `gguf.quants.dequantize` gives; and an embedding's rows read from them. Compiled into each
// graph's .so by AOTInductor as the C shims of `aotgen::gguf_linear` / `aotgen::gguf_linear_k`
// / `aotgen::gguf_rows` (kernels/gguf_blocks.py).
//
// Layout (kernels/gguf_blocks.py `pack`): panels of 16 output features, as kernels/packed.cpp.
// - codes: per panel, units of U inputs (U = 8 for 4-, 5- and 6-bit codes, 4 for 8-bit ones),
//   each unit 64 bytes: 32-bit lane j holds output j's codes for the unit, byte i the code of
//   input i (8-bit) or inputs i and i + 4 (low and high nibble). 5- and 6-bit codes follow
//   with their high bits: 16 bytes (byte j: bit t = bit 4 of input t's code) or 32 (uint16 j:
//   bits 2t, 2t + 1 = bits 4, 5 of input t's code).
// - group scales: float16 [K / G][NG][16] per panel: the group's scale (or, for k-quants, its
//   6/8-bit sub-scale) and, with NG = 2, its offset (k-quants: sub-minimum).
// - k-quants also carry super-block scales: float16 [K / 256][NS][16]: d and, with NS = 2,
//   -dmin.
// A group's weights are w = s * (code - zero) + o with s = d * sub-scale and o = -dmin * sub-min
// (k-quants) or s = d and o = m (legacy). Each product is exact in float32 (at most 23
// significant bits), so one fused multiply-add gives gguf's value bit for bit.
//
// Tile: rows x panels accumulators, as packed.cpp; each unit's codes are decoded once per
// tile and multiplied into every row. On AVX2 without AVX-512 the tile sums code x input per
// group and applies the group's scale and offset once (`group_tile`). Threads: OpenMP over
// groups of panels.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#pragma GCC push_options
// AOTInductor builds its wrapper (and this, export/shims.py) at -O1, and on AVX-512 CPUs with
// -ffp-contract=off (export/aoti.py), which would split every multiply-add in two.
#pragma GCC optimize("O3", "fp-contract=fast")

namespace aotgen_gguf {

constexpr int64_t kPanel = 16;
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
constexpr int kVecs = kPanel / kLanes;
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
typedef float vf_unaligned __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef int32_t vi_unaligned __attribute__((vector_size(4 * kLanes), aligned(1)));

// What a GGUF block type is to this kernel (kernels/gguf_blocks.py QTYPES, same order).
struct QType {
  int bits, group, zero, ng, ns;  // ns = 0: no super-blocks (legacy types)
};
constexpr QType kTypes[] = {
    {4, 32, 8, 1, 0},   // Q4_0
    {4, 32, 0, 2, 0},   // Q4_1
    {5, 32, 16, 1, 0},  // Q5_0
    {5, 32, 0, 2, 0},   // Q5_1
    {8, 32, 128, 1, 0}, // Q8_0 (codes stored as q + 128)
    {4, 32, 0, 2, 2},   // Q4_K
    {5, 32, 0, 2, 2},   // Q5_K
    {6, 16, 32, 1, 1},  // Q6_K
};
constexpr int kSuper = 256;

constexpr int unit_inputs(int bits) { return bits == 8 ? 4 : 8; }
constexpr int unit_bytes(int bits) { return 64 + (bits == 5 ? 16 : bits == 6 ? 32 : 0); }

__attribute__((always_inline)) inline vf halves(const uint16_t* h) {  // kLanes float16 -> float32
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h));
#elif defined(__AVX2__) && defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
#else
  vf r;
  for (int i = 0; i < kLanes; i++) {
    const uint32_t b = h[i], sign = (b & 0x8000u) << 16, e = (b >> 10) & 0x1f, m = b & 0x3ff;
    float v;
    if (e == 0)
      v = (float)m * (1.0f / 16777216.0f);  // subnormal: m * 2^-24
    else if (e == 31) {
      const uint32_t bits = 0x7f800000u | (m << 13);
      std::memcpy(&v, &bits, 4);
    } else {
      const uint32_t bits = ((e + 112) << 23) | (m << 13);
      std::memcpy(&v, &bits, 4);
    }
    uint32_t out;
    std::memcpy(&out, &v, 4);
    out |= sign;
    std::memcpy(&r[i], &out, 4);
  }
  return r;
#endif
}

// The high bits of a 5/6-bit unit, one 32-bit lane per output (vector v of the panel).
template <int BITS>
__attribute__((always_inline)) inline vi high_bits(const uint8_t* h, int v) {
#if defined(__AVX512F__)
  if constexpr (BITS == 5) return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)h));
  else return (vi)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)h));
#elif defined(__AVX2__)
  if constexpr (BITS == 5) return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(h + 8 * v)));
  else return (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(h + 16 * v)));
#else
  vi r;
  for (int i = 0; i < kLanes; i++)
    r[i] = BITS == 5 ? h[kLanes * v + i] : ((const uint16_t*)h)[kLanes * v + i];
  return r;
#endif
}

// Code of unit input t, from the unit's code lanes c and high-bit lanes h (t is a constant
// once the loops over it are unrolled).
// Unsigned shifts, so the mask after the top byte's or nibble's shift folds away.
template <int BITS>
__attribute__((always_inline)) inline vi code(vi lanes, vi high, int t) {
  const vu c = (vu)lanes, h = (vu)high;
  if constexpr (BITS == 8) return (vi)((c >> (8 * t)) & 0xff);
  vu q = (c >> (8 * (t % 4) + 4 * (t / 4))) & 0xf;
  if constexpr (BITS == 5) q |= t <= 4 ? (h << (4 - t)) & 0x10 : (h >> (t - 4)) & 0x10;
  if constexpr (BITS == 6) q |= t <= 2 ? (h << (4 - 2 * t)) & 0x30 : (h >> (2 * t - 4)) & 0x30;
  return (vi)q;
}

// Unit input t's codes minus `zero`, as float32. 4-bit codes without a zero to subtract on
// AVX-512: the shifted lanes index a table of 0..15 (`vpermps` reads the low 4 bits), one
// instruction where masking and converting take two.
template <int BITS, int ZERO>
__attribute__((always_inline)) inline vf code_float(vi lanes, vi high, int t) {
#if defined(__AVX512F__)
  if constexpr (BITS == 4 && ZERO == 0) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const vu shifted = (vu)lanes >> (8 * (t % 4) + 4 * (t / 4));
    return (vf)_mm512_permutexvar_ps((__m512i)shifted, table);
  }
#endif
  return __builtin_convertvector(code<BITS>(lanes, high, t) - ZERO, vf);
}

// Where one panel's data starts, and the scale / offset of a group.
template <int TYPE>
struct Panel {
  static constexpr QType Q = kTypes[TYPE];
  static constexpr int U = unit_inputs(Q.bits), UB = unit_bytes(Q.bits);
  const uint8_t* q = nullptr;
  const uint16_t *g = nullptr, *s = nullptr;

  Panel() = default;
  Panel(const uint8_t* codes, const uint16_t* groups, const uint16_t* supers, int64_t K, int64_t p)
      : q(codes + p * (K / U) * UB),
        g(groups + p * (K / Q.group) * Q.ng * kPanel),
        s(Q.ns ? supers + p * (K / kSuper) * Q.ns * kPanel : nullptr) {}

  __attribute__((always_inline)) inline void scale(int64_t gi, int v, vf& sc, vf& off) const {
    const uint16_t* gp = g + gi * Q.ng * kPanel + v * kLanes;
    sc = halves(gp);
    off = (vf){};
    if constexpr (Q.ns) {
      const uint16_t* sp = s + (gi * Q.group / kSuper) * Q.ns * kPanel + v * kLanes;
      sc *= halves(sp);  // d * sub-scale: exact
      if constexpr (Q.ng == 2) off = halves(sp + kPanel) * halves(gp + kPanel);  // -dmin * m
    } else if constexpr (Q.ng == 2) {
      off = halves(gp + kPanel);
    } else {
      off = sc * (float)-Q.zero;  // -8d, -16d, -128d: exact, and so is s * code + off
    }
  }

  // The zero the codes carry once the offset is applied: the legacy types' is in `off`; for
  // Q6_K, s * code could need 25 bits, so its zero is subtracted from the code first.
  static constexpr int kZero = Q.ns ? Q.zero : 0;
};

// RM rows of x (stride ldx) x RN panels: the codes decoded once per unit, multiplied into
// every row.
template <int TYPE, int RM, int RN>
inline void tile(const float* x, int64_t ldx, const Panel<TYPE>* panels, int64_t K, float* out,
                 int64_t ldo) {
  using P = Panel<TYPE>;
  constexpr QType Q = P::Q;
  constexpr int V = RN * kVecs, U = P::U;
  vf acc[RM][V];
#pragma GCC unroll 64
  for (int m = 0; m < RM; m++)
#pragma GCC unroll 64
    for (int v = 0; v < V; v++) acc[m][v] = (vf){};
  for (int64_t gi = 0; gi < K / Q.group; gi++) {
    vf sc[V], off[V];
#pragma GCC unroll 64
    for (int v = 0; v < V; v++) panels[v / kVecs].scale(gi, v % kVecs, sc[v], off[v]);
    for (int64_t u = gi * Q.group / U; u < (gi + 1) * Q.group / U; u++) {
      vi c[V], h[V];
#pragma GCC unroll 64
      for (int v = 0; v < V; v++) {
        const uint8_t* unit = panels[v / kVecs].q + u * P::UB;
        c[v] = *(const vi_unaligned*)(unit + (v % kVecs) * kLanes * 4);
        if constexpr (Q.bits == 5 || Q.bits == 6) h[v] = high_bits<Q.bits>(unit + 64, v % kVecs);
        else h[v] = (vi){};
      }
#pragma GCC unroll 8
      for (int t = 0; t < U; t++) {
        const int64_t k = u * U + t;
#pragma GCC unroll 64
        for (int v = 0; v < V; v++) {
          const vf w = sc[v] * code_float<Q.bits, P::kZero>(c[v], h[v], t) + off[v];
#pragma GCC unroll 64
          for (int m = 0; m < RM; m++) acc[m][v] += w * x[m * ldx + k];
        }
      }
    }
  }
#pragma GCC unroll 64
  for (int m = 0; m < RM; m++)
#pragma GCC unroll 64
    for (int v = 0; v < V; v++) *(vf_unaligned*)(out + m * ldo + v * kLanes) = acc[m][v];
}

#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kGroupSums = true;
constexpr int64_t kPrefetchBytes = 2048;  // 1024 gained less, 4096 the same

// A unit's codes as `group_tile` reads them, as floats kScale * q + kBias of the code q the
// group's scale and offset apply to. 4-bit codes without a zero (Q4_1, Q4_K) are split once per
// unit into bytes holding 8 q (low nibbles: inputs 0-3, high: 4-7), and for input t one byte
// shuffle puts byte t % 4 of each lane in bits 16-23 and an or adds 1.0's exponent: the float
// 1 + q / 16. Shifting and converting each code instead kept Zen 1's single 256-bit shift and
// conversion pipes busy two cycles per 8 weights, the one-row step's bottleneck. Other codes
// are converted, the legacy types' zero subtracted first (Q4_0's 8, Q8_0's 128: stored in their
// offset, it would cancel against zero * sum(x)).
template <int TYPE>
struct GroupCodes {
  static constexpr QType Q = kTypes[TYPE];
  static constexpr bool kBytes = Q.bits == 4 && Q.zero == 0;
  static constexpr float kScale = kBytes ? 1.0f / 16 : 1.0f;
  static constexpr float kBias = kBytes ? 1.0f : Q.ns ? 0.0f : -(float)Q.zero;
  vi lo, hi;

  GroupCodes() = default;
  __attribute__((always_inline)) inline GroupCodes(vi lanes, vi high) {
    if constexpr (kBytes) {  // 8 q as bytes, in bits 3-6 (bits 19-22 once shuffled)
      lo = (vi)(((vu)lanes << 3) & 0x78787878u);
      hi = (vi)(((vu)lanes >> 1) & 0x78787878u);
    } else {
      lo = lanes;
      hi = high;
    }
  }

  __attribute__((always_inline)) inline vf at(int t) const {
    if constexpr (kBytes) {
      const char b = (char)(t % 4), z = (char)0x80;  // z: a zero byte
      const __m256i pick = _mm256_setr_epi8(z, z, b, z, z, z, b + 4, z, z, z, b + 8, z, z, z,
                                            b + 12, z, z, z, b, z, z, z, b + 4, z, z, z, b + 8,
                                            z, z, z, b + 12, z);
      const vu bytes = (vu)_mm256_shuffle_epi8((__m256i)(t < 4 ? lo : hi), pick);
      return (vf)(bytes | 0x3f800000u);
    }
    return code_float<Q.bits, Q.zero>(lo, hi, t);
  }
};

// RM rows x RN panels. Per group, sum_k (s q_k + o) x_k = s sum_k q_k x_k + o sum_k x_k, with
// the rows' input sums per group given (xsum, stride gstride): after decoding, one
// multiply-add per weight and row where applying s and o to every weight took two. Each
// group's result is added into `out` (L1), so the registers hold only the group's sums, S-fold
// for fewer than 4 of them (their multiply-adds would otherwise wait on each other). More than
// 8 sums (5+ rows x a panel, or one row x 5+ panels) spilled to the stack: those tiles sum one
// vector of outputs at a time, reading x again from L1 (7 rows: 17 -> 22 GFLOP/s on one Zen 1
// core).
template <int TYPE, int RM, int RN>
inline void group_tile(const float* x, int64_t ldx, const float* xsum, int64_t gstride,
                       const Panel<TYPE>* panels, int64_t K, float* out, int64_t ldo) {
  using P = Panel<TYPE>;
  using C = GroupCodes<TYPE>;
  constexpr QType Q = P::Q;
  constexpr int V = RN * kVecs, U = P::U, G = Q.group;
  constexpr int VN = RM * V > 8 ? 1 : V;  // vectors summed together
  constexpr int S = RM * VN >= 4 ? 1 : 4 / (RM * VN);
#pragma GCC unroll 64
  for (int m = 0; m < RM; m++)
#pragma GCC unroll 64
    for (int v = 0; v < V; v++) *(vf_unaligned*)(out + m * ldo + v * kLanes) = (vf){};
  for (int64_t gi = 0; gi < K / G; gi++) {
    // Each panel's codes kPrefetchBytes ahead, a line at a time: the hardware prefetcher
    // alone left a one-row step 4-8 % slower (Q4_1; Q4_K, Q6_K 1-5 %) on a Zen 3; several rows
    // measured alike either way.
#pragma GCC unroll 8
    for (int r = 0; r < RN; r++)
#pragma GCC unroll 8
      for (int64_t b = 0; b < G / U * P::UB; b += 64)
        __builtin_prefetch(panels[r].q + gi * (G / U) * P::UB + kPrefetchBytes + b, 0, 2);
#pragma GCC unroll 1
    for (int v0 = 0; v0 < V; v0 += VN) {
      vf sum[RM][VN][S];
#pragma GCC unroll 64
      for (int m = 0; m < RM; m++)
#pragma GCC unroll 64
        for (int v = 0; v < VN; v++)
#pragma GCC unroll 4
          for (int s = 0; s < S; s++) sum[m][v][s] = (vf){};
#pragma GCC unroll 4
      for (int64_t u = gi * G / U; u < (gi + 1) * G / U; u++) {
        C codes[VN];
#pragma GCC unroll 64
        for (int v = 0; v < VN; v++) {
          const int pv = v0 + v;
          const uint8_t* unit = panels[pv / kVecs].q + u * P::UB;
          vi high = (vi){};
          if constexpr (Q.bits == 5 || Q.bits == 6) high = high_bits<Q.bits>(unit + 64, pv % kVecs);
          codes[v] = C(*(const vi_unaligned*)(unit + (pv % kVecs) * kLanes * 4), high);
        }
#pragma GCC unroll 8
        for (int t = 0; t < U; t++)
#pragma GCC unroll 64
          for (int v = 0; v < VN; v++) {
            const vf w = codes[v].at(t);
#pragma GCC unroll 64
            for (int m = 0; m < RM; m++) sum[m][v][t % S] += w * x[m * ldx + u * U + t];
          }
      }
#pragma GCC unroll 64
      for (int v = 0; v < VN; v++) {
        const int pv = v0 + v;
        vf sc, off;
        panels[pv / kVecs].scale(gi, pv % kVecs, sc, off);
        const vf code_scale = sc * (1.0f / C::kScale), x_scale = off - code_scale * C::kBias;
#pragma GCC unroll 64
        for (int m = 0; m < RM; m++) {
          vf s = sum[m][v][0];
#pragma GCC unroll 4
          for (int i = 1; i < S; i++) s += sum[m][v][i];
          *(vf_unaligned*)(out + m * ldo + pv * kLanes) += code_scale * s + x_scale * xsum[m * gstride + gi];
        }
      }
    }
  }
}
#else
constexpr bool kGroupSums = false;
#endif

// One panel's weights dequantized to float32 [K][16] (the prefill path: once per call, then
// every row tile reads them from cache).
template <int TYPE>
inline void dequantize(const Panel<TYPE>& panel, int64_t K, float* w) {
  using P = Panel<TYPE>;
  constexpr QType Q = P::Q;
  for (int64_t gi = 0; gi < K / Q.group; gi++) {
    vf sc[kVecs], off[kVecs];
    for (int v = 0; v < kVecs; v++) panel.scale(gi, v, sc[v], off[v]);
    for (int64_t u = gi * Q.group / P::U; u < (gi + 1) * Q.group / P::U; u++) {
      const uint8_t* unit = panel.q + u * P::UB;
#pragma GCC unroll 2
      for (int v = 0; v < kVecs; v++) {
        const vi c = *(const vi_unaligned*)(unit + v * kLanes * 4);
        vi h = (vi){};
        if constexpr (Q.bits == 5 || Q.bits == 6) h = high_bits<Q.bits>(unit + 64, v);
#pragma GCC unroll 8
        for (int t = 0; t < P::U; t++)
          *(vf_unaligned*)(w + (u * P::U + t) * kPanel + v * kLanes) =
              sc[v] * code_float<Q.bits, P::kZero>(c, h, t) + off[v];
      }
    }
  }
}

// RM rows x RN float32 panels [K][16] (stride K * 16), as kernels/packed.cpp's tile.
template <int RM, int RN>
inline void float_tile(const float* x, int64_t ldx, const float* w, int64_t K, float* out,
                       int64_t ldo) {
  constexpr int V = RN * kVecs;
  vf acc[RM][V];
#pragma GCC unroll 64
  for (int m = 0; m < RM; m++)
#pragma GCC unroll 64
    for (int v = 0; v < V; v++) acc[m][v] = (vf){};
  for (int64_t k = 0; k < K; k++) {
#pragma GCC unroll 64
    for (int m = 0; m < RM; m++) {
      const float xv = x[m * ldx + k];
#pragma GCC unroll 64
      for (int v = 0; v < V; v++)
        acc[m][v] += *(const vf_unaligned*)(w + (v / kVecs) * K * kPanel + k * kPanel +
                                            (v % kVecs) * kLanes) * xv;
    }
  }
#pragma GCC unroll 64
  for (int m = 0; m < RM; m++)
#pragma GCC unroll 64
    for (int v = 0; v < V; v++) *(vf_unaligned*)(out + m * ldo + v * kLanes) = acc[m][v];
}

constexpr int kMaxAcc = kLanes == 16 ? 24 : 12;  // the decode needs registers of its own
constexpr int max_panels(int rm) { return kMaxAcc / (rm * kVecs) > 0 ? kMaxAcc / (rm * kVecs) : 1; }

inline int tile_panels(int want, int rm) {
  const int allowed[] = {8, 6, 4, 3, 2, 1};
  for (int a : allowed)
    if (a <= want && a <= max_panels(rm)) return a;
  return 1;
}

// Calls F::template run<RM, RN>() for runtime rm in 1..8, rn in {1, 2, 3, 4, 6, 8} that fit.
template <typename F, int RM>
inline void dispatch_rn(int rn, F& f) {
  switch (rn) {
#define AOTGEN_RN(N) \
  case N:            \
    if constexpr (N <= max_panels(RM)) f.template run<RM, N>(); \
    return;
    AOTGEN_RN(1) AOTGEN_RN(2) AOTGEN_RN(3) AOTGEN_RN(4) AOTGEN_RN(6) AOTGEN_RN(8)
#undef AOTGEN_RN
  }
}

#if defined(__AVX2__)
constexpr bool kSimd = true;
#else
constexpr bool kSimd = false;  // portable: 1 x 1 tiles (wider ones spill, and take minutes to compile)
#endif

template <typename F>
inline void dispatch(int rm, int rn, F& f) {
  if constexpr (!kSimd) {
    f.template run<1, 1>();
    return;
  }
  switch (rm) {
    case 1: return dispatch_rn<F, 1>(rn, f);
    case 2: return dispatch_rn<F, 2>(rn, f);
    case 3: return dispatch_rn<F, 3>(rn, f);
    case 4: return dispatch_rn<F, 4>(rn, f);
    case 5: return dispatch_rn<F, 5>(rn, f);
    case 6: return dispatch_rn<F, 6>(rn, f);
    case 7: return dispatch_rn<F, 7>(rn, f);
    default: return dispatch_rn<F, 8>(rn, f);
  }
}

template <int TYPE>
struct QuantTile {
  const float* x;
  int64_t ldx;
  const float* xsum;  // kGroupSums: the rows' input sums per group
  int64_t gstride;
  const Panel<TYPE>* panels;
  int64_t K;
  float* out;
  int64_t ldo;
  template <int RM, int RN>
  void run() {
#if defined(__AVX2__) && !defined(__AVX512F__)
    group_tile<TYPE, RM, RN>(x, ldx, xsum, gstride, panels, K, out, ldo);
#else
    tile<TYPE, RM, RN>(x, ldx, panels, K, out, ldo);
#endif
  }
};

struct FloatTile {
  const float* x;
  int64_t ldx;
  const float* w;
  int64_t K;
  float* out;
  int64_t ldo;
  template <int RM, int RN>
  void run() { float_tile<RM, RN>(x, ldx, w, K, out, ldo); }
};

// out [M, N] (N a multiple of 16) = x [M, K] (row stride ldx) @ W^T in tiles of up to
// `rows` x `panels`. With more rows than one tile, each panel group is dequantized once into
// a per-thread buffer and the row tiles run on floats.
template <int TYPE>
inline void linear(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes,
                   const uint16_t* groups, const uint16_t* supers, int64_t N, float* out,
                   int rows, int panels) {
  rows = kSimd ? std::clamp(rows, 1, 8) : 1;
  panels = kSimd ? tile_panels(panels, rows) : 1;
  const int64_t total = N / kPanel, ngroups = (total + panels - 1) / panels;
  const bool buffered = M > rows;
  constexpr int64_t G = kTypes[TYPE].group;
  std::vector<float> xsum(kGroupSums && !buffered ? M * (K / G) : 0);
  for (int64_t i = 0; i < (int64_t)xsum.size(); i++) {
    const float* xg = x + (i / (K / G)) * ldx + (i % (K / G)) * G;
    float s = 0;
    for (int64_t k = 0; k < G; k++) s += xg[k];
    xsum[i] = s;
  }
#pragma omp parallel for schedule(static)
  for (int64_t gi = 0; gi < ngroups; gi++) {
    static thread_local float* buffer = nullptr;
    static thread_local int64_t buffer_floats = 0;
    const int64_t end = std::min(total, (gi + 1) * panels);
    for (int64_t p = gi * panels; p < end;) {
      const int rn = tile_panels((int)(end - p), rows);
      Panel<TYPE> ps[8];
      for (int r = 0; r < rn; r++) ps[r] = Panel<TYPE>(codes, groups, supers, K, p + r);
      if (buffered) {
        if (buffer_floats < rn * K * kPanel) {
          delete[] buffer;
          buffer_floats = rn * K * kPanel;
          buffer = new float[buffer_floats];
        }
        for (int r = 0; r < rn; r++) dequantize<TYPE>(ps[r], K, buffer + r * K * kPanel);
      }
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int rm = (int)std::min<int64_t>(rows, M - m0);
        float* o = out + m0 * N + p * kPanel;
        if (buffered) {
          FloatTile f{x + m0 * ldx, ldx, buffer, K, o, N};
          dispatch(rm, rn, f);
        } else {
          QuantTile<TYPE> f{x + m0 * ldx, ldx, xsum.data() + m0 * (K / G), K / G, ps, K, o, N};
          dispatch(rm, rn, f);
        }
      }
      p += rn;
    }
  }
}

// Not inline: moe.cpp's experts on GGUF blocks call it too (export/shims.py links this object
// beside moe.cpp's). Hidden: it stays inside the graph's .so.
__attribute__((visibility("hidden"))) void linear_any(int qtype, const float* x, int64_t ldx,
                                                      int64_t M, int64_t K, const uint8_t* codes,
                                                      const uint16_t* groups,
                                                      const uint16_t* supers, int64_t N,
                                                      float* out, int rows, int panels) {
  switch (qtype) {
#define AOTGEN_QTYPE(T) \
  case T: return linear<T>(x, ldx, M, K, codes, groups, supers, N, out, rows, panels);
    AOTGEN_QTYPE(0) AOTGEN_QTYPE(1) AOTGEN_QTYPE(2) AOTGEN_QTYPE(3)
    AOTGEN_QTYPE(4) AOTGEN_QTYPE(5) AOTGEN_QTYPE(6) AOTGEN_QTYPE(7)
#undef AOTGEN_QTYPE
  }
}

// out [L, K] = rows `ids` of W, dequantized: an embedding tied to a head on blocks reads its
// table from the head's panels (stored once). Each row's panel is dequantized whole and the
// row's lane copied out: 16 rows' work for one, small beside the step that follows.
template <int TYPE>
inline void rows(const int64_t* ids, int64_t L, int64_t K, const uint8_t* codes,
                 const uint16_t* groups, const uint16_t* supers, float* out) {
#pragma omp parallel for schedule(static) if (L > 1)
  for (int64_t i = 0; i < L; i++) {
    static thread_local std::vector<float> panel;
    panel.resize(K * kPanel);
    dequantize<TYPE>(Panel<TYPE>(codes, groups, supers, K, ids[i] / kPanel), K, panel.data());
    const int64_t lane = ids[i] % kPanel;
    for (int64_t k = 0; k < K; k++) out[i * K + k] = panel[k * kPanel + lane];
  }
}

inline void rows_any(int qtype, const int64_t* ids, int64_t L, int64_t K, const uint8_t* codes,
                     const uint16_t* groups, const uint16_t* supers, float* out) {
  switch (qtype) {
#define AOTGEN_QTYPE(T) \
  case T: return rows<T>(ids, L, K, codes, groups, supers, out);
    AOTGEN_QTYPE(0) AOTGEN_QTYPE(1) AOTGEN_QTYPE(2) AOTGEN_QTYPE(3)
    AOTGEN_QTYPE(4) AOTGEN_QTYPE(5) AOTGEN_QTYPE(6) AOTGEN_QTYPE(7)
#undef AOTGEN_QTYPE
  }
}

}  // namespace aotgen_gguf

#pragma GCC pop_options

#ifdef AOTGEN_GGUF_STANDALONE
// For tests and the build's autotune: the kernel without AOTInductor's tensor handles.
extern "C" void aotgen_gguf_linear(int qtype, const float* x, int64_t M, int64_t K,
                                   const uint8_t* codes, const uint16_t* groups,
                                   const uint16_t* supers, int64_t N, float* out, int rows,
                                   int panels) {
  aotgen_gguf::linear_any(qtype, x, K, M, K, codes, groups, supers, N, out, rows, panels);
}
#else
// Hidden: the shims stay inside the graph's .so (export/shims.py links them in).
#pragma GCC visibility push(hidden)
// The C shims AOTInductor calls: x [M, K] float32 (rows may be strided), the panels' codes
// [N / 16, ...] uint8, group scales (and k-quants' super-block scales) float16 -> a new
// float32 [M, N].
static AOTITorchError aotgen_gguf_output(int64_t M, int64_t N, AtenTensorHandle* out) {
  int64_t sizes[2] = {M, N}, strides[2] = {N, 1};
  return aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(),
                                  aoti_torch_device_type_cpu(), 0, out);
}

static AOTITorchError aotgen_gguf_shim(AtenTensorHandle x, AtenTensorHandle codes,
                                       AtenTensorHandle groups, AtenTensorHandle supers,
                                       int64_t qtype, int64_t rows, int64_t panels,
                                       AtenTensorHandle* ret0) {
  int64_t *x_sizes, *x_strides, *c_sizes;
  void *x_data, *c_data, *g_data, *s_data = nullptr, *o_data;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(x, &x_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(x, &x_strides));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(codes, &c_sizes));
  if (x_strides[1] != 1 || qtype < 0 || qtype > 7) return AOTI_TORCH_FAILURE;
  const int64_t M = x_sizes[0], K = x_sizes[1], N = c_sizes[0] * aotgen_gguf::kPanel;
  AtenTensorHandle out;
  AOTI_TORCH_ERROR_CODE_CHECK(aotgen_gguf_output(M, N, &out));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(x, &x_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(codes, &c_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(groups, &g_data));
  if (supers) AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(supers, &s_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(out, &o_data));
  aotgen_gguf::linear_any((int)qtype, (const float*)x_data, x_strides[0], M, K,
                          (const uint8_t*)c_data, (const uint16_t*)g_data,
                          (const uint16_t*)s_data, N, (float*)o_data, (int)rows, (int)panels);
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}

AOTITorchError aoti_torch_cpu_gguf_linear(AtenTensorHandle x, AtenTensorHandle codes,
                                          AtenTensorHandle groups, int64_t qtype,
                                          int64_t rows, int64_t panels,
                                          AtenTensorHandle* ret0) {
  return aotgen_gguf_shim(x, codes, groups, nullptr, qtype, rows, panels, ret0);
}

AOTITorchError aoti_torch_cpu_gguf_linear_k(AtenTensorHandle x, AtenTensorHandle codes,
                                            AtenTensorHandle groups,
                                            AtenTensorHandle supers, int64_t qtype,
                                            int64_t rows, int64_t panels,
                                            AtenTensorHandle* ret0) {
  return aotgen_gguf_shim(x, codes, groups, supers, qtype, rows, panels, ret0);
}

// ids int64 [L] (each below 16 P) -> a new float32 [L, K].
AOTITorchError aoti_torch_cpu_gguf_rows(AtenTensorHandle ids, AtenTensorHandle codes,
                                        AtenTensorHandle groups, AtenTensorHandle* supers,
                                        int64_t qtype, AtenTensorHandle* ret0) {
  int64_t *i_sizes, *i_strides, *c_sizes;
  int32_t i_dtype;
  void *i_data, *c_data, *g_data, *s_data = nullptr, *o_data;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(ids, &i_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(ids, &i_strides));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(ids, &i_dtype));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(codes, &c_sizes));
  if (qtype < 0 || qtype > 7 || i_dtype != aoti_torch_dtype_int64() || i_strides[0] != 1)
    return AOTI_TORCH_FAILURE;
  const int64_t L = i_sizes[0], N = c_sizes[0] * aotgen_gguf::kPanel;
  const int64_t K = c_sizes[1] * aotgen_gguf::unit_inputs(aotgen_gguf::kTypes[qtype].bits);
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(ids, &i_data));
  const int64_t* id = (const int64_t*)i_data;
  for (int64_t i = 0; i < L; i++)
    if (id[i] < 0 || id[i] >= N) return AOTI_TORCH_FAILURE;
  AtenTensorHandle out;
  AOTI_TORCH_ERROR_CODE_CHECK(aotgen_gguf_output(L, K, &out));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(codes, &c_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(groups, &g_data));
  if (supers && *supers) AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(*supers, &s_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(out, &o_data));
  aotgen_gguf::rows_any((int)qtype, id, L, K, (const uint8_t*)c_data, (const uint16_t*)g_data,
                        (const uint16_t*)s_data, (float*)o_data);
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}
#pragma GCC visibility pop
#endif
