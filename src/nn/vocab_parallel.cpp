// Vocab-parallel embedding and LM head (see tessera/nn/vocab_parallel.h).
#include "tessera/nn/vocab_parallel.h"

#include <algorithm>

#include "tessera/dist/process_group.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/embedding.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/loss.h"

namespace tessera::nn {
namespace {

// The logit of a padding column: exp(-1e30 - lse) is exactly 0 in every dtype the model
// runs in (BF16 holds it too), and unlike -inf it never meets another infinity.
constexpr double kMaskedLogit = -1e30;

std::shared_ptr<dist::ProcessGroup> tensor_group(const ParallelContext& parallel, const std::string& name) {
  if (parallel.tensor_size == 1) return parallel.tensor_group ? parallel.tensor_group : dist::local_group();
  TESSERA_CHECK(parallel.tensor_group != nullptr && parallel.tensor_group->size() == parallel.tensor_size, name,
                ": tensor_size ", parallel.tensor_size, " needs its tensor_group (dist::ParallelGrid::context())");
  return parallel.tensor_group;
}

std::vector<int64_t> host_ids(const Tensor& ids) { return ids.to(Device::cpu()).contiguous().to_ints(); }

Tensor gather_rows(Context& ctx, dist::ProcessGroup& group, const Tensor& local) {
  Shape shape = local.shape();
  shape[0] *= group.size();
  Tensor full = Tensor::empty(shape, local.dtype(), ctx.device);
  group.all_gather(ctx, local.contiguous(), full);
  return full;
}

void check_rows_divide(int64_t rows, int tp, const std::string& name) {
  TESSERA_CHECK(rows % tp == 0, name, ": sequence parallelism needs batch x seq (", rows,
                ") divisible by the tensor-parallel size ", tp);
}

}  // namespace

// ---- VocabShard ----

VocabShard::VocabShard(int64_t vocab_, int tp_, int rank_) : vocab(vocab_), tp(tp_), rank(rank_) {
  TESSERA_CHECK(vocab > 0 && tp >= 1 && rank >= 0 && rank < tp, "VocabShard: bad vocabulary ", vocab, " / rank ", rank,
                " of ", tp);
  rows = (vocab + tp - 1) / tp;
  begin = rank * rows;
  owned = std::clamp<int64_t>(vocab - begin, 0, rows);
}

ShardLayout VocabShard::layout(int64_t hidden) const {
  if (tp == 1) return ShardLayout::replicated({vocab, hidden});
  ShardLayout l;
  l.full = {vocab, hidden};
  l.dim = 0;
  l.local_extent = rows;
  for (int r = 0; r < tp; ++r) {
    const int64_t b = r * rows, e = std::min(vocab, b + rows);
    l.ranges.push_back(b < e ? std::vector<std::pair<int64_t, int64_t>>{{b, e}} : std::vector<std::pair<int64_t, int64_t>>{});
  }
  return l;
}

// ---- VocabParallelEmbedding ----

VocabParallelEmbedding::VocabParallelEmbedding(const std::string& name, int64_t vocab, int64_t hidden, DType dtype,
                                               const ParallelContext& parallel)
    : shard_(vocab, parallel.tensor_size, parallel.tensor_rank),
      sequence_parallel_(parallel.sequence_parallel && parallel.tensor_size > 1),
      overlap_(parallel.tp_comm_overlap && parallel.tensor_size > 1),
      group_(tensor_group(parallel, name)) {
  TESSERA_CHECK(hidden > 0, "VocabParallelEmbedding ", name, ": hidden size must be positive");
  weight = Parameter(name, {shard_.rows, hidden}, dtype, true);
  to(Device::cpu());
}

void VocabParallelEmbedding::to(Device device) {
  weight.to(device);
  const int64_t rows = shard_.rows, hidden = weight.value.size(1);
  // At least one zero row past the parameter; on CUDA a multiple of 64 rows (aligned GEMMs).
  const int64_t padded = device.is_cuda() ? (rows + 1 + 63) / 64 * 64 : rows + 1;
  value_padded_ = Tensor::zeros({padded, hidden}, weight.value.dtype(), device);
  grad_padded_ = Tensor::zeros({padded, hidden}, weight.grad.dtype(), device);
  Tensor value = value_padded_.slice(0, 0, rows), grad = grad_padded_.slice(0, 0, rows);
  value.copy_from(weight.value);
  grad.copy_from(weight.grad);
  weight.value = value;
  weight.grad = grad;
}

void VocabParallelEmbedding::clear_padding_grad() { grad_padded_.slice(0, shard_.rows, grad_padded_.size(0)).fill_zero(); }

void VocabParallelEmbedding::load_full(Context& ctx, const Tensor& full) {
  const ShardLayout l = layout();
  TESSERA_CHECK(full.shape() == l.full, "VocabParallelEmbedding ", weight.name, "::load_full: want ",
                shape_to_string(l.full), ", got ", full.describe());
  weight.weights().copy_from(slice_full(l, shard_.rank, host_copy_as(full, weight.weights().dtype())));
  weight.refresh_value(ctx);
}

Tensor VocabParallelEmbedding::forward_partial(Context& ctx, const Tensor& ids, Saved& saved) const {
  const std::vector<int64_t> host = host_ids(ids);
  const int64_t n = static_cast<int64_t>(host.size());
  Tensor local = Tensor::empty({n}, DType::I32);
  int32_t* out = local.data<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = host[static_cast<size_t>(i)];
    TESSERA_CHECK(id >= 0 && id < shard_.vocab, "VocabParallelEmbedding ", weight.name, ": token id ", id,
                  " at position ", i, " is outside the vocabulary [0, ", shard_.vocab, ")");
    out[i] = static_cast<int32_t>(shard_.holds(id) ? id - shard_.begin : shard_.rows);
  }
  saved.local_ids = local.to(ctx.device);
  Tensor partial = Tensor::empty({n, weight.value.size(1)}, weight.value.dtype(), ctx.device);
  embedding_forward(ctx, saved.local_ids, value_padded_, partial);
  return partial;
}

Tensor VocabParallelEmbedding::reduce(Context& ctx, const Tensor& partial) const {
  if (shard_.tp == 1) return partial;
  if (!sequence_parallel_) {
    Tensor out = partial;
    group_->all_reduce(ctx, out);
    return out;
  }
  check_rows_divide(partial.size(0), shard_.tp, weight.name);
  Tensor local = Tensor::empty({partial.size(0) / shard_.tp, partial.size(1)}, partial.dtype(), ctx.device);
  group_->reduce_scatter(ctx, partial, local);
  return local;
}

Tensor VocabParallelEmbedding::gather_grad(Context& ctx, const Tensor& dy) const {
  return sequence_parallel_ ? gather_rows(ctx, *group_, dy) : dy;
}

void VocabParallelEmbedding::backward_weight(Context& ctx, const Tensor& dy_full, const Saved& saved) {
  TESSERA_CHECK(dy_full.dim() == 2 && dy_full.size(0) == saved.local_ids.numel(), "VocabParallelEmbedding ",
                weight.name, ": the gradient must cover every id of the forward, got ", dy_full.describe());
  embedding_backward(ctx, saved.local_ids, dy_full.contiguous(), grad_padded_);
}

// ---- VocabParallelLMHead ----

VocabParallelLMHead::VocabParallelLMHead(VocabParallelEmbedding& table, int64_t chunk_rows)
    : table_(table), chunk_rows_(chunk_rows) {
  TESSERA_CHECK(chunk_rows > 0, "VocabParallelLMHead: chunk_rows must be positive");
}

double VocabParallelLMHead::Loss::read() const {
  if (!chunk_losses.defined()) return 0.0;
  const Tensor host = chunk_losses.to(Device::cpu());  // the one wait for the device
  double loss = 0;
  for (size_t i = 0; i < weights.size(); ++i) loss += host.item(static_cast<int64_t>(i)) * weights[i];
  return loss;
}

VocabParallelLMHead::Loss VocabParallelLMHead::loss(Context& ctx, const Tensor& h, const Tensor& targets, Tensor* d_h,
                                                    float scale_by, int64_t ignore_index) {
  const VocabShard& shard = table_.shard();
  dist::ProcessGroup& group = table_.group();
  const int tp = shard.tp;
  const bool sp = table_.sequence_parallel();
  const std::string& name = table_.weight.name;
  TESSERA_CHECK(h.dim() == 2 && h.size(1) == table_.weight.value.size(1), "VocabParallelLMHead ", name,
                ": h must be [rows, ", table_.weight.value.size(1), "], got ", h.describe());
  if (d_h) check_shape(*d_h, h.shape(), "VocabParallelLMHead::loss", "d_h");
  const int64_t rows = sp ? h.size(0) * tp : h.size(0);
  const std::vector<int64_t> host = host_ids(targets);
  TESSERA_CHECK(static_cast<int64_t>(host.size()) == rows, "VocabParallelLMHead ", name, ": ", host.size(),
                " targets for ", rows, " rows");

  // The three target vectors (see the header), and per chunk the valid targets and those
  // this rank holds. One host-to-device copy for all three.
  Tensor host_targets = Tensor::empty({3, rows}, DType::I32);
  int32_t* fwd = host_targets.data<int32_t>();
  int32_t* bwd = fwd + rows;
  int32_t* owner = bwd + rows;
  const int64_t num_chunks = (rows + chunk_rows_ - 1) / chunk_rows_;
  // chunk_owned[c * tp + r]: the chunk's valid targets that rank r holds.
  std::vector<int64_t> chunk_valid(static_cast<size_t>(num_chunks), 0),
      chunk_owned(static_cast<size_t>(num_chunks * tp), 0);
  int64_t valid = 0;
  const auto ignore = static_cast<int32_t>(ignore_index);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = host[static_cast<size_t>(i)];
    if (t == ignore_index) {
      fwd[i] = bwd[i] = owner[i] = ignore;
      continue;
    }
    TESSERA_CHECK(t >= 0 && t < shard.vocab, "VocabParallelLMHead ", name, ": target ", t, " at position ", i,
                  " is outside the vocabulary [0, ", shard.vocab, ")");
    const bool here = shard.holds(t);
    fwd[i] = here ? static_cast<int32_t>(t - shard.begin) : ignore;
    bwd[i] = static_cast<int32_t>(here ? t - shard.begin : shard.rows);  // elsewhere: the zero padding row
    owner[i] = shard.owner(t);
    chunk_valid[static_cast<size_t>(i / chunk_rows_)] += 1;
    chunk_owned[static_cast<size_t>(i / chunk_rows_ * tp + owner[i])] += 1;
    valid += 1;
  }
  if (valid == 0) {  // every rank sees the same targets, so all return here together
    if (d_h) d_h->fill_zero();
    return {};
  }

  const Tensor h_full = sp ? gather_rows(ctx, group, h) : h;
  const Tensor device_targets = host_targets.to(ctx.device);
  const Tensor t_fwd = device_targets.select(0, 0), t_bwd = device_targets.select(0, 1),
               t_owner = device_targets.select(0, 2);
  const Tensor& w = table_.padded_value();
  Tensor& grad = table_.padded_grad();
  const int64_t padded = w.size(0);
  const DType dtype = w.dtype(), stats = master_dtype(dtype);
  if (!mask_bias_.defined() || mask_bias_.device() != ctx.device || mask_bias_.size(0) != padded ||
      mask_bias_.dtype() != dtype) {
    Tensor bias = Tensor::zeros({padded}, dtype);
    for (int64_t i = shard.owned; i < padded; ++i) bias.set_item(i, kMaskedLogit);
    mask_bias_ = bias.to(ctx.device);
  }
  Tensor d_h_full;
  if (d_h) d_h_full = sp ? Tensor::empty({rows, h.size(1)}, d_h->dtype(), ctx.device) : *d_h;

  // Per chunk, tp + 1 slots: sum (lse - lse_owner) / valid, then every rank's local mean
  // (sum over the valid targets it holds of lse_r - logit[target], over their count). The
  // loss is their sum with the weights below, taken in double on the host by read(); on the
  // device nothing is scaled, so an F64 model keeps every bit.
  const int64_t slots = tp + 1;
  // Communication overlap: each chunk's weight-gradient GEMM is deferred to the start of the
  // next chunk with valid targets (the same GEMMs accumulating in the same order, no more
  // logits alive at once), so the last one runs beside d_h's reduction.
  const bool overlap = d_h && tp > 1 && table_.comm_overlap();
  Tensor pending_logits, pending_h;
  auto flush_weight_grad = [&] {
    if (!pending_logits.defined()) return;
    gemm(ctx, pending_logits, pending_h, grad, {.transpose_a = true, .beta = 1});  // dW += dlogits^T h
    pending_logits = pending_h = Tensor();
  };
  Tensor chunk_losses = Tensor::zeros({num_chunks * slots}, stats, ctx.device);
  std::vector<double> weights(static_cast<size_t>(num_chunks * slots), 0.0);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t r0 = c * chunk_rows_, r1 = std::min(rows, r0 + chunk_rows_), n = r1 - r0;
    const int64_t n_valid = chunk_valid[static_cast<size_t>(c)];
    if (n_valid == 0) {
      if (d_h) d_h_full.slice(0, r0, r1).fill_zero();
      continue;
    }
    const double chunk_weight = double(n_valid) / double(valid);
    weights[static_cast<size_t>(c * slots)] = chunk_weight;
    for (int r = 0; r < tp; ++r)
      weights[static_cast<size_t>(c * slots + 1 + r)] =
          chunk_weight * double(chunk_owned[static_cast<size_t>(c * tp + r)]) / double(n_valid);
    flush_weight_grad();
    const Tensor h_chunk = h_full.slice(0, r0, r1);
    Tensor logits = Tensor::empty({n, padded}, dtype, ctx.device);
    gemm(ctx, h_chunk, w, logits, {.transpose_b = true}, mask_bias_);
    // 1. local statistics: [lse_r of each row | local mean], gathered in one collective
    Tensor local = Tensor::empty({n + 1}, stats, ctx.device);
    Tensor local_lse = local.slice(0, 0, n), local_loss = local.slice(0, n, n + 1);
    cross_entropy_forward(ctx, logits, t_fwd.slice(0, r0, r1), local_loss, local_lse, {.ignore_index = ignore_index});
    Tensor gathered = Tensor::empty({tp * (n + 1)}, stats, ctx.device);
    group.all_gather(ctx, local, gathered);
    Tensor per_rank = Tensor::empty({n + 1, tp}, stats, ctx.device);
    transpose_2d(ctx, gathered.reshape({tp, n + 1}), per_rank);
    // 2. the global log-sum-exp and sum (lse - lse_owner) / n_valid
    Tensor lse = Tensor::empty({n}, stats, ctx.device), correction = chunk_losses.slice(0, c * slots, c * slots + 1);
    cross_entropy_forward(ctx, per_rank.slice(0, 0, n), t_owner.slice(0, r0, r1), correction, lse,
                          {.ignore_index = ignore_index});
    // 3. the local means, weighted on the host
    chunk_losses.slice(0, c * slots + 1, (c + 1) * slots).copy_from(per_rank.select(0, n));
    if (!d_h) continue;
    // 4. backward, in place of the logits
    cross_entropy_backward(ctx, logits, t_bwd.slice(0, r0, r1), lse, static_cast<float>(chunk_weight * scale_by), logits,
                           {.ignore_index = ignore_index});
    Tensor d_h_chunk = d_h_full.slice(0, r0, r1);
    gemm(ctx, logits, w, d_h_chunk);  // dh = dlogits W
    pending_logits = logits;
    pending_h = h_chunk;
    if (!overlap) flush_weight_grad();
  }
  if (d_h && tp > 1) {
    if (overlap) {
      // d_h_full / *d_h stay alive and untouched until the wait; the GEMM reads only the
      // last chunk's logits and h.
      std::unique_ptr<dist::Work> work =
          sp ? group.reduce_scatter_async(ctx, d_h_full, *d_h) : group.all_reduce_async(ctx, *d_h);
      flush_weight_grad();
      work->wait();
    } else if (sp) {
      group.reduce_scatter(ctx, d_h_full, *d_h);
    } else {
      group.all_reduce(ctx, *d_h);
    }
  }
  flush_weight_grad();
  return {chunk_losses, weights};
}

Tensor VocabParallelLMHead::logits(Context& ctx, const Tensor& h) {
  const VocabShard& shard = table_.shard();
  dist::ProcessGroup& group = table_.group();
  const Tensor h_full = table_.sequence_parallel() ? gather_rows(ctx, group, h) : h;
  const int64_t rows = h_full.size(0);
  Tensor local = Tensor::empty({rows, shard.rows}, DType::F32, ctx.device);
  gemm(ctx, h_full, table_.weight.value, local, {.transpose_b = true});
  if (shard.tp == 1) return local;
  Tensor gathered = Tensor::empty({shard.tp * rows, shard.rows}, DType::F32, ctx.device);
  group.all_gather(ctx, local, gathered);
  synchronize(ctx);
  Tensor out = Tensor::empty({rows, shard.vocab}, DType::F32, ctx.device);
  for (int r = 0; r < shard.tp; ++r) {
    const int64_t b = r * shard.rows, e = std::min(shard.vocab, b + shard.rows);
    if (b >= e) continue;
    out.slice(1, b, e).copy_from(gathered.slice(0, r * rows, (r + 1) * rows).slice(1, 0, e - b));
  }
  return out;
}

}  // namespace tessera::nn
