// How a tensor-parallel rank's parameter sits inside the full (single-device) tensor, and
// the conversions between the two that checkpoints, imports and resharding need.
//
// A parameter is either replicated (every tensor rank holds the whole tensor) or split
// along one dimension: tensor rank r holds the ranges ranges[r] of the full tensor along
// `dim`, laid end to end in its local tensor. Ranges of different ranks may coincide
// (grouped-query attention with fewer K/V heads than ranks holds copies of a K/V head on
// several ranks). The local extent may exceed the ranges' total: the rows past it are
// padding that is not part of the full tensor (a vocabulary padded to a multiple of the
// tensor size); they stay zero.
//
// Every rank of the tensor group holds the same local shape for a given parameter, which is
// what lets gather_full run one all-gather per tensor.
#pragma once

#include <utility>
#include <vector>

#include "tessera/nn/parameter.h"

namespace tessera::nn {

struct ShardLayout {
  Shape full;    // the single-device shape
  int dim = -1;  // -1: replicated; otherwise the split dimension
  // ranges[r]: [begin, end) along `dim` of the full tensor that tensor rank r holds, in the
  // order of its local tensor. Empty when replicated.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges;
  int64_t local_extent = 0;  // the local tensor's size along `dim` (>= the ranges' total)

  static ShardLayout replicated(const Shape& full);
  // Equal contiguous slices along `dim` (full[dim] / tp each, rank order).
  static ShardLayout even(const Shape& full, int dim, int tp);
  bool is_replicated() const { return dim < 0; }
  int tensor_size() const { return is_replicated() ? 1 : static_cast<int>(ranges.size()); }
  Shape local_shape() const;
};

// The full tensor from every rank's local tensor (collective over `group`, the tensor group
// the layout was made for; a replicated layout needs no communication and returns this
// rank's copy). The result is a new tensor on `dst`, in local's dtype.
Tensor gather_full(Context& ctx, dist::ProcessGroup& group, const ShardLayout& layout, const Tensor& local,
                   Device dst = Device::cpu());

// Tensor rank `rank`'s local tensor cut out of the full one (padding zero): a new tensor on
// full's device, in full's dtype. No communication.
Tensor slice_full(const ShardLayout& layout, int rank, const Tensor& full);

// A contiguous host copy of `t` in `dtype` (cast on the CPU when the dtypes differ): the
// full tensor slice_full cuts from when loading a checkpoint into a parameter's dtype.
Tensor host_copy_as(const Tensor& t, DType dtype);

// The L2 norm of the gradients of a tensor-parallel parameter list as the single-device
// model would compute it: the squares of split parameters summed over the tensor group,
// replicated parameters (whose gradients every rank holds in full) and rows held by several
// ranks counted once. Collective over `group`; the same value on every rank. This is the
// norm that global-norm clipping must use under tensor parallelism (each rank's local norm
// differs, and clipping by it would make the replicated weights drift apart).
double tensor_parallel_grad_norm(Context& ctx, dist::ProcessGroup& group, const ParameterList& parameters,
                                 const std::vector<ShardLayout>& layouts);

}  // namespace tessera::nn
