// accumulate_weighted_loss on the GPU: acc += (sum_i double(x[i]) * w[i]) / divisor, the
// host's double arithmetic in the host's order (one thread, __dmul_rn / __dadd_rn /
// __ddiv_rn: no contraction into fused multiply-adds), so the device value is bit for bit
// the host's. Layout: x [n] contiguous F32 or F64; the weights travel as kernel arguments,
// kMaxWeights per launch, with the running total carried between launches in a device
// scratch double, so that nothing is copied from the host and the launches can be captured
// into a CUDA graph. Floor: a few hundred bytes and one launch per 64 chunks of 1024 rows,
// i.e. launch latency (~2 us, nothing under a graph replay).
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_check.h"
#include "loss_accumulate.h"

namespace tessera::cuda {

namespace {

constexpr int kMaxWeights = 64;  // 512 bytes of kernel arguments per launch

struct Weights {
  double w[kMaxWeights];
};

// running: scratch carrying the total between launches (read unless first, written unless
// last); acc: read and written by the last launch only.
template <typename T>
__global__ void weighted_sum_kernel(const T* x, int count, Weights weights, bool first, bool last, double* running,
                                    double* acc, double divisor) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double total = first ? 0.0 : *running;
  for (int i = 0; i < count; ++i) total = __dadd_rn(total, __dmul_rn(static_cast<double>(x[i]), weights.w[i]));
  if (last) *acc = __dadd_rn(*acc, __ddiv_rn(total, divisor));
  else *running = total;
}

}  // namespace

bool accumulate_weighted_loss_supported(const Tensor& chunk_losses, const Tensor& acc) {
  return (chunk_losses.dtype() == DType::F32 || chunk_losses.dtype() == DType::F64) && acc.dtype() == DType::F64;
}

void accumulate_weighted_loss(void* stream, const Tensor& chunk_losses, const std::vector<double>& weights,
                              double divisor, Tensor& acc) {
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t n = static_cast<int64_t>(weights.size());
  Tensor running;
  if (n > kMaxWeights) running = Tensor::empty({1}, DType::F64, acc.device());
  double* running_ptr = running.defined() ? running.data<double>() : nullptr;
  // n = 0 still adds 0 / divisor, as the host does.
  for (int64_t begin = 0; begin == 0 || begin < n; begin += kMaxWeights) {
    const int count = static_cast<int>(std::min<int64_t>(kMaxWeights, n - begin));
    Weights w{};
    std::copy(weights.begin() + begin, weights.begin() + begin + count, w.w);
    const bool first = begin == 0, last = begin + kMaxWeights >= n;
    if (chunk_losses.dtype() == DType::F64) {
      weighted_sum_kernel<double><<<1, 32, 0, s>>>(chunk_losses.data<double>() + begin, count, w, first, last,
                                                    running_ptr, acc.data<double>(), divisor);
    } else {
      weighted_sum_kernel<float><<<1, 32, 0, s>>>(chunk_losses.data<float>() + begin, count, w, first, last,
                                                   running_ptr, acc.data<double>(), divisor);
    }
    TESSERA_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace tessera::cuda
