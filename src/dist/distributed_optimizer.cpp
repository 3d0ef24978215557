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
  for (auto [name, target] : {std::pair<const char*, Tensor*>{"exp_avg", &exp_avg_}, {"exp_avg_sq", &exp_avg_sq_}}) {
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
  Tensor sq = Tensor::zeros({1}, DType::F64, ctx.device);
  sum_of_squares(ctx, grad_shard_, sq);
  group_->all_reduce(ctx, sq, ReduceOp::Sum);
  synchronize(ctx);  // the host reads the norm (NCCL queued the sum on ctx.stream)
  const double norm = std::sqrt(sq.to(Device::cpu()).item(0));
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
