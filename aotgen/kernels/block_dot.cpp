// Integer dot products for linears with int4 / int8 weights and int8 activations in blocks of
// 32 (llama.cpp's Q4_1 / Q8_0 x Q8_1). Compiled into each graph's .so by AOTInductor as the
// C shims of `aotgen::int4_block_linear` / `aotgen::int8_block_linear` (kernels/block_dot.py).
//
// Layouts (K inputs, nb = K / 32 blocks), for a set of R rows: groups of R = 4 rows, then the
// N % 4 last rows one by one (R = 1), so that the 4-row loop reads memory in order:
//   int4 weight: 32-byte chunks, chunk p of row r at 32 (R p + r); its byte j holds
//         q[64p + j] | q[64p + 32 + j] << 4, q in 0..15;
//         scales fp16, d[b] of row r at R b + r, then m[b] at R (nb + b) + r; w = q d + m
//   int8 weight: chunk b (32 codes in -127..127) of row r at 32 (R b + r);
//         scales fp16, d[b] of row r at R b + r; w = q d
// Activations are quantized per row and block: dx = max|x| / 127, qx = round(x * (1 / dx)),
// sx = dx * sum(qx). Then out[n] = sum_b d[b] dx[b] sum(q qx) (+ m[b] sx[b] for int4).
//
// AVX2: `maddubs` multiplies 32 unsigned x signed bytes and adds pairs (int16), `madd` adds
// pairs again (int32): 32 multiply-adds in two instructions, where a float32 weight needs four
// vector FMAs and an int8 one a conversion each. Other CPUs take the portable loops.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AOTGEN_BLOCK_DOT_AVX2 1
#endif

#pragma GCC push_options
// AOTInductor builds its wrapper (and this, export/shims.py) at -O1, and on AVX-512 CPUs with
// -ffp-contract=off (export/aoti.py), which would split every multiply-add in two.
#pragma GCC optimize("O3", "fp-contract=fast")

namespace aotgen_block_dot {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxBlocks = 1024;  // K <= 32768: per-row scale tables live on the stack
// Bytes ahead to prefetch in a 4-row group: each call streams a few hundred KB, too short for
// the hardware prefetcher to ramp up (the draft's 121 linears: 5.3-5.9 -> 4.1-4.8 ms).
constexpr int64_t kPrefetch = 1024;

inline float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      mant <<= 1;
      e++;
    } while (!(mant & 0x400u));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Row m of x (stride `ld`) -> qx [M, K] int8, dx and sx [M, nb].
inline void quantize_rows(const float* x, int64_t ld, int64_t M, int64_t K, int8_t* qx, float* dx,
                          float* sx) {
  const int64_t nb = K / kBlock;
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < nb; b++) {
      const float* v = x + m * ld + b * kBlock;
      int8_t* q = qx + m * K + b * kBlock;
#ifdef AOTGEN_BLOCK_DOT_AVX2
      __m256 f[4], amax = _mm256_setzero_ps();
      const __m256 sign = _mm256_set1_ps(-0.f);
      for (int i = 0; i < 4; i++) {
        f[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, f[i]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float d = _mm_cvtss_f32(h) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      __m256i c[4], sum = _mm256_setzero_si256();
      for (int i = 0; i < 4; i++) {  // rounds to nearest even (the default MXCSR mode)
        c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], _mm256_set1_ps(id)));
        sum = _mm256_add_epi32(sum, c[i]);
      }
      // packs work per 128-bit lane: undo their interleaving of the 4 vectors
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                                _mm256_packs_epi32(c[2], c[3]));
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(packed, order));
      int32_t lanes[8];
      _mm256_storeu_si256((__m256i*)lanes, sum);
      int32_t total = 0;
      for (int32_t l : lanes) total += l;
      dx[m * nb + b] = d;
      sx[m * nb + b] = d * (float)total;
#else
      float amax = 0.f;
      for (int64_t j = 0; j < kBlock; j++) amax = std::fmax(amax, std::fabs(v[j]));
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; j++) {
        q[j] = (int8_t)std::nearbyint(v[j] * id);  // to nearest even, like torch.round
        sum += q[j];
      }
      dx[m * nb + b] = d;
      sx[m * nb + b] = d * (float)sum;
#endif
    }
  }
}

#ifdef AOTGEN_BLOCK_DOT_AVX2
// dd[b][r] = d[b][r] * dx[b] for the R rows of a group; mterm[r] = sum_b m[b][r] * sx[b]
// (m null: int8 weights).
template <int R>
inline void block_scales(const uint16_t* d, const uint16_t* m, const float* dx, const float* sx,
                         int64_t nb, float* dd, float* mterm) {
  if constexpr (R == 4) {
    __m128 mv = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      const __m128 dv = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(d + 4 * b)));
      _mm_storeu_ps(dd + 4 * b, _mm_mul_ps(dv, _mm_set1_ps(dx[b])));
      if (m) {
        const __m128 mb = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(m + 4 * b)));
        mv = _mm_fmadd_ps(mb, _mm_set1_ps(sx[b]), mv);
      }
    }
    _mm_storeu_ps(mterm, mv);
  } else {
    for (int r = 0; r < R; r++) mterm[r] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
      for (int r = 0; r < R; r++) {
        dd[R * b + r] = _cvtsh_ss(d[R * b + r]) * dx[b];
        if (m) mterm[r] += _cvtsh_ss(m[R * b + r]) * sx[b];
      }
    }
  }
}

// The R sums of acc[r]'s lanes, plus add[r], into out.
template <int R>
inline void store_sums(const __m256* acc, const float* add, float* out) {
  if constexpr (R == 4) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    _mm_storeu_ps(out, _mm_add_ps(t, _mm_loadu_ps(add)));
  } else {
    for (int r = 0; r < R; r++) {
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      out[r] = _mm_cvtss_f32(h) + add[r];
    }
  }
}

// R rows (see "Layouts") against one quantized activation row; each x block is loaded once
// for all R rows.
template <int R>
inline void int4_rows(const uint8_t* w, const uint16_t* scales, int64_t K, const int8_t* qx,
                      const float* dx, const float* sx, float* out) {
  const int64_t nb = K / kBlock;
  float dd[kMaxBlocks * R], mterm[R];
  block_scales<R>(scales, scales + R * nb, dx, sx, nb, dd, mterm);
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t p = 0; p < nb / 2; p++) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i*)(qx + 64 * p));
    const __m256i x1 = _mm256_loadu_si256((const __m256i*)(qx + 64 * p + 32));
    if constexpr (R == 4) {
      _mm_prefetch((const char*)(w + 128 * p + kPrefetch), _MM_HINT_T0);
      _mm_prefetch((const char*)(w + 128 * p + kPrefetch + 64), _MM_HINT_T0);
    }
    for (int r = 0; r < R; r++) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 32 * (R * p + r)));
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      const __m256 s0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), ones));
      const __m256 s1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), ones));
      const __m256 t = _mm256_mul_ps(s0, _mm256_broadcast_ss(dd + R * (2 * p) + r));
      acc[r] = _mm256_add_ps(acc[r], _mm256_fmadd_ps(s1, _mm256_broadcast_ss(dd + R * (2 * p + 1) + r), t));
    }
  }
  store_sums<R>(acc, mterm, out);
}

template <int R>
inline void int8_rows(const int8_t* w, const uint16_t* scales, int64_t K, const int8_t* qx,
                      const float* dx, float* out) {
  const int64_t nb = K / kBlock;
  float dd[kMaxBlocks * R], zero[R] = {};
  block_scales<R>(scales, nullptr, dx, nullptr, nb, dd, zero);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)(qx + kBlock * b));
    const __m256i ax = _mm256_sign_epi8(x, x);  // |x| as unsigned bytes, w takes x's sign
    if constexpr (R == 4) {
      _mm_prefetch((const char*)(w + 128 * b + kPrefetch), _MM_HINT_T0);
      _mm_prefetch((const char*)(w + 128 * b + kPrefetch + 64), _MM_HINT_T0);
    }
    for (int r = 0; r < R; r++) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 32 * (R * b + r)));
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(v, x)), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(dd + R * b + r), acc[r]);
    }
  }
  store_sums<R>(acc, zero, out);
}
#endif

// Portable: row r of R (see "Layouts") against one activation row.
inline float int4_row(const uint8_t* w, const uint16_t* scales, int R, int r, int64_t K,
                      const int8_t* qx, const float* dx, const float* sx) {
  const int64_t nb = K / kBlock;
  float total = 0.f;
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* bytes = w + 32 * (R * (b / 2) + r);
    const int shift = (b % 2) * 4;
    int32_t dot = 0;
    for (int64_t j = 0; j < kBlock; j++) dot += ((bytes[j] >> shift) & 0xf) * qx[b * kBlock + j];
    const float d = half_to_float(scales[R * b + r]), m = half_to_float(scales[R * (nb + b) + r]);
    total += d * dx[b] * (float)dot + m * sx[b];
  }
  return total;
}

inline float int8_row(const int8_t* w, const uint16_t* scales, int R, int r, int64_t K,
                      const int8_t* qx, const float* dx) {
  float total = 0.f;
  for (int64_t b = 0; b < K / kBlock; b++) {
    const int8_t* bytes = w + 32 * (R * b + r);
    int32_t dot = 0;
    for (int64_t j = 0; j < kBlock; j++) dot += bytes[j] * qx[b * kBlock + j];
    total += half_to_float(scales[R * b + r]) * dx[b] * (float)dot;
  }
  return total;
}

// out [M, N] = x [M, K] (row stride ld) times the weight; `bits` 4 or 8.
inline void linear(int bits, const float* x, int64_t ld, int64_t M, int64_t K, const void* weight,
                   const uint16_t* scales, int64_t N, float* out) {
  const int64_t nb = K / kBlock;
  std::vector<int8_t> qx(M * K);
  std::vector<float> dx(M * nb), sx(M * nb);
  quantize_rows(x, ld, M, K, qx.data(), dx.data(), sx.data());
  const int64_t row_bytes = bits == 4 ? K / 2 : K, row_scales = bits == 4 ? 2 * nb : nb;
  constexpr int kRows = 4;  // a group: read in order, and in L1 across the M rows
  const int64_t groups = N / kRows;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups + N % kRows; g++) {
    // Group g < groups: rows 4g..4g+3, interleaved. Then the tail rows one by one.
    const int R = g < groups ? kRows : 1;
    const int64_t n0 = g < groups ? g * kRows : groups * kRows + (g - groups);
    const uint8_t* w = (const uint8_t*)weight + n0 * row_bytes;
    const uint16_t* s = scales + n0 * row_scales;
    for (int64_t m = 0; m < M; m++) {
      const int8_t* q = qx.data() + m * K;
      const float *d = dx.data() + m * nb, *ms = sx.data() + m * nb;
      float* o = out + m * N + n0;
#ifdef AOTGEN_BLOCK_DOT_AVX2
      const int8_t* w8 = (const int8_t*)w;
      if (bits == 4)
        R == kRows ? int4_rows<kRows>(w, s, K, q, d, ms, o) : int4_rows<1>(w, s, K, q, d, ms, o);
      else
        R == kRows ? int8_rows<kRows>(w8, s, K, q, d, o) : int8_rows<1>(w8, s, K, q, d, o);
#else
      for (int r = 0; r < R; r++)
        o[r] = bits == 4 ? int4_row(w, s, R, r, K, q, d, ms)
                         : int8_row((const int8_t*)w, s, R, r, K, q, d);
#endif
    }
  }
}

}  // namespace aotgen_block_dot

#pragma GCC pop_options

#ifdef AOTGEN_BLOCK_DOT_STANDALONE
// For tests and the build's autotune: the kernel without AOTInductor's tensor handles.
extern "C" void aotgen_block_linear(int bits, const float* x, int64_t M, int64_t K,
                                    const void* weight, const uint16_t* scales, int64_t N,
                                    float* out) {
  aotgen_block_dot::linear(bits, x, K, M, K, weight, scales, N, out);
}
#else
// Hidden: the shims stay inside the graph's .so (export/shims.py links them in).
#pragma GCC visibility push(hidden)
// The C shims AOTInductor calls: x [M, K] float32 (rows may be strided), weight, scales ->
// a new float32 [M, N].
static AOTITorchError aotgen_block_linear_shim(int bits, AtenTensorHandle x,
                                               AtenTensorHandle weight, AtenTensorHandle scales,
                                               AtenTensorHandle* ret0) {
  int64_t *x_sizes, *x_strides, *w_sizes;
  void *x_data, *w_data, *s_data, *o_data;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(x, &x_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(x, &x_strides));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(weight, &w_sizes));
  if (x_strides[1] != 1) return AOTI_TORCH_FAILURE;
  const int64_t M = x_sizes[0], K = x_sizes[1], N = w_sizes[0];
  int64_t out_sizes[2] = {M, N}, out_strides[2] = {N, 1};
  AtenTensorHandle out;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(2, out_sizes, out_strides,
                                                       aoti_torch_dtype_float32(),
                                                       aoti_torch_device_type_cpu(), 0, &out));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(x, &x_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(weight, &w_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(scales, &s_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(out, &o_data));
  aotgen_block_dot::linear(bits, (const float*)x_data, x_strides[0], M, K, w_data,
                           (const uint16_t*)s_data, N, (float*)o_data);
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}

AOTITorchError aoti_torch_cpu_int4_block_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                AtenTensorHandle scales,
                                                AtenTensorHandle* ret0) {
  return aotgen_block_linear_shim(4, x, weight, scales, ret0);
}

AOTITorchError aoti_torch_cpu_int8_block_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                AtenTensorHandle scales,
                                                AtenTensorHandle* ret0) {
  return aotgen_block_linear_shim(8, x, weight, scales, ret0);
}
#pragma GCC visibility pop
#endif
