// The experts of a mixture-of-experts layer on CPU: out [T, d] = sum over each token's k routed
// experts e of w * down_e(silu(gate_e(x)) * up_e(x)). Compiled into each graph's .so by
// AOTInductor as the C shim of `aotgen::moe_experts` (kernels/moe.py, whose eager reference
// defines it).
//
// Why: an exported graph has fixed shapes, so without a kernel it must either run every expert
// on every token (E / k times the work) or gather k weight matrices per token (one weight read
// per token and expert). Here the tokens are grouped by expert (a counting sort of the routing
// ids) and each routed expert runs once, as two matmuls over its tokens: its weights are read
// once per step, and a decode step reads only the k experts its token chose.
//
// x [T, d] float32; weights [T, k] float32 and ids [T, k] int64: each token's experts and their
// routing weights; gate_up [E, 2f, d] (the gate's rows, then the up projection's) and down
// [E, d, f], float32, contiguous. The matmuls go to ATen's CPU mm (MKL / oneDNN) through the
// C shim API; the grouping, SwiGLU and weighted sum are plain loops. Experts are taken in
// ascending order and each token's output accumulated in that order, as transformers does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#pragma GCC push_options
#pragma GCC optimize("O3")

namespace aotgen_moe {

// A [rows, cols] float32 view of `data` with the given row and column strides.
static AOTITorchError view(float* data, int64_t rows, int64_t cols, int64_t row_stride,
                           int64_t col_stride, AtenTensorHandle* out) {
  const int64_t sizes[2] = {rows, cols}, strides[2] = {row_stride, col_stride};
  return aoti_torch_create_tensor_from_blob(data, 2, sizes, strides, 0, aoti_torch_dtype_float32(),
                                            aoti_torch_device_type_cpu(), 0, out);
}

// out [n, m] = a [n, K] @ b^T, b's rows at `b` ([m, K] contiguous).
static AOTITorchError matmul_t(float* a, int64_t n, int64_t K, float* b, int64_t m, float* out) {
  AtenTensorHandle ha, hb, ho;
  AOTI_TORCH_ERROR_CODE_CHECK(view(a, n, K, K, 1, &ha));
  AOTI_TORCH_ERROR_CODE_CHECK(view(b, K, m, 1, K, &hb));
  AOTI_TORCH_ERROR_CODE_CHECK(view(out, n, m, m, 1, &ho));
  const AOTITorchError rc = aoti_torch_mm_out(ho, ha, hb);
  aoti_torch_delete_tensor_object(ha);
  aoti_torch_delete_tensor_object(hb);
  aoti_torch_delete_tensor_object(ho);
  return rc;
}

static AOTITorchError experts(const float* x, const float* weights, const int64_t* ids,
                              float* gate_up, float* down, float* out, int64_t T, int64_t k,
                              int64_t E, int64_t d, int64_t f) {
  // Counting sort of the (token, slot) pairs by expert.
  std::vector<int64_t> start(E + 1, 0), order(T * k);
  for (int64_t i = 0; i < T * k; i++) {
    if (ids[i] < 0 || ids[i] >= E) return AOTI_TORCH_FAILURE;
    start[ids[i] + 1]++;
  }
  int64_t most = 0;
  for (int64_t e = 0; e < E; e++) {
    most = std::max(most, start[e + 1]);
    start[e + 1] += start[e];
  }
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < T * k; i++) order[fill[ids[i]]++] = i;

  std::vector<float> rows(most * d), hidden(most * 2 * f), act(most * f), y(most * d);
  for (int64_t i = 0; i < T * d; i++) out[i] = 0.f;
  for (int64_t e = 0; e < E; e++) {
    const int64_t n = start[e + 1] - start[e];
    if (!n) continue;
    const int64_t* pairs = order.data() + start[e];
    for (int64_t r = 0; r < n; r++) {
      const float* src = x + (pairs[r] / k) * d;
      std::copy(src, src + d, rows.data() + r * d);
    }
    AOTI_TORCH_ERROR_CODE_CHECK(
        matmul_t(rows.data(), n, d, gate_up + e * 2 * f * d, 2 * f, hidden.data()));
    for (int64_t r = 0; r < n; r++) {
      const float* g = hidden.data() + r * 2 * f;
      float* a = act.data() + r * f;
      for (int64_t j = 0; j < f; j++) a[j] = g[j] / (1.f + std::exp(-g[j])) * g[f + j];
    }
    AOTI_TORCH_ERROR_CODE_CHECK(matmul_t(act.data(), n, f, down + e * d * f, d, y.data()));
    for (int64_t r = 0; r < n; r++) {
      const float w = weights[pairs[r]];
      float* dst = out + (pairs[r] / k) * d;
      const float* src = y.data() + r * d;
      for (int64_t j = 0; j < d; j++) dst[j] += src[j] * w;
    }
  }
  return AOTI_TORCH_SUCCESS;
}

}  // namespace aotgen_moe

#pragma GCC pop_options

// Hidden: the shim stays inside the graph's .so (export/shims.py links it in).
#pragma GCC visibility push(hidden)
AOTITorchError aoti_torch_cpu_moe_experts(AtenTensorHandle x, AtenTensorHandle weights,
                                          AtenTensorHandle ids, AtenTensorHandle gate_up,
                                          AtenTensorHandle down, AtenTensorHandle* ret0) {
  int64_t *x_sizes, *w_sizes, *gu_sizes, *down_sizes;
  void *x_data, *w_data, *id_data, *gu_data, *down_data, *out_data;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(x, &x_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(weights, &w_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(gate_up, &gu_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(down, &down_sizes));
  for (AtenTensorHandle t : {x, weights, ids, gate_up, down}) {
    bool contiguous = false;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_is_contiguous(t, &contiguous));
    if (!contiguous) return AOTI_TORCH_FAILURE;
  }
  const int64_t T = x_sizes[0], d = x_sizes[1], k = w_sizes[1], E = gu_sizes[0];
  const int64_t f = down_sizes[2];
  if (gu_sizes[1] != 2 * f || gu_sizes[2] != d || down_sizes[0] != E || down_sizes[1] != d)
    return AOTI_TORCH_FAILURE;
  const int64_t out_sizes[2] = {T, d}, out_strides[2] = {d, 1};
  AtenTensorHandle out;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(
      2, out_sizes, out_strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0, &out));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(x, &x_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(weights, &w_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(ids, &id_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(gate_up, &gu_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(down, &down_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(out, &out_data));
  const AOTITorchError rc = aotgen_moe::experts(
      (const float*)x_data, (const float*)w_data, (const int64_t*)id_data, (float*)gu_data,
      (float*)down_data, (float*)out_data, T, k, E, d, f);
  if (rc != AOTI_TORCH_SUCCESS) {
    aoti_torch_delete_tensor_object(out);
    return rc;
  }
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}
#pragma GCC visibility pop
