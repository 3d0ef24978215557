// Shard layouts of tensor-parallel parameters (see tessera/nn/parallel_layout.h).
#include "tessera/nn/parallel_layout.h"

#include <algorithm>
#include <cmath>

#include "tessera/dist/process_group.h"
#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"

namespace tessera::nn {

ShardLayout ShardLayout::replicated(const Shape& full) {
  ShardLayout l;
  l.full = full;
  return l;
}

ShardLayout ShardLayout::even(const Shape& full, int dim, int tp) {
  TESSERA_CHECK(dim >= 0 && dim < static_cast<int>(full.size()) && tp >= 1 && full[static_cast<size_t>(dim)] % tp == 0,
                "ShardLayout::even: ", shape_to_string(full), " does not split in ", tp, " along dimension ", dim);
  ShardLayout l;
  l.full = full;
  l.dim = dim;
  l.local_extent = full[static_cast<size_t>(dim)] / tp;
  for (int r = 0; r < tp; ++r) l.ranges.push_back({{r * l.local_extent, (r + 1) * l.local_extent}});
  return l;
}

Shape ShardLayout::local_shape() const {
  Shape s = full;
  if (!is_replicated()) s[static_cast<size_t>(dim)] = local_extent;
  return s;
}

Tensor gather_full(Context& ctx, dist::ProcessGroup& group, const ShardLayout& layout, const Tensor& local, Device dst) {
  TESSERA_CHECK(local.shape() == layout.local_shape(), "gather_full: the local tensor is ", local.describe(),
                ", the layout wants ", shape_to_string(layout.local_shape()));
  if (layout.is_replicated()) {
    Tensor out = local.to(dst);
    return out.shares_storage(local) ? out.clone() : out.contiguous();
  }
  const int tp = layout.tensor_size();
  TESSERA_CHECK(group.size() == tp, "gather_full: the layout is for ", tp, " tensor ranks, the group has ", group.size());
  const Tensor packed = local.contiguous();
  Shape gathered_shape = packed.shape();
  gathered_shape[0] *= tp;
  Tensor gathered = Tensor::empty(gathered_shape, packed.dtype(), packed.device());
  group.all_gather(ctx, packed, gathered);
  synchronize(ctx);  // a NCCL gather is queued on ctx.stream; the copies below are not
  const Tensor parts = gathered.to(dst);
  Tensor full = Tensor::zeros(layout.full, packed.dtype(), dst);
  const int64_t rows = packed.size(0);
  for (int r = 0; r < tp; ++r) {
    const Tensor part = parts.slice(0, r * rows, (r + 1) * rows);
    int64_t at = 0;
    for (auto [begin, end] : layout.ranges[static_cast<size_t>(r)]) {
      full.slice(layout.dim, begin, end).copy_from(part.slice(layout.dim, at, at + end - begin));
      at += end - begin;
    }
  }
  return full;
}

Tensor host_copy_as(const Tensor& t, DType dtype) {
  const Tensor host = t.to(Device::cpu()).contiguous();
  if (host.dtype() == dtype) return host;
  Tensor out = Tensor::empty(host.shape(), dtype);
  Context cpu = Context::cpu();
  cast(cpu, host, out);
  return out;
}

Tensor slice_full(const ShardLayout& layout, int rank, const Tensor& full) {
  TESSERA_CHECK(full.shape() == layout.full, "slice_full: the full tensor is ", full.describe(), ", the layout wants ",
                shape_to_string(layout.full));
  if (layout.is_replicated()) return full.clone();
  TESSERA_CHECK(rank >= 0 && rank < layout.tensor_size(), "slice_full: rank ", rank, " outside ", layout.tensor_size());
  Tensor local = Tensor::zeros(layout.local_shape(), full.dtype(), full.device());
  int64_t at = 0;
  for (auto [begin, end] : layout.ranges[static_cast<size_t>(rank)]) {
    local.slice(layout.dim, at, at + end - begin).copy_from(full.slice(layout.dim, begin, end));
    at += end - begin;
  }
  return local;
}

double tensor_parallel_grad_norm(Context& ctx, dist::ProcessGroup& group, const ParameterList& parameters,
                                 const std::vector<ShardLayout>& layouts) {
  TESSERA_CHECK(parameters.size() == layouts.size(), "tensor_parallel_grad_norm: ", parameters.size(),
                " parameters but ", layouts.size(), " layouts");
  const int rank = group.rank();
  // One slot per piece, summed on the host in a fixed order after one copy.
  std::vector<Tensor> pieces;
  for (size_t i = 0; i < parameters.size(); ++i) {
    const ShardLayout& l = layouts[i];
    const Tensor& g = parameters[i]->grad;
    if (l.is_replicated()) {
      if (rank == 0) pieces.push_back(g);
      continue;
    }
    TESSERA_CHECK(l.tensor_size() == group.size(), "tensor_parallel_grad_norm: ", parameters[i]->name,
                  "'s layout is for ", l.tensor_size(), " ranks, the group has ", group.size());
    // Count each full index once: skip what a lower rank also holds.
    int64_t at = 0;
    for (auto [begin, end] : l.ranges[static_cast<size_t>(rank)]) {
      int64_t b = begin;
      for (int r = 0; r < rank && b < end; ++r)
        for (auto [ob, oe] : l.ranges[static_cast<size_t>(r)])
          if (ob <= b && b < oe) b = std::min(end, oe);  // ranges are whole blocks: a lower rank's copy covers it
      if (b < end) pieces.push_back(g.slice(l.dim, at + (b - begin), at + (end - begin)).contiguous());
      at += end - begin;
    }
  }
  const DType stats = DType::F64;
  Tensor sums = Tensor::zeros({static_cast<int64_t>(pieces.size()) + 1}, stats, ctx.device);
  for (size_t i = 0; i < pieces.size(); ++i) {
    Tensor slot = sums.slice(0, static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
    sum_of_squares(ctx, pieces[i], slot);
  }
  const std::vector<double> host = sums.to(Device::cpu()).to_doubles();
  double local = 0;
  for (double v : host) local += v;
  Tensor total = Tensor::from_doubles({local}, {1}).to(ctx.device);
  group.all_reduce(ctx, total);
  return std::sqrt(total.to(Device::cpu()).item(0));
}

}  // namespace tessera::nn
