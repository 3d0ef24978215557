// Tensor- and sequence-parallel linear layers (see tessera/nn/parallel_linear.h).
#include "tessera/nn/parallel_linear.h"

#include "tessera/dist/process_group.h"
#include "tessera/ops/activation.h"
#include "tessera/ops/attention.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/rope.h"
#include "tessera/ops/gemm.h"

namespace tessera::nn {
namespace {

std::shared_ptr<dist::ProcessGroup> tensor_group_of(const ParallelContext& parallel, const std::string& name) {
  if (parallel.tensor_size == 1) return parallel.tensor_group ? parallel.tensor_group : dist::local_group();
  TESSERA_CHECK(parallel.tensor_group != nullptr && parallel.tensor_group->size() == parallel.tensor_size,
                name, ": tensor_size ", parallel.tensor_size, " needs its tensor_group (dist::ParallelGrid::context())");
  return parallel.tensor_group;
}

// Rows [r * n/tp, (r+1) * n/tp) of a [n, ...] tensor gathered along dimension 0.
Tensor gather_rows(Context& ctx, dist::ProcessGroup& group, const Tensor& local) {
  Shape shape = local.shape();
  shape[0] *= group.size();
  Tensor full = Tensor::empty(shape, local.dtype(), ctx.device);
  group.all_gather(ctx, local.contiguous(), full);
  return full;
}

// The [n/tp, ...] output of a reduce-scatter of `full` along rows.
Tensor scattered_rows(Context& ctx, dist::ProcessGroup& group, const Tensor& full, const char* what) {
  TESSERA_CHECK(full.size(0) % group.size() == 0, what, ": sequence parallelism needs rows (", full.size(0),
                ") divisible by the tensor-parallel size ", group.size());
  Shape shape = full.shape();
  shape[0] /= group.size();
  return Tensor::empty(shape, full.dtype(), ctx.device);
}

Tensor reduce_scatter_rows(Context& ctx, dist::ProcessGroup& group, const Tensor& full, const char* what) {
  Tensor local = scattered_rows(ctx, group, full, what);
  group.reduce_scatter(ctx, full, local);
  return local;
}

void check_divisible(int64_t n, int64_t by, const std::string& name, const char* what) {
  TESSERA_CHECK(n % by == 0, name, ": ", what, " ", n, " is not divisible by ", by);
}

}  // namespace

// ---- ColumnParallelLinear ----

namespace {
std::vector<ColumnParallelLinear::Block> equal_blocks(int64_t out, int parts, const std::string& name) {
  TESSERA_CHECK(parts >= 1 && out % parts == 0, "ColumnParallelLinear ", name, ": out_features ", out,
                " is not ", parts, " equal blocks");
  return std::vector<ColumnParallelLinear::Block>(static_cast<size_t>(parts), {out / parts, 0});
}
std::vector<ColumnParallelLinear::Block> split_blocks(const std::vector<int64_t>& widths) {
  std::vector<ColumnParallelLinear::Block> blocks;
  for (int64_t w : widths) blocks.push_back({w, 0});
  return blocks;
}
}  // namespace

ColumnParallelLinear::ColumnParallelLinear(const std::string& name, int64_t in_features, int64_t out_features,
                                           bool has_bias, DType dtype, const ParallelContext& parallel, int parts)
    : ColumnParallelLinear(name, in_features, equal_blocks(out_features, parts, name), has_bias, dtype, parallel) {}

ColumnParallelLinear::ColumnParallelLinear(const std::string& name, int64_t in_features,
                                           const std::vector<int64_t>& blocks, bool has_bias, DType dtype,
                                           const ParallelContext& parallel)
    : ColumnParallelLinear(name, in_features, split_blocks(blocks), has_bias, dtype, parallel) {}

ColumnParallelLinear::ColumnParallelLinear(const std::string& name, int64_t in_features,
                                           const std::vector<Block>& blocks, bool has_bias, DType dtype,
                                           const ParallelContext& parallel)
    : in_(in_features),
      out_(0),
      tp_(parallel.tensor_size),
      rank_(parallel.tensor_rank),
      blocks_(blocks),
      sequence_parallel_(parallel.sequence_parallel && parallel.tensor_size > 1),
      overlap_(parallel.tp_comm_overlap && parallel.tensor_size > 1),
      group_(tensor_group_of(parallel, name)) {
  TESSERA_CHECK(in_features > 0 && !blocks.empty(), "ColumnParallelLinear ", name, ": bad sizes");
  for (Block& b : blocks_) {
    if (b.shards == 0) b.shards = tp_;
    TESSERA_CHECK(b.width > 0, "ColumnParallelLinear ", name, ": block widths must be positive");
    TESSERA_CHECK(b.shards >= 1 && tp_ % b.shards == 0, "ColumnParallelLinear ", name, ": a block in ", b.shards,
                  " shards does not fit the tensor-parallel size ", tp_);
    check_divisible(b.width, b.shards, name, "output block");
    out_ += b.width;
    local_out_ += b.width / b.shards;
  }
  weight = Parameter(name + ".weight", {local_out_, in_}, dtype, true);
  if (has_bias) bias = Parameter(name + ".bias", {local_out_}, dtype, false);
}

std::vector<std::pair<int64_t, int64_t>> ColumnParallelLinear::shard_rows(int rank) const {
  std::vector<std::pair<int64_t, int64_t>> rows;
  int64_t start = 0;
  for (const Block& block : blocks_) {
    const int64_t slice = block.width / block.shards, index = rank / (tp_ / block.shards);
    rows.emplace_back(start + index * slice, start + (index + 1) * slice);
    start += block.width;
  }
  return rows;
}

ShardLayout ColumnParallelLinear::weight_layout() const {
  if (tp_ == 1) return ShardLayout::replicated({out_, in_});
  ShardLayout l;
  l.full = {out_, in_};
  l.dim = 0;
  l.local_extent = local_out_;
  for (int r = 0; r < tp_; ++r) l.ranges.push_back(shard_rows(r));
  return l;
}

ShardLayout ColumnParallelLinear::bias_layout() const {
  ShardLayout l = weight_layout();
  l.full = {out_};
  return l;
}

void ColumnParallelLinear::load_full(Context& ctx, const Tensor& full_weight, const Tensor& full_bias) {
  check_shape(full_weight, {out_, in_}, "ColumnParallelLinear::load_full", "full_weight");
  int64_t at = 0;
  for (auto [begin, end] : shard_rows()) {
    weight.weights().slice(0, at, at + end - begin).copy_from(full_weight.slice(0, begin, end));
    if (bias.value.defined()) {
      check_shape(full_bias, {out_}, "ColumnParallelLinear::load_full", "full_bias");
      bias.weights().slice(0, at, at + end - begin).copy_from(full_bias.slice(0, begin, end));
    }
    at += end - begin;
  }
  weight.refresh_value(ctx);
  if (bias.value.defined()) bias.refresh_value(ctx);
}

Tensor ColumnParallelLinear::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  TESSERA_CHECK(x.dim() == 2 && x.size(1) == in_, "ColumnParallelLinear ", weight.name, ": input must be [N, ", in_,
                "], got ", x.describe());
  saved.x = sequence_parallel_ ? gather_rows(ctx, *group_, x) : x;
  Tensor y = Tensor::empty({saved.x.size(0), local_out_}, weight.value.dtype(), ctx.device);
  gemm(ctx, saved.x, weight.value, y, {.transpose_b = true}, bias.value);
  return y;
}

Tensor ColumnParallelLinear::backward_input(Context& ctx, const Tensor& dy, Saved& saved) {
  Tensor dx = Tensor::empty({saved.x.size(0), in_}, weight.value.dtype(), ctx.device);
  gemm(ctx, dy, weight.value, dx);  // this rank's share of dx: its output features' part
  if (tp_ == 1) return dx;
  if (!overlap_) {
    if (sequence_parallel_) return reduce_scatter_rows(ctx, *group_, dx, weight.name.c_str());
    group_->all_reduce(ctx, dx);
    return dx;
  }
  TESSERA_CHECK(!saved.weight_grad_done, "ColumnParallelLinear ", weight.name,
                ": backward_input ran twice without backward_weight in between");
  // The reduction of dx runs (NCCL: on the group's communication stream) while this stream
  // computes the weight gradient, which needs only dy and x. dx (and out) stay alive and
  // untouched here until the wait.
  Tensor out = dx;
  std::unique_ptr<dist::Work> work;
  if (sequence_parallel_) {
    out = scattered_rows(ctx, *group_, dx, weight.name.c_str());
    work = group_->reduce_scatter_async(ctx, dx, out);
  } else {
    work = group_->all_reduce_async(ctx, dx);
  }
  linear_weight_grad(ctx, dy, saved.x, weight.grad, bias.grad);
  saved.weight_grad_done = true;
  work->wait();
  return out;
}

void ColumnParallelLinear::backward_weight(Context& ctx, const Tensor& dy, Saved& saved) {
  if (saved.weight_grad_done) {  // accumulated by backward_input, beside dx's reduction
    saved.weight_grad_done = false;
    return;
  }
  linear_weight_grad(ctx, dy, saved.x, weight.grad, bias.grad);
}

void ColumnParallelLinear::parameters(ParameterList& out) {
  out.push_back(&weight);
  if (bias.value.defined()) out.push_back(&bias);
}

// ---- RowParallelLinear ----

RowParallelLinear::RowParallelLinear(const std::string& name, int64_t in_features, int64_t out_features, bool has_bias,
                                     DType dtype, const ParallelContext& parallel)
    : in_(in_features),
      out_(out_features),
      tp_(parallel.tensor_size),
      rank_(parallel.tensor_rank),
      sequence_parallel_(parallel.sequence_parallel && parallel.tensor_size > 1),
      overlap_(parallel.tp_comm_overlap && parallel.tensor_size > 1),
      group_(tensor_group_of(parallel, name)) {
  TESSERA_CHECK(in_features > 0 && out_features > 0, "RowParallelLinear ", name, ": bad sizes");
  check_divisible(in_features, tp_, name, "in_features");
  weight = Parameter(name + ".weight", {out_, in_ / tp_}, dtype, true);
  if (has_bias) bias = Parameter(name + ".bias", {out_}, dtype, false);
}

ShardLayout RowParallelLinear::weight_layout() const {
  return tp_ == 1 ? ShardLayout::replicated({out_, in_}) : ShardLayout::even({out_, in_}, 1, tp_);
}

ShardLayout RowParallelLinear::bias_layout() const { return ShardLayout::replicated({out_}); }

void RowParallelLinear::load_full(Context& ctx, const Tensor& full_weight, const Tensor& full_bias) {
  check_shape(full_weight, {out_, in_}, "RowParallelLinear::load_full", "full_weight");
  const int64_t slice = in_ / tp_;
  weight.weights().copy_from(full_weight.slice(1, rank_ * slice, (rank_ + 1) * slice));
  weight.refresh_value(ctx);
  if (bias.value.defined()) {
    check_shape(full_bias, {out_}, "RowParallelLinear::load_full", "full_bias");
    bias.weights().copy_from(full_bias);
    bias.refresh_value(ctx);
  }
}

Tensor RowParallelLinear::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  TESSERA_CHECK(x.dim() == 2 && x.size(1) == in_ / tp_, "RowParallelLinear ", weight.name, ": input must be [N, ",
                in_ / tp_, "], got ", x.describe());
  saved.x = x;
  Tensor y = Tensor::empty({x.size(0), out_}, weight.value.dtype(), ctx.device);
  // The bias joins on rank 0 only, so the sum over ranks holds it once.
  gemm(ctx, x, weight.value, y, {.transpose_b = true}, rank_ == 0 ? bias.value : Tensor());
  if (tp_ == 1) return y;
  if (sequence_parallel_) return reduce_scatter_rows(ctx, *group_, y, weight.name.c_str());
  group_->all_reduce(ctx, y);
  return y;
}

std::unique_ptr<dist::Work> RowParallelLinear::start_gather_dy(Context& ctx, const Tensor& dy, Saved& saved) const {
  TESSERA_CHECK(sequence_parallel_, "RowParallelLinear ", weight.name, ": start_gather_dy needs sequence parallelism");
  TESSERA_CHECK(dy.is_contiguous(), "RowParallelLinear ", weight.name, ": start_gather_dy needs a contiguous dy");
  Shape shape = dy.shape();
  shape[0] *= group_->size();
  saved.dy_full = Tensor::empty(shape, dy.dtype(), ctx.device);
  saved.dy_gathered = true;
  return group_->all_gather_async(ctx, dy, saved.dy_full);
}

Tensor RowParallelLinear::backward_input(Context& ctx, const Tensor& dy, Saved& saved) const {
  if (sequence_parallel_ && !saved.dy_gathered) saved.dy_full = gather_rows(ctx, *group_, dy);
  saved.dy_gathered = false;
  const Tensor& full = sequence_parallel_ ? saved.dy_full : dy;
  Tensor dx = Tensor::empty({full.size(0), in_ / tp_}, weight.value.dtype(), ctx.device);
  gemm(ctx, full, weight.value, dx);
  return dx;
}

void RowParallelLinear::backward_weight(Context& ctx, const Tensor& dy, Saved& saved) {
  if (saved.weight_grad_done) {
    saved.weight_grad_done = false;
    return;
  }
  Tensor full = dy;
  if (sequence_parallel_) full = saved.dy_full.defined() ? saved.dy_full : gather_rows(ctx, *group_, dy);
  linear_weight_grad(ctx, full, saved.x, weight.grad, bias.grad);
}

void RowParallelLinear::parameters(ParameterList& out) {
  out.push_back(&weight);
  if (bias.value.defined()) out.push_back(&bias);
}

// ---- TensorParallelMLP ----

TensorParallelMLP::TensorParallelMLP(const std::string& name, int64_t hidden, int64_t ffn, Activation act, bool has_bias,
                                     DType dtype, const ParallelContext& parallel)
    : activation(act),
      fc(name + ".fc", hidden, act == Activation::SwiGLU ? 2 * ffn : ffn, has_bias, dtype, parallel,
         act == Activation::SwiGLU ? 2 : 1),
      proj(name + ".proj", ffn, hidden, has_bias, dtype, parallel) {}

Tensor TensorParallelMLP::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  saved.h_pre = fc.forward(ctx, x, saved.fc_in);
  Tensor h = Tensor::empty({saved.h_pre.size(0), proj.local_in_features()}, saved.h_pre.dtype(), ctx.device);
  if (activation == Activation::GELU) {
    gelu_forward(ctx, saved.h_pre, h);
  } else {
    swiglu_forward(ctx, saved.h_pre, h);
  }
  return proj.forward(ctx, h, saved.proj_in);
}

Tensor TensorParallelMLP::backward_input(Context& ctx, const Tensor& dy, Saved& saved) {
  const Tensor d_h = proj.backward_input(ctx, dy, saved.proj_in);
  saved.d_h_pre = Tensor::empty(saved.h_pre.shape(), d_h.dtype(), ctx.device);
  if (activation == Activation::GELU) {
    gelu_backward(ctx, saved.h_pre, d_h, saved.d_h_pre);
  } else {
    swiglu_backward(ctx, saved.h_pre, d_h, saved.d_h_pre);
  }
  return fc.backward_input(ctx, saved.d_h_pre, saved.fc_in);
}

void TensorParallelMLP::backward_weight(Context& ctx, const Tensor& dy, Saved& saved) {
  proj.backward_weight(ctx, dy, saved.proj_in);
  fc.backward_weight(ctx, saved.d_h_pre, saved.fc_in);
}

void TensorParallelMLP::parameters(ParameterList& out) {
  fc.parameters(out);
  proj.parameters(out);
}

void TensorParallelMLP::layouts(std::vector<ShardLayout>& out) const {
  out.push_back(fc.weight_layout());
  if (fc.bias.value.defined()) out.push_back(fc.bias_layout());
  out.push_back(proj.weight_layout());
  if (proj.bias.value.defined()) out.push_back(proj.bias_layout());
}

void TensorParallelMLP::load_full(Context& ctx, MLP& full) {
  TESSERA_CHECK(full.activation == activation, "TensorParallelMLP::load_full: activations differ");
  fc.load_full(ctx, full.fc.weight.weights(), full.fc.bias.weights());
  proj.load_full(ctx, full.proj.weight.weights(), full.proj.bias.weights());
}

// ---- TensorParallelSelfAttention ----

namespace {
// The fused [q | k | v] blocks of the QKV projection; checks the head counts first, so the
// error names the rule rather than a block width.
std::vector<ColumnParallelLinear::Block> qkv_blocks(const AttentionConfig& c, int tp, const std::string& name) {
  TESSERA_CHECK(c.num_heads > 0 && c.num_kv_heads > 0 && c.hidden % c.num_heads == 0, name,
                ": bad head counts (hidden ", c.hidden, ", num_heads ", c.num_heads, ", num_kv_heads ",
                c.num_kv_heads, ")");
  TESSERA_CHECK(c.num_heads % tp == 0, name, ": num_heads (", c.num_heads,
                ") must divide by the tensor-parallel size ", tp);
  TESSERA_CHECK(c.num_kv_heads % tp == 0 || tp % c.num_kv_heads == 0, name, ": num_kv_heads (", c.num_kv_heads,
                ") and the tensor-parallel size ", tp,
                " do not fit: K/V heads are split when num_kv_heads divides by it and replicated when it divides by "
                "num_kv_heads");
  const int64_t d = c.hidden / c.num_heads;
  const int kv_shards = c.num_kv_heads % tp == 0 ? tp : static_cast<int>(c.num_kv_heads);
  return {{c.num_heads * d, tp}, {c.num_kv_heads * d, kv_shards}, {c.num_kv_heads * d, kv_shards}};
}
}  // namespace

TensorParallelSelfAttention::TensorParallelSelfAttention(const std::string& name, const AttentionConfig& c,
                                                         DType dtype, const ParallelContext& parallel)
    : qkv(name + ".qkv", c.hidden, qkv_blocks(c, parallel.tensor_size, name), c.bias, dtype, parallel),
      proj(name + ".proj", c.hidden, c.hidden, c.bias, dtype, parallel),
      config_(c),
      local_heads_(c.num_heads / parallel.tensor_size),
      local_kv_heads_(c.num_kv_heads % parallel.tensor_size == 0 ? c.num_kv_heads / parallel.tensor_size : 1) {
  // Replicated K/V heads: the ranks holding the same head form a group (a collective over
  // the tensor group, made once here).
  if (c.num_kv_heads % parallel.tensor_size != 0) {
    const int copies = parallel.tensor_size / static_cast<int>(c.num_kv_heads);
    kv_group_ = parallel.tensor_group->split(parallel.tensor_rank / copies, parallel.tensor_rank);
  }
}

void TensorParallelSelfAttention::layouts(std::vector<ShardLayout>& out) const {
  out.push_back(qkv.weight_layout());
  if (qkv.bias.value.defined()) out.push_back(qkv.bias_layout());
  out.push_back(proj.weight_layout());
  if (proj.bias.value.defined()) out.push_back(proj.bias_layout());
}

void TensorParallelSelfAttention::load_full(Context& ctx, SelfAttention& full) {
  qkv.load_full(ctx, full.qkv.weight.weights(), full.qkv.bias.weights());
  proj.load_full(ctx, full.proj.weight.weights(), full.proj.bias.weights());
}

// As SelfAttention::forward, with this rank's heads.
Tensor TensorParallelSelfAttention::forward(Context& ctx, const Tensor& x, int64_t batch, int64_t seq,
                                            Saved& saved) const {
  const Tensor fused = qkv.forward(ctx, x, saved.qkv_in);
  const Tensor out = attention_core_forward(ctx, config_, fused, batch, seq, local_heads_, local_kv_heads_, saved);
  return proj.forward(ctx, out, saved.out_in);
}

Tensor TensorParallelSelfAttention::backward_input(Context& ctx, const Tensor& dy, Saved& saved) {
  const Tensor d_out = proj.backward_input(ctx, dy, saved.out_in);
  attention_core_backward(ctx, config_, d_out, local_heads_, local_kv_heads_, saved);
  // With overlap the QKV projection accumulates its weight gradient here, so replicated K/V
  // rows are set aside first (see backward_weight).
  if (kv_group_ && qkv.comm_overlap()) set_aside_kv_grads(saved);
  return qkv.backward_input(ctx, saved.d_qkv, saved.qkv_in);
}

void TensorParallelSelfAttention::set_aside_kv_grads(Saved& saved) {
  const int64_t d = config_.hidden / config_.num_heads, kv0 = local_heads_ * d, kv1 = kv0 + 2 * local_kv_heads_ * d;
  std::vector<Tensor> kv_grads{qkv.weight.grad.slice(0, kv0, kv1)};
  if (qkv.bias.value.defined()) kv_grads.push_back(qkv.bias.grad.slice(0, kv0, kv1));
  saved.kv_earlier.clear();
  for (Tensor& g : kv_grads) {
    saved.kv_earlier.push_back(g.clone());
    g.fill_zero();
  }
}

void TensorParallelSelfAttention::backward_weight(Context& ctx, const Tensor& dy, Saved& saved) {
  proj.backward_weight(ctx, dy, saved.out_in);
  if (!kv_group_) {
    qkv.backward_weight(ctx, saved.d_qkv, saved.qkv_in);
    return;
  }
  // A replicated K/V head's weight gradient is the sum of what each sharing rank's query
  // heads contribute. The gradient accumulates over micro-batches, so only this call's part
  // is summed: the rows' earlier value is set aside (here, or by backward_input under
  // communication overlap) and added back.
  if (!saved.qkv_in.weight_grad_done) set_aside_kv_grads(saved);
  qkv.backward_weight(ctx, saved.d_qkv, saved.qkv_in);
  const int64_t d = config_.hidden / config_.num_heads, kv0 = local_heads_ * d, kv1 = kv0 + 2 * local_kv_heads_ * d;
  std::vector<Tensor> kv_grads{qkv.weight.grad.slice(0, kv0, kv1)};
  if (qkv.bias.value.defined()) kv_grads.push_back(qkv.bias.grad.slice(0, kv0, kv1));
  TESSERA_CHECK(saved.kv_earlier.size() == kv_grads.size(), "TensorParallelSelfAttention ", qkv.weight.name,
                ": the K/V gradients were not set aside");
  for (size_t i = 0; i < kv_grads.size(); ++i) {
    kv_group_->all_reduce(ctx, kv_grads[i]);
    add(ctx, kv_grads[i], saved.kv_earlier[i], kv_grads[i]);
  }
  saved.kv_earlier.clear();
}

void TensorParallelSelfAttention::parameters(ParameterList& out) {
  qkv.parameters(out);
  proj.parameters(out);
}

}  // namespace tessera::nn
