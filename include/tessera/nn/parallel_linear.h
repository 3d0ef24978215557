// Tensor-parallel linear layers (Megatron-style) and the MLP built from them.
//
// ColumnParallelLinear splits W [out, in] by rows (output features): rank r holds
// out/tp of them and computes its slice of y. RowParallelLinear splits W by columns (input
// features): rank r takes its slice of x and produces a partial y that the group sums.
// Column -> (elementwise) -> Row needs one collective per direction:
//   forward:  identity before Column ("f"),  all-reduce after Row ("g")
//   backward: all-reduce of Column's dx ("f"), identity for Row ("g")
// With sequence parallelism (ParallelContext::sequence_parallel) the activations outside the
// pair are split along rows (tokens) across the group instead of replicated:
//   forward:  all-gather rows before Column,  reduce-scatter rows after Row
//   backward: reduce-scatter Column's dx,     all-gather Row's dy
// so the norms and residual adds between blocks work on N/tp rows each. N must be a
// multiple of tp. Inputs and outputs are 2-D [rows, features], as nn::Linear.
//
// Gradient rules as everywhere in nn/: backward_input overwrites (returns a new dx),
// backward_weight accumulates. A replicated bias (RowParallelLinear's) gets the same
// gradient on every rank (it is computed from the full dy), so it needs no extra reduction.
//
// Communication overlap (ParallelContext::tp_comm_overlap, parallel.tp_comm_overlap): with
// tp > 1, ColumnParallelLinear::backward_input starts dx's all-reduce (reduce-scatter under
// sequence parallelism) asynchronously, accumulates the weight and bias gradients (which need
// only dy and the saved input) while it runs, then waits for it (on NCCL a stream-ordered
// wait, no host synchronisation) and returns dx; its backward_weight then has nothing left
// to do (Saved records it). The GEMMs and reductions are the same ones, so the results are
// bit-identical to running without it; on the CPU backends the collective completes at once
// and only the order changes. Under sequence parallelism RowParallelLinear::start_gather_dy
// lets the owner start the all-gather of dy early and compute something else meanwhile
// (TensorParallelTransformerLayer: the MLP's row-parallel weight gradient beside the
// attention's dy gather).
#pragma once

#include "tessera/nn/attention.h"
#include "tessera/nn/mlp.h"
#include "tessera/nn/parallel_layout.h"
#include "tessera/nn/parameter.h"

namespace tessera::dist {
class Work;
}

namespace tessera::nn {

class ColumnParallelLinear {
 public:
  struct Saved {
    Tensor x;  // the full input [N, in] (gathered under sequence parallelism)
    // backward_input accumulated the weight (and bias) gradient already (communication
    // overlap); backward_weight clears it instead of accumulating a second time.
    bool weight_grad_done = false;
  };
  // A block of output features split into `shards` equal slices, rank r holding slice
  // r / (tp / shards): shards = tp (0 means tp) splits it across the ranks, fewer shards
  // give each slice to tp / shards neighbouring ranks (K/V heads under GQA with fewer heads
  // than ranks), shards = 1 replicates it. shards must divide tp and the width. The input
  // gradient stays exact (each rank's share is summed), but the weight gradient of a slice
  // held by several ranks is each rank's part only: the owner of the layer sums it over
  // those ranks (TensorParallelSelfAttention does).
  struct Block {
    int64_t width = 0;
    int shards = 0;
  };
  // `parts`: the output features are `parts` equal blocks each split across the ranks (2 for
  // SwiGLU's [gate | up], 3 for a fused [q | k | v] of equal widths), so that every rank
  // holds matching slices of each block, side by side.
  ColumnParallelLinear(const std::string& name, int64_t in_features, int64_t out_features, bool bias, DType dtype,
                       const ParallelContext& parallel, int parts = 1);
  // Unequal blocks (a fused [q | k | v] with fewer K/V heads, GQA): `blocks` are the widths,
  // summing to out_features, each divisible by the tensor-parallel size.
  ColumnParallelLinear(const std::string& name, int64_t in_features, const std::vector<int64_t>& blocks, bool bias,
                       DType dtype, const ParallelContext& parallel);
  // The general form (see Block).
  ColumnParallelLinear(const std::string& name, int64_t in_features, const std::vector<Block>& blocks, bool bias,
                       DType dtype, const ParallelContext& parallel);

  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const;  // -> [N, out/tp]
  // -> dx, reduced. With communication overlap also accumulates the weight gradients (see
  // the top of this file), hence not const.
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved);
  void backward_weight(Context& ctx, const Tensor& dy, Saved& saved);
  // Whether backward_input overlaps its collective with the weight-gradient GEMM.
  bool comm_overlap() const { return overlap_; }
  void parameters(ParameterList& out);

  // Fills this rank's shard from the full weight [out, in] and bias [out] (bias may be
  // undefined), any device: for tests, imports and resharding.
  void load_full(Context& ctx, const Tensor& full_weight, const Tensor& full_bias);
  // The rows of the full weight this rank (or tensor rank `rank`) holds, in the order it
  // holds them.
  std::vector<std::pair<int64_t, int64_t>> shard_rows() const { return shard_rows(rank_); }
  std::vector<std::pair<int64_t, int64_t>> shard_rows(int rank) const;
  // Where weight and bias sit in the full tensors (nn/parallel_layout.h).
  ShardLayout weight_layout() const;
  ShardLayout bias_layout() const;

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }  // full
  int64_t local_out_features() const { return local_out_; }
  Parameter weight, bias;  // [local out, in], [local out] (out/tp each when every block is split tp ways)

 private:
  int64_t in_, out_, local_out_ = 0;
  int tp_, rank_;
  std::vector<Block> blocks_;
  bool sequence_parallel_;
  bool overlap_;
  std::shared_ptr<dist::ProcessGroup> group_;
};

class RowParallelLinear {
 public:
  struct Saved {
    Tensor x;        // the local input [N, in/tp]
    Tensor dy_full;  // sequence parallel: the gathered dy, kept by backward_input for backward_weight
    bool dy_gathered = false;       // start_gather_dy filled dy_full for the next backward_input
    bool weight_grad_done = false;  // the owner ran backward_weight early; the next call skips
  };
  RowParallelLinear(const std::string& name, int64_t in_features, int64_t out_features, bool bias, DType dtype,
                    const ParallelContext& parallel);

  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const;        // [N, in/tp] -> [N, out] (SP: [N/tp, out])
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved) const;  // -> dx [N, in/tp]
  // Accumulates the weight (and bias) gradient, unless saved.weight_grad_done says an
  // earlier call already did (then clears it).
  void backward_weight(Context& ctx, const Tensor& dy, Saved& saved);
  // Sequence parallelism: starts the all-gather of dy into saved.dy_full (asynchronous on
  // NCCL, see ProcessGroup::all_gather_async) for the next backward_input, which then uses
  // it. dy must stay alive and unwritten until the returned Work's wait().
  std::unique_ptr<dist::Work> start_gather_dy(Context& ctx, const Tensor& dy, Saved& saved) const;
  bool sequence_parallel() const { return sequence_parallel_; }
  bool comm_overlap() const { return overlap_; }
  void parameters(ParameterList& out);

  void load_full(Context& ctx, const Tensor& full_weight, const Tensor& full_bias);
  ShardLayout weight_layout() const;  // split along the input features (dimension 1)
  ShardLayout bias_layout() const;    // replicated

  int64_t in_features() const { return in_; }  // full
  int64_t out_features() const { return out_; }
  int64_t local_in_features() const { return in_ / tp_; }
  Parameter weight, bias;  // [out, in/tp], [out] (replicated)

 private:
  int64_t in_, out_;
  int tp_, rank_;
  bool sequence_parallel_;
  bool overlap_;
  std::shared_ptr<dist::ProcessGroup> group_;
};

// MLP with the first projection column-parallel and the second row-parallel: the same
// function as nn::MLP, with ffn/tp hidden features per rank.
class TensorParallelMLP {
 public:
  struct Saved {
    ColumnParallelLinear::Saved fc_in;
    RowParallelLinear::Saved proj_in;
    Tensor h_pre;  // fc output, before the activation
    Tensor d_h_pre;
  };
  TensorParallelMLP(const std::string& name, int64_t hidden, int64_t ffn, Activation activation, bool bias,
                    DType dtype, const ParallelContext& parallel);

  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const;
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved);
  void backward_weight(Context& ctx, const Tensor& dy, Saved& saved);
  void parameters(ParameterList& out);
  // The layouts of parameters(), in the same order.
  void layouts(std::vector<ShardLayout>& out) const;
  // Shards a single-device MLP's weights into this rank's part.
  void load_full(Context& ctx, MLP& full);

  Activation activation;
  ColumnParallelLinear fc;
  RowParallelLinear proj;
};

// Self-attention with the heads split across the tensor-parallel ranks: each rank projects
// and attends with num_heads/tp query heads, then the row-parallel output projection sums
// the ranks' shares. Same function as nn::SelfAttention. num_heads must divide by tp. The
// K/V heads (GQA):
//   num_kv_heads % tp == 0   split: num_kv_heads/tp per rank, the ones its query heads use
//   tp % num_kv_heads == 0   replicated: each rank holds the one K/V head its query heads
//                            use, shared by tp/num_kv_heads neighbouring ranks; the K/V
//                            weight gradients are summed over those ranks in backward_weight
//   otherwise                an error naming both numbers
class TensorParallelSelfAttention {
 public:
  struct Saved : AttentionCoreSaved {
    ColumnParallelLinear::Saved qkv_in;
    RowParallelLinear::Saved out_in;
    // Replicated K/V heads with communication overlap: the K/V rows' gradients from before
    // this backward, set aside by backward_input (whose QKV projection accumulates the new
    // part), added back by backward_weight after summing the new part over kv_group.
    std::vector<Tensor> kv_earlier;
  };
  TensorParallelSelfAttention(const std::string& name, const AttentionConfig& config, DType dtype,
                              const ParallelContext& parallel);

  // x is [B*T, hidden], or under sequence parallelism this rank's B*T/tp rows of it.
  Tensor forward(Context& ctx, const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const;
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved);
  void backward_weight(Context& ctx, const Tensor& dy, Saved& saved);
  void parameters(ParameterList& out);
  void layouts(std::vector<ShardLayout>& out) const;
  void load_full(Context& ctx, SelfAttention& full);

  int64_t local_heads() const { return local_heads_; }
  int64_t local_kv_heads() const { return local_kv_heads_; }
  bool kv_replicated() const { return kv_group_ != nullptr; }

  ColumnParallelLinear qkv;
  RowParallelLinear proj;

 private:
  // Sets the K/V rows' gradients aside into saved.kv_earlier and zeroes them.
  void set_aside_kv_grads(Saved& saved);

  AttentionConfig config_;
  int64_t local_heads_, local_kv_heads_;
  // The ranks that share this rank's K/V head when K/V heads are replicated (else null).
  std::shared_ptr<dist::ProcessGroup> kv_group_;
};

}  // namespace tessera::nn
