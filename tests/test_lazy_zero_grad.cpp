// Lazy zero_grad (nn::Parameter::grad_unwritten): the gradients of Linear weights and biases
// (biases while no FP8 recipe is bound), GroupedLinear weights and the LM head are not
// cleared by zero_grad; their first writer of the step
// overwrites them (beta 0). The stale memory must never leak: every gradient here is filled
// with NaN before zero_grad, and the step must give the gradients of an eagerly zeroed model
// (the same bits on the CPU; on the GPU cuBLASLt may pick another kernel for beta 0, so there
// within a few float roundings), also over two accumulated micro-batches.
#include <cmath>
#include <limits>

#include "gpu_testing.h"
#include "tessera/models/transformer_lm.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/moe.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

models::ModelConfig tiny(const std::string& arch) {
  models::ModelConfig c;
  c.architecture = arch;
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = arch == "gpt2" ? 2 : 1;
  c.intermediate_size = arch == "gpt2" ? 64 : 24;
  c.max_seq_len = 16;
  if (arch == "mixtral") {
    c.tie_embeddings = false;
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
  }
  return c;
}

void fill_nan(Tensor& t) {
  const std::vector<float> nan(static_cast<size_t>(t.numel()), std::numeric_limits<float>::quiet_NaN());
  t.copy_from(Tensor::from_floats(nan, t.shape()).to(t.device()));
}

// Gradients after `micro` forward_backward calls: lazily zeroed over NaN-filled gradients, or
// zeroed eagerly (every grad cleared, no flag set).
std::vector<std::vector<double>> grads_after(const models::ModelConfig& c, DType dtype, Context& ctx, bool lazy,
                                             int micro) {
  models::TransformerLM model(c, dtype);
  model.to(ctx.device);
  model.init(ctx, 11);
  if (lazy) {
    for (nn::Parameter* p : model.parameters()) fill_nan(p->grad);
    model.zero_grad();
  } else {
    for (nn::Parameter* p : model.parameters()) {
      p->grad.fill_zero();
      p->grad_unwritten = false;
    }
  }
  for (int m = 0; m < micro; ++m) {
    const Tensor inputs = random_ids({2, 12}, c.vocab_size, 1 + 2 * m).to(ctx.device);
    const Tensor targets = random_ids({2, 12}, c.vocab_size, 2 + 2 * m).to(ctx.device);
    model.forward_backward(ctx, inputs, targets, 0.5f);
  }
  std::vector<std::vector<double>> out;
  for (nn::Parameter* p : model.parameters()) {
    EXPECT_FALSE(p->grad_unwritten) << p->name << ": still unwritten after the backward";
    out.push_back(p->grad.to(Device::cpu()).to_doubles());
  }
  return out;
}

void expect_lazy_equals_eager(Context& ctx, double tolerance) {
  for (const std::string arch : {"gpt2", "llama", "mixtral"})
    for (DType dtype : {DType::F32, DType::BF16})
      for (int micro : {1, 2}) {
        const models::ModelConfig c = tiny(arch);
        const auto lazy = grads_after(c, dtype, ctx, true, micro), eager = grads_after(c, dtype, ctx, false, micro);
        ASSERT_EQ(lazy.size(), eager.size());
        const std::string what = arch + " " + dtype_name(dtype) + " micro-batches " + std::to_string(micro);
        for (size_t i = 0; i < lazy.size(); ++i) {
          ASSERT_EQ(lazy[i].size(), eager[i].size());
          double scale = 0;
          for (double v : eager[i]) scale = std::max(scale, std::fabs(v));
          for (size_t k = 0; k < lazy[i].size(); ++k) {
            ASSERT_FALSE(std::isnan(lazy[i][k])) << what << " parameter " << i << " element " << k;
            if (tolerance == 0) {
              ASSERT_EQ(lazy[i][k], eager[i][k]) << what << " parameter " << i << " element " << k;
            } else {
              ASSERT_NEAR(lazy[i][k], eager[i][k], tolerance * scale) << what << " parameter " << i << " element " << k;
            }
          }
        }
      }
}

// The grouped weight gradient's overwrite form: experts without rows get zeros, the others
// dy_e^T x_e, whatever dw held; the accumulate form adds to it.
void expect_grouped_overwrite(Context& ctx) {
  const std::vector<int64_t> splits = {3, 0, 5, 0};
  const Tensor dy = random_tensor({8, 6}, DType::F32, 1).to(ctx.device);
  const Tensor x = random_tensor({8, 4}, DType::F32, 2).to(ctx.device);
  Tensor zeros = Tensor::zeros({4, 6, 4}, DType::F32, ctx.device);
  Tensor dw = Tensor::empty({4, 6, 4}, DType::F32, ctx.device);
  fill_nan(dw);
  grouped_linear_backward_weight(ctx, dy, x, splits, dw, /*accumulate=*/false);
  grouped_linear_backward_weight(ctx, dy, x, splits, zeros);
  EXPECT_EQ(dw.to(Device::cpu()).to_doubles(), zeros.to(Device::cpu()).to_doubles());
}

// linear_weight_grad's overwrite form: dweight = dy^T x whatever it held (NaN here), while
// dbias still adds; against the accumulating form on zeros. BF16 operands with a bias take
// cuBLASLt's bias-gradient epilogue on CUDA.
void expect_linear_overwrite(Context& ctx, double tolerance) {
  const Tensor dy = random_tensor({40, 24}, DType::BF16, 3).to(ctx.device);
  const Tensor x = random_tensor({40, 16}, DType::BF16, 4).to(ctx.device);
  Tensor dw = Tensor::empty({24, 16}, DType::F32, ctx.device), dw_ref = Tensor::zeros({24, 16}, DType::F32, ctx.device);
  fill_nan(dw);
  const Tensor bias0 = random_tensor({24}, DType::F32, 5).to(ctx.device);
  Tensor db = bias0.clone(), db_ref = bias0.clone();
  linear_weight_grad(ctx, dy, x, dw, db, /*accumulate_weight=*/false);
  linear_weight_grad(ctx, dy, x, dw_ref, db_ref);
  // (On CUDA beta 0 and 1 may run different cuBLASLt kernels: hence the tolerance there.)
  const auto expect_close = [&](const Tensor& a, const Tensor& b, const char* what) {
    const std::vector<double> got = a.to(Device::cpu()).to_doubles(), want = b.to(Device::cpu()).to_doubles();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], want[i], tolerance * (1 + std::fabs(want[i]))) << what << " element " << i;
  };
  expect_close(dw, dw_ref, "dweight");
  expect_close(db, db_ref, "dbias");  // the bias gradient still adds to what it held

  // Both overwritten (accumulate_bias false: on CUDA the epilogue writes into dbias itself),
  // over NaN, against the accumulating form on zeros.
  Tensor db_over = Tensor::empty({24}, DType::F32, ctx.device), db_zero = Tensor::zeros({24}, DType::F32, ctx.device);
  Tensor dw_zero = Tensor::zeros({24, 16}, DType::F32, ctx.device);
  fill_nan(dw);
  fill_nan(db_over);
  linear_weight_grad(ctx, dy, x, dw, db_over, /*accumulate_weight=*/false, /*accumulate_bias=*/false);
  linear_weight_grad(ctx, dy, x, dw_zero, db_zero);
  expect_close(dw, dw_zero, "dweight (both overwritten)");
  expect_close(db_over, db_zero, "dbias (overwritten)");
}

}  // namespace

TEST(LazyZeroGrad, LinearWeightGradOverwrites) {
  Context cpu = Context::cpu();
  expect_linear_overwrite(cpu, 0.0);
}

TEST(LazyZeroGrad, GpuLinearWeightGradOverwrites) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  expect_linear_overwrite(gpu, 1e-5);
}

TEST(LazyZeroGrad, CpuStepEqualsEagerZeroing) {
  Context ctx = Context::cpu();
  expect_lazy_equals_eager(ctx, 0.0);
}

TEST(LazyZeroGrad, GpuStepMatchesEagerZeroing) {
  REQUIRE_GPU();
  Context ctx = Context::cuda();
  expect_lazy_equals_eager(ctx, 1e-5);
}

TEST(LazyZeroGrad, GroupedWeightGradientOverwrites) {
  Context cpu = Context::cpu();
  expect_grouped_overwrite(cpu);
}

TEST(LazyZeroGrad, GpuGroupedWeightGradientOverwrites) {
  REQUIRE_GPU();
  Context gpu = Context::cuda();
  expect_grouped_overwrite(gpu);
}

// A gradient no backward wrote reads as zeros once materialized (what the optimizer does).
TEST(LazyZeroGrad, MaterializeGivesZeros) {
  Context ctx = Context::cpu();
  models::TransformerLM model(tiny("llama"), DType::F32);
  for (nn::Parameter* p : model.parameters()) fill_nan(p->grad);
  model.zero_grad();
  int lazy = 0;
  for (nn::Parameter* p : model.parameters()) lazy += p->grad_unwritten;
  EXPECT_GT(lazy, 0);
  model.materialize_grads(ctx);
  for (nn::Parameter* p : model.parameters()) {
    EXPECT_FALSE(p->grad_unwritten);
    for (double v : p->grad.to_doubles()) ASSERT_EQ(v, 0.0) << p->name;
  }
}
