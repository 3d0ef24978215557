// The norm backward's dgamma/dbeta finalize launched as a programmatic dependent (the
// default, cuda::NormTuning::finalize_pdl) and in stream order, after each backward kernel
// family that writes its partials (row-group, warp-row, the looping kernels of rows too wide
// for registers), against the CPU reference: LayerNorm (with and without beta) and RMSNorm,
// plain and with the residual gradient fused, F32 and BF16; more rows than one wave (several
// rows per worker), parameter gradients accumulating onto non-zero values, dx poisoned
// first. Also, under each variant: the fused backward equals the plain one followed by add()
// to the bit, and two runs give the same bits. Skipped (saying so) without a GPU.
#include <cmath>

#if TESSERA_WITH_CUDA
#include "gpu_norm_testing.h"
#endif
#include "tessera/ops/elementwise.h"
#include "tessera/ops/norm.h"
#include "gpu_testing.h"

using namespace tessera;
using namespace tessera::testing;

#if TESSERA_WITH_CUDA

namespace {

constexpr float kEps = 1e-5f;

struct Variant {
  const char* name;
  cuda::NormTuning tuning;
};
const Variant kVariants[] = {
    {"row groups, finalize in stream order", {.kernel = 1, .finalize_pdl = 0}},
    {"row groups, PDL finalize", {.kernel = 1, .finalize_pdl = 1}},
    {"warp rows, finalize in stream order", {.kernel = 2, .finalize_pdl = 0}},
    {"warp rows, PDL finalize", {.kernel = 2, .finalize_pdl = 1}},
    {"the default", {}},
};

struct Case {
  bool layer, add, beta;
};

// One backward on the CPU, then on the GPU under each variant, from the same inputs and
// statistics.
void check_backward(const Case& k, int64_t rows, int64_t cols, DType t, uint64_t seed) {
  Context cpu = Context::cpu(), gpu = Context::cuda();
  const std::string what = std::string(k.layer ? "layernorm" : "rmsnorm") + (k.add ? "+residual" : "") +
                           (k.layer && !k.beta ? " no beta " : " ") + dtype_name(t) + " " + std::to_string(rows) +
                           "x" + std::to_string(cols);
  const Shape shape{rows, cols};
  const Tensor x = random_tensor(shape, t, seed, -1.0f, 3.0f), dy = random_tensor(shape, t, seed + 1);
  const Tensor dres = random_tensor(shape, t, seed + 2);
  const Tensor gamma = random_tensor({cols}, DType::F32, seed + 3, 0.5f, 1.5f);
  const Tensor beta = random_tensor({cols}, DType::F32, seed + 4);
  const Tensor dgamma0 = random_tensor({cols}, DType::F32, seed + 5), dbeta0 = random_tensor({cols}, DType::F32, seed + 6);
  Tensor y = Tensor::empty(shape, t), mean = Tensor::empty({rows}, DType::F32), rstd = Tensor::empty({rows}, DType::F32);
  if (k.layer) layernorm_forward(cpu, x, gamma, beta, kEps, y, mean, rstd);
  else rmsnorm_forward(cpu, x, gamma, kEps, y, rstd);
  Tensor dx = Tensor::empty(shape, t), dgamma = dgamma0.clone(), dbeta = k.beta ? dbeta0.clone() : Tensor();
  if (k.layer && k.add) layernorm_backward_add(cpu, dy, x, gamma, mean, rstd, dres, dx, dgamma, dbeta);
  else if (k.layer) layernorm_backward(cpu, dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
  else if (k.add) rmsnorm_backward_add(cpu, dy, x, gamma, rstd, dres, dx, dgamma);
  else rmsnorm_backward(cpu, dy, x, gamma, rstd, dx, dgamma);

  const Tensor g_dy = dev(dy), g_x = dev(x), g_gamma = dev(gamma), g_mean = dev(mean), g_rstd = dev(rstd),
               g_dres = dev(dres), dx_poison = poisoned_device(shape, t);
  for (const Variant& v : kVariants) {
    const TuningScope scope(v.tuning);
    Tensor gdx = dx_poison.clone(), gdgamma = dev(dgamma0), gdbeta = k.beta ? dev(dbeta0) : Tensor();
    if (k.layer && k.add) layernorm_backward_add(gpu, g_dy, g_x, g_gamma, g_mean, g_rstd, g_dres, gdx, gdgamma, gdbeta);
    else if (k.layer) layernorm_backward(gpu, g_dy, g_x, g_gamma, g_mean, g_rstd, gdx, gdgamma, gdbeta);
    else if (k.add) rmsnorm_backward_add(gpu, g_dy, g_x, g_gamma, g_rstd, g_dres, gdx, gdgamma);
    else rmsnorm_backward(gpu, g_dy, g_x, g_gamma, g_rstd, gdx, gdgamma);
    const std::string where = std::string(v.name) + ": " + what;
    expect_close(gdx, dx, tolerance(t), where + " dx");
    expect_close(gdgamma, dgamma, 1e-5, where + " dgamma");
    if (k.beta) expect_close(gdbeta, dbeta, 1e-5, where + " dbeta");
  }
}

const Case kCases[] = {{true, false, true}, {true, false, false}, {true, true, true}, {false, false, false},
                       {false, true, false}};

}  // namespace

TEST(GpuNormBackwardVariants, MatchTheCpuReference) {
  REQUIRE_GPU();
  // 2001 and 1501 rows: several rows per worker; 16 rows: fewer rows than workers; 40000
  // columns: a row too wide for registers (the looping kernels).
  const std::pair<int64_t, int64_t> shapes[] = {{2001, 768}, {1501, 4096}, {16, 4096}, {40, 40000}};
  uint64_t seed = 100;
  for (auto [rows, cols] : shapes)
    for (DType t : {DType::BF16, DType::F32})
      for (const Case& k : kCases) check_backward(k, rows, cols, t, seed += 10);
}

TEST(GpuNormBackwardVariants, FusedEqualsPlainThenAddAndRunsRepeat) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const int64_t rows = 3000, cols = 4096;
  const Shape shape{rows, cols};
  for (const Variant& v : kVariants) {
    const TuningScope scope(v.tuning);
    for (DType t : {DType::BF16, DType::F32}) {
      const std::string what = std::string(v.name) + " " + dtype_name(t);
      const Tensor x = dev(random_tensor(shape, t, 7, -1.0f, 3.0f)), dy = dev(random_tensor(shape, t, 8));
      const Tensor dres = dev(random_tensor(shape, t, 9)), gamma = dev(random_tensor({cols}, DType::F32, 10, 0.5f, 1.5f));
      const Tensor beta = dev(random_tensor({cols}, DType::F32, 11));
      Tensor y = Tensor::empty(shape, t, kCuda), mean = Tensor::empty({rows}, DType::F32, kCuda),
             rstd = Tensor::empty({rows}, DType::F32, kCuda);
      layernorm_forward(gpu, x, gamma, beta, kEps, y, mean, rstd);
      std::vector<double> first[3];
      for (int run = 0; run < 2; ++run) {
        Tensor dx = Tensor::empty(shape, t, kCuda), sum = Tensor::empty(shape, t, kCuda),
               fused = Tensor::empty(shape, t, kCuda);
        Tensor dgamma = Tensor::zeros({cols}, DType::F32, kCuda), dbeta = Tensor::zeros({cols}, DType::F32, kCuda);
        Tensor fgamma = Tensor::zeros({cols}, DType::F32, kCuda), fbeta = Tensor::zeros({cols}, DType::F32, kCuda);
        layernorm_backward(gpu, dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
        add(gpu, dx, dres, sum);
        layernorm_backward_add(gpu, dy, x, gamma, mean, rstd, dres, fused, fgamma, fbeta);
        EXPECT_TRUE(same_bits(host(fused), host(sum))) << what << ": fused dx is not the plain dx + add";
        EXPECT_TRUE(same_bits(host(fgamma), host(dgamma))) << what << ": dgamma";
        EXPECT_TRUE(same_bits(host(fbeta), host(dbeta))) << what << ": dbeta";
        const std::vector<double> now[3] = {host(fused).to_doubles(), host(fgamma).to_doubles(),
                                            host(fbeta).to_doubles()};
        for (int k = 0; k < 3; ++k) {
          if (run == 0) first[k] = now[k];
          else EXPECT_TRUE(first[k] == now[k]) << what << ": output " << k << " differs between two runs";
        }
      }
    }
  }
}

#else

TEST(GpuNormBackwardVariants, NeedsTheCudaBackend) { GTEST_SKIP() << "tessera was built without CUDA"; }

#endif
