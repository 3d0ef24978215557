// ZeRO-1 AdamW (see tessera/dist/distributed_optimizer.h).
#include "tessera/dist/distributed_optimizer.h"

#include <algorithm>
#include <cmath>

#include "stream_copy.h"

#include "tessera/ops/elementwise.h"
#include "tessera/ops/gemm.h"
#include "tessera/ops/optimizer.h"

namespace tessera::dist {

DistributedOptimizer::DistributedOptimizer(Context& ctx, nn::ParameterList parameters, GroupPtr group,
                                           const train::OptimizerConfig& config)
    : params_(std::move(parameters)), group_(std::move(group)), config_(config) {
  TESSERA_CHECK(group_ != nullptr, "DistributedOptimizer: no group");
  TESSERA_CHECK(!params_.empty(), "DistributedOptimizer: no parameters");
  const DType dtype = params_[0]->weights().dtype();
  const Device device = params_[0]->weights().device();
  uint64_t h = hash_string("zero1");
  for (nn::Parameter* p : params_) {
    TESSERA_CHECK(p->weights().dtype() == dtype && p->weights().device() == device && p->grad.dtype() == dtype,
                  "DistributedOptimizer: ", p->name, " differs in dtype or device from ", params_[0]->name);
    offsets_.push_back(total_);
    total_ += p->numel();
    h = hash_string(p->name, h);
    const int64_t n = p->numel();
    h = hash_bytes(&n, sizeof n, h);
  }
  check_consistent(ctx, *group_, h, "the distributed optimizer's parameter list");
  const int size = group_->size();
  shard_ = (total_ + size - 1) / size;
  shard_begin_ = group_->rank() * shard_;
  flat_grad_ = Tensor::zeros({size * shard_}, dtype, device);
  flat_weights_ = Tensor::zeros({size * shard_}, dtype, device);
  grad_shard_ = Tensor::zeros({shard_}, dtype, device);
  weights_shard_ = Tensor::zeros({shard_}, dtype, device);
  exp_avg_ = Tensor::zeros({shard_}, dtype, device);
  exp_avg_sq_ = Tensor::zeros({shard_}, dtype, device);
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t begin = std::max(offsets_[i], shard_begin_);
    const int64_t end = std::min(offsets_[i] + params_[i]->numel(), shard_begin_ + shard_);
    if (begin >= end) continue;
    segments_.push_back({params_[i], begin - shard_begin_, end - begin, begin - offsets_[i]});
  }
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
  for (const Segment& s : segments_) {
    const size_t i = static_cast<size_t>(std::find(params_.begin(), params_.end(), s.parameter) - params_.begin());
    for (auto [lo, hi] : counted_ranges(layouts[i], s.parameter->weights().shape(), tensor_group_->rank())) {
      const int64_t b = std::max(lo, s.param_offset), e = std::min(hi, s.param_offset + s.length);
      if (b >= e) continue;
      const int64_t sb = s.shard_offset + (b - s.param_offset), se = s.shard_offset + (e - s.param_offset);
      if (!norm_pieces_.empty() && norm_pieces_.back().second == sb) norm_pieces_.back().second = se;
      else norm_pieces_.emplace_back(sb, se);
    }
  }
}

std::vector<std::pair<std::string, Tensor>> DistributedOptimizer::state() const {
  return {{"exp_avg", exp_avg_.slice(0, 0, owned())}, {"exp_avg_sq", exp_avg_sq_.slice(0, 0, owned())}};
}

nlohmann::json DistributedOptimizer::state_layout() const {
  nlohmann::json params = nlohmann::json::array();
  for (const nn::Parameter* p : params_) params.push_back({p->name, p->numel()});
  return {{"kind", "zero1"},        {"rank", group_->rank()}, {"size", group_->size()},
          {"begin", shard_begin_},  {"end", shard_begin_ + owned()}, {"total", total_},
          {"parameters", params}};
}

void DistributedOptimizer::load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step) {
  for (const auto& moment : {std::pair<const char*, Tensor*>{"exp_avg", &exp_avg_}, {"exp_avg_sq", &exp_avg_sq_}}) {
    // Plain names, not a structured binding: clang before 16 refuses a lambda that
    // captures one.
    const char* name = moment.first;
    Tensor* target = moment.second;
    auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& t) { return t.first == name; });
    TESSERA_CHECK(it != tensors.end(), "DistributedOptimizer::load_state: no tensor '", name, "'");
    TESSERA_CHECK(it->second.numel() == owned(), "DistributedOptimizer::load_state: '", name, "' has ",
                  it->second.numel(), " elements, rank ", group_->rank(), "'s range holds ", owned());
    Tensor converted = Tensor::empty({owned()}, target->dtype());
    Context cpu = Context::cpu();
    if (owned() > 0) cast(cpu, it->second.to(Device::cpu()).contiguous().reshape({owned()}), converted);
    target->fill_zero();
    Tensor range = target->slice(0, 0, owned());
    if (owned() > 0) range.copy_from(converted.to(target->device()));
  }
  step_ = step;
}

std::vector<std::pair<std::string, Tensor>> DistributedOptimizer::per_parameter_state(Context& ctx) const {
  std::vector<std::pair<std::string, Tensor>> out;
  const int64_t size = group_->size();
  Tensor flat_avg = Tensor::zeros({size * shard_}, exp_avg_.dtype(), exp_avg_.device());
  Tensor flat_sq = Tensor::zeros({size * shard_}, exp_avg_.dtype(), exp_avg_.device());
  group_->all_gather(ctx, exp_avg_, flat_avg);
  group_->all_gather(ctx, exp_avg_sq_, flat_sq);
  for (size_t i = 0; i < params_.size(); ++i) {
    const Shape& shape = params_[i]->weights().shape();
    const int64_t begin = offsets_[i], end = offsets_[i] + params_[i]->numel();
    out.emplace_back(params_[i]->name + ".exp_avg", flat_avg.slice(0, begin, end).reshape(shape).clone());
    out.emplace_back(params_[i]->name + ".exp_avg_sq", flat_sq.slice(0, begin, end).reshape(shape).clone());
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
  exp_avg_.fill_zero();
  exp_avg_sq_.fill_zero();
  for (const Segment& s : segments_) {
    for (auto [suffix, target] : {std::pair<const char*, Tensor*>{".exp_avg", &exp_avg_}, {".exp_avg_sq", &exp_avg_sq_}}) {
      const Tensor& t = find(s.parameter->name + suffix);
      TESSERA_CHECK(t.numel() == s.parameter->numel(), "DistributedOptimizer::load_per_parameter_state: '",
                    s.parameter->name, suffix, "' has ", t.numel(), " elements, the parameter ", s.parameter->numel());
      const Tensor part =
          t.to(Device::cpu()).contiguous().reshape({t.numel()}).slice(0, s.param_offset, s.param_offset + s.length).contiguous();
      Tensor converted = Tensor::empty({s.length}, target->dtype());
      cast(cpu, part, converted);
      Tensor slot = target->slice(0, s.shard_offset, s.shard_offset + s.length);
      slot.copy_from(converted.to(target->device()));
    }
  }
  step_ = step;
}

double DistributedOptimizer::step(Context& ctx, double lr) {
  ++step_;
  // 0. This range's master weights, from the parameters (see the header).
  for (const Segment& s : segments_) {
    const Tensor w = s.parameter->weights().contiguous().reshape({s.parameter->numel()});
    Tensor dst = weights_shard_.slice(0, s.shard_offset, s.shard_offset + s.length);
    detail::stream_copy(ctx, w.slice(0, s.param_offset, s.param_offset + s.length), dst);
  }
  // 1. Averaged gradients of this rank's range.
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& g = params_[i]->grad;
    Tensor slot = flat_grad_.slice(0, offsets_[i], offsets_[i] + g.numel());
    detail::stream_copy(ctx, g.contiguous().reshape({g.numel()}), slot);
  }
  group_->reduce_scatter(ctx, flat_grad_, grad_shard_, ReduceOp::Avg);
  // 2. The global norm: this range's sum of squares, summed over the ranks (padding is 0).
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
  // 4. AdamW on this range, segment by segment for the per-parameter weight decay.
  for (const Segment& s : segments_) {
    Tensor w = weights_shard_.slice(0, s.shard_offset, s.shard_offset + s.length);
    Tensor m = exp_avg_.slice(0, s.shard_offset, s.shard_offset + s.length);
    Tensor v = exp_avg_sq_.slice(0, s.shard_offset, s.shard_offset + s.length);
    const Tensor g = grad_shard_.slice(0, s.shard_offset, s.shard_offset + s.length);
    adamw_step(ctx, w, g, m, v,
               {.lr = static_cast<float>(lr), .beta1 = static_cast<float>(config_.beta1),
                .beta2 = static_cast<float>(config_.beta2), .eps = static_cast<float>(config_.eps),
                .weight_decay = s.parameter->weight_decay ? static_cast<float>(config_.weight_decay) : 0.0f,
                .step = step_});
  }
  // 5. Every rank gets every updated weight.
  group_->all_gather(ctx, weights_shard_, flat_weights_);
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& w = params_[i]->weights();
    detail::stream_copy(ctx, flat_weights_.slice(0, offsets_[i], offsets_[i] + params_[i]->numel()).reshape(w.shape()), w);
    params_[i]->refresh_value(ctx);
  }
  return norm;
}

}  // namespace tessera::dist
