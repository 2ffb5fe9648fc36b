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
#pragma GCC unroll 16
    for (int c = 0; c < kChains; c++) acc[c] = (vf){} + (2.5f + c);  // none at the fixed point 1, or GCC folds its chain
    for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 16
      for (int c = 0; c < kChains; c++) acc[c] = acc[c] * m + b;
    for (int c = 0; c < kChains; c++) sink += acc[c][0];
  }
  const double seconds = omp_get_wtime() - start;
  return sink == 12345.f ? 0 : 2.0 * kLanes * kChains * iters * threads / seconds / 1e9;
}

// GB/s of `threads` threads summing their parts of a `bytes` buffer, best of `rounds`.
extern "C" double read_gbps(int threads, int64_t bytes, int rounds) {
  const int64_t n = bytes / sizeof(vf);
  vf* buf = (vf*)aligned_alloc(64, n * sizeof(vf));
  memset(buf, 1, n * sizeof(vf));
  double best = 0;
  float sink = 0;
  for (int r = 0; r < rounds; r++) {
    const double start = omp_get_wtime();
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : sink)
    for (int64_t block = 0; block < n / 4; block++) {
      const vf s = buf[4 * block] + buf[4 * block + 1] + buf[4 * block + 2] + buf[4 * block + 3];
      sink += s[0];
    }
    const double gbps = n * sizeof(vf) / (omp_get_wtime() - start) / 1e9;
    best = gbps > best ? gbps : best;
  }
  free(buf);
  return sink == 12345.f ? 0 : best;
}
