// GEMM autotuning (tessera::set_gemm_autotune, ops/gemm.h): a tuned shape's calls must
// compute what the heuristic's algorithm computes. The risk is in the timing runs, which
// launch the GEMM many times (up to two runs for each of several hundred candidates: the
// heuristic's and their tile / option / cluster variants) before the real call: with beta != 0
// they must not add into c (they run in place on a scratch copy), and epilogue outputs (GELU's pre-activation, the bias
// gradient, an FP8 output's amax) must end up as one call leaves them. Each case runs the
// same inputs with autotuning off (the reference) and then on, through the call that tunes
// and the call after it, and checks the log names the tuned shape.
// Skipped (saying so) where no GPU is present, except the setting's own test.
#include <algorithm>
#include <cstdlib>
#include <string>

#include "gpu_testing.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/quantize.h"
#include "tessera/train/config.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

// Restores the process's setting when a test ends.
class AutotuneSetting {
 public:
  explicit AutotuneSetting(bool on) : before_(gemm_autotune()) { set_gemm_autotune(on); }
  ~AutotuneSetting() { set_gemm_autotune(before_); }

 private:
  bool before_;
};

bool log_names(const std::string& fragment) {
  const std::vector<std::string> log = gemm_autotune_log();
  return std::any_of(log.begin(), log.end(), [&](const std::string& l) { return l.find(fragment) != std::string::npos; });
}

// Runs `call` (which writes its outputs from fresh copies of the inputs) once with autotuning
// off and three times with it on, and checks each tuned run's outputs against the first.
template <typename Call>
void check_tuned_runs(const std::string& what, const std::string& log_fragment, double tol, Call call) {
  std::vector<Tensor> want;
  {
    AutotuneSetting off(false);
    want = call();
  }
  AutotuneSetting on(true);
  for (int run = 0; run < 3; ++run) {  // the plan's second use tunes, the third runs the choice
    const std::vector<Tensor> got = call();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_LT(relative_error(got[i].to(Device::cpu()), want[i].to(Device::cpu())), tol)
          << what << ", output " << i << ", run " << run;
  }
  EXPECT_TRUE(log_names(log_fragment)) << what << ": no autotune line names \"" << log_fragment << "\"";
}

}  // namespace

TEST(GpuGemmAutotune, AccumulatingAndOverwritingGemmsComputeWhatTheHeuristicDoes) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  // A weight gradient (F32, beta 1: the timing runs must not add into it) and a forward
  // GEMM (BF16, beta 0, NaN-poisoned output).
  const Tensor dy = random_tensor({768, 1536}, DType::BF16, 1).to(Device::cuda());
  const Tensor x = random_tensor({768, 512}, DType::BF16, 2).to(Device::cuda());
  const Tensor dw0 = random_tensor({1536, 512}, DType::F32, 3).to(Device::cuda());
  check_tuned_runs("dW += dy^T x", "M 1536 N 512 K 768", 1e-5, [&] {
    Tensor dw = dw0.clone();
    gemm(gpu, dy, x, dw, {.transpose_a = true, .beta = 1});
    return std::vector<Tensor>{dw};
  });
  const Tensor w = random_tensor({1536, 512}, DType::BF16, 4).to(Device::cuda());
  check_tuned_runs("y = x W^T", "M 768 N 1536 K 512", 1e-2, [&] {
    Tensor y = poisoned_device({768, 1536}, DType::BF16);
    gemm(gpu, x, w, y, {.transpose_b = true});
    return std::vector<Tensor>{y};
  });
}

TEST(GpuGemmAutotune, EpilogueOutputsAreThoseOfOneCall) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  const Tensor x = random_tensor({640, 768}, DType::BF16, 10, -2, 2).to(Device::cuda());
  const Tensor w = random_tensor({3072, 768}, DType::BF16, 11, -0.2f, 0.2f).to(Device::cuda());
  const Tensor bias = random_tensor({3072}, DType::BF16, 12).to(Device::cuda());
  check_tuned_runs("GELU epilogue", "GELU epilogue", 1e-2, [&] {
    Tensor pre = Tensor::empty({640, 3072}, DType::BF16, Device::cuda());
    Tensor y = Tensor::empty({640, 3072}, DType::BF16, Device::cuda());
    gemm_bias_gelu(gpu, x, w, bias, pre, y, {.transpose_b = true});
    return std::vector<Tensor>{pre, y};
  });
  // The bias gradient out of the weight GEMM's epilogue, accumulating into both gradients.
  const Tensor dy = random_tensor({640, 3072}, DType::BF16, 13).to(Device::cuda());
  const Tensor dw0 = random_tensor({3072, 768}, DType::F32, 14).to(Device::cuda());
  const Tensor db0 = random_tensor({3072}, DType::F32, 15).to(Device::cuda());
  check_tuned_runs("linear_weight_grad", "M 3072 N 768 K 640", 1e-5, [&] {
    Tensor dw = dw0.clone(), db = db0.clone();
    linear_weight_grad(gpu, dy, x, dw, db);
    return std::vector<Tensor>{dw, db};
  });
}

TEST(GpuGemmAutotune, Fp8GemmsComputeWhatTheHeuristicDoes) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  auto quantize = [&](const Tensor& x_cpu, DType fp8, float scale) {
    return fp8::quantize_with_transpose(gpu, x_cpu.to(Device::cuda()),
                                        Tensor::from_floats({scale}, {1}).to(Device::cuda()), fp8);
  };
  const fp8::QuantizedTensor dy = quantize(random_tensor({1024, 2048}, DType::F32, 20), DType::E5M2, 8.0f);
  const fp8::QuantizedTensor x = quantize(random_tensor({1024, 1024}, DType::F32, 21), DType::E4M3, 64.0f);
  const fp8::QuantizedTensor w = quantize(random_tensor({2048, 1024}, DType::F32, 22, -0.1f, 0.1f), DType::E4M3, 512.0f);
  // The weight gradient accumulates in F32 (beta 1).
  const Tensor dw0 = random_tensor({2048, 1024}, DType::F32, 23).to(Device::cuda());
  check_tuned_runs("fp8 dW += dy^T x", "fp8 M = 2048, N = 1024, K = 1024", 1e-5, [&] {
    Tensor dw = dw0.clone();
    fp8::fp8_gemm(gpu, dy, true, x, false, dw, 1.0f, 1.0f);
    return std::vector<Tensor>{dw};
  });
  // An E4M3 output with its amax and scale (what the next layer's delayed scale reads).
  const Tensor out_scale = Tensor::from_floats({0.5f}, {1}).to(Device::cuda());
  // Another algorithm adds in another order, which may move a rare code by one step.
  check_tuned_runs("fp8 y = x W^T -> E4M3", "fp8 M = 1024, N = 2048, K = 1024", 1e-2, [&] {
    Tensor y = Tensor::empty({1024, 2048}, DType::E4M3, Device::cuda());
    Tensor amax = poisoned_device({1}, DType::F32);
    fp8::Fp8GemmOptions o;
    o.out_scale = out_scale;
    o.amax_out = amax;
    fp8::fp8_gemm(gpu, x, false, w, true, y, o);
    return std::vector<Tensor>{y, amax};
  });
}

TEST(GpuGemmAutotune, OffTunesNothing) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  AutotuneSetting off(false);
  const size_t before = gemm_autotune_log().size();
  const Tensor a = random_tensor({320, 448}, DType::BF16, 30).to(Device::cuda());
  Tensor c = Tensor::empty({320, 320}, DType::F32, Device::cuda());
  for (int i = 0; i < 4; ++i) gemm(gpu, a, a, c, {.transpose_b = true});
  EXPECT_EQ(gemm_autotune_log().size(), before);
}

// Runs everywhere: the default, the setter, and the config key.
TEST(GpuGemmAutotune, OffByDefaultAndAConfigKey) {
  if (std::getenv("TESSERA_GEMM_AUTOTUNE") == nullptr) EXPECT_FALSE(gemm_autotune());
  {
    AutotuneSetting on(true);
    EXPECT_TRUE(gemm_autotune());
  }
  EXPECT_FALSE(train::RunConfig::from_json(nlohmann::json::object()).training.gemm_autotune);
  nlohmann::json j;
  j["training"]["gemm_autotune"] = true;
  const train::RunConfig c = train::RunConfig::from_json(j);
  EXPECT_TRUE(c.training.gemm_autotune);
  EXPECT_TRUE(c.to_json()["training"]["gemm_autotune"].get<bool>());
  j["training"]["gemm_autotune"] = "fast";
  EXPECT_THROW(train::RunConfig::from_json(j), Error);
}
