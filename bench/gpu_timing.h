// What every GPU benchmark program here times with: a check that exits on a CUDA error, and
// the median of many timed runs after warm-up, timed with CUDA events (METHOD: events, not
// host clocks; median, not mean).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CHECK_CUDA(call)                                                                             \
  do {                                                                                               \
    cudaError_t e_ = (call);                                                                         \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

// Calls per timed sample: 1, or TESSERA_BENCH_BATCH. With one call the GPU is idle when the
// start event fires, so the sample includes the host's time to launch the call (the op's
// checks, allocations and launches: a few microseconds). With K calls back to back the host
// runs ahead of the GPU, as in a training step, and a sample is the K calls' time over K: the
// GPU time of one call, its launch latency hidden behind the previous call.
inline int timing_batch() {
  const char* s = std::getenv("TESSERA_BENCH_BATCH");
  const int k = s ? std::atoi(s) : 1;
  return k > 1 ? k : 1;
}

// Median milliseconds of `runs` timed samples of fn after `warmup` untimed calls; a sample is
// one call, or the mean of timing_batch() calls back to back.
inline double median_ms(const std::function<void()>& fn, int runs, int warmup = 5) {
  for (int i = 0; i < warmup; ++i) fn();
  CHECK_CUDA(cudaDeviceSynchronize());
  const int batch = timing_batch();
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    for (int k = 0; k < batch; ++k) fn();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(double(t) / batch);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}
