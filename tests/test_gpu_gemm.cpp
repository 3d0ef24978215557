// cuBLASLt GEMM against the CPU reference on random data: every transpose combination,
// odd sizes, alpha/beta, bias, F32 and BF16. Outputs are poisoned with NaN first.
// Skipped (saying so) where no GPU is present.
#include <tuple>

#include "tessera/core/allocator.h"
#include "tessera/ops/gemm.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

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

// The GELU epilogues (cuBLASLt GELU_AUX_BIAS / DGELU for BF16, GEMM + activation kernel
// otherwise) against the CPU reference, which is the GEMM followed by gelu_forward /
// gelu_backward. Sizes include ones the epilogue cannot take (N not a multiple of 8).
TEST(GpuGemm, GeluEpiloguesMatchTheCpuReference) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  uint64_t seed = 900;
  for (DType t : {DType::BF16, DType::F32}) {
    for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{64, 256, 96}, {37, 3072, 768}, {5, 100, 33}}) {
      const std::string what = std::string(dtype_name(t)) + " " + std::to_string(m) + "x" + std::to_string(n) + "x" +
                               std::to_string(k);
      const Tensor x = random_tensor({m, k}, t, seed++, -2, 2), w = random_tensor({n, k}, t, seed++, -0.2f, 0.2f);
      const Tensor bias = random_tensor({n}, t, seed++);
      for (bool with_bias : {true, false}) {
        const Tensor b = with_bias ? bias : Tensor();
        Tensor pre_cpu = Tensor::empty({m, n}, t), y_cpu = Tensor::empty({m, n}, t);
        gemm_bias_gelu(cpu, x, w, b, pre_cpu, y_cpu, {.transpose_b = true});
        Tensor pre_gpu = Tensor::empty({m, n}, t), y_gpu = Tensor::empty({m, n}, t);
        poison(pre_gpu);
        poison(y_gpu);
        pre_gpu = pre_gpu.to(Device::cuda());
        y_gpu = y_gpu.to(Device::cuda());
        gemm_bias_gelu(gpu, x.to(Device::cuda()), w.to(Device::cuda()), with_bias ? bias.to(Device::cuda()) : Tensor(),
                       pre_gpu, y_gpu, {.transpose_b = true});
        const double tol = t == DType::BF16 ? 1e-2 : 1e-5;
        EXPECT_LT(relative_error(pre_gpu.to(Device::cpu()), pre_cpu), tol) << what << " pre";
        EXPECT_LT(relative_error(y_gpu.to(Device::cpu()), y_cpu), tol) << what << " gelu";
      }
      // Backward: d_pre = (dy W) * gelu'(pre), with dy [m, k'] = [m, n_out] and W [n_out, n].
      const Tensor pre = random_tensor({m, n}, t, seed++, -3, 3);
      const Tensor dy = random_tensor({m, k}, t, seed++), w2 = random_tensor({k, n}, t, seed++, -0.2f, 0.2f);
      Tensor d_cpu = Tensor::empty({m, n}, t);
      gemm_gelu_backward(cpu, dy, w2, pre, d_cpu);
      Tensor d_gpu = Tensor::empty({m, n}, t);
      poison(d_gpu);
      d_gpu = d_gpu.to(Device::cuda());
      gemm_gelu_backward(gpu, dy.to(Device::cuda()), w2.to(Device::cuda()), pre.to(Device::cuda()), d_gpu);
      EXPECT_LT(relative_error(d_gpu.to(Device::cpu()), d_cpu), t == DType::BF16 ? 1.5e-2 : 1e-5) << what << " backward";
    }
  }
}

// The plan cache keys on shape and alignment, not on pointers: the same shape with fresh
// buffers (and an offset view, so a different alignment) must still be right.
TEST(GpuGemm, CachedPlansServeNewBuffers) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  for (int round = 0; round < 3; ++round) {
    const Tensor a = random_tensor({48, 64}, DType::BF16, 70 + round), b = random_tensor({64, 40}, DType::BF16, 80 + round);
    Tensor want = Tensor::empty({48, 40}, DType::F32);
    gemm(cpu, a, b, want);
    Tensor big = Tensor::zeros({48 * 40 + 2}, DType::F32, Device::cuda());
    Tensor got = big.slice(0, round == 2 ? 1 : 0, (round == 2 ? 1 : 0) + 48 * 40).reshape({48, 40});
    gemm(gpu, a.to(Device::cuda()), b.to(Device::cuda()), got);
    EXPECT_LT(relative_error(got.to(Device::cpu()), want), 1e-5) << "round " << round;
  }
}

// The LM head's GEMMs with a padded row stride on the output (forward) and on an input
// (both backward products) against the packed CPU reference.
TEST(GpuGemm, RowStridedOperands) {
  REQUIRE_GPU();
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const int64_t n = 64, c = 96, vocab = 1001, ld = 1008;
  const Tensor h = random_tensor({n, c}, DType::BF16, 41), w = random_tensor({vocab, c}, DType::BF16, 42);
  Tensor want = Tensor::empty({n, vocab}, DType::BF16);
  gemm(cpu, h, w, want, {.transpose_b = true});
  Tensor buf = Tensor::empty({n, ld}, DType::BF16, Device::cuda());
  Tensor logits = buf.slice(1, 0, vocab);
  gemm(gpu, h.to(Device::cuda()), w.to(Device::cuda()), logits, {.transpose_b = true});
  EXPECT_LT(relative_error(logits.contiguous().to(Device::cpu()), want), 1e-2);
  // dh = dlogits W and dW = dlogits^T h with the strided dlogits as an input.
  Tensor dh_want = Tensor::empty({n, c}, DType::F32), dw_want = Tensor::empty({vocab, c}, DType::F32);
  gemm(cpu, want, w, dh_want);
  gemm(cpu, want, h, dw_want, {.transpose_a = true});
  Tensor dh = Tensor::empty({n, c}, DType::F32, Device::cuda()), dw = Tensor::empty({vocab, c}, DType::F32, Device::cuda());
  gemm(gpu, logits, w.to(Device::cuda()), dh);
  gemm(gpu, logits, h.to(Device::cuda()), dw, {.transpose_a = true});
  EXPECT_LT(relative_error(dh.to(Device::cpu()), dh_want), 1e-2);
  EXPECT_LT(relative_error(dw.to(Device::cpu()), dw_want), 1e-2);
}

// linear_weight_grad: dW += dy^T x and db += column sums of dy, on CUDA one cuBLASLt GEMM
// whose epilogue makes the bias sums (or the two ops where cuBLASLt has no such kernel,
// e.g. odd widths). Both gradients accumulate onto what they held.
TEST(GpuGemm, LinearWeightGradMatchesTheCpuReference) {
  REQUIRE_GPU();
  Context gpu = Context::cuda(), cpu = Context::cpu();
  struct Size {
    int64_t rows, out, in;
  };
  uint64_t seed = 900;
  for (const Size s : {Size{4096, 768, 768}, Size{1024, 2304, 768}, Size{300, 72, 40}, Size{17, 5, 3}}) {
    for (const DType t : {DType::BF16, DType::F32}) {
      const Tensor dy = random_tensor({s.rows, s.out}, t, seed++), x = random_tensor({s.rows, s.in}, t, seed++);
      Tensor dw_cpu = random_tensor({s.out, s.in}, DType::F32, seed++), db_cpu = random_tensor({s.out}, DType::F32, seed++);
      Tensor dw_gpu = dw_cpu.to(kCuda), db_gpu = db_cpu.to(kCuda);
      linear_weight_grad(cpu, dy, x, dw_cpu, db_cpu);
      linear_weight_grad(gpu, dy.to(kCuda), x.to(kCuda), dw_gpu, db_gpu);
      const std::string what = std::string(dtype_name(t)) + " " + std::to_string(s.rows) + "x" + std::to_string(s.out) +
                               "x" + std::to_string(s.in);
      // FP32 accumulation on the GPU against double column sums on the CPU.
      const double tol = t == DType::BF16 ? 1e-3 : 1e-5;
      EXPECT_LT(relative_error(dw_gpu.to(Device::cpu()), dw_cpu), tol) << what << " weight";
      EXPECT_LT(relative_error(db_gpu.to(Device::cpu()), db_cpu), tol) << what << " bias";
    }
  }
  // Without a bias it is the weight GEMM alone.
  const Tensor dy = random_tensor({64, 32}, DType::BF16, seed++), x = random_tensor({64, 16}, DType::BF16, seed++);
  Tensor dw_cpu = Tensor::zeros({32, 16}, DType::F32), none;
  Tensor dw_gpu = dw_cpu.to(kCuda);
  linear_weight_grad(cpu, dy, x, dw_cpu, none);
  linear_weight_grad(gpu, dy.to(kCuda), x.to(kCuda), dw_gpu, none);
  EXPECT_LT(relative_error(dw_gpu.to(Device::cpu()), dw_cpu), 1e-3);
}
