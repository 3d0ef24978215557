// Vocab-parallel embedding and LM head with its cross-entropy (Megatron's
// VocabParallelEmbedding and vocab-parallel cross entropy).
//
// The [V, C] table is split by rows across the tensor group: with rows = ceil(V / tp),
// tensor rank r holds token ids [r rows, (r + 1) rows). When tp does not divide V the last
// rank(s) hold rows past V: padding, zero, never an id or a target, masked out of the
// softmax. Every rank's parameter is [rows, C], so the shapes agree across the group; the
// full (single-device) tensor is the first V rows of the ranks' tables in rank order (see
// layout()).
//
// The parameter's value and gradient are views of the first `rows` rows of buffers with at
// least one more row, which stays zero in the value: ids this rank does not hold look up
// that row (so the embedding needs no mask), and the cross-entropy backward sends the
// "target is elsewhere" one-hot there (see below); what the extra gradient rows collect is
// cleared by clear_padding_grad(). On CUDA the buffers have a multiple of 64 rows so the
// head's GEMMs get aligned shapes, as the single-device model's head does.
//
// Embedding (ids [N] on every rank, the same ones):
//   forward_partial  this rank's rows' embeddings, zero for other ids     [N, C]
//   reduce           all-reduce, or under sequence parallelism reduce-scatter along the
//                    rows                                                   [N, C] / [N/tp, C]
//   gather_grad      the reverse of reduce for the output gradient          [N, C]
//   backward_weight  accumulates this rank's rows of the table gradient
//
// Head + cross-entropy (VocabParallelLMHead): each rank computes the logits of its
// vocabulary slice, [chunk, rows] at a time (the single-device head's chunking: never
// [N, V], and here never even [N, rows]). Per chunk:
//   1. local log-sum-exp lse_r of each row and the mean of (lse_r - logit[target]) over the
//      rows whose target this rank holds  (cross_entropy_forward over the local logits)
//   2. all-gather both ([tp, chunk + 1] floats: one collective), the global lse =
//      logsumexp over r of lse_r (max-subtracted, the same statistic as the single-device
//      lse), and sum (lse - lse_owner) over the valid rows  (cross_entropy_forward over
//      [chunk, tp])
//   3. the chunk's mean loss = that / valid rows + each rank's local mean times its share
//      of the valid rows (weights applied in double when the loss is read)
//   4. backward: d_logits = d_loss (softmax(logits; lse) - onehot) / valid, the onehot at
//      the target column on its owner and at the zero padding row elsewhere, so one
//      cross_entropy_backward per chunk on every rank; dh = d_logits W and
//      dW += d_logits^T h as on one device
// The padding columns (rows past V and the extra rows) get a logit of -1e30 through the
// head GEMM's bias, so they add exactly 0 to every sum. The loss is the same number on
// every tensor rank; dh is summed over the group (all-reduce, or reduce-scatter under
// sequence parallelism), so it comes back in h's rows.
#pragma once

#include <memory>
#include <vector>

#include "tessera/nn/parallel_layout.h"
#include "tessera/nn/parameter.h"

namespace tessera::nn {

// Which rows of the vocabulary a tensor rank holds.
struct VocabShard {
  int64_t vocab = 0;  // V
  int64_t rows = 0;   // ceil(V / tp): every rank's parameter rows
  int64_t begin = 0;  // the first id this rank holds
  int64_t owned = 0;  // ids this rank holds (rows, or fewer on the last ranks: the rest is padding)
  int tp = 1, rank = 0;

  VocabShard() = default;
  VocabShard(int64_t vocab, int tp, int rank);
  int owner(int64_t id) const { return static_cast<int>(id / rows); }
  bool holds(int64_t id) const { return id >= begin && id < begin + owned; }
  // The table's layout: split along rows, rank r holding [r rows, min((r + 1) rows, V)).
  ShardLayout layout(int64_t hidden) const;
};

class VocabParallelEmbedding {
 public:
  struct Saved {
    Tensor local_ids;  // [N] I32 on the device: id - begin, or `rows` (the zero row) for ids held elsewhere
  };
  // `name` is the parameter's name ("embed.weight", "lm_head.weight"). Needs the tensor group
  // when parallel.tensor_size > 1.
  VocabParallelEmbedding(const std::string& name, int64_t vocab, int64_t hidden, DType dtype,
                         const ParallelContext& parallel);

  // ids [N] (or any shape, flattened): I32/I64 token ids in [0, V), read on the host (the
  // loader's host tensors; a device tensor is copied back). An id outside [0, V) is an
  // Error naming it and its position.
  Tensor forward_partial(Context& ctx, const Tensor& ids, Saved& saved) const;
  Tensor reduce(Context& ctx, const Tensor& partial) const;
  Tensor forward(Context& ctx, const Tensor& ids, Saved& saved) const { return reduce(ctx, forward_partial(ctx, ids, saved)); }
  Tensor gather_grad(Context& ctx, const Tensor& dy) const;
  // dy_full: [N, C] (gather_grad's result). Accumulates into weight.grad.
  void backward_weight(Context& ctx, const Tensor& dy_full, const Saved& saved);

  // Moves the parameter to `device` and rebuilds the padded buffers there (call after the
  // parameter itself was moved, or instead of moving it).
  void to(Device device);
  // Zeroes the gradient rows past the parameter (they collect the "elsewhere" terms).
  void clear_padding_grad();
  void parameters(ParameterList& out) { out.push_back(&weight); }
  ShardLayout layout() const { return shard_.layout(weight.value.size(1)); }
  // Fills this rank's rows from the full [V, C] table (any device).
  void load_full(Context& ctx, const Tensor& full);

  const VocabShard& shard() const { return shard_; }
  int64_t padded_rows() const { return value_padded_.size(0); }
  const Tensor& padded_value() const { return value_padded_; }
  Tensor& padded_grad() { return grad_padded_; }
  bool sequence_parallel() const { return sequence_parallel_; }
  // ParallelContext::tp_comm_overlap (with tp > 1): the LM head on this table overlaps its
  // d_h reduction with its last weight-gradient GEMM.
  bool comm_overlap() const { return overlap_; }
  dist::ProcessGroup& group() const { return *group_; }

  Parameter weight;  // [rows, C]

 private:
  VocabShard shard_;
  bool sequence_parallel_;
  bool overlap_;
  std::shared_ptr<dist::ProcessGroup> group_;
  Tensor value_padded_, grad_padded_;  // [padded rows, C]; weight.value / weight.grad view their first rows
};

class VocabParallelLMHead {
 public:
  // The head's weight is `table`'s (the input embedding when tied, else a table of its own,
  // named "lm_head.weight"); the head keeps a reference, so `table` must outlive it.
  explicit VocabParallelLMHead(VocabParallelEmbedding& table, int64_t chunk_rows = 1024);

  // The mean cross-entropy, kept on the device until read(): sum_i chunk_losses[i] *
  // weights[i] (per chunk tp + 1 slots: the log-sum-exp correction and each rank's local
  // mean over the targets it holds; see the .cpp).
  struct Loss {
    Tensor chunk_losses;          // undefined when no target is valid (the loss is 0)
    std::vector<double> weights;  // one per slot
    double read() const;
  };
  // h: the final hidden states, [N, C], or under sequence parallelism this rank's [N/tp, C]
  // rows of them. targets: N ids (any shape, flattened; read on the host), ignore_index
  // rows contribute nothing. The mean cross-entropy of the full logits h W^T over the valid
  // targets. With d_h (preallocated like h), also writes the gradient w.r.t. h times
  // `scale` and accumulates the weight's gradient times `scale`. Collective over the
  // tensor group.
  Loss loss(Context& ctx, const Tensor& h, const Tensor& targets, Tensor* d_h, float scale = 1.0f,
            int64_t ignore_index = -100);
  // The full logits [N, V] (F32) on every rank; h as for loss(). Collective.
  Tensor logits(Context& ctx, const Tensor& h);

 private:
  VocabParallelEmbedding& table_;
  int64_t chunk_rows_;
  Tensor mask_bias_;  // [padded rows]: 0 for held ids, -1e30 for padding
};

}  // namespace tessera::nn
