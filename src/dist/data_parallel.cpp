// Gradient buckets and their reduction (see tessera/dist/data_parallel.h).
#include "tessera/dist/data_parallel.h"

#include <algorithm>

#include "stream_copy.h"

namespace tessera::dist {

DataParallel::DataParallel(Context& ctx, nn::ParameterList parameters, GroupPtr group, const DataParallelOptions& options)
    : group_(std::move(group)), options_(options), parameters_(std::move(parameters)) {
  TESSERA_CHECK(group_ != nullptr, "DataParallel: no group");
  uint64_t h = hash_string("params");
  for (const nn::Parameter* p : parameters_) {
    TESSERA_CHECK(p != nullptr && p->grad.defined(), "DataParallel: a parameter without a gradient buffer");
    h = hash_string(p->name, h);
    const Shape& s = p->grad.shape();
    h = hash_bytes(s.data(), s.size() * sizeof(int64_t), h);
    const DType d = p->grad.dtype();
    h = hash_bytes(&d, sizeof d, h);
  }
  check_consistent(ctx, *group_, h, "the data-parallel parameter list (names, shapes, dtypes)");

  // Reverse order: the last layers' gradients are final first in backward.
  for (auto it = parameters_.rbegin(); it != parameters_.rend(); ++it) {
    nn::Parameter* p = *it;
    const size_t bytes = p->grad.nbytes();
    bool fits = !buckets_.empty();
    if (fits) {
      const Bucket& b = buckets_.back();
      const nn::Parameter* first = b.parameters.front();
      const size_t used = static_cast<size_t>(b.offsets.back() + b.parameters.back()->grad.numel()) *
                          dtype_size(first->grad.dtype());
      fits = first->grad.dtype() == p->grad.dtype() && first->grad.device() == p->grad.device() &&
             used + bytes <= options_.bucket_bytes;
    }
    if (!fits) buckets_.emplace_back();
    Bucket& b = buckets_.back();
    const int64_t offset = b.parameters.empty() ? 0 : b.offsets.back() + b.parameters.back()->grad.numel();
    b.parameters.push_back(p);
    b.offsets.push_back(offset);
    bucket_of_.emplace_back(p, buckets_.size() - 1);
  }
  for (Bucket& b : buckets_) {
    const nn::Parameter* last = b.parameters.back();
    b.flat = Tensor::empty({b.offsets.back() + last->grad.numel()}, last->grad.dtype(), last->grad.device());
  }
  std::sort(bucket_of_.begin(), bucket_of_.end());
}

void broadcast_parameters(Context& ctx, const nn::ParameterList& parameters, ProcessGroup& group, int root) {
  if (group.size() == 1) return;
  for (nn::Parameter* p : parameters) {
    Tensor& w = p->weights();
    if (w.is_contiguous()) {
      group.broadcast(ctx, w, root);
    } else {
      Tensor packed = w.contiguous();
      group.broadcast(ctx, packed, root);
      w.copy_from(packed);
    }
    p->refresh_value(ctx);
  }
}

void DataParallel::broadcast_parameters(Context& ctx, int root) {
  dist::broadcast_parameters(ctx, parameters_, *group_, root);
}

void DataParallel::start(Context& ctx, Bucket& b) {
  for (size_t i = 0; i < b.parameters.size(); ++i) {
    const Tensor& g = b.parameters[i]->grad;
    Tensor slot = b.flat.slice(0, b.offsets[i], b.offsets[i] + g.numel());
    detail::stream_copy(ctx, g.contiguous().reshape({g.numel()}), slot);
  }
  b.work = group_->all_reduce_async(ctx, b.flat, options_.average ? ReduceOp::Avg : ReduceOp::Sum);
}

void DataParallel::unpack(Context& ctx, Bucket& b) {
  if (b.work) b.work->wait();
  b.work.reset();
  for (size_t i = 0; i < b.parameters.size(); ++i) {
    Tensor& g = b.parameters[i]->grad;
    detail::stream_copy(ctx, b.flat.slice(0, b.offsets[i], b.offsets[i] + g.numel()).reshape(g.shape()), g);
  }
  b.ready = 0;
}

void DataParallel::all_reduce_gradients(Context& ctx) {
  if (group_->size() == 1) return;
  for (Bucket& b : buckets_) start(ctx, b);
  for (Bucket& b : buckets_) unpack(ctx, b);
  marked_.clear();
}

void DataParallel::mark_ready(Context& ctx, const nn::Parameter& parameter) {
  auto it = std::lower_bound(bucket_of_.begin(), bucket_of_.end(), std::make_pair(&parameter, size_t{0}));
  TESSERA_CHECK(it != bucket_of_.end() && it->first == &parameter, "DataParallel::mark_ready: ", parameter.name,
                " is not one of the data-parallel parameters");
  TESSERA_CHECK(std::find(marked_.begin(), marked_.end(), &parameter) == marked_.end(),
                "DataParallel::mark_ready: ", parameter.name, " was marked twice in one step");
  marked_.push_back(&parameter);
  if (group_->size() == 1) return;
  Bucket& b = buckets_[it->second];
  if (++b.ready == static_cast<int>(b.parameters.size())) start(ctx, b);
}

void DataParallel::finish(Context& ctx) {
  marked_.clear();
  if (group_->size() == 1) return;
  // What mark_ready did not start, starts here in bucket order. Every rank runs the same
  // backward and marks in the same order, so every rank issues the same collectives.
  for (Bucket& b : buckets_)
    if (!b.work) start(ctx, b);
  for (Bucket& b : buckets_) unpack(ctx, b);
}

}  // namespace tessera::dist
