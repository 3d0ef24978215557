#include "tessera/core/random.h"

#include "../backend/cpu/element.h"
#include "tessera/core/philox.h"
#if TESSERA_WITH_CUDA
#include "../backend/cuda/cuda_backend.h"
#endif

namespace tessera {

namespace {
void check_fill_target(const Context& ctx, const Tensor& out, const char* op) {
  check_contiguous(out, op, "out");
  check_floating(out, op, "out");
  TESSERA_CHECK(out.device() == ctx.device, op, ": out ", out.describe(), " is not on the context's device ",
                ctx.device.to_string());
}
}  // namespace

void fill_uniform(Context& ctx, Tensor& out, float low, float high, uint64_t seed, uint64_t offset) {
  check_fill_target(ctx, out, "fill_uniform");
  TESSERA_CHECK(low <= high, "fill_uniform: low ", low, " is above high ", high);
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    cuda::fill_uniform(ctx.stream, out, low, high, seed, offset);
    return;
#endif
  }
  void* p = out.raw_data();
  const int64_t n = out.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float u = uniform_from_word(philox_word(seed, offset, static_cast<uint64_t>(i)));
    cpu::store_element(p, out.dtype(), i, low + (high - low) * u);
  }
}

void fill_normal(Context& ctx, Tensor& out, float mean, float std, uint64_t seed, uint64_t offset) {
  check_fill_target(ctx, out, "fill_normal");
  TESSERA_CHECK(std >= 0.0f, "fill_normal: negative standard deviation ", std);
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    cuda::fill_normal(ctx.stream, out, mean, std, seed, offset);
    return;
#endif
  }
  void* p = out.raw_data();
  const int64_t n = out.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t w = 2 * static_cast<uint64_t>(i);
    const float z = normal_from_words(philox_word(seed, offset, w), philox_word(seed, offset, w + 1));
    cpu::store_element(p, out.dtype(), i, mean + std * z);
  }
}

}  // namespace tessera
