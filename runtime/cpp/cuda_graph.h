// The CUDA side of the runtime (aotgen/runtime/cuda_graph.py): which GPU this process sees,
// and the replay of a fixed-width graph's calls as CUDA graphs. Compiled with CUDA where the
// libtorch it links has it (AOTGEN_WITH_CUDA); otherwise no GPU is seen and no replay made.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace aotgen::detail {

// "major.minor" of GPU 0, as the manifest records it; none without a GPU or without CUDA.
std::optional<std::string> cuda_compute_capability();

// Why this runtime cannot run a CUDA package, or none if it can.
std::optional<std::string> cuda_problem();

// Calls of one graph replayed as CUDA graphs: captured on first use per KV cache and span of
// keys (the runtime's key_span), with the call's inputs copied into buffers the capture owns,
// replayed after. The logits live in the capture's memory: the next replay overwrites them.
class CudaReplays {
 public:
  // Runs the graph on `inputs` (tokens, input_pos[, tree_mask], on the GPU) attending `span`
  // keys; it is called to warm up and to capture.
  using Call = std::function<at::Tensor(const std::vector<at::Tensor>& inputs, int64_t span)>;

  CudaReplays();  // throws where the runtime was built without CUDA
  ~CudaReplays();

  at::Tensor operator()(const std::vector<at::Tensor>& inputs, const void* cache, int64_t span,
                        const Call& call);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace aotgen::detail
