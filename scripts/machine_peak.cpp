// What the CPU can do at most, for judging a kernel's GFLOP/s and GB/s (scripts/machine_peak.py):
// float32 multiply-adds per second from independent vector chains, and read bandwidth of a
// buffer far larger than the caches. Built with -march=native, as the kernels are.
#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#pragma GCC optimize("O2", "fp-contract=fast")

#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
constexpr int kChains = 12;  // > FMA latency x pipes on the CPUs measured; fits 16 registers

// GFLOP/s (2 per multiply-add) of `threads` threads each running `iters` steps of kChains
// independent vector multiply-adds.
extern "C" double fma_gflops(int threads, int64_t iters) {
  float sink = 0;
  const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    vf acc[kChains];
    const vf m = (vf){} + 0.999f, b = (vf){} + 1e-3f;
    // No chain may start at the fixed point 1 (0.999 * 1 + 0.001): GCC would fold it away.
#pragma GCC unroll 16
    for (int c = 0; c < kChains; c++) acc[c] = (vf){} + (2.5f + c);
    for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 16
      for (int c = 0; c < kChains; c++) acc[c] = acc[c] * m + b;
    for (int c = 0; c < kChains; c++) sink += acc[c][0];
  }
  const double seconds = omp_get_wtime() - start;
  return sink == 12345.f ? 0 : 2.0 * kLanes * kChains * iters * threads / seconds / 1e9;
}

// GB/s of `threads` threads summing their parts of a `bytes` buffer, best of `rounds`. Each
// thread reads kStreams places of its part in step: one stream at a time leaves the memory
// system idle between a core's requests (measured 17.6 GB/s on 2 Zen 1 threads, where a kernel
// streaming three weight panels side by side read 23 GB/s).
constexpr int kStreams = 4;

extern "C" double read_gbps(int threads, int64_t bytes, int rounds) {
  const int64_t n = bytes / sizeof(vf), part = n / threads, step = part / kStreams;
  vf* buf = (vf*)aligned_alloc(64, n * sizeof(vf));
  memset(buf, 1, n * sizeof(vf));
  double best = 0;
  float sink = 0;
  for (int r = 0; r < rounds; r++) {
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      const vf* base = buf + omp_get_thread_num() * part;
      vf acc[kStreams] = {};
      for (int64_t i = 0; i < step; i += 2)
#pragma GCC unroll 8
        for (int s = 0; s < kStreams; s++) acc[s] += base[s * step + i] + base[s * step + i + 1];
      for (int s = 0; s < kStreams; s++) sink += acc[s][0];
    }
    const double gbps = threads * part * sizeof(vf) / (omp_get_wtime() - start) / 1e9;
    best = gbps > best ? gbps : best;
  }
  free(buf);
  return sink == 12345.f ? 0 : best;
}
