// The experts of a mixture-of-experts layer on CPU: out [T, d] = sum over each token's k routed
// experts e of w * down_e(silu(gate_e(x)) * up_e(x)). Compiled into each graph's .so by
// AOTInductor as the C shim of `aotgen::moe_experts` (kernels/moe.py, whose eager reference
// defines it).
//
// Why: an exported graph has fixed shapes, so without a kernel it must either run every expert
// on every token (E / k times the work) or gather k weight matrices per token (one weight read
// per token and expert). Here the tokens are grouped by expert (a counting sort of the routing
// ids) and each routed expert runs once, as two matmuls over its tokens: its weights are read
// once per step. Experts run in parallel, one thread each.
//
// x [T, d] float32; weights [T, k] float32 and ids [T, k] int64: each token's experts and their
// routing weights; gate_up [E, 2f, d] (the gate's rows, then the up projection's) and down
// [E, d, f], contiguous: float32, or int8 with float32 scales per row (`moe_experts_int8`: each
// routed expert dequantized once per call into a buffer). The matmuls go to ATen's CPU mm
// (MKL / oneDNN) through the C shim API; the grouping, SwiGLU and weighted sum are plain loops.
// Each token's output sums its experts in ascending order, as transformers does.
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

// One expert's weights [rows, cols] as float32: in place when they are, else int8 rows times
// their scales, into `buffer`.
static float* expert_weights(const void* all, const float* scales, int64_t e, int64_t rows,
                             int64_t cols, std::vector<float>& buffer) {
  if (!scales) return (float*)all + e * rows * cols;
  const int8_t* q = (const int8_t*)all + e * rows * cols;
  const float* s = scales + e * rows;
  buffer.resize(rows * cols);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) buffer[r * cols + c] = q[r * cols + c] * s[r];
  return buffer.data();
}

static AOTITorchError experts(const float* x, const float* weights, const int64_t* ids,
                              const void* gate_up, const float* gate_up_scale, const void* down,
                              const float* down_scale, float* out, int64_t T, int64_t k,
                              int64_t E, int64_t d, int64_t f) {
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
  AOTITorchError rc = AOTI_TORCH_SUCCESS;
#pragma omp parallel
  {
    std::vector<float> rows, hidden, act, gate_up_f, down_f;
#pragma omp for schedule(dynamic, 1)
    for (size_t h = 0; h < hit.size(); h++) {
      const int64_t e = hit[h], n = start[e + 1] - start[e];
      const int64_t* pairs = order.data() + start[e];
      rows.resize(n * d);
      hidden.resize(n * 2 * f);
      act.resize(n * f);
      for (int64_t r = 0; r < n; r++) {
        const float* src = x + (pairs[r] / k) * d;
        std::copy(src, src + d, rows.data() + r * d);
      }
      float* w_gate_up = expert_weights(gate_up, gate_up_scale, e, 2 * f, d, gate_up_f);
      if (matmul_t(rows.data(), n, d, w_gate_up, 2 * f, hidden.data()) != AOTI_TORCH_SUCCESS)
        rc = AOTI_TORCH_FAILURE;
      for (int64_t r = 0; r < n; r++) {
        const float* g = hidden.data() + r * 2 * f;
        float* a = act.data() + r * f;
        for (int64_t j = 0; j < f; j++) a[j] = g[j] / (1.f + std::exp(-g[j])) * g[f + j];
      }
      float* w_down = expert_weights(down, down_scale, e, d, f, down_f);
      if (matmul_t(act.data(), n, f, w_down, d, y.data() + start[e] * d) != AOTI_TORCH_SUCCESS)
        rc = AOTI_TORCH_FAILURE;
    }
  }
  if (rc != AOTI_TORCH_SUCCESS) return rc;
  // The weighted sum, experts in ascending order as transformers adds them.
  for (int64_t i = 0; i < T * d; i++) out[i] = 0.f;
  for (int64_t p = 0; p < T * k; p++) {
    const float w = weights[order[p]];
    float* dst = out + (order[p] / k) * d;
    const float* src = y.data() + p * d;
    for (int64_t j = 0; j < d; j++) dst[j] += src[j] * w;
  }
  return AOTI_TORCH_SUCCESS;
}

}  // namespace aotgen_moe

#pragma GCC pop_options

// Hidden: the shims stay inside the graph's .so (export/shims.py links them in).
#pragma GCC visibility push(hidden)
// x [T, d], weights [T, k] float32, ids [T, k] int64, gate_up [E, 2f, d], down [E, d, f]: float32,
// or int8 with float32 row scales gate_up_scale [E, 2f], down_scale [E, d] (else null).
static AOTITorchError aotgen_moe_shim(AtenTensorHandle x, AtenTensorHandle weights,
                                      AtenTensorHandle ids, AtenTensorHandle gate_up,
                                      AtenTensorHandle gate_up_scale, AtenTensorHandle down,
                                      AtenTensorHandle down_scale, AtenTensorHandle* ret0) {
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
  if (gate_up_scale) {
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(gate_up_scale, &gu_scale));
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(down_scale, &down_scale_data));
  }
  const AOTITorchError rc = aotgen_moe::experts(
      (const float*)x_data, (const float*)w_data, (const int64_t*)id_data, gu_data,
      (const float*)gu_scale, down_data, (const float*)down_scale_data, (float*)out_data, T, k, E,
      d, f);
  if (rc != AOTI_TORCH_SUCCESS) {
    aoti_torch_delete_tensor_object(out);
    return rc;
  }
  *ret0 = out;
  return AOTI_TORCH_SUCCESS;
}

AOTITorchError aoti_torch_cpu_moe_experts(AtenTensorHandle x, AtenTensorHandle weights,
                                          AtenTensorHandle ids, AtenTensorHandle gate_up,
                                          AtenTensorHandle down, AtenTensorHandle* ret0) {
  return aotgen_moe_shim(x, weights, ids, gate_up, nullptr, down, nullptr, ret0);
}

AOTITorchError aoti_torch_cpu_moe_experts_int8(AtenTensorHandle x, AtenTensorHandle weights,
                                               AtenTensorHandle ids, AtenTensorHandle gate_up,
                                               AtenTensorHandle gate_up_scale,
                                               AtenTensorHandle down, AtenTensorHandle down_scale,
                                               AtenTensorHandle* ret0) {
  return aotgen_moe_shim(x, weights, ids, gate_up, gate_up_scale, down, down_scale, ret0);
}
#pragma GCC visibility pop
