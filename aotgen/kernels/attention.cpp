// Attention of a few query rows (decode, verify, token trees, batched steps) over the filled
// prefix of a KV cache: out [B, H, R, D] = softmax(q k^T + mask) v, q already scaled (with a
// cap > 0, Gemma 2's, the scores softcapped first: cap * tanh(q k^T / cap); with sinks,
// gpt-oss's, each row's softmax has one more key, of score sinks[query head] and value zero:
// `normalise`). Compiled into each graph's .so by AOTInductor as the C shims of
// `aotgen::attend_cache` (one sequence) and `aotgen::attend_cache_slots` (a batch),
// kernels/attention.py, whose eager reference defines them.
//
// Why: SDPA's CPU kernel took 44 us a layer for SmolLM2's 5-row verify over 205 keys (1.2 M
// multiply-adds), in dispatch, blocking and MKL calls sized for many rows; a batch first
// gathered every sequence's prefix out of its cache slot.
//
// q [B, H, R, D]: H KV heads, each with its group of query heads folded into the rows
// (row r = g * T + i: query head g of the group, token i), so K and V are read once per tile
// of rows. mask [T, N] or [B, T, N] bool: row r sees key j iff mask[b][r % T][j]; N is the
// prefix attended; sequence b reads cache slot slots[b]. Work: OpenMP over (sequence, head,
// group of row tiles, span of keys) (`attend`); each tile streams its span's keys twice
// (scores, then the weighted sum of values), the rows' scores in a per-thread buffer.
//
// The caches hold float32, bfloat16 or int8 rows (`kv_cache_dtype`): a bfloat16 vector is
// widened to float32 as it is loaded (zero-extend, shift by 16: exact); an int8 row is head_dim
// codes and its float32 scale (kernels/cache_rows.py), the scale multiplying a key's score or
// a value's weight once. Scores and sums are float32 either way; a long context reads half or
// about a quarter of the bytes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#pragma GCC push_options
// AOTInductor builds its wrapper (and this, export/shims.py) at -O1, and on AVX-512 CPUs with
// -ffp-contract=off (export/aoti.py), which would split every multiply-add in two.
#pragma GCC optimize("O3", "fp-contract=fast")

namespace aotgen_attn {

#ifdef __AVX512F__
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef float vf_unaligned __attribute__((vector_size(4 * kLanes), aligned(4)));
constexpr int kTile = 4;  // rows per tile: one key load serves them all

typedef uint16_t vbf_unaligned __attribute__((vector_size(2 * kLanes), aligned(2)));
typedef uint16_t bf16;  // bfloat16 bits: the high half of a float32

__attribute__((always_inline)) inline vf load(const float* p) { return *(const vf_unaligned*)p; }
__attribute__((always_inline)) inline vf load(const bf16* p) {
  return (vf)(__builtin_convertvector(*(const vbf_unaligned*)p, vi) << 16);
}
// int8 codes, unscaled (intrinsics: GCC's vector conversion loads them a byte at a time).
__attribute__((always_inline)) inline vf load(const int8_t* p) {
#ifdef __AVX512F__
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
  vf x;
  for (int i = 0; i < kLanes; i++) x[i] = p[i];
  return x;
#endif
}

constexpr int64_t kScaleBytes = 4;  // an int8 row's float32 scale, after its D codes

// The scale of a cache row of D values: an int8 row's float32 after its codes; 1 otherwise.
template <typename KV>
__attribute__((always_inline)) inline float row_scale(const KV* row, int64_t D) {
  if constexpr (std::is_same_v<KV, int8_t>) {
    float s;
    std::memcpy(&s, row + D, sizeof s);
    return s;
  } else {
    return 1.f;
  }
}

// `rows` cache rows of D bfloat16 or int8 values (ld apart) -> float32 rows of D at dst,
// contiguous, scaled.
template <typename KV>
inline void widen_rows(const KV* src, int64_t ld, int64_t rows, int64_t D, float* dst) {
  for (int64_t j = 0; j < rows; j++) {
    const float s = row_scale(src + j * ld, D);
    for (int64_t c = 0; c < D; c += kLanes) {
      vf x = load(src + j * ld + c);
      if constexpr (std::is_same_v<KV, int8_t>) x *= s;
      *(vf_unaligned*)(dst + j * D + c) = x;
    }
  }
}

__attribute__((always_inline)) inline float hsum(vf v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; i++) s += v[i];
  return s;
#endif
}

// e^x for x <= 0 (scores minus their maximum), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2,
// e^r by its degree-6 polynomial, 2^n into the exponent. Relative error ~2e-7; below -87 -> 0.
__attribute__((always_inline)) inline vf exp_nonpositive(vf x) {
  const vi under = x < -87.0f;
  x = under ? (vf){} - 87.0f : x;
  const vf fn = x * 1.44269504088896341f - 0.5f;
  const vi n = __builtin_convertvector(fn, vi);  // truncation: round to nearest for fn < 0
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vf y = (vf)((vi)p + (n << 23));
  return under ? (vf){} : y;
}

// Horizontal sums of kLanes vectors at once: lane i of the result is the sum of a[i]'s lanes.
// The first two levels shuffle inside 128-bit blocks only (vshufps), leaving in block b of a
// vector the partial sums of four sources over block b's lanes; the blocks are then added
// across (`halve`): one cross-block shuffle pair per two vectors left (one for 8 sums on
// AVX2, three for 16 on AVX-512), where crossing blocks at the first level takes one per two
// sources. On Zen 1 a 256-bit cross-block shuffle is several operations, an in-block one two.
template <bool second>  // first level: lanes (0, 2), (1, 3); second: (0, 1), (2, 3)
__attribute__((always_inline)) inline vf in_block(vf x, vf y) {
  vi lo, hi;
  for (int l = 0; l < kLanes; l++) {
    const int from = (l % 4 < 2 ? 0 : kLanes) + l / 4 * 4, p = l % 2;
    lo[l] = from + (second ? 2 * p : p);
    hi[l] = from + (second ? 2 * p + 1 : p + 2);
  }
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

// Adds blocks across vectors of W lanes per source: x's sources first, then y's.
template <int W>
__attribute__((always_inline)) inline vf halve(vf x, vf y) {
  constexpr int sources = kLanes / W, half = W / 2;
  vi lo, hi;
  for (int l = 0; l < kLanes; l++) {
    const int b = l / half, o = l % half;
    const int base = b < sources ? b * W : kLanes + (b - sources) * W;
    lo[l] = base + o;
    hi[l] = base + half + o;
  }
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

// W / 4 vectors of 4-lane blocks -> one: W / 8 cross-block pairs per level.
template <int W>
__attribute__((always_inline)) inline vf across_blocks(vf* a) {
  if constexpr (W == 4) {
    return a[0];
  } else {
    for (int i = 0; i < W / 8; i++) a[i] = halve<W>(a[2 * i], a[2 * i + 1]);
    return across_blocks<W / 2>(a);
  }
}

__attribute__((always_inline)) inline vf sums(vf* a) {
  for (int i = 0; i < kLanes / 2; i++) a[i] = in_block<false>(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < kLanes / 4; i++) a[i] = in_block<true>(a[2 * i], a[2 * i + 1]);
  return across_blocks<kLanes>(a);
}

template <typename KV>
__attribute__((always_inline)) inline float dot(const float* a, const KV* b, int64_t D) {
  vf acc = load(a) * load(b);
  for (int64_t c = kLanes; c < D; c += kLanes) acc += load(a + c) * load(b + c);
  return hsum(acc);
}

// Scores of kLanes keys for one row: their block of K stays in L1 across the tile's rows.
template <typename KV>
__attribute__((always_inline)) inline vf key_block(const float* qr, const KV* k, int64_t ldkv,
                                                   int64_t D) {
  vf a[kLanes] = {};
  for (int64_t c = 0; c < D; c += kLanes) {
    const vf qc = load(qr + c);
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; i++) a[i] += qc * load(k + i * ldkv + c);
  }
  return sums(a);
}

// Gemma 2's softcap of the scores: cap * tanh(s / cap), tanh(a) = sign(a) (1 - e) / (1 + e)
// with e = exp(-2 |a|).
__attribute__((always_inline)) inline vf capped(vf x, float inv_cap, float cap) {
  const vf a = x * inv_cap;
  const vi negative = a < 0.f;
  const vf e = exp_nonpositive(negative ? 2.f * a : -2.f * a);
  const vf t = (1.f - e) / (1.f + e);
  return (negative ? -t : t) * cap;
}

inline void softcap(float* s, int64_t N, float cap) {
  const float inv = 1.f / cap;
  int64_t j = 0;
  for (; j + kLanes <= N; j += kLanes) *(vf_unaligned*)(s + j) = capped(load(s + j), inv, cap);
  for (; j < N; j++) {
    vf tail = {};
    tail[0] = s[j];
    s[j] = capped(tail, inv, cap)[0];
  }
}

// Masked scores -> unnormalised softmax weights e^(s - max) in place (0 where masked); returns
// the max and the weights' sum. A row that sees nothing gets zeros, max -inf and sum 0.
struct RowStats {
  float max, sum;
};

inline RowStats exp_weights(float* s, const uint8_t* mask, int64_t ldm1, int64_t N) {
  vf mv = (vf){} - INFINITY;
  int64_t j = 0;
  for (; j < N; j++)
    if (!mask[j * ldm1]) s[j] = -INFINITY;
  for (j = 0; j + kLanes <= N; j += kLanes) {
    const vf x = load(s + j);
    mv = x > mv ? x : mv;
  }
  float mx = -INFINITY;
  for (int i = 0; i < kLanes; i++) mx = std::max(mx, mv[i]);
  for (; j < N; j++) mx = std::max(mx, s[j]);
  if (mx == -INFINITY) {
    std::fill(s, s + N, 0.f);
    return {mx, 0.f};
  }
  vf total = {};
  for (j = 0; j + kLanes <= N; j += kLanes) {
    const vf e = exp_nonpositive(load(s + j) - mx);
    *(vf_unaligned*)(s + j) = e;
    total += e;
  }
  float sum = hsum(total);
  for (; j < N; j++) {
    vf tail = {};
    tail[0] = s[j] - mx;
    s[j] = exp_nonpositive(tail)[0];
    sum += s[j];
  }
  return {mx, sum};
}

// Value accumulators a tile keeps in registers (32 vector registers with AVX-512, 16 below it,
// where 4 rows x 4 vectors spilled): a pass over the values sums min(4, this / rows) vectors of
// dimensions.
#ifdef __AVX512F__
constexpr int kAccumulators = 16;
#else
constexpr int kAccumulators = 12;
#endif

// out rows += sum_j s[m][j] v_j over C vectors of dimensions from c0: RT * C accumulators.
template <int RT, int C, typename KV>
__attribute__((always_inline)) inline void weigh_values(const float* s, int64_t N,
                                                        const KV* v, int64_t ldkv,
                                                        int64_t c0, float* out, int64_t ldo) {
  vf acc[RT][C] = {};
  for (int64_t j = 0; j < N; j++) {
    const KV* vj = v + j * ldkv + c0;
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) {
      const vf vv = load(vj + c * kLanes);
#pragma GCC unroll 8
      for (int m = 0; m < RT; m++) acc[m][c] += vv * s[m * N + j];
    }
  }
  for (int m = 0; m < RT; m++)
    for (int c = 0; c < C; c++) *(vf_unaligned*)(out + m * ldo + c0 + c * kLanes) = acc[m][c];
}

// RT rows of one head (row m at q + m * ldq, its mask row at mask_rows[m]) over N keys: the
// unnormalised weighted sums of values into out, each row's max and sum into stats; scores in
// s. bfloat16 and int8 keys are widened (int8 scaled) once per tile, a block of kLanes keys
// into `wide`, not once per row; int8 values' scales go into their weights. Reading the cache
// itself (`fetch`), the block's values are prefetched while its scores are computed: the
// values pass then finds them in cache (decode over 4,096 keys 10-17 % faster). Only the
// item's first tile prefetches: the span is in L2 for the others.
template <int RT, typename KV>
inline void tile(const float* q, int64_t ldq, const KV* k, const KV* v, int64_t ldkv,
                 const uint8_t* const* mask_rows, int64_t ldm1, int64_t N, int64_t D, float cap,
                 bool fetch, float* s, float* wide, float* out, int64_t ldo, RowStats* stats) {
  int64_t j0 = 0;
  for (; j0 + kLanes <= N; j0 += kLanes) {
    const float* kb;
    int64_t ldk = ldkv;
    if constexpr (std::is_same_v<KV, float>) {
      kb = k + j0 * ldkv;
    } else {
      widen_rows(k + j0 * ldkv, ldkv, kLanes, D, wide);
      kb = wide;
      ldk = D;
    }
    if (fetch)
      for (int i = 0; i < kLanes; i++)
        for (int64_t c = 0; c < D * (int64_t)sizeof(KV); c += 64)
          __builtin_prefetch((const char*)(v + (j0 + i) * ldkv) + c, 0, 2);
    for (int m = 0; m < RT; m++)
      *(vf_unaligned*)(s + m * N + j0) = key_block(q + m * ldq, kb, ldk, D);
  }
  for (int m = 0; m < RT; m++) {
    for (int64_t j = j0; j < N; j++)
      s[m * N + j] = dot(q + m * ldq, k + j * ldkv, D) * row_scale(k + j * ldkv, D);
    if (cap > 0.f) softcap(s + m * N, N, cap);
    stats[m] = exp_weights(s + m * N, mask_rows[m], ldm1, N);
  }
  if constexpr (std::is_same_v<KV, int8_t>) {  // each value's scale into its weights
    for (int64_t j = 0; j < N; j++) {
      const float f = row_scale(v + j * ldkv, D);
      for (int m = 0; m < RT; m++) s[m * N + j] *= f;
    }
  }
  constexpr int kChunk = std::min(4, kAccumulators / RT);
  int64_t c0 = 0;
  for (; c0 + kChunk * kLanes <= D; c0 += kChunk * kLanes)
    weigh_values<RT, kChunk, KV>(s, N, v, ldkv, c0, out, ldo);
  for (; c0 + 2 * kLanes <= D; c0 += 2 * kLanes)
    weigh_values<RT, 2, KV>(s, N, v, ldkv, c0, out, ldo);
  for (; c0 < D; c0 += kLanes) weigh_values<RT, 1, KV>(s, N, v, ldkv, c0, out, ldo);
}

// tile<n> for n = 1..kTile rows.
template <typename KV>
inline void tiles_of(int n, const float* q, int64_t ldq, const KV* k, const KV* v, int64_t ldkv,
                     const uint8_t* const* rows, int64_t ldm, int64_t N, int64_t D, float cap,
                     bool fetch, float* s, float* wide, float* out, RowStats* stats) {
  switch (n) {
    case 1: return tile<1>(q, ldq, k, v, ldkv, rows, ldm, N, D, cap, fetch, s, wide, out, D, stats);
    case 2: return tile<2>(q, ldq, k, v, ldkv, rows, ldm, N, D, cap, fetch, s, wide, out, D, stats);
    case 3: return tile<3>(q, ldq, k, v, ldkv, rows, ldm, N, D, cap, fetch, s, wide, out, D, stats);
    default:
      return tile<4>(q, ldq, k, v, ldkv, rows, ldm, N, D, cap, fetch, s, wide, out, D, stats);
  }
}

inline void scale(float* x, int64_t D, float f) {
  for (int64_t c = 0; c < D; c += kLanes) *(vf_unaligned*)(x + c) = load(x + c) * f;
}

// A row's unnormalised sums out (weights e^(s - st.max), summing to st.sum) -> its softmax.
// With a sink (gpt-oss; -INFINITY: none), one more key of score `sink` and value zero: the
// max becomes m = max(st.max, sink), the denominator st.sum e^(st.max - m) + e^(sink - m),
// the sums' weight e^(st.max - m) (exactly 1 where a score reaches the sink). The tiles'
// loops stay as they are. A row that sees no key stays zero (its sums are zero, st.max
// -INFINITY: weight 0, denominator 1).
inline void normalise(float* out, RowStats st, float sink, int64_t D) {
  if (sink == -INFINITY) {
    if (st.sum > 0.f) scale(out, D, 1.f / st.sum);
    return;
  }
  const float mx = std::max(st.max, sink), f = std::exp(st.max - mx);
  scale(out, D, f / (st.sum * f + std::exp(sink - mx)));
}

// A row's parts over `parts` spans of keys (part c's sums at o + c * R * D, its stats at
// stats[c * R]) -> out: the softmax over all the keys, each part rescaled by e^(max_c - max);
// a sink (-INFINITY: none) counts once, as a part of max `sink`, sum 1 and sums zero.
inline void merge(const float* o, const RowStats* stats, int64_t parts, int64_t R, int64_t D,
                  float sink, float* out) {
  float mx = sink, sum = 0.f;
  for (int64_t c = 0; c < parts; c++) mx = std::max(mx, stats[c * R].max);
  std::fill(out, out + D, 0.f);
  if (mx == -INFINITY) return;
  for (int64_t c = 0; c < parts; c++) {
    if (stats[c * R].max == -INFINITY) continue;
    const float f = std::exp(stats[c * R].max - mx);
    sum += f * stats[c * R].sum;
    for (int64_t d = 0; d < D; d += kLanes)
      *(vf_unaligned*)(out + d) = load(out + d) + load(o + c * R * D + d) * f;
  }
  if (sink != -INFINITY) sum += std::exp(sink - mx);
  scale(out, D, 1.f / sum);
}

// B sequences' rows: q [B, H, R, D], sequence b reading cache slot slots[b] (b without slots)
// of k / v [S, H, L, D], with mask rows [B or shared, T, N] (batch stride 0: shared);
// out [B, H, R, D] contiguous. Strides in elements; D a multiple of kLanes. The caches hold
// float32, bfloat16 or int8 rows (KV). sinks: one float32 logit per query head (H * R / T of
// them, sink_stride apart), row r of head h being query head h * (R / T) + r / T; nullptr:
// none.
template <typename KV>
struct Problem {
  const float* q;
  const KV *k, *v;
  const uint8_t* mask;
  const int64_t* slots;  // nullptr: sequence b reads slot b
  float* out;
  int64_t B, H, R, T, N, D;
  int64_t q_b, q_h, q_r, kv_s, kv_h, kv_j, m_b, m_t, m_j, slot_stride;
  float cap;  // > 0: scores softcapped (Gemma 2)
  const float* sinks;
  int64_t sink_stride;

  // Row r of KV head h's sink logit; -INFINITY without sinks.
  float sink(int64_t h, int64_t r) const {
    return sinks ? sinks[(h * (R / T) + r / T) * sink_stride] : -INFINITY;
  }
};

// Work items: (sequence, head, group of row tiles, span of keys). A span's keys and values
// (256 kB as float32) stay in L2 while the item's tiles of rows read them, so a long prefix is read
// from memory once per head, not once per tile of rows; the spans' parts are merged after.
// A bfloat16 span is widened to float32 once per item when several tiles read it. Few heads
// (decode of a 3-head model) split the keys further, down to kMinSpan, then the rows, down to
// one a tile, so that both cores have work.
constexpr int64_t kSpanBytes = 256 << 10;  // keys and values of a span, as float32
constexpr int64_t kMinSpan = 128;          // keys
constexpr int64_t kItems = 4;              // work items wanted for two cores

template <typename KV>
inline void attend(const Problem<KV>& p) {
  const int64_t span_keys = std::max<int64_t>(kLanes, kSpanBytes / (8 * p.D) / kLanes * kLanes);
  int64_t spans = std::max<int64_t>(1, (p.N + span_keys - 1) / span_keys);
  int rt = kTile;
  int64_t tiles = (p.R + rt - 1) / rt, groups = 1;
  const auto items = [&] { return p.B * p.H * groups * spans; };
  for (;;) {
    if (items() >= kItems) break;
    if (p.N >= 2 * spans * kMinSpan) {
      spans *= 2;
    } else if (groups < tiles) {
      groups++;
    } else if (rt > 1) {
      rt /= 2;
      tiles = groups = (p.R + rt - 1) / rt;
    } else {
      break;
    }
  }
  const int64_t per_group = (tiles + groups - 1) / groups;
  const int64_t span = (p.N + spans - 1) / spans;
  const bool widen = !std::is_same_v<KV, float> && per_group > 1;
  // Parts of the split rows: [B * H][spans][R][D] sums and [B * H][spans][R] stats.
  std::vector<float> parts(spans > 1 ? p.B * p.H * spans * p.R * p.D : 0);
  std::vector<RowStats> part_stats(spans > 1 ? p.B * p.H * spans * p.R : 0);
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < items(); item++) {
    static thread_local std::vector<float> scores, wide, wide_k, wide_v;
    if ((int64_t)scores.size() < kTile * span) scores.resize(kTile * span);
    if ((int64_t)wide.size() < kLanes * p.D) wide.resize(kLanes * p.D);
    const int64_t bh = item / (groups * spans), b = bh / p.H, h = bh % p.H;
    const int64_t group = item / spans % groups, part = item % spans;
    const int64_t j0 = part * span, N = std::min(span, p.N - j0);
    const int64_t slot = p.slots ? p.slots[b * p.slot_stride] : b;
    const KV* kh = p.k + slot * p.kv_s + h * p.kv_h + j0 * p.kv_j;
    const KV* vh = p.v + slot * p.kv_s + h * p.kv_h + j0 * p.kv_j;
    const int64_t ldq = p.q_r, ldkv = p.kv_j, ldm = p.m_j, D = p.D;
    if constexpr (!std::is_same_v<KV, float>) {
      if (widen) {
        wide_k.resize(std::max<size_t>(wide_k.size(), span * D));
        wide_v.resize(wide_k.size());
        widen_rows(kh, ldkv, N, D, wide_k.data());
        widen_rows(vh, ldkv, N, D, wide_v.data());
      }
    }
    const float cap = p.cap;
    float *sc = scores.data(), *wd = wide.data();
    for (int64_t t = group * per_group; t < std::min(tiles, (group + 1) * per_group); t++) {
      const int64_t r0 = t * rt;
      const int n = (int)std::min<int64_t>(rt, p.R - r0);
      const uint8_t* rows[kTile];
      for (int m = 0; m < n; m++)
        rows[m] = p.mask + b * p.m_b + ((r0 + m) % p.T) * p.m_t + j0 * p.m_j;
      const float* qh = p.q + b * p.q_b + h * p.q_h + r0 * p.q_r;
      RowStats own[kTile];
      RowStats* st = spans > 1 ? part_stats.data() + (bh * spans + part) * p.R + r0 : own;
      float* oh = spans > 1 ? parts.data() + ((bh * spans + part) * p.R + r0) * D
                            : p.out + (bh * p.R + r0) * D;
      if (widen)
        tiles_of(n, qh, ldq, wide_k.data(), wide_v.data(), D, rows, ldm, N, D, cap, false, sc,
                 wd, oh, st);
      else
        tiles_of(n, qh, ldq, kh, vh, ldkv, rows, ldm, N, D, cap, t == group * per_group, sc,
                 wd, oh, st);
      if (spans == 1)
        for (int m = 0; m < n; m++) normalise(oh + m * D, st[m], p.sink(h, r0 + m), D);
    }
  }
  if (spans == 1) return;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < p.B * p.H * p.R; row++) {
    const int64_t bh = row / p.R, r = row % p.R;
    merge(parts.data() + (bh * spans * p.R + r) * p.D, part_stats.data() + bh * spans * p.R + r,
          spans, p.R, p.D, p.sink(bh % p.H, r), p.out + row * p.D);
  }
}

}  // namespace aotgen_attn

#pragma GCC pop_options

#ifdef AOTGEN_ATTENTION_STANDALONE
// For tests: the kernel without AOTInductor's tensor handles, contiguous tensors: q [B, H, R,
// D], k / v [S, H, L, row] (cache_kind 0: float32, row D; 1: bfloat16, row D; 2: int8, row
// D + 4), mask [B, T, N] (or [T, N] shared: shared_mask), slots [B] or null, sinks [H * R / T]
// or null.
extern "C" int aotgen_attend_cache(const float* q, const void* k, const void* v,
                                   const uint8_t* mask, int shared_mask, const int64_t* slots,
                                   int64_t B, int64_t H, int64_t R, int64_t T, int64_t N,
                                   int64_t L, int64_t D, float cap, int cache_kind,
                                   const float* sinks, float* out) {
  if (D % aotgen_attn::kLanes) return 1;
  const int64_t row = cache_kind == 2 ? D + aotgen_attn::kScaleBytes : D;
  const auto run = [&](auto kv) {
    using KV = decltype(kv);
    aotgen_attn::attend<KV>({q, (const KV*)k, (const KV*)v, mask, slots, out, B, H, R, T, N, D,
                             H * R * D, R * D, D, H * L * row, L * row, row,
                             shared_mask ? 0 : T * N, N, 1, 1, cap, sinks, 1});
  };
  if (cache_kind == 1)
    run(aotgen_attn::bf16{});
  else if (cache_kind == 2)
    run(int8_t{});
  else
    run(0.f);
  return 0;
}
#else
// Hidden: the shims stay inside the graph's .so (export/shims.py links them in).
#pragma GCC visibility push(hidden)
// The C shims AOTInductor calls: q [B, H, R, D] float32, the caches [S, H, L, D] float32 or
// bfloat16, or [S, H, L, D + 4] int8 rows (the first N = mask.size(-1) positions of slot
// slots[b], or of slot 0 for one sequence read), mask [T, N] (one sequence) or [B, T, N]
// bool, cap (0: none), sinks float32 [H * R / T] or none -> a new float32 [B, H, R, D].
// AOTInductor passes an `Optional[Tensor]` argument as a pointer to its handle: nullptr for
// None (cpp_wrapper_cpu.py's val_to_arg_str).
static AOTITorchError aotgen_attend_shim(AtenTensorHandle q, AtenTensorHandle k_cache,
                                         AtenTensorHandle v_cache, AtenTensorHandle mask,
                                         AtenTensorHandle slots, double cap,
                                         AtenTensorHandle* sinks, AtenTensorHandle* ret0) {
  int64_t *q_sizes, *q_strides, *k_sizes, *k_strides, *v_strides, *m_sizes, *m_strides;
  int64_t *s_strides = nullptr, *sk_sizes, *sk_strides = nullptr;
  int64_t m_dim, sk_dim;
  int32_t k_dtype, v_dtype, sk_dtype;
  void *q_data, *k_data, *v_data, *m_data, *s_data = nullptr, *sk_data = nullptr, *o_data;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(q, &q_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(q, &q_strides));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(k_cache, &k_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(k_cache, &k_strides));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(v_cache, &v_strides));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(k_cache, &k_dtype));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(v_cache, &v_dtype));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(mask, &m_dim));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(mask, &m_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(mask, &m_strides));
  const int64_t B = q_sizes[0], H = q_sizes[1], R = q_sizes[2], D = q_sizes[3];
  const bool batched = m_dim == 3;
  const bool int8 = k_dtype == aoti_torch_dtype_int8();
  if (q_strides[3] != 1 || k_strides[3] != 1 || v_strides[3] != 1 || k_strides[0] != v_strides[0] ||
      k_strides[1] != v_strides[1] || k_strides[2] != v_strides[2] || D % aotgen_attn::kLanes ||
      k_dtype != v_dtype || k_sizes[3] != (int8 ? D + aotgen_attn::kScaleBytes : D) ||
      (k_dtype != aoti_torch_dtype_float32() && k_dtype != aoti_torch_dtype_bfloat16() && !int8))
    return AOTI_TORCH_FAILURE;
  if (sinks && *sinks) {  // one per query head: H * R / T
    const int64_t T = m_sizes[m_dim - 2];
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(*sinks, &sk_dim));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(*sinks, &sk_sizes));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(*sinks, &sk_strides));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(*sinks, &sk_dtype));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(*sinks, &sk_data));
    if (sk_dim != 1 || sk_dtype != aoti_torch_dtype_float32() || T <= 0 || R % T ||
        sk_sizes[0] != H * (R / T))
      return AOTI_TORCH_FAILURE;
  }
  int64_t out_sizes[4] = {B, H, R, D}, out_strides[4] = {H * R * D, R * D, D, 1};
  AtenTensorHandle out;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(4, out_sizes, out_strides,
                                                       aoti_torch_dtype_float32(),
                                                       aoti_torch_device_type_cpu(), 0, &out));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(q, &q_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(k_cache, &k_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(v_cache, &v_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(mask, &m_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(out, &o_data));
  if (slots) {
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(slots, &s_strides));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(slots, &s_data));
  }
  const auto run = [&](auto kv) {
    using KV = decltype(kv);
    aotgen_attn::attend<KV>({(const float*)q_data, (const KV*)k_data, (const KV*)v_data,
                             (const uint8_t*)m_data, (const int64_t*)s_data, (float*)o_data, B,
                             H, R, m_sizes[m_dim - 2], m_sizes[m_dim - 1], D, q_strides[0],
                             q_strides[1], q_strides[2], k_strides[0], k_strides[1],
                             k_strides[2], batched ? m_strides[0] : 0, m_strides[m_dim - 2],
                             m_strides[m_dim - 1], s_strides ? s_strides[0] : 1, (float)cap,
                             (const float*)sk_data, sk_strides ? sk_strides[0] : 1});
  };
  if (k_dtype == aoti_torch_dtype_bfloat16())
    run(aotgen_attn::bf16{});
  else if (int8)
    run(int8_t{});
  else
    run(0.f);
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}

AOTITorchError aoti_torch_cpu_attend_cache(AtenTensorHandle q, AtenTensorHandle k_cache,
                                           AtenTensorHandle v_cache, AtenTensorHandle mask,
                                           double cap, AtenTensorHandle* sinks,
                                           AtenTensorHandle* ret0) {
  return aotgen_attend_shim(q, k_cache, v_cache, mask, nullptr, cap, sinks, ret0);
}

AOTITorchError aoti_torch_cpu_attend_cache_slots(AtenTensorHandle q,
                                                 AtenTensorHandle k_cache,
                                                 AtenTensorHandle v_cache,
                                                 AtenTensorHandle mask,
                                                 AtenTensorHandle slots, double cap,
                                                 AtenTensorHandle* sinks,
                                                 AtenTensorHandle* ret0) {
  return aotgen_attend_shim(q, k_cache, v_cache, mask, slots, cap, sinks, ret0);
}
#pragma GCC visibility pop
#endif
