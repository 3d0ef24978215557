// cuBLASLt GEMM against the CPU reference on random data: every transpose combination,
// odd sizes, alpha/beta, bias, F32 and BF16. Outputs are poisoned with NaN first.
// Skipped (saying so) where no GPU is present.
#include "tessera/core/allocator.h"
#include "tessera/ops/gemm.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

#define REQUIRE_GPU() \
  if (!cuda_available()) GTEST_SKIP() << "no GPU present (or no CUDA backend in this build): skipping GPU test"

TEST(GpuGemm, MatchesTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  struct Case {
    int64_t m, n, k;
  };
  uint64_t seed = 1;
  for (DType in : {DType::F32, DType::BF16}) {
    for (DType out : {DType::F32, DType::BF16}) {
      if (in == DType::F32 && out == DType::BF16) continue;  // no cuBLASLt path: see the next test
      for (Case s : {Case{1, 1, 1}, Case{33, 65, 17}, Case{128, 256, 64}, Case{7, 300, 129}}) {
        for (int t = 0; t < 4; ++t) {
          const bool ta = t & 1, tb = t & 2;
          Tensor a = random_tensor(ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, in, seed++);
          Tensor b = random_tensor(tb ? Shape{s.n, s.k} : Shape{s.k, s.n}, in, seed++);
          Tensor bias = random_tensor({s.n}, out, seed++);
          for (bool with_bias : {false, true}) {
            for (float beta : {0.0f, 0.5f}) {
              Tensor c_cpu = random_tensor({s.m, s.n}, out, seed++);
              Tensor c_gpu = c_cpu.to(Device::cuda());
              if (beta == 0.0f) {
                poison(c_cpu);
                c_gpu = c_cpu.to(Device::cuda());  // NaN must not leak through beta = 0
              }
              const GemmOptions o{.transpose_a = ta, .transpose_b = tb, .alpha = 0.75f, .beta = beta};
              const Tensor no_bias;
              gemm(cpu, a, b, c_cpu, o, with_bias ? bias : no_bias);
              gemm(gpu, a.to(Device::cuda()), b.to(Device::cuda()), c_gpu, o,
                   with_bias ? bias.to(Device::cuda()) : no_bias);
              const double tol = out == DType::BF16 ? 1e-2 : 1e-5;
              EXPECT_LT(relative_error(c_gpu.to(Device::cpu()), c_cpu), tol)
                  << dtype_name(in) << "->" << dtype_name(out) << " " << s.m << "x" << s.n << "x" << s.k << " ta=" << ta
                  << " tb=" << tb << " bias=" << with_bias << " beta=" << beta;
            }
          }
        }
      }
    }
  }
}

TEST(GpuGemm, UnsupportedDtypesAreAClearError) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  Tensor a = Tensor::zeros({4, 4}, DType::E4M3, Device::cuda()), c = Tensor::zeros({4, 4}, DType::F32, Device::cuda());
  EXPECT_THROW(gemm(gpu, a, a, c), Error);
  Tensor f32 = Tensor::zeros({4, 4}, DType::F32, Device::cuda()), bf16 = Tensor::zeros({4, 4}, DType::BF16, Device::cuda());
  EXPECT_THROW(gemm(gpu, f32, f32, bf16), Error);
  Tensor host = Tensor::zeros({4, 4}, DType::F32);
  EXPECT_THROW(gemm(gpu, host, host, c), Error);  // operands on another device
}
