// Tensor and sequence parallel layers against the single-device modules: the same full
// weights, sharded, give the same outputs, input gradients and (sharded) weight gradients.
// The tensor-parallel size is the world size (1 alone, 2 and 4 under mpirun), and with 4
// ranks also a 2 x 2 data x tensor grid, each data rank taking half the rows.
#include "dist_testing.h"
#include "tessera/dist/data_parallel.h"
#include "tessera/dist/parallel_grid.h"
#include "tessera/nn/parallel_linear.h"
#include "testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

constexpr double kTolerance = 1e-5;  // F32: the sums over ranks run in another order

void fill(nn::Parameter& p, uint64_t seed, float scale = 0.3f) {
  if (!p.value.defined()) return;
  p.weights().copy_from(random_tensor(p.weights().shape(), p.weights().dtype(), seed, -scale, scale));
  Context ctx = Context::cpu();
  p.refresh_value(ctx);
}

std::vector<double> rows_of(const Tensor& t, int64_t begin, int64_t end) { return doubles_of(t.slice(0, begin, end)); }

struct Case {
  nn::Activation activation;
  bool sequence_parallel;
  bool bias;
};

// Runs the full MLP on every rank and the tensor-parallel one over `parallel`, on rows
// [row_begin, row_end) of one global batch, and compares.
void check_mlp(const nn::ParallelContext& parallel, const Case& c, int64_t row_begin, int64_t row_end) {
  Context ctx = Context::cpu();
  const int64_t hidden = 16, ffn = 24, rows = 8;
  const int tp = parallel.tensor_size, tr = parallel.tensor_rank;
  nn::MLP full("mlp", hidden, ffn, c.activation, c.bias, DType::F32);
  fill(full.fc.weight, 11);
  fill(full.fc.bias, 12);
  fill(full.proj.weight, 13);
  fill(full.proj.bias, 14);
  const Tensor x_all = random_tensor({rows, hidden}, DType::F32, 21);
  const Tensor dy_all = random_tensor({rows, hidden}, DType::F32, 22);
  const Tensor x = x_all.slice(0, row_begin, row_end).contiguous();
  const Tensor dy = dy_all.slice(0, row_begin, row_end).contiguous();
  const int64_t n = row_end - row_begin;

  nn::MLP::Saved fs;
  const Tensor y_ref = full.forward(ctx, x, fs);
  const Tensor dx_ref = full.backward_input(ctx, dy, fs);
  full.backward_weight(ctx, dy, fs);

  nn::TensorParallelMLP mlp("mlp", hidden, ffn, c.activation, c.bias, DType::F32, parallel);
  mlp.load_full(ctx, full);
  // Sequence parallel: this rank holds rows [tr n/tp, (tr+1) n/tp) of the activations.
  const int64_t local = c.sequence_parallel ? n / tp : n, first = c.sequence_parallel ? tr * local : 0;
  nn::TensorParallelMLP::Saved s;
  const Tensor y = mlp.forward(ctx, x.slice(0, first, first + local).contiguous(), s);
  const Tensor dx = mlp.backward_input(ctx, dy.slice(0, first, first + local).contiguous(), s);
  mlp.backward_weight(ctx, dy.slice(0, first, first + local).contiguous(), s);

  const std::string what = std::string(c.activation == nn::Activation::GELU ? "gelu" : "swiglu") +
                           (c.sequence_parallel ? " sp" : "") + (c.bias ? " bias" : "") +
                           (parallel.tp_comm_overlap ? " overlap" : "") + " tp=" +
                           std::to_string(tp) + " rank=" + std::to_string(tr);
  EXPECT_LT(relative_error(doubles_of(y), rows_of(y_ref, first, first + local)), kTolerance) << what;
  EXPECT_LT(relative_error(doubles_of(dx), rows_of(dx_ref, first, first + local)), kTolerance) << what;
  // fc: this rank's rows of the full gradient (per block for SwiGLU's [gate | up]).
  std::vector<double> fc_want, fc_bias_want;
  for (auto [b, e] : mlp.fc.shard_rows()) {
    const auto w = rows_of(full.fc.weight.grad, b, e);
    fc_want.insert(fc_want.end(), w.begin(), w.end());
    if (c.bias) {
      const auto bb = rows_of(full.fc.bias.grad, b, e);
      fc_bias_want.insert(fc_bias_want.end(), bb.begin(), bb.end());
    }
  }
  EXPECT_LT(relative_error(doubles_of(mlp.fc.weight.grad), fc_want), kTolerance) << what;
  const int64_t slice = ffn / tp;
  EXPECT_LT(relative_error(doubles_of(mlp.proj.weight.grad),
                           doubles_of(full.proj.weight.grad.slice(1, tr * slice, (tr + 1) * slice))),
            kTolerance)
      << what;
  if (c.bias) {
    EXPECT_LT(relative_error(doubles_of(mlp.fc.bias.grad), fc_bias_want), kTolerance) << what;
    EXPECT_LT(relative_error(doubles_of(mlp.proj.bias.grad), doubles_of(full.proj.bias.grad)), kTolerance) << what;
  }
}

const Case kCases[] = {{nn::Activation::GELU, false, true},
                       {nn::Activation::GELU, true, true},
                       {nn::Activation::SwiGLU, false, false},
                       {nn::Activation::SwiGLU, true, false},
                       {nn::Activation::GELU, true, false}};

}  // namespace

TEST(DistTensorParallel, MlpMatchesTheSingleDeviceModuleWithTensorParallelOverTheWorld) {
  Context ctx = Context::cpu();
  auto world = test_world();
  dist::ParallelGrid grid(ctx, world, {.data = 1, .tensor = world->size(), .pipeline = 1, .sequence_parallel = true});
  // And with parallel.tp_comm_overlap: the fc weight gradient accumulated by backward_input,
  // exactly once (backward_weight leaves it).
  for (bool overlap : {false, true})
  for (const Case& c : kCases) {
    nn::ParallelContext pc = grid.context();
    pc.sequence_parallel = c.sequence_parallel && pc.tensor_size > 1;
    pc.tp_comm_overlap = overlap && pc.tensor_size > 1;
    check_mlp(pc, c, 0, 8);
  }
}

TEST(DistTensorParallel, DataTimesTensorGridMatchesTheSingleDeviceModule) {
  Context ctx = Context::cpu();
  auto world = test_world();
  if (world->size() != 4) GTEST_SKIP() << "needs 4 ranks (2 x 2)";
  dist::ParallelGrid grid(ctx, world, {.data = 2, .tensor = 2, .pipeline = 1});
  // Each data rank takes half the rows of the batch; the reference runs on the same half.
  const int64_t half = 4, begin = grid.data_rank() * half;
  for (bool overlap : {false, true})
  for (const Case& c : kCases) {
    nn::ParallelContext pc = grid.context();
    pc.sequence_parallel = c.sequence_parallel;
    pc.tp_comm_overlap = overlap;
    check_mlp(pc, c, begin, begin + half);
  }
}

namespace {

// The same for self-attention: heads split across the tensor group, GQA and RoPE included.
void check_attention(const nn::ParallelContext& parallel, const nn::AttentionConfig& config, bool sp) {
  Context ctx = Context::cpu();
  const int64_t batch = 2, seq = 4, rows = batch * seq, hidden = config.hidden;
  const int tp = parallel.tensor_size, tr = parallel.tensor_rank;
  nn::SelfAttention full("attn", config, DType::F32);
  fill(full.qkv.weight, 31);
  fill(full.qkv.bias, 32);
  fill(full.proj.weight, 33);
  fill(full.proj.bias, 34);
  const Tensor x = random_tensor({rows, hidden}, DType::F32, 41);
  const Tensor dy = random_tensor({rows, hidden}, DType::F32, 42);
  nn::SelfAttention::Saved fs;
  const Tensor y_ref = full.forward(ctx, x, batch, seq, fs);
  const Tensor dx_ref = full.backward_input(ctx, dy, fs);
  full.backward_weight(ctx, dy, fs);

  nn::ParallelContext pc = parallel;
  pc.sequence_parallel = sp && tp > 1;
  nn::TensorParallelSelfAttention attn("attn", config, DType::F32, pc);
  attn.load_full(ctx, full);
  const int64_t local = pc.sequence_parallel ? rows / tp : rows, first = pc.sequence_parallel ? tr * local : 0;
  nn::TensorParallelSelfAttention::Saved s;
  const Tensor dy_local = dy.slice(0, first, first + local).contiguous();
  const Tensor y = attn.forward(ctx, x.slice(0, first, first + local).contiguous(), batch, seq, s);
  const Tensor dx = attn.backward_input(ctx, dy_local, s);
  attn.backward_weight(ctx, dy_local, s);
  const std::string what = std::string(config.rope ? "llama" : "gpt2") + " kv=" + std::to_string(config.num_kv_heads) +
                           (sp ? " sp" : "") + (pc.tp_comm_overlap ? " overlap" : "") + " tp=" +
                           std::to_string(tp) + " rank=" + std::to_string(tr);
  EXPECT_LT(relative_error(doubles_of(y), rows_of(y_ref, first, first + local)), kTolerance) << what;
  EXPECT_LT(relative_error(doubles_of(dx), rows_of(dx_ref, first, first + local)), kTolerance) << what;
  std::vector<double> qkv_want;
  for (auto [b, e] : attn.qkv.shard_rows()) {
    const auto w = rows_of(full.qkv.weight.grad, b, e);
    qkv_want.insert(qkv_want.end(), w.begin(), w.end());
  }
  EXPECT_LT(relative_error(doubles_of(attn.qkv.weight.grad), qkv_want), kTolerance) << what;
  const int64_t slice = hidden / tp;
  EXPECT_LT(relative_error(doubles_of(attn.proj.weight.grad),
                           doubles_of(full.proj.weight.grad.slice(1, tr * slice, (tr + 1) * slice))),
            kTolerance)
      << what;
  if (config.bias) {
    EXPECT_LT(relative_error(doubles_of(attn.proj.bias.grad), doubles_of(full.proj.bias.grad)), kTolerance) << what;
    std::vector<double> qkv_bias_want;
    for (auto [b, e] : attn.qkv.shard_rows()) {
      const auto g = rows_of(full.qkv.bias.grad, b, e);
      qkv_bias_want.insert(qkv_bias_want.end(), g.begin(), g.end());
    }
    EXPECT_LT(relative_error(doubles_of(attn.qkv.bias.grad), qkv_bias_want), kTolerance) << what;
  }
}

}  // namespace

TEST(DistTensorParallel, AttentionWithHeadsSplitMatchesTheSingleDeviceModule) {
  Context ctx = Context::cpu();
  auto world = test_world();
  dist::ParallelGrid grid(ctx, world, {.data = 1, .tensor = world->size(), .pipeline = 1});
  const nn::AttentionConfig gpt2{.hidden = 32, .num_heads = 4, .num_kv_heads = 4, .bias = true};
  const nn::AttentionConfig llama{.hidden = 32, .num_heads = 8, .num_kv_heads = 4, .bias = false, .rope = true,
                                  .rope_theta = 100.0f};
  // Fewer K/V heads than ranks: each K/V head is replicated on world/kv ranks, whose
  // gradients for it are summed.
  const nn::AttentionConfig one_kv{.hidden = 32, .num_heads = 8, .num_kv_heads = 1, .bias = true, .rope = true,
                                   .rope_theta = 100.0f};
  const nn::AttentionConfig two_kv{.hidden = 32, .num_heads = 8, .num_kv_heads = 2, .bias = false, .rope = true,
                                   .rope_theta = 100.0f};
  for (bool overlap : {false, true})  // parallel.tp_comm_overlap (replicated K/V rows included)
  for (bool sp : {false, true}) {
    nn::ParallelContext pc = grid.context();
    pc.tp_comm_overlap = overlap && pc.tensor_size > 1;
    check_attention(pc, gpt2, sp);
    check_attention(pc, llama, sp);
    check_attention(pc, one_kv, sp);
    check_attention(pc, two_kv, sp);
  }
  if (world->size() > 1) {
    nn::TensorParallelSelfAttention replicated("attn", one_kv, DType::F32, grid.context());
    EXPECT_TRUE(replicated.kv_replicated());
    EXPECT_EQ(replicated.local_kv_heads(), 1);
    // Neither 3 % tp nor tp % 3 is 0 for tp = 2 or 4.
    const nn::AttentionConfig three_kv{.hidden = 48, .num_heads = 12, .num_kv_heads = 3};
    EXPECT_THROW(nn::TensorParallelSelfAttention("attn", three_kv, DType::F32, grid.context()), Error);
  }
}

TEST(DistTensorParallel, ShapesThatDoNotDivideAreRefused) {
  auto world = test_world();
  Context ctx = Context::cpu();
  dist::ParallelGrid grid(ctx, world, {.data = 1, .tensor = world->size(), .pipeline = 1});
  if (world->size() == 1) {
    EXPECT_NO_THROW(nn::ColumnParallelLinear("c", 4, 3, true, DType::F32, grid.context()));
    return;
  }
  EXPECT_THROW(nn::ColumnParallelLinear("c", 4, world->size() + 1, true, DType::F32, grid.context()), Error);
  EXPECT_THROW(nn::RowParallelLinear("r", world->size() + 1, 4, true, DType::F32, grid.context()), Error);
  nn::ParallelContext missing = grid.context();
  missing.tensor_group = nullptr;
  EXPECT_THROW(nn::ColumnParallelLinear("c", 4, 8, true, DType::F32, missing), Error);
}
