// Linears on GGUF blocks with integer dot products, as llama.cpp computes them on CPU: each
// activation row is quantized to int8 per block of 32 inputs, and every weight group's dot
// product is an integer one. Same packed tensors as kernels/gguf_blocks.cpp (layout in its
// header); compiled into each graph's .so by AOTInductor as the C shims of `aotgen::gguf_dot` /
// `aotgen::gguf_dot_k` (kernels/gguf_dot.py, whose `reference_dot` defines the numerics).
//
// Numerics: dx[b] = max|x| / 127 per block b of 32 inputs, xq = round-half-even(x * (1 / dx)).
// Per weight group g (16 or 32 inputs inside one block b), with s, o its scale and offset
// (gguf_blocks.cpp `Panel::scale`) and the stored unsigned codes:
//   J = sum xq * code - zero * sum xq   (int32, exact)
//   out += (s * dx[b]) * J + o * (dx[b] * sum xq)
// which is dx[b] * (s * I + (o - s * zero) * Xq) of the reference up to float rounding.
//
// A 64-byte unit of codes is VNNI's layout: 32-bit lane j = output j, 4 byte-codes of 4
// consecutive inputs (4-bit units: low nibbles inputs 0..3, high nibbles 4..7; 5/6-bit high
// bits OR-ed in at bits 4/5, with AVX-512 VBMI by one multishift per 4 inputs, else by byte
// tests). So each unit is one `dpbusd` per 4 inputs against the row's 4 int8 activations
// broadcast to every lane. Without VNNI, `maddubs` + `madd` (AVX2 and AVX-512BW); maddubs
// saturates int16, so Q8_0 there takes llama.cpp's sign trick on the signed codes
// (code - 128). Portable: the same products in 16-byte generic vectors and 1 x 1 tiles (wider
// ones spill, and take minutes to compile).
//
// Tile: rows x panels; a group's integer sums in registers, then one float update per group.
// Activations are quantized once per call, then OpenMP over groups of panels.
#include <algorithm>
#include <cmath>
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

namespace aotgen_gguf_idot {

constexpr int64_t kPanel = 16, kBlock = 32, kSuper = 256;
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define AOTGEN_GGUF_DOT_512 1
constexpr int kLanes = 16;
typedef __m512i simd;
#elif defined(__AVX2__)
#define AOTGEN_GGUF_DOT_256 1
constexpr int kLanes = 8;
typedef __m256i simd;
#else
constexpr int kLanes = 4;  // 16-byte vectors: what every target has
#endif
#if (defined(AOTGEN_GGUF_DOT_512) && defined(__AVX512VNNI__)) || \
    (defined(AOTGEN_GGUF_DOT_256) && defined(__AVXVNNI__))
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif
#if defined(AOTGEN_GGUF_DOT_512) || defined(AOTGEN_GGUF_DOT_256)
constexpr bool kSimd = true;
#else
constexpr bool kSimd = false;
#endif
constexpr bool kSaturates = kSimd && !kVnni;  // maddubs: int16 pair sums
constexpr int kVecs = kPanel / kLanes;
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef float vf_unaligned __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef int32_t vi_unaligned __attribute__((vector_size(4 * kLanes), aligned(1)));
#define AOTGEN_DOT_INLINE __attribute__((always_inline)) inline

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

constexpr int unit_inputs(int bits) { return bits == 8 ? 4 : 8; }
constexpr int unit_bytes(int bits) { return 64 + (bits == 5 ? 16 : bits == 6 ? 32 : 0); }

AOTGEN_DOT_INLINE vf halves(const uint16_t* h) {  // kLanes float16 -> float32
#if defined(AOTGEN_GGUF_DOT_512)
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

// Where one panel's data starts, and a group's scale / offset (gguf_blocks.cpp's Panel).
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

  AOTGEN_DOT_INLINE void scale(int64_t gi, int v, vf& sc, vf& off) const {
    const uint16_t* gp = g + gi * Q.ng * kPanel + v * kLanes;
    sc = halves(gp);
    off = (vf){};
    if constexpr (Q.ns) {
      const uint16_t* sp = s + (gi * Q.group / kSuper) * Q.ns * kPanel + v * kLanes;
      sc *= halves(sp);  // d * sub-scale: exact
      if constexpr (Q.ng == 2) off = halves(sp + kPanel) * halves(gp + kPanel);  // -dmin * m
    } else if constexpr (Q.ng == 2) {
      off = halves(gp + kPanel);
    }
  }
};

// ---- byte dot products ------------------------------------------------------------------------
AOTGEN_DOT_INLINE vi broadcast4(const int8_t* p) {  // 4 activation bytes into every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return (vi){} + v;
}

// acc + per lane the sum of the 4 products unsigned byte of a x signed byte of b (a <= 127
// where maddubs is used).
AOTGEN_DOT_INLINE vi dot4(vi acc, vi a, vi b) {
#if defined(AOTGEN_GGUF_DOT_512) && defined(__AVX512VNNI__)
  return (vi)_mm512_dpbusd_epi32((simd)acc, (simd)a, (simd)b);
#elif defined(AOTGEN_GGUF_DOT_512)
  const simd pairs = _mm512_maddubs_epi16((simd)a, (simd)b);
  return acc + (vi)_mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
#elif defined(AOTGEN_GGUF_DOT_256) && defined(__AVXVNNI__)
  return (vi)_mm256_dpbusd_avx_epi32((simd)acc, (simd)a, (simd)b);
#elif defined(AOTGEN_GGUF_DOT_256)
  const simd pairs = _mm256_maddubs_epi16((simd)a, (simd)b);
  return acc + (vi)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++)  // byte i of each lane: unsigned in a, sign-extended in b
    acc += ((a >> (8 * i)) & 0xff) * ((b << (24 - 8 * i)) >> 24);
  return acc;
#endif
}

// acc + sum q * b for signed bytes q in -128..127 (Q8_0's code - 128) where maddubs would
// saturate on unsigned codes: |q| (at most 128) against b with q's sign (llama.cpp's trick).
AOTGEN_DOT_INLINE vi dot4_signed(vi acc, vi q, vi b) {
#if defined(AOTGEN_GGUF_DOT_512)
  const simd neg = _mm512_mask_sub_epi8((simd)b, _mm512_movepi8_mask((simd)q),
                                        _mm512_setzero_si512(), (simd)b);
  return dot4(acc, (vi)_mm512_abs_epi8((simd)q), (vi)neg);
#elif defined(AOTGEN_GGUF_DOT_256)
  return dot4(acc, (vi)_mm256_sign_epi8((simd)q, (simd)q), (vi)_mm256_sign_epi8((simd)b, (simd)q));
#else
  return dot4(acc, q, b);  // unused: the portable dot4 does not saturate
#endif
}

// OR a 5/6-bit unit's high bits into its low (inputs 0..3) and high (4..7) byte-codes; `h`
// points at the unit's high bits, v is the vector of the panel.
template <int BITS>
AOTGEN_DOT_INLINE void merge_high(const uint8_t* h, int v, vi& lo, vi& hi) {
#if defined(AOTGEN_GGUF_DOT_512) && defined(__AVX512VBMI__)
  // Each lane's high bits zero-extended to 32 bits; multishift moves input t's bits of a lane
  // to bit 4 of its byte t (8 bits from any offset of the lane pair's qword), and a ternary
  // logic op ORs them in: lo | (shifted & mask).
  const simd h32 = BITS == 5 ? _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)h))
                             : _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)h));
  const simd mask = _mm512_set1_epi8(BITS == 5 ? 0x10 : 0x30);
  // offsets (mod 64) per destination byte of a qword: lane 2q (bytes 0..3), 2q + 1 (4..7)
  const simd at_lo = _mm512_set1_epi64(BITS == 5 ? 0x1f1e1d1c3f3e3d3cll : 0x22201e1c02003e3cll);
  const simd at_hi = _mm512_set1_epi64(BITS == 5 ? 0x2322212003020100ll : 0x2a2826240a080604ll);
  lo = (vi)_mm512_ternarylogic_epi32((simd)lo, _mm512_multishift_epi64_epi8(at_lo, h32), mask, 0xf8);
  hi = (vi)_mm512_ternarylogic_epi32((simd)hi, _mm512_multishift_epi64_epi8(at_hi, h32), mask, 0xf8);
#elif defined(AOTGEN_GGUF_DOT_512)
  // Each lane's high-bit byte(s) copied to its 4 bytes, then bit tests pick the bytes to OR.
  const simd lane = _mm512_setr_epi32(0, 0x01010101, 0x02020202, 0x03030303, 0x04040404,
                                      0x05050505, 0x06060606, 0x07070707, 0x08080808,
                                      0x09090909, 0x0a0a0a0a, 0x0b0b0b0b, 0x0c0c0c0c,
                                      0x0d0d0d0d, 0x0e0e0e0e, 0x0f0f0f0f);
  const simd b4 = _mm512_set1_epi8(0x10), b5 = _mm512_set1_epi8(0x20);
  if constexpr (BITS == 5) {  // byte j: bit t = input t's bit 4
    const simd rep = _mm512_shuffle_epi8(
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)h)), lane);
    lo = (vi)_mm512_mask_add_epi8((simd)lo, _mm512_test_epi8_mask(rep, _mm512_set1_epi32(0x08040201)),
                                  (simd)lo, b4);
    hi = (vi)_mm512_mask_add_epi8((simd)hi, _mm512_test_epi8_mask(rep, _mm512_set1_epi32(0x80402010)),
                                  (simd)hi, b4);
  } else {  // uint16 j: bits 2t, 2t + 1 = input t's bits 4, 5
    const simd h2 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)h));
    const simd both = _mm512_shuffle_i64x2(h2, h2, 0x50);  // 128-bit chunks 0, 0, 1, 1
    const simd idx = _mm512_and_si512(_mm512_add_epi8(lane, lane), _mm512_set1_epi8(0x0f));
    const simd a = _mm512_set1_epi32(0x40100401), b = _mm512_set1_epi32(0x80200802);
    const simd rl = _mm512_shuffle_epi8(both, idx);
    const simd rh = _mm512_shuffle_epi8(both, _mm512_add_epi8(idx, _mm512_set1_epi8(1)));
    simd l = _mm512_mask_add_epi8((simd)lo, _mm512_test_epi8_mask(rl, a), (simd)lo, b4);
    simd u = _mm512_mask_add_epi8((simd)hi, _mm512_test_epi8_mask(rh, a), (simd)hi, b4);
    lo = (vi)_mm512_mask_add_epi8(l, _mm512_test_epi8_mask(rl, b), l, b5);
    hi = (vi)_mm512_mask_add_epi8(u, _mm512_test_epi8_mask(rh, b), u, b5);
  }
#elif defined(AOTGEN_GGUF_DOT_256)
  const simd lane = _mm256_setr_epi32(0, 0x01010101, 0x02020202, 0x03030303, 0x04040404,
                                      0x05050505, 0x06060606, 0x07070707);
  const auto set = [](simd rep, simd bits, simd value) {  // value where rep has bits
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, bits), bits), value);
  };
  const simd b4 = _mm256_set1_epi8(0x10), b5 = _mm256_set1_epi8(0x20);
  if constexpr (BITS == 5) {
    const simd rep = _mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_loadl_epi64((const __m128i*)(h + 8 * v))), lane);
    lo = (vi)_mm256_or_si256((simd)lo, set(rep, _mm256_set1_epi32(0x08040201), b4));
    hi = (vi)_mm256_or_si256((simd)hi, set(rep, _mm256_set1_epi32(0x80402010), b4));
  } else {
    const simd both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(h + 16 * v)));
    const simd idx = _mm256_add_epi8(lane, lane);
    const simd a = _mm256_set1_epi32(0x40100401), b = _mm256_set1_epi32(0x80200802);
    const simd rl = _mm256_shuffle_epi8(both, idx);
    const simd rh = _mm256_shuffle_epi8(both, _mm256_add_epi8(idx, _mm256_set1_epi8(1)));
    lo = (vi)_mm256_or_si256(_mm256_or_si256((simd)lo, set(rl, a, b4)), set(rl, b, b5));
    hi = (vi)_mm256_or_si256(_mm256_or_si256((simd)hi, set(rh, a, b4)), set(rh, b, b5));
  }
#else
  vi r;
  for (int i = 0; i < kLanes; i++)
    r[i] = BITS == 5 ? h[kLanes * v + i] : ((const uint16_t*)h)[kLanes * v + i];
  constexpr int W = BITS - 4, mask = (1 << W) - 1;
  const vi top = r >> (4 * W);
#pragma GCC unroll 4
  for (int t = 0; t < 4; t++) {  // input t's high bits (at W t) to bit 4 of byte t
    lo |= ((r >> (W * t)) & mask) << (8 * t + 4);
    hi |= ((top >> (W * t)) & mask) << (8 * t + 4);
  }
#endif
}

// ---- activations ------------------------------------------------------------------------------
// One block of 32 inputs -> 32 int8 codes in q, the sums of each half in sums; returns dx.
AOTGEN_DOT_INLINE float quantize_block(const float* v, int8_t* q, int32_t* sums) {
#if defined(AOTGEN_GGUF_DOT_512)
  const __m512 f0 = _mm512_loadu_ps(v), f1 = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(f0), _mm512_abs_ps(f1)));
  const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  // cvtps rounds to nearest even (the default MXCSR mode), like torch.round
  const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(f0, _mm512_set1_ps(id)));
  const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(f1, _mm512_set1_ps(id)));
  _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(c0));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(c1));
  sums[0] = _mm512_reduce_add_epi32(c0);
  sums[1] = _mm512_reduce_add_epi32(c1);
  return d;
#elif defined(AOTGEN_GGUF_DOT_256)
  __m256 f[4], amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; i++) {
    f[i] = _mm256_loadu_ps(v + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, f[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  __m256i c[4];
  for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], _mm256_set1_ps(id)));
  // packs work per 128-bit lane: undo their interleaving of the 4 vectors
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                            _mm256_packs_epi32(c[2], c[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(packed, order));
  for (int half = 0; half < 2; half++) {
    const __m256i s = _mm256_add_epi32(c[2 * half], c[2 * half + 1]);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    sums[half] = _mm_cvtsi128_si32(t);
  }
  return d;
#else
  float amax = 0.f;
  for (int j = 0; j < kBlock; j++) amax = std::fmax(amax, std::fabs(v[j]));
  const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  sums[0] = sums[1] = 0;
  for (int j = 0; j < kBlock; j++) {
    q[j] = (int8_t)std::nearbyint(v[j] * id);  // to nearest even, like torch.round
    sums[j / 16] += q[j];
  }
  return d;
#endif
}

// The quantized activations: row m's codes at xq + m K, its block scales dx [K / 32], and per
// weight group (G inputs) the code sums xs and dxs = dx * xs.
struct Act {
  const int8_t* xq;
  const float *dx, *dxs;
  const int32_t* xs;
  int64_t K, G;
  Act at(int64_t m) const { return {xq + m * K, dx + m * (K / kBlock), dxs + m * G, xs + m * G, K, G}; }
};

struct ActBuffers {
  std::vector<int8_t> xq;
  std::vector<float> dx, dxs;
  std::vector<int32_t> xs;
};

inline Act quantize(const float* x, int64_t ldx, int64_t M, int64_t K, int group) {
  static thread_local ActBuffers buf;
  const int64_t nb = K / kBlock, G = K / group;
  buf.xq.resize(M * K);
  buf.dx.resize(M * nb);
  buf.dxs.resize(M * G);
  buf.xs.resize(M * G);
  for (int64_t m = 0; m < M; m++)
    for (int64_t b = 0; b < nb; b++) {
      int32_t sums[2];
      const float d = quantize_block(x + m * ldx + b * kBlock, buf.xq.data() + m * K + b * kBlock, sums);
      buf.dx[m * nb + b] = d;
      if (group == kBlock) {
        buf.xs[m * G + b] = sums[0] + sums[1];
        buf.dxs[m * G + b] = d * (float)(sums[0] + sums[1]);
      } else {
        for (int h = 0; h < 2; h++) {
          buf.xs[m * G + 2 * b + h] = sums[h];
          buf.dxs[m * G + 2 * b + h] = d * (float)sums[h];
        }
      }
    }
  return {buf.xq.data(), buf.dx.data(), buf.dxs.data(), buf.xs.data(), K, G};
}

// ---- the tile ---------------------------------------------------------------------------------
// RM rows x RN panels: per group, integer sums over its units (the codes decoded once per
// tile, multiplied into every row), then one float update.
template <int TYPE, int RM, int RN>
inline void tile(const Act& a, const Panel<TYPE>* panels, float* out, int64_t ldo) {
  using P = Panel<TYPE>;
  constexpr QType Q = P::Q;
  constexpr int V = RN * kVecs, U = P::U, UG = Q.group / U;
  constexpr bool sign_trick = Q.bits == 8 && kSaturates;  // J directly, from code - 128
  const int64_t K = a.K, nb = K / kBlock;
  vf acc[RM][V];
#pragma GCC unroll 64
  for (int m = 0; m < RM; m++)
#pragma GCC unroll 64
    for (int v = 0; v < V; v++) acc[m][v] = (vf){};
  for (int64_t gi = 0; gi < a.G; gi++) {
    vi dot[RM][V];
#pragma GCC unroll 64
    for (int m = 0; m < RM; m++) {
      const vi init = (vi){} + (sign_trick ? 0 : -Q.zero * a.xs[m * a.G + gi]);
#pragma GCC unroll 64
      for (int v = 0; v < V; v++) dot[m][v] = init;
    }
#pragma GCC unroll 8
    for (int64_t u = gi * UG; u < (gi + 1) * UG; u++) {
      vi x0[RM], x1[RM];
#pragma GCC unroll 64
      for (int m = 0; m < RM; m++) {
        x0[m] = broadcast4(a.xq + m * K + u * U);
        x1[m] = U == 8 ? broadcast4(a.xq + m * K + u * U + 4) : x0[m];
      }
#pragma GCC unroll 64
      for (int v = 0; v < V; v++) {
        const uint8_t* unit = panels[v / kVecs].q + u * P::UB;
        const vi c = *(const vi_unaligned*)(unit + (v % kVecs) * kLanes * 4);
        if constexpr (Q.bits == 8) {
          const vi q = c ^ (int32_t)0x80808080u;
#pragma GCC unroll 64
          for (int m = 0; m < RM; m++)
            dot[m][v] = sign_trick ? dot4_signed(dot[m][v], q, x0[m]) : dot4(dot[m][v], c, x0[m]);
        } else {
          vi lo = c & 0x0f0f0f0f, hi = (c >> 4) & 0x0f0f0f0f;
          if constexpr (Q.bits > 4) merge_high<Q.bits>(unit + 64, v % kVecs, lo, hi);
#pragma GCC unroll 64
          for (int m = 0; m < RM; m++) dot[m][v] = dot4(dot4(dot[m][v], lo, x0[m]), hi, x1[m]);
        }
      }
    }
    const int64_t b = gi * Q.group / kBlock;
#pragma GCC unroll 64
    for (int v = 0; v < V; v++) {
      vf sc, off;
      panels[v / kVecs].scale(gi, v % kVecs, sc, off);
#pragma GCC unroll 64
      for (int m = 0; m < RM; m++) {
        acc[m][v] += __builtin_convertvector(dot[m][v], vf) * (sc * a.dx[m * nb + b]);
        if constexpr (Q.ng == 2) acc[m][v] += off * a.dxs[m * a.G + gi];
      }
    }
  }
#pragma GCC unroll 64
  for (int m = 0; m < RM; m++)
#pragma GCC unroll 64
    for (int v = 0; v < V; v++) *(vf_unaligned*)(out + m * ldo + v * kLanes) = acc[m][v];
}

// Integer and float accumulators both live in registers.
constexpr int kMaxAcc = kLanes == 16 ? 12 : kLanes == 8 ? 6 : 4;
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
#define AOTGEN_DOT_RN(N) \
  case N:                \
    if constexpr (N <= max_panels(RM)) f.template run<RM, N>(); \
    return;
    AOTGEN_DOT_RN(1) AOTGEN_DOT_RN(2) AOTGEN_DOT_RN(3) AOTGEN_DOT_RN(4) AOTGEN_DOT_RN(6)
    AOTGEN_DOT_RN(8)
#undef AOTGEN_DOT_RN
  }
}

template <typename F>
inline void dispatch(int rm, int rn, F& f) {
  if constexpr (!kSimd) {
    f.template run<1, 1>();  // `dot` runs 1 x 1 tiles there
  } else {
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
}

template <int TYPE>
struct Tile {
  const Act& a;
  const Panel<TYPE>* panels;
  float* out;
  int64_t ldo;
  template <int RM, int RN>
  void run() { tile<TYPE, RM, RN>(a, panels, out, ldo); }
};

// out [M, N] (N a multiple of 16) = x [M, K] (row stride ldx) @ W^T in the integer numerics,
// in tiles of up to `rows` x `panels`.
template <int TYPE>
inline void dot(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes,
                const uint16_t* groups, const uint16_t* supers, int64_t N, float* out, int rows,
                int panels) {
  rows = kSimd ? std::clamp(rows, 1, 8) : 1;  // portable: a tile's registers would spill
  panels = kSimd ? tile_panels(panels, rows) : 1;
  const Act act = quantize(x, ldx, M, K, kTypes[TYPE].group);
  const int64_t total = N / kPanel, ngroups = (total + panels - 1) / panels;
#pragma omp parallel for schedule(static)
  for (int64_t gi = 0; gi < ngroups; gi++) {
    const int64_t end = std::min(total, (gi + 1) * panels);
    for (int64_t p = gi * panels; p < end;) {
      const int rn = kSimd ? tile_panels((int)(end - p), rows) : 1;
      Panel<TYPE> ps[8];
      for (int r = 0; r < rn; r++) ps[r] = Panel<TYPE>(codes, groups, supers, K, p + r);
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int rm = (int)std::min<int64_t>(rows, M - m0);
        const Act a = act.at(m0);
        Tile<TYPE> f{a, ps, out + m0 * N + p * kPanel, N};
        dispatch(rm, rn, f);
      }
      p += rn;
    }
  }
}

// Not inline: moe.cpp's experts on GGUF blocks call it too (export/shims.py links this object
// beside moe.cpp's). Hidden: it stays inside the graph's .so.
__attribute__((visibility("hidden"))) void dot_any(int qtype, const float* x, int64_t ldx,
                                                   int64_t M, int64_t K, const uint8_t* codes,
                                                   const uint16_t* groups, const uint16_t* supers,
                                                   int64_t N, float* out, int rows, int panels) {
  switch (qtype) {
#define AOTGEN_DOT_QTYPE(T) \
  case T: return dot<T>(x, ldx, M, K, codes, groups, supers, N, out, rows, panels);
    AOTGEN_DOT_QTYPE(0) AOTGEN_DOT_QTYPE(1) AOTGEN_DOT_QTYPE(2) AOTGEN_DOT_QTYPE(3)
    AOTGEN_DOT_QTYPE(4) AOTGEN_DOT_QTYPE(5) AOTGEN_DOT_QTYPE(6) AOTGEN_DOT_QTYPE(7)
#undef AOTGEN_DOT_QTYPE
  }
}

}  // namespace aotgen_gguf_idot

#undef AOTGEN_DOT_INLINE
#pragma GCC pop_options

#ifdef AOTGEN_GGUF_DOT_STANDALONE
// For tests and the build's autotune: the kernel without AOTInductor's tensor handles.
extern "C" void aotgen_gguf_dot(int qtype, const float* x, int64_t ldx, int64_t M, int64_t K,
                                const uint8_t* codes, const uint16_t* groups,
                                const uint16_t* supers, int64_t N, float* out, int rows,
                                int panels) {
  aotgen_gguf_idot::dot_any(qtype, x, ldx, M, K, codes, groups, supers, N, out, rows, panels);
}
#else
// Hidden: the shims stay inside the graph's .so (export/shims.py links them in).
#pragma GCC visibility push(hidden)
// The C shims AOTInductor calls: x [M, K] float32 (rows may be strided), the panels' codes
// [N / 16, ...] uint8, group scales (and k-quants' super-block scales) float16 -> a new
// float32 [M, N].
static AOTITorchError aotgen_gguf_dot_shim(AtenTensorHandle x, AtenTensorHandle codes,
                                           AtenTensorHandle groups, AtenTensorHandle supers,
                                           int64_t qtype, int64_t rows, int64_t panels,
                                           AtenTensorHandle* ret0) {
  int64_t *x_sizes, *x_strides, *c_sizes;
  void *x_data, *c_data, *g_data, *s_data = nullptr, *o_data;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(x, &x_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(x, &x_strides));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(codes, &c_sizes));
  if (x_strides[1] != 1 || qtype < 0 || qtype > 7) return AOTI_TORCH_FAILURE;
  if ((aotgen_gguf_idot::kTypes[qtype].ns != 0) != (supers != nullptr)) return AOTI_TORCH_FAILURE;
  const int64_t M = x_sizes[0], K = x_sizes[1], N = c_sizes[0] * aotgen_gguf_idot::kPanel;
  int64_t out_sizes[2] = {M, N}, out_strides[2] = {N, 1};
  AtenTensorHandle out;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(2, out_sizes, out_strides,
                                                       aoti_torch_dtype_float32(),
                                                       aoti_torch_device_type_cpu(), 0, &out));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(x, &x_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(codes, &c_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(groups, &g_data));
  if (supers) AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(supers, &s_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(out, &o_data));
  aotgen_gguf_idot::dot_any((int)qtype, (const float*)x_data, x_strides[0], M, K,
                           (const uint8_t*)c_data, (const uint16_t*)g_data,
                           (const uint16_t*)s_data, N, (float*)o_data, (int)rows, (int)panels);
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}

AOTITorchError aoti_torch_cpu_gguf_dot(AtenTensorHandle x, AtenTensorHandle codes,
                                       AtenTensorHandle groups, int64_t qtype,
                                       int64_t rows, int64_t panels,
                                       AtenTensorHandle* ret0) {
  return aotgen_gguf_dot_shim(x, codes, groups, nullptr, qtype, rows, panels, ret0);
}

AOTITorchError aoti_torch_cpu_gguf_dot_k(AtenTensorHandle x, AtenTensorHandle codes,
                                         AtenTensorHandle groups,
                                         AtenTensorHandle supers, int64_t qtype,
                                         int64_t rows, int64_t panels,
                                         AtenTensorHandle* ret0) {
  return aotgen_gguf_dot_shim(x, codes, groups, supers, qtype, rows, panels, ret0);
}
#pragma GCC visibility pop
#endif
