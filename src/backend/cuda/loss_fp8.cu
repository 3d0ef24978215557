// Cross-entropy backward written straight to FP8 codes, for the FP8 LM head
// (models/transformer_lm.cpp): one read of the BF16 logits row, the gradient
// d_loss / n_valid * (softmax - onehot) computed with loss.cu's arithmetic (exp2f of the
// scaled difference to lse), rounded to BF16 as loss.cu stores it, times the static FP8
// scale and converted with fp8_cvt.cuh's rules: the bytes of cross_entropy_backward (BF16)
// followed by quantize_per_tensor, without writing and re-reading the BF16 gradient.
// Columns in [V, W) (the head's vocabulary padding) get code 0.
//
// Layout: logits [N, ld] BF16, row stride and base multiples of 8 elements (16 bytes); q
// [N, W] contiguous, W a multiple of 8. One 256-thread block per row, 8 elements (one 16-byte
// load, one 8-byte store) per thread per step. n_valid is counted on the device by a
// one-block kernel first (nothing read back, so a CUDA graph can capture both).
//
// Floor: 2 bytes read + 1 written per element (1024 x 128256: 394 MB -> ~96 us at 4.1 TB/s),
// against 2 + 2 for the BF16 backward plus 2 + 2 for the cast with its transposed copy; the
// transposed copy is transpose_2d's (1 + 1). Not measured yet.
#include "loss_fp8.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda_check.h"
#include "fp8_cvt.cuh"
#include "vec_io.cuh"

namespace tessera::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kCountThreads = 1024;
constexpr float kLog2e = 1.4426950408889634f;  // loss.cu's constant: the same exp2f argument

// scale = d_loss / n_valid as loss.cu's grad_scale_kernel computes it (double division, one
// rounding to float), 0 when no row is valid.
template <typename Tg>
__global__ void __launch_bounds__(kCountThreads)
    count_scale_kernel(const Tg* targets, int64_t rows, int64_t ignore_index, float d_loss, float* scale) {
  __shared__ unsigned long long total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  unsigned long long valid = 0;
  for (int64_t n = threadIdx.x; n < rows; n += kCountThreads) valid += static_cast<int64_t>(targets[n]) != ignore_index;
  atomicAdd(&total, valid);
  __syncthreads();
  if (threadIdx.x == 0)
    *scale = total > 0 ? static_cast<float>(static_cast<double>(d_loss) / static_cast<double>(total)) : 0.0f;
}

template <typename Tg, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    grad_fp8_kernel(const uint16_t* logits, const Tg* targets, const float* lse, const float* scale_ptr,
                    const float* fp8_scale, uint8_t* q, int64_t vocab, int64_t width, int64_t ld,
                    int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const int64_t t = static_cast<int64_t>(targets[row]);
  const float row_lse = lse[row], scale = *scale_ptr, s = *fp8_scale;
  const bool ignored = t == ignore_index, fixed = ignored || t < 0 || t >= vocab;
  const float fixed_value = ignored ? 0.0f : NAN;
  const uint16_t* x = logits + row * ld;
  uint8_t* out = q + row * width;
  for (int64_t v0 = int64_t(threadIdx.x) * vec::kWidth; v0 < width; v0 += int64_t(kThreads) * vec::kWidth) {
    float g[vec::kWidth];
    if (v0 + vec::kWidth <= vocab) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + v0);
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        g[2 * k] = bits_float(w[k] << 16);
        g[2 * k + 1] = bits_float(w[k] & 0xffff0000u);
      }
    } else {
#pragma unroll
      for (int k = 0; k < vec::kWidth; ++k) g[k] = v0 + k < vocab ? bf16_bits_to_float(x[v0 + k]) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < vec::kWidth; ++k) {
      const int64_t v = v0 + k;
      const float p = scale * exp2f((g[k] - row_lse) * kLog2e);
      const float d = fixed ? fixed_value : (v == t ? p - scale : p);
      // Padding columns: exactly 0 (loss.cu never writes them; the GEMM left them 0).
      g[k] = v < vocab ? bf16_bits_to_float(float_to_bf16_bits(d)) : 0.0f;
    }
    uint32_t words[2];
    fp8cvt::quantize_words<kE4M3, vec::kWidth>(g, s, words);
    *reinterpret_cast<uint2*>(out + v0) = make_uint2(words[0], words[1]);
  }
}

}  // namespace

bool cross_entropy_backward_fp8_supported(const Tensor& logits, const Tensor& lse, const Tensor& q) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return logits.dtype() == DType::BF16 && lse.dtype() == DType::F32 && lse.is_contiguous() &&
         (q.dtype() == DType::E4M3 || q.dtype() == DType::E5M2) && q.dim() == 2 && q.is_contiguous() &&
         q.size(0) == logits.size(0) && q.size(1) >= logits.size(1) && q.size(1) % 8 == 0 &&
         logits.stride(1) == 1 && logits.stride(0) % 8 == 0 && aligned(logits.raw_data()) && aligned(q.raw_data());
}

void cross_entropy_backward_fp8(void* stream, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                float d_loss, const Tensor& fp8_scale, Tensor& q, int64_t ignore_index) {
  const int64_t rows = logits.size(0), vocab = logits.size(1), width = q.size(1);
  if (rows == 0) return;
  TESSERA_CHECK(rows <= 0x7fffffff, "cross_entropy_backward_fp8 on CUDA: ", rows, " rows exceed one grid");
  auto s = static_cast<cudaStream_t>(stream);
  Tensor scale = Tensor::empty({1}, DType::F32, logits.device());
  const auto run = [&](auto* ttag) {
    using Tg = std::remove_pointer_t<decltype(ttag)>;
    const Tg* tg = targets.data<Tg>();
    count_scale_kernel<Tg><<<1, kCountThreads, 0, s>>>(tg, rows, ignore_index, d_loss, scale.data<float>());
    const auto* x = static_cast<const uint16_t*>(logits.raw_data());
    auto* out = static_cast<uint8_t*>(q.raw_data());
    const auto kernel = q.dtype() == DType::E4M3 ? grad_fp8_kernel<Tg, true> : grad_fp8_kernel<Tg, false>;
    kernel<<<static_cast<unsigned>(rows), kThreads, 0, s>>>(x, tg, lse.data<float>(), scale.data<float>(),
                                                            fp8_scale.data<float>(), out, vocab, width,
                                                            logits.stride(0), ignore_index);
  };
  if (targets.dtype() == DType::I64) run(static_cast<int64_t*>(nullptr));
  else run(static_cast<int32_t*>(nullptr));
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
