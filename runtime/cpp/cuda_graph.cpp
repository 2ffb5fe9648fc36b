// CUDA-graph replay of fixed-width graphs: CudaReplays (aotgen/runtime/cuda_graph.py).
#include "cuda_graph.h"

#include <map>
#include <stdexcept>
#include <utility>

#ifdef AOTGEN_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace aotgen::detail {

#ifdef AOTGEN_WITH_CUDA

std::optional<std::string> cuda_compute_capability() {
  if (c10::cuda::device_count() == 0) return std::nullopt;
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
  return std::to_string(major) + "." + std::to_string(minor);
}

std::optional<std::string> cuda_problem() {
  if (c10::cuda::device_count() == 0) return "this machine has no CUDA GPU";
  return std::nullopt;
}

namespace {

struct Capture {
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  std::vector<at::Tensor> inputs;  // copied into before each replay
  at::Tensor logits;               // written by each replay
};

}  // namespace

struct CudaReplays::Impl {
  // One memory pool for all of the graph's captures: they never run at the same time.
  at::cuda::MempoolId_t pool = at::cuda::graph_pool_handle();
  std::map<std::pair<const void*, int64_t>, Capture> captures;
};

CudaReplays::CudaReplays() : impl_(std::make_unique<Impl>()) {}
CudaReplays::~CudaReplays() = default;

at::Tensor CudaReplays::operator()(const std::vector<at::Tensor>& inputs, const void* cache,
                                   int64_t span, const Call& call) {
  auto it = impl_->captures.find({cache, span});
  if (it == impl_->captures.end()) {
    // Warm up on a side stream (kernel loading, cuBLAS handles: not capturable), then capture
    // one call there (a capture refuses the default stream); both run the step for real,
    // writing the keys and values the call stands in for.
    Capture c;
    for (const auto& x : inputs) c.inputs.push_back(x.clone());
    c10::cuda::device_synchronize();
    {
      const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
      call(c.inputs, span);
      c10::cuda::device_synchronize();
      c.graph = std::make_unique<at::cuda::CUDAGraph>();
      c.graph->capture_begin(impl_->pool);
      c.logits = call(c.inputs, span);
      c.graph->capture_end();
    }
    c10::cuda::device_synchronize();
    it = impl_->captures.emplace(std::make_pair(cache, span), std::move(c)).first;
  }
  Capture& c = it->second;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!c.inputs[i].sizes().equals(inputs[i].sizes())) {
      throw std::logic_error("a replayed graph's inputs changed shape");
    }
    c.inputs[i].copy_(inputs[i], /*non_blocking=*/true);
  }
  c.graph->replay();
  return c.logits;
}

#else  // a runtime without CUDA: no GPU, nothing replayed

std::optional<std::string> cuda_compute_capability() { return std::nullopt; }

std::optional<std::string> cuda_problem() {
  return "this runtime was built against a libtorch without CUDA";
}

struct CudaReplays::Impl {};

CudaReplays::CudaReplays() {
  throw std::logic_error("this runtime was built without CUDA: nothing to replay");
}
CudaReplays::~CudaReplays() = default;

at::Tensor CudaReplays::operator()(const std::vector<at::Tensor>&, const void*, int64_t,
                                   const Call&) {
  throw std::logic_error("this runtime was built without CUDA: nothing to replay");
}

#endif

}  // namespace aotgen::detail
