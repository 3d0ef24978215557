#include "tessera/fp8/device_scaling.h"

#include <cmath>

#include "tessera/core/numeric.h"
#include "tessera/ops/quantize.h"
#if TESSERA_WITH_CUDA
#include "backend/cuda/fp8_scaling.h"
#endif

namespace tessera::fp8 {

namespace {

// The fold of DelayedScalingState::record: NaN is sticky (an overflowed micro-batch keeps the
// step visible as such), otherwise the larger value.
float fold_amax(float slot, float amax) {
  if (std::isnan(amax) || std::isnan(slot)) return NAN;
  return amax > slot ? amax : slot;
}

}  // namespace

DeviceDelayedScaling::DeviceDelayedScaling(Context& ctx, const DelayedScalingConfig& config, std::vector<Role> roles)
    : config_(config), roles_(std::move(roles)) {
  TESSERA_CHECK(config_.history_len >= 1, "DeviceDelayedScaling: history_len must be at least 1, got ",
                config_.history_len);
  TESSERA_CHECK(std::isfinite(config_.margin), "DeviceDelayedScaling: margin must be finite, got ", config_.margin);
  const int64_t n = size();
  std::vector<float> ones(static_cast<size_t>(n), 1.0f), maxes;
  for (int64_t i = 0; i < n; ++i) maxes.push_back(fp8_max(dtype(i)));
  history_ = Tensor::zeros({n, config_.history_len}, DType::F32, ctx.device);
  pending_ = Tensor::zeros({n}, DType::F32, ctx.device);
  scale_ = Tensor::from_floats(ones, {n}).to(ctx.device);
  scale_inv_ = Tensor::from_floats(ones, {n}).to(ctx.device);
  fp8_max_ = Tensor::from_floats(maxes, {n}).to(ctx.device);
  position_ = Tensor::zeros({1}, DType::I64, ctx.device);
}

int64_t DeviceDelayedScaling::position() const { return position_.to(Device::cpu()).data<int64_t>()[0]; }

Tensor DeviceDelayedScaling::scale(int64_t i) const { return scale_.slice(0, i, i + 1); }
Tensor DeviceDelayedScaling::scale_inv(int64_t i) const { return scale_inv_.slice(0, i, i + 1); }
Tensor DeviceDelayedScaling::pending_amax(int64_t i) const { return pending_.slice(0, i, i + 1); }

void DeviceDelayedScaling::record(Context& ctx) {
  const int64_t n = size(), len = config_.history_len;
  if (n == 0) return;
  TESSERA_CHECK(history_.device() == ctx.device, "DeviceDelayedScaling::record: state is on ",
                history_.device().to_string(), ", context on ", ctx.device.to_string());
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    cuda::delayed_scaling_record(ctx.stream, history_, pending_, position_);
    return;
#endif
  }
  const int64_t position = position_.data<int64_t>()[0];
  float* history = history_.data<float>();
  float* pending = pending_.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    float& slot = history[i * len + position];
    slot = fold_amax(slot, pending[i]);
    pending[i] = 0.0f;
  }
}

void DeviceDelayedScaling::update(Context& ctx) {
  const int64_t n = size(), len = config_.history_len;
  const bool window_max = config_.amax_compute == DelayedScalingConfig::AmaxCompute::Max;
  TESSERA_CHECK(position_.device() == ctx.device, "DeviceDelayedScaling::update: state is on ",
                position_.device().to_string(), ", context on ", ctx.device.to_string());
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    // One launch: the scales, then the position advanced (also with no tensors, as on the CPU).
    cuda::delayed_scaling_update(ctx.stream, history_, pending_, scale_, scale_inv_, fp8_max_, position_, window_max,
                                 config_.margin);
    return;
#endif
  }
  int64_t& position = position_.data<int64_t>()[0];
  if (n > 0) {
    record(ctx);
    float* history = history_.data<float>();
    float* scale = scale_.data<float>();
    float* scale_inv = scale_inv_.data<float>();
    const float* maxes = fp8_max_.data<float>();
    const int64_t next = (position + 1) % len;
    for (int64_t i = 0; i < n; ++i) {
      float* row = history + i * len;
      float amax = row[position];
      if (window_max) {
        amax = 0.0f;
        for (int64_t s = 0; s < len; ++s) amax = std::fmax(amax, row[s]);  // fmax skips NaN
      }
      if (amax > 0.0f && std::isfinite(amax)) {
        scale[i] = fp8_scale_for_amax(amax, maxes[i], config_.margin, false);
        scale_inv[i] = 1.0f / scale[i];
      }
      row[next] = 0.0f;
    }
  }
  position = (position + 1) % len;
}

std::map<std::string, Tensor> DeviceDelayedScaling::state_dict(const std::string& prefix) const {
  // Copies, also on the CPU: a saved state must not follow the live one.
  auto host_copy = [](const Tensor& t) { return t.device().is_cpu() ? t.clone() : t.to(Device::cpu()); };
  return {{prefix + "amax_history", host_copy(history_)},
          {prefix + "scale", host_copy(scale_)},
          {prefix + "scale_inv", host_copy(scale_inv_)},
          {prefix + "position", host_copy(position_)}};
}

void DeviceDelayedScaling::load_state_dict(Context& ctx, const std::map<std::string, Tensor>& tensors,
                                           const std::string& prefix) {
  auto get = [&](const char* name, DType dtype, const Shape& shape) {
    const auto it = tensors.find(prefix + name);
    TESSERA_CHECK(it != tensors.end(), "DeviceDelayedScaling: checkpoint lacks tensor '", prefix, name, "'");
    const Tensor& t = it->second;
    TESSERA_CHECK(t.dtype() == dtype && t.shape() == shape, "DeviceDelayedScaling: tensor '", prefix, name, "' is ",
                  t.describe(), ", expected ", dtype_name(dtype), shape_to_string(shape),
                  " (different tensor count or history_len?)");
    return t;
  };
  const int64_t n = size();
  const Tensor history = get("amax_history", DType::F32, {n, config_.history_len});
  const Tensor scale = get("scale", DType::F32, {n});
  const Tensor scale_inv = get("scale_inv", DType::F32, {n});
  const int64_t position = get("position", DType::I64, {1}).to_ints()[0];
  TESSERA_CHECK(position >= 0 && position < config_.history_len, "DeviceDelayedScaling: tensor '", prefix,
                "position' holds ", position, ", outside [0, ", config_.history_len, ")");
  TESSERA_CHECK(history_.device() == ctx.device, "DeviceDelayedScaling::load_state_dict: state is on ",
                history_.device().to_string(), ", context on ", ctx.device.to_string());
  // Written only after every check passed, so a failed load leaves the state untouched; and
  // in place, so that a captured graph that reads these buffers reads the loaded state.
  history_.copy_from(history);
  scale_.copy_from(scale);
  scale_inv_.copy_from(scale_inv);
  pending_.fill_zero();
  position_.copy_from(Tensor::from_ints({position}, {1}, DType::I64));
}

void scale_from_amax(Context& ctx, const Tensor& amax, DType fp8, float margin, bool power_of_two, Tensor& scale) {
  for (const Tensor* t : {&amax, static_cast<const Tensor*>(&scale)})
    TESSERA_CHECK(t->dtype() == DType::F32 && t->numel() == 1 && t->device() == ctx.device,
                  "scale_from_amax: amax and scale must be F32 [1] on ", ctx.device.to_string(), ", got ", t->describe());
  const float max_value = fp8_max(fp8);
  if (ctx.device.is_cuda()) {
#if TESSERA_WITH_CUDA
    cuda::scale_from_amax(ctx.stream, amax, max_value, margin, power_of_two, scale);
    return;
#endif
  }
  scale.data<float>()[0] = fp8_scale_for_amax(amax.data<float>()[0], max_value, margin, power_of_two);
}

}  // namespace tessera::fp8
