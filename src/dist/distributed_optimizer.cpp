// ZeRO-1 AdamW over gradient buckets (see tessera/dist/distributed_optimizer.h).
#include "tessera/dist/distributed_optimizer.h"

#include <algorithm>
#include <cmath>

#include "stream_copy.h"

#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/optimizer.h"

namespace tessera::dist {

std::vector<std::vector<size_t>> zero1_buckets(const std::vector<int64_t>& numels, size_t element_bytes,
                                               size_t bucket_bytes) {
  // DataParallel's rule (data_parallel.cpp), on element counts.
  std::vector<std::vector<size_t>> out;
  size_t used = 0;
  for (size_t k = numels.size(); k-- > 0;) {
    const size_t bytes = static_cast<size_t>(numels[k]) * element_bytes;
    if (out.empty() || used + bytes > bucket_bytes) {
      out.emplace_back();
      used = 0;
    }
    out.back().push_back(k);
    used += bytes;
  }
  return out;
}

std::vector<Zero1Piece> zero1_pieces(const std::vector<int64_t>& numels, const std::vector<std::vector<size_t>>& buckets,
                                     int size, int rank) {
  std::vector<Zero1Piece> out;
  int64_t shard_at = 0, packed_at = 0;
  for (const std::vector<size_t>& bucket : buckets) {
    int64_t elements = 0;
    for (size_t k : bucket) {
      TESSERA_CHECK(k < numels.size(), "zero1_pieces: parameter index ", k, " of ", numels.size());
      elements += numels[k];
    }
    const int64_t chunk = (elements + size - 1) / size;
    const int64_t lo = rank * chunk, hi = lo + chunk;
    int64_t at = 0;
    for (size_t k : bucket) {
      const int64_t b = std::max(lo, at), e = std::min(hi, at + numels[k]);
      if (b < e) {
        out.push_back({k, b - at, e - b, shard_at + (b - lo), packed_at});
        packed_at += e - b;
      }
      at += numels[k];
    }
    shard_at += chunk;
  }
  return out;
}

DistributedOptimizer::DistributedOptimizer(Context& ctx, nn::ParameterList parameters, GroupPtr group,
                                           const train::OptimizerConfig& config, const DistributedOptimizerOptions& options)
    : params_(std::move(parameters)), group_(std::move(group)), config_(config) {
  TESSERA_CHECK(group_ != nullptr, "DistributedOptimizer: no group");
  TESSERA_CHECK(!params_.empty(), "DistributedOptimizer: no parameters");
  const DType dtype = params_[0]->weights().dtype();
  const Device device = params_[0]->weights().device();
  uint64_t h = hash_string("zero1-buckets");
  std::vector<int64_t> numels;
  for (nn::Parameter* p : params_) {
    TESSERA_CHECK(p->weights().dtype() == dtype && p->weights().device() == device && p->grad.dtype() == dtype,
                  "DistributedOptimizer: ", p->name, " differs in dtype or device from ", params_[0]->name);
    numels.push_back(p->numel());
    total_ += p->numel();
    h = hash_string(p->name, h);
    const int64_t n = p->numel();
    h = hash_bytes(&n, sizeof n, h);
  }
  h = hash_bytes(&options.bucket_bytes, sizeof options.bucket_bytes, h);
  check_consistent(ctx, *group_, h, "the distributed optimizer's parameter list and bucket size");
  const int size = group_->size(), rank = group_->rank();
  bucket_params_ = zero1_buckets(numels, dtype_size(dtype), options.bucket_bytes);
  pieces_ = zero1_pieces(numels, bucket_params_, size, rank);
  for (const Zero1Piece& p : pieces_) owned_ += p.length;
  for (size_t b = 0; b < bucket_params_.size(); ++b) {
    Bucket bucket;
    bucket.parameters = bucket_params_[b];
    int64_t at = 0;
    for (size_t k : bucket.parameters) {
      bucket.offsets.push_back(at);
      at += numels[k];
      bucket_of_.emplace_back(params_[k], b);
    }
    bucket.chunk = (at + size - 1) / size;
    bucket.shard_offset = shard_;
    shard_ += bucket.chunk;
    // Zeros: the padding at the end stays zero (only parameter ranges are ever packed, and
    // the all-gather brings back the shards' padding, which is zero too).
    bucket.flat = Tensor::zeros({size * bucket.chunk}, dtype, device);
    buckets_.push_back(std::move(bucket));
  }
  std::sort(bucket_of_.begin(), bucket_of_.end());
  grad_shard_ = Tensor::zeros({shard_}, dtype, device);
  weights_shard_ = Tensor::zeros({shard_}, dtype, device);
  exp_avg_ = Tensor::zeros({owned_}, dtype, device);
  exp_avg_sq_ = Tensor::zeros({owned_}, dtype, device);
}

DistributedOptimizer::~DistributedOptimizer() {
  // No reduction may outlive the buffers it writes.
  for (Bucket& b : buckets_)
    if (b.work) b.work->wait();
}

namespace {

// The flat element ranges [begin, end) of a local (tensor-parallel) tensor that tensor rank
// `rank` counts in the single-device norm (nn::tensor_parallel_grad_norm's rule: a
// replicated tensor on rank 0 only; along a split dimension, what no lower rank holds too).
std::vector<std::pair<int64_t, int64_t>> counted_ranges(const nn::ShardLayout& l, const Shape& local, int rank) {
  int64_t numel = 1;
  for (int64_t d : local) numel *= d;
  if (l.is_replicated()) {
    if (rank == 0) return {{0, numel}};
    return {};
  }
  // Along `dim`: the local index ranges this rank counts.
  std::vector<std::pair<int64_t, int64_t>> along;
  int64_t at = 0;
  for (auto [begin, end] : l.ranges[static_cast<size_t>(rank)]) {
    int64_t b = begin;
    for (int r = 0; r < rank && b < end; ++r)
      for (auto [ob, oe] : l.ranges[static_cast<size_t>(r)])
        if (ob <= b && b < oe) b = std::min(end, oe);
    if (b < end) along.emplace_back(at + (b - begin), at + (end - begin));
    at += end - begin;
  }
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < l.dim; ++d) outer *= local[static_cast<size_t>(d)];
  for (size_t d = static_cast<size_t>(l.dim) + 1; d < local.size(); ++d) inner *= local[d];
  const int64_t extent = local[static_cast<size_t>(l.dim)];
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t o = 0; o < outer; ++o)
    for (auto [b, e] : along) {
      const int64_t lo = (o * extent + b) * inner, hi = (o * extent + e) * inner;
      if (!out.empty() && out.back().second == lo) out.back().second = hi;
      else out.emplace_back(lo, hi);
    }
  return out;
}

}  // namespace

void DistributedOptimizer::set_tensor_parallel(GroupPtr tensor_group, const std::vector<nn::ShardLayout>& layouts) {
  TESSERA_CHECK(tensor_group != nullptr, "DistributedOptimizer::set_tensor_parallel: no tensor group");
  TESSERA_CHECK(layouts.size() == params_.size(), "DistributedOptimizer::set_tensor_parallel: ", layouts.size(),
                " layouts for ", params_.size(), " parameters");
  tensor_group_ = std::move(tensor_group);
  norm_pieces_.clear();
  for (const Zero1Piece& s : pieces_) {
    const nn::Parameter* p = params_[s.parameter];
    for (auto [lo, hi] : counted_ranges(layouts[s.parameter], p->weights().shape(), tensor_group_->rank())) {
      const int64_t b = std::max(lo, s.param_offset), e = std::min(hi, s.param_offset + s.length);
      if (b >= e) continue;
      const int64_t sb = s.shard_offset + (b - s.param_offset), se = s.shard_offset + (e - s.param_offset);
      if (!norm_pieces_.empty() && norm_pieces_.back().second == sb) norm_pieces_.back().second = se;
      else norm_pieces_.emplace_back(sb, se);
    }
  }
}

std::vector<std::pair<std::string, Tensor>> DistributedOptimizer::state() const {
  return {{"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}};
}

nlohmann::json DistributedOptimizer::state_layout() const {
  nlohmann::json params = nlohmann::json::array();
  for (const nn::Parameter* p : params_) params.push_back({p->name, p->numel()});
  return {{"kind", "zero1-buckets"}, {"rank", group_->rank()}, {"size", group_->size()}, {"total", total_},
          {"parameters", params},    {"buckets", bucket_params_}};
}

void DistributedOptimizer::load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step) {
  for (const auto& moment : {std::pair<const char*, Tensor*>{"exp_avg", &exp_avg_}, {"exp_avg_sq", &exp_avg_sq_}}) {
    // Plain names, not a structured binding: clang before 16 refuses a lambda that
    // captures one.
    const char* name = moment.first;
    Tensor* target = moment.second;
    auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& t) { return t.first == name; });
    TESSERA_CHECK(it != tensors.end(), "DistributedOptimizer::load_state: no tensor '", name, "'");
    TESSERA_CHECK(it->second.numel() == owned_, "DistributedOptimizer::load_state: '", name, "' has ",
                  it->second.numel(), " elements, rank ", group_->rank(), " owns ", owned_);
    if (owned_ == 0) continue;
    Tensor converted = Tensor::empty({owned_}, target->dtype());
    Context cpu = Context::cpu();
    cast(cpu, it->second.to(Device::cpu()).contiguous().reshape({owned_}), converted);
    target->copy_from(converted.to(target->device()));
  }
  step_ = step;
}

std::vector<std::pair<std::string, Tensor>> DistributedOptimizer::per_parameter_state(Context& ctx) const {
  const int64_t size = group_->size();
  std::vector<Tensor> avg, sq;
  for (const nn::Parameter* p : params_) {
    avg.push_back(Tensor::zeros({p->numel()}, exp_avg_.dtype(), exp_avg_.device()));
    sq.push_back(Tensor::zeros({p->numel()}, exp_avg_.dtype(), exp_avg_.device()));
  }
  // Per bucket: this rank's chunk (padded, from the packed moments), all-gathered.
  for (const Bucket& b : buckets_) {
    for (auto [moment, out] : {std::pair<const Tensor*, std::vector<Tensor>*>{&exp_avg_, &avg}, {&exp_avg_sq_, &sq}}) {
      Tensor chunk = Tensor::zeros({b.chunk}, exp_avg_.dtype(), exp_avg_.device());
      for (const Zero1Piece& s : pieces_) {
        if (s.shard_offset < b.shard_offset || s.shard_offset >= b.shard_offset + b.chunk) continue;
        Tensor dst = chunk.slice(0, s.shard_offset - b.shard_offset, s.shard_offset - b.shard_offset + s.length);
        detail::stream_copy(ctx, moment->slice(0, s.packed_offset, s.packed_offset + s.length), dst);
      }
      Tensor flat = Tensor::zeros({size * b.chunk}, exp_avg_.dtype(), exp_avg_.device());
      group_->all_gather(ctx, chunk, flat);
      for (size_t j = 0; j < b.parameters.size(); ++j) {
        Tensor& dst = (*out)[b.parameters[j]];
        detail::stream_copy(ctx, flat.slice(0, b.offsets[j], b.offsets[j] + dst.numel()), dst);
      }
    }
  }
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Shape& shape = params_[i]->weights().shape();
    out.emplace_back(params_[i]->name + ".exp_avg", avg[i].reshape(shape));
    out.emplace_back(params_[i]->name + ".exp_avg_sq", sq[i].reshape(shape));
  }
  return out;
}

void DistributedOptimizer::load_per_parameter_state(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                                    int64_t step) {
  Context cpu = Context::cpu();
  auto find = [&](const std::string& name) -> const Tensor& {
    auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& t) { return t.first == name; });
    TESSERA_CHECK(it != tensors.end(), "DistributedOptimizer::load_per_parameter_state: no tensor '", name, "'");
    return it->second;
  };
  for (const Zero1Piece& s : pieces_) {
    const nn::Parameter* p = params_[s.parameter];
    for (auto [suffix, target] : {std::pair<const char*, Tensor*>{".exp_avg", &exp_avg_}, {".exp_avg_sq", &exp_avg_sq_}}) {
      const Tensor& t = find(p->name + suffix);
      TESSERA_CHECK(t.numel() == p->numel(), "DistributedOptimizer::load_per_parameter_state: '", p->name, suffix,
                    "' has ", t.numel(), " elements, the parameter ", p->numel());
      const Tensor part =
          t.to(Device::cpu()).contiguous().reshape({t.numel()}).slice(0, s.param_offset, s.param_offset + s.length).contiguous();
      Tensor converted = Tensor::empty({s.length}, target->dtype());
      cast(cpu, part, converted);
      Tensor slot = target->slice(0, s.packed_offset, s.packed_offset + s.length);
      slot.copy_from(converted.to(target->device()));
    }
  }
  step_ = step;
}

void DistributedOptimizer::start(Context& ctx, Bucket& b) {
  for (size_t j = 0; j < b.parameters.size(); ++j) {
    const Tensor& g = params_[b.parameters[j]]->grad;
    Tensor slot = b.flat.slice(0, b.offsets[j], b.offsets[j] + g.numel());
    detail::stream_copy(ctx, g.contiguous().reshape({g.numel()}), slot);
  }
  Tensor out = grad_shard_.slice(0, b.shard_offset, b.shard_offset + b.chunk);
  b.work = group_->reduce_scatter_async(ctx, b.flat, out, ReduceOp::Avg);
  b.started = true;
}

void DistributedOptimizer::wait_all() {
  for (Bucket& b : buckets_) {
    if (b.work) b.work->wait();
    b.work.reset();
  }
}

void DistributedOptimizer::mark_ready(Context& ctx, const nn::Parameter& parameter) {
  auto it = std::lower_bound(bucket_of_.begin(), bucket_of_.end(), std::make_pair(&parameter, size_t{0}));
  TESSERA_CHECK(it != bucket_of_.end() && it->first == &parameter, "DistributedOptimizer::mark_ready: ", parameter.name,
                " is not one of the optimizer's parameters");
  TESSERA_CHECK(!reduced_, "DistributedOptimizer::mark_ready: ", parameter.name,
                " marked after the gradients were reduced (begin_backward first)");
  TESSERA_CHECK(std::find(marked_.begin(), marked_.end(), &parameter) == marked_.end(),
                "DistributedOptimizer::mark_ready: ", parameter.name, " was marked twice in one step");
  marked_.push_back(&parameter);
  Bucket& b = buckets_[it->second];
  if (++b.ready == static_cast<int>(b.parameters.size())) start(ctx, b);
}

void DistributedOptimizer::reduce_gradients(Context& ctx) {
  if (reduced_) return;
  // What the marks did not start, starts here in bucket order. Every rank runs the same
  // backward and marks in the same order, so every rank issues the same collectives.
  for (Bucket& b : buckets_)
    if (!b.started) start(ctx, b);
  wait_all();
  reduced_ = true;
}

void DistributedOptimizer::begin_backward() {
  wait_all();
  for (Bucket& b : buckets_) {
    b.ready = 0;
    b.started = false;
  }
  marked_.clear();
  reduced_ = false;
}

double DistributedOptimizer::step(Context& ctx, double lr) {
  ++step_;
  // 1. Averaged gradients of this rank's chunks (what the backward started, and the rest).
  reduce_gradients(ctx);
  // 0. This shard's master weights, from the parameters (see the header).
  for (const Zero1Piece& s : pieces_) {
    const nn::Parameter* p = params_[s.parameter];
    const Tensor w = p->weights().contiguous().reshape({p->numel()});
    Tensor dst = weights_shard_.slice(0, s.shard_offset, s.shard_offset + s.length);
    detail::stream_copy(ctx, w.slice(0, s.param_offset, s.param_offset + s.length), dst);
  }
  // 2. The global norm: this shard's sum of squares, summed over the ranks (padding is 0).
  double norm = 0;
  if (!tensor_group_) {
    Tensor sq = Tensor::zeros({1}, DType::F64, ctx.device);
    sum_of_squares(ctx, grad_shard_, sq);
    group_->all_reduce(ctx, sq, ReduceOp::Sum);
    synchronize(ctx);  // the host reads the norm (NCCL queued the sum on ctx.stream)
    norm = std::sqrt(sq.to(Device::cpu()).item(0));
  } else {
    // Tensor parallelism: only the elements this rank counts (set_tensor_parallel), one slot
    // each, added on the host in a fixed order, then over the data and the tensor group.
    Tensor sums = Tensor::zeros({static_cast<int64_t>(norm_pieces_.size()) + 1}, DType::F64, ctx.device);
    for (size_t i = 0; i < norm_pieces_.size(); ++i) {
      Tensor slot = sums.slice(0, static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
      sum_of_squares(ctx, grad_shard_.slice(0, norm_pieces_[i].first, norm_pieces_[i].second), slot);
    }
    double local = 0;
    for (double v : sums.to(Device::cpu()).to_doubles()) local += v;
    Tensor sq = Tensor::from_doubles({local}, {1}).to(ctx.device);
    group_->all_reduce(ctx, sq, ReduceOp::Sum);
    tensor_group_->all_reduce(ctx, sq, ReduceOp::Sum);
    synchronize(ctx);
    norm = std::sqrt(sq.to(Device::cpu()).item(0));
  }
  // 3. Clipping, as train::Optimizer (adamw_step_multi) does it.
  if (config_.grad_clip > 0 && norm > config_.grad_clip) {
    const float clip = static_cast<float>(config_.grad_clip / (norm + 1e-6));
    scale(ctx, grad_shard_, clip, grad_shard_);
  }
  // 4. AdamW on this shard, piece by piece for the per-parameter weight decay.
  for (const Zero1Piece& s : pieces_) {
    Tensor w = weights_shard_.slice(0, s.shard_offset, s.shard_offset + s.length);
    Tensor m = exp_avg_.slice(0, s.packed_offset, s.packed_offset + s.length);
    Tensor v = exp_avg_sq_.slice(0, s.packed_offset, s.packed_offset + s.length);
    const Tensor g = grad_shard_.slice(0, s.shard_offset, s.shard_offset + s.length);
    adamw_step(ctx, w, g, m, v,
               {.lr = static_cast<float>(lr), .beta1 = static_cast<float>(config_.beta1),
                .beta2 = static_cast<float>(config_.beta2), .eps = static_cast<float>(config_.eps),
                .weight_decay = params_[s.parameter]->weight_decay ? static_cast<float>(config_.weight_decay) : 0.0f,
                .step = step_});
  }
  // 5. Every rank gets every updated weight, bucket by bucket, through the bucket's buffer.
  for (Bucket& b : buckets_) {
    group_->all_gather(ctx, weights_shard_.slice(0, b.shard_offset, b.shard_offset + b.chunk), b.flat);
    for (size_t j = 0; j < b.parameters.size(); ++j) {
      nn::Parameter* p = params_[b.parameters[j]];
      Tensor& w = p->weights();
      detail::stream_copy(ctx, b.flat.slice(0, b.offsets[j], b.offsets[j] + p->numel()).reshape(w.shape()), w);
      p->refresh_value(ctx);
    }
  }
  begin_backward();
  return norm;
}

}  // namespace tessera::dist
