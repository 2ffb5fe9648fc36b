// The gated delta rule of Qwen3.5's linear-attention layers, one token after another, with the
// recurrent state kept in a ring of cells. Compiled into each graph's .so by AOTInductor as the
// C shim of `aotgen::gated_delta_rule` (kernels/gated_delta.py, whose eager reference defines
// it and says what each input is).
//
// Per sequence b and value head h (OpenMP over both), with S the [Dk, Dv] state:
//   S = state[slots[b], h, (positions[b, 0] - 1) % cells], zero at position 0
//   for each row t:  S *= exp(g);  d = (v - S^T k) * beta;  S += k d^T;  out[t] = S^T q
// and the state after each of the last min(T, cells) rows is written to the cell of its
// position. A row of T costs 4 Dk Dv multiply-adds a head: a few percent of a layer's matmuls.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC push_options
// AOTInductor builds its wrapper (and this, export/shims.py) at -O1.
#pragma GCC optimize("O3", "fp-contract=fast")

namespace aotgen_gdr {

struct Args {
  const float *q, *k, *v, *g, *beta;
  float* state;
  const int64_t *slots, *positions;
  float* out;
  int64_t B, T, Hk, Hv, Dk, Dv, cells;
  // Strides in elements: q / k [B, T, Hk, Dk], v [B, T, Hv, Dv], g / beta [B, T, Hv],
  // state [slots, Hv, cells, Dk * Dv], positions [B, T]; out is contiguous.
  int64_t qs[3], ks[3], vs[3], gs[3], bs[3], ss[3], ps[2], slot_stride;
};

static void run(const Args& a) {
  const int64_t group = a.Hv / a.Hk, span = a.Dk * a.Dv;
  const int64_t written = std::min(a.T, a.cells);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t h = 0; h < a.Hv; ++h) {
      std::vector<float> S(span), kv(a.Dv), d(a.Dv);
      const int64_t slot = a.slots[b * a.slot_stride];
      const int64_t* pos = a.positions + b * a.ps[0];
      float* ring = a.state + slot * a.ss[0] + h * a.ss[1];
      if (pos[0] > 0)
        std::memcpy(S.data(), ring + ((pos[0] - 1) % a.cells) * a.ss[2], span * sizeof(float));
      else
        std::fill(S.begin(), S.end(), 0.f);
      const int64_t kh = h / group;
      for (int64_t t = 0; t < a.T; ++t) {
        const float* q = a.q + b * a.qs[0] + t * a.qs[1] + kh * a.qs[2];
        const float* k = a.k + b * a.ks[0] + t * a.ks[1] + kh * a.ks[2];
        const float* v = a.v + b * a.vs[0] + t * a.vs[1] + h * a.vs[2];
        const float decay = std::exp(a.g[b * a.gs[0] + t * a.gs[1] + h * a.gs[2]]);
        const float beta = a.beta[b * a.bs[0] + t * a.bs[1] + h * a.bs[2]];
        std::fill(kv.begin(), kv.end(), 0.f);
        for (int64_t i = 0; i < a.Dk; ++i) {
          const float* row = S.data() + i * a.Dv;
          const float ki = k[i];
          for (int64_t j = 0; j < a.Dv; ++j) kv[j] += ki * row[j];
        }
        for (int64_t j = 0; j < a.Dv; ++j) d[j] = (v[j] - decay * kv[j]) * beta;
        float* o = a.out + ((b * a.T + t) * a.Hv + h) * a.Dv;
        std::fill(o, o + a.Dv, 0.f);
        for (int64_t i = 0; i < a.Dk; ++i) {
          float* row = S.data() + i * a.Dv;
          const float ki = k[i], qi = q[i];
          for (int64_t j = 0; j < a.Dv; ++j) {
            row[j] = decay * row[j] + ki * d[j];
            o[j] += qi * row[j];
          }
        }
        if (t >= a.T - written)
          std::memcpy(ring + (pos[t * a.ps[1]] % a.cells) * a.ss[2], S.data(),
                      span * sizeof(float));
      }
    }
  }
}

}  // namespace aotgen_gdr

#pragma GCC pop_options

#ifndef AOTGEN_GATED_DELTA_STANDALONE
#pragma GCC visibility push(default)
AOTITorchError aoti_torch_cpu_gated_delta_rule(AtenTensorHandle q, AtenTensorHandle k,
                                               AtenTensorHandle v, AtenTensorHandle g,
                                               AtenTensorHandle beta, AtenTensorHandle state,
                                               AtenTensorHandle slots,
                                               AtenTensorHandle positions,
                                               AtenTensorHandle* ret0) {
  AtenTensorHandle all[8] = {q, k, v, g, beta, state, slots, positions};
  int64_t dims[8] = {4, 4, 4, 3, 3, 4, 1, 2};
  int64_t *sizes[8], *strides[8];
  void* data[8];
  for (int i = 0; i < 8; ++i) {
    int64_t dim;
    int32_t dtype;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(all[i], &dim));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(all[i], &dtype));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(all[i], &sizes[i]));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(all[i], &strides[i]));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(all[i], &data[i]));
    const bool index = i >= 6;
    if (dim != dims[i] ||
        dtype != (index ? aoti_torch_dtype_int64() : aoti_torch_dtype_float32()))
      return AOTI_TORCH_FAILURE;
  }
  const int64_t B = sizes[0][0], T = sizes[0][1], Hk = sizes[0][2], Dk = sizes[0][3];
  const int64_t Hv = sizes[2][2], Dv = sizes[2][3];
  for (int i = 0; i < 3; ++i)
    if (strides[i][3] != 1) return AOTI_TORCH_FAILURE;
  if (Hk <= 0 || Hv % Hk || sizes[5][1] != Hv || sizes[5][3] != Dk * Dv || strides[5][3] != 1 ||
      sizes[5][2] <= 0)
    return AOTI_TORCH_FAILURE;
  int64_t out_sizes[4] = {B, T, Hv, Dv}, out_strides[4] = {T * Hv * Dv, Hv * Dv, Dv, 1};
  AtenTensorHandle out;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(4, out_sizes, out_strides,
                                                       aoti_torch_dtype_float32(),
                                                       aoti_torch_device_type_cpu(), 0, &out));
  void* o_data;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(out, &o_data));
  aotgen_gdr::Args a{(const float*)data[0], (const float*)data[1], (const float*)data[2],
                     (const float*)data[3], (const float*)data[4], (float*)data[5],
                     (const int64_t*)data[6], (const int64_t*)data[7], (float*)o_data,
                     B, T, Hk, Hv, Dk, Dv, sizes[5][2]};
  for (int j = 0; j < 3; ++j) {
    a.qs[j] = strides[0][j];
    a.ks[j] = strides[1][j];
    a.vs[j] = strides[2][j];
    a.gs[j] = strides[3][j];
    a.bs[j] = strides[4][j];
    a.ss[j] = strides[5][j];
  }
  a.ps[0] = strides[7][0];
  a.ps[1] = strides[7][1];
  a.slot_stride = strides[6][0];
  aotgen_gdr::run(a);
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}
#pragma GCC visibility pop
#endif
