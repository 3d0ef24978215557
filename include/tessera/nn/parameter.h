// Parameters, the parallel context, and the conventions every module follows.
//
// A module owns its Parameters and has explicit forward and backward passes:
//   forward(ctx, x, saved)            -> output; fills `saved` with what backward needs
//   backward_input(ctx, dy, saved)    -> gradient w.r.t. the input (dgrad)
//   backward_weight(ctx, dy, saved)   -> accumulates into each Parameter's grad (wgrad)
// Splitting dgrad from wgrad is what zero-bubble and DualPipe schedules need. The
// `saved` struct belongs to the caller, so several micro-batches can be in flight.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera::dist {
class ProcessGroup;  // tessera/dist/process_group.h
}

namespace tessera::nn {

// Mixed precision: with a BF16 compute dtype, `value` is the BF16 copy the ops read, `master`
// holds the FP32 weights the optimizer updates, and `grad` is FP32 (BF16 gradients summed
// over many micro-batches and layers would lose the small updates). With an F32 or F64
// compute dtype there is no separate master: `value` is updated in place.
struct Parameter {
  std::string name;      // Hugging Face-style dotted name, e.g. "model.layers.0.self_attn.q_proj.weight"
  Tensor value;          // what the ops compute with: F32, F64 (gradient checks) or BF16
  Tensor grad;           // F32 (F64 for F64 values); accumulated by backward_weight
  Tensor master;         // F32 master weights when value is BF16; undefined otherwise
  bool weight_decay = true;  // false for norms and biases
  // Lazy zeroing. A model's zero_grad() does not clear the gradients of parameters whose
  // every gradient writer can overwrite (grad_overwrite_ok, set by their module: Linear,
  // GroupedLinear, the LM head); it sets grad_unwritten instead, and the step's first writer
  // stores its result with beta = 0 rather than adding it to zeros. That saves a memset of
  // every FP32 gradient and the first GEMM's read of it (about 2 ms of a Llama-1B step).
  bool grad_overwrite_ok = false;
  bool grad_unwritten = false;  // grad's memory is stale: it stands for zeros
  // value lags master: the optimizer updated master without rewriting the BF16 copy
  // (fp8.cast_in_optimizer, whose update writes the FP8 casts the next forward reads instead;
  // nn::GroupedLinear::optimizer_update). Whoever reads value then calls
  // refresh_value_if_stale first; refresh_value and a plain optimizer update clear it.
  bool value_stale = false;
  // While value is stale, its memory may hold other data (the FP8 codes a cast_in_optimizer
  // update wrote there, which a forward or a pending backward may still read): refresh_value
  // then gives value memory of its own instead of writing over them.
  bool value_memory_lent = false;

  Parameter() = default;
  Parameter(std::string name_, const Shape& shape, DType dtype, bool decay, Device device = Device::cpu());
  int64_t numel() const { return value.numel(); }

  // For a gradient writer, before it writes: true when it must OVERWRITE grad (and from then
  // on the gradient is written); false when it must add. A writer that cannot overwrite
  // (can_overwrite false: a scatter-add, a GEMM with nothing to sum) gets grad zeroed here,
  // on ctx's stream, and adds.
  bool begin_grad_write(Context& ctx, bool can_overwrite = true);
  // For a reader of grad (optimizer, reductions): zeroes a gradient no writer touched.
  void materialize_grad(Context& ctx) { begin_grad_write(ctx, false); }

  // The full-precision weights: what the optimizer updates, checkpoints save and imports fill.
  Tensor& weights() { return master.defined() ? master : value; }
  const Tensor& weights() const { return master.defined() ? master : value; }
  // Refreshes `value` from `master` after the weights changed (no-op without a master).
  void refresh_value(Context& ctx);
  void refresh_value_if_stale(Context& ctx) {
    if (value_stale) refresh_value(ctx);
  }
  // Gives value memory of its own again where it was lent (value_memory_lent), contents
  // undefined: for whoever writes all of value next.
  void own_value_memory();
  // Moves every tensor of the parameter to `device` (copies; the old storage is released).
  void to(Device device);
};

// The dtype of gradients and master weights for a compute dtype.
inline DType master_dtype(DType compute) { return compute == DType::F64 ? DType::F64 : DType::F32; }

// Sizes and ranks of the parallel groups. Everything is 1 / 0 on a single device; every
// module takes one so that none assumes it runs alone. The groups are null on a single
// device; dist::ParallelGrid::context() fills them (the tensor-parallel layers in
// nn/parallel_linear.h need tensor_group when tensor_size > 1).
struct ParallelContext {
  int data_size = 1, data_rank = 0;
  int tensor_size = 1, tensor_rank = 0;
  int pipeline_size = 1, pipeline_rank = 0;
  bool sequence_parallel = false;  // activations outside the TP regions split along rows
  // The tensor-parallel layers start their backward collectives asynchronously and compute
  // the weight gradients that do not depend on them meanwhile (parallel.tp_comm_overlap;
  // bit-identical results, only the order of independent work changes).
  bool tp_comm_overlap = false;
  std::shared_ptr<dist::ProcessGroup> data_group, tensor_group, pipeline_group;
  bool single_device() const { return data_size * tensor_size * pipeline_size == 1; }
};

// Collects pointers to parameters, so models can hand the optimizer one flat list.
using ParameterList = std::vector<Parameter*>;

}  // namespace tessera::nn
