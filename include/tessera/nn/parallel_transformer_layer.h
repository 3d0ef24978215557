// TensorParallelTransformerLayer: nn::TransformerLayer with its attention and MLP split
// across the tensor group (TensorParallelSelfAttention, TensorParallelMLP).
//
// The same pre-norm block and the same fused residual adds (x1 = x + attn(norm1(x)) added
// inside norm2; the block's output handed on as two summands for the next norm). The norms
// and residual adds run on the full rows, replicated on every tensor rank, or under
// sequence parallelism on this rank's rows [r N/tp, (r+1) N/tp) of the B*T rows; the
// attention and MLP gather the rows they need and scatter their output back.
//
// Under sequence parallelism the norms' weight gradients come from this rank's rows only:
// sequence_parallel_parameters() lists them, and the model sums them over the tensor group
// (TransformerLM does so in forward_backward). Without it they are complete on every rank.
//
// With communication overlap (ParallelContext::tp_comm_overlap) and sequence parallelism,
// backward_input also starts the attention's all-gather of its dy before the attention's
// backward and computes the MLP's row-parallel weight gradient meanwhile (backward_weight
// then skips it); see parallel_linear.h for the column-parallel overlap.
#pragma once

#include "tessera/models/config.h"
#include "tessera/nn/norm.h"
#include "tessera/nn/parallel_linear.h"

namespace tessera::nn {

class TensorParallelTransformerLayer {
 public:
  struct Saved {
    Norm::Saved norm1, norm2;
    TensorParallelSelfAttention::Saved attn;
    TensorParallelMLP::Saved mlp;
    Tensor d_x1;
  };
  struct Output {
    Tensor residual, branch;
  };
  // Dense models only (gpt2, llama); the head and FFN sizes must fit the tensor size (see
  // TensorParallelSelfAttention and ColumnParallelLinear for the rules and errors).
  TensorParallelTransformerLayer(const std::string& name, const models::ModelConfig& config, DType dtype,
                                 const ParallelContext& parallel);

  // x and branch: [rows, C] with rows = B*T, or B*T/tp under sequence parallelism.
  Output forward(Context& ctx, const Tensor& x, const Tensor& branch, int64_t batch, int64_t seq, Saved& saved) const;
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved);
  void backward_weight(Context& ctx, const Tensor& dy, Saved& saved);

  void parameters(ParameterList& out);  // in nn::TransformerLayer's order
  void layouts(std::vector<ShardLayout>& out) const;  // parallel to parameters()
  void sequence_parallel_parameters(ParameterList& out);  // the norms' parameters

  Norm norm1, norm2;
  TensorParallelSelfAttention attn;
  TensorParallelMLP mlp;
};

}  // namespace tessera::nn
