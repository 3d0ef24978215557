// Shared by test_fp8_device_scaling.cpp (CPU) and test_gpu_fp8_scaling.cpp (CUDA): drives
// DeviceDelayedScaling and the host reference DelayedScalingState through the same random
// amax sequence (zeros, NaN and Inf included, several micro-batches per step) and compares
// every bit of history, scale and scale_inv after each step.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/core/philox.h"
#include "tessera/fp8/device_scaling.h"

namespace tessera::testing {

inline uint32_t float_bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// The amax a tensor "saw" in a micro-batch: mostly ordinary magnitudes, sometimes 0, NaN or Inf.
inline float random_amax(uint64_t seed, uint64_t index) {
  const uint32_t w = philox_word(seed, 0, index);
  switch (w % 23) {
    case 0: return 0.0f;
    case 1: return NAN;
    case 2: return INFINITY;
    default: return std::ldexp(1.0f + float(w >> 8) / float(1u << 24), int(w % 17) - 8);
  }
}

// Runs `steps` steps of `micro` micro-batches on ctx's device and checks against the host
// reference after every update.
inline void check_device_scaling_against_reference(Context& ctx, const fp8::DelayedScalingConfig& config,
                                                   int steps, int micro, uint64_t seed) {
  const std::vector<fp8::Role> roles = {fp8::Role::Forward, fp8::Role::Forward, fp8::Role::Gradient,
                                        fp8::Role::Forward, fp8::Role::Gradient};
  fp8::DelayedScalingState reference(config, roles);
  fp8::DeviceDelayedScaling state(ctx, config, roles);
  const int64_t n = static_cast<int64_t>(roles.size());
  uint64_t index = 0;
  for (int step = 0; step < steps; ++step) {
    for (int m = 0; m < micro; ++m) {
      for (int64_t i = 0; i < n; ++i) {
        if (philox_word(seed + 1, 0, index) % 5 == 0) {  // not quantized in this micro-batch
          ++index;
          continue;
        }
        const float amax = random_amax(seed, index++);
        reference.record(i, amax);
        state.pending_amax(i).copy_from(Tensor::from_floats({amax}, {1}));
      }
      if (m + 1 < micro) state.record(ctx);  // the last micro-batch is folded by update
    }
    reference.update();
    state.update(ctx);
    const std::vector<float> history = state.history().to(Device::cpu()).to_floats();
    const std::vector<float> scale = state.scales().to(Device::cpu()).to_floats();
    const std::vector<float> scale_inv = state.scale_invs().to(Device::cpu()).to_floats();
    ASSERT_EQ(state.position(), 0 + (step + 1) % config.history_len);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(float_bits_of(scale[i]), float_bits_of(reference.scale(i))) << "step " << step << " tensor " << i;
      ASSERT_EQ(float_bits_of(scale_inv[i]), float_bits_of(reference.scale_inv(i))) << "step " << step << " tensor " << i;
      for (int ago = 0; ago < config.history_len; ++ago) {
        const int64_t slot = ((state.position() - ago) % config.history_len + config.history_len) % config.history_len;
        ASSERT_EQ(float_bits_of(history[i * config.history_len + slot]), float_bits_of(reference.history(i, ago)))
            << "step " << step << " tensor " << i << " steps_ago " << ago;
      }
    }
  }
}

// The ring position on ctx's device: an I64 [1] there, unmoved by record, advanced by each
// update and wrapping at history_len exactly as DelayedScalingState's host counter (also
// with no tensors at all); a checkpoint's position (the format of old checkpoints: I64 [1])
// loads in place and is validated.
inline void check_device_position(Context& ctx, int64_t len) {
  fp8::DelayedScalingConfig config;
  config.history_len = len;
  const std::vector<fp8::Role> roles = {fp8::Role::Forward, fp8::Role::Gradient};
  fp8::DeviceDelayedScaling state(ctx, config, roles), empty(ctx, config, {});
  fp8::DelayedScalingState reference(config, roles);
  const Tensor& position = state.position_tensor();
  ASSERT_EQ(position.dtype(), DType::I64);
  ASSERT_EQ(position.shape(), (Shape{1}));
  ASSERT_EQ(position.device(), ctx.device);
  const void* address = position.raw_data();
  auto reference_position = [&] { return reference.state_dict().at("fp8.position").to_ints()[0]; };
  for (int64_t step = 0; step < 3 * len + 2; ++step) {
    ASSERT_EQ(state.position(), reference_position()) << "len " << len << " step " << step;
    state.pending_amax(0).copy_from(Tensor::from_floats({float(step + 1)}, {1}));
    state.record(ctx);
    ASSERT_EQ(state.position(), reference_position()) << "record must not move the position";
    reference.record(0, float(step + 1));
    reference.update();
    state.update(ctx);
    empty.update(ctx);
    ASSERT_EQ(state.position(), (step + 1) % len) << "len " << len << " step " << step;
    ASSERT_EQ(empty.position(), (step + 1) % len) << "len " << len << " step " << step;
    ASSERT_EQ(state.state_dict().at("fp8.position").to_ints(), std::vector<int64_t>{(step + 1) % len});
  }
  ASSERT_EQ(state.position_tensor().raw_data(), address) << "the position must stay where a graph reads it";
  // A checkpoint of the old layout (written when the position was a host counter).
  fp8::DeviceDelayedScaling loaded(ctx, config, roles);
  const void* history_address = loaded.history().raw_data();
  const void* loaded_address = loaded.position_tensor().raw_data();
  auto dict = reference.state_dict();
  for (const int64_t p : {int64_t{0}, len - 1}) {
    dict["fp8.position"] = Tensor::from_ints({p}, {1}, DType::I64);
    loaded.load_state_dict(ctx, dict);
    ASSERT_EQ(loaded.position(), p);
    ASSERT_EQ(loaded.position_tensor().raw_data(), loaded_address) << "load_state_dict writes in place";
    ASSERT_EQ(loaded.history().raw_data(), history_address) << "load_state_dict writes in place";
    loaded.update(ctx);
    ASSERT_EQ(loaded.position(), (p + 1) % len);
  }
  // Outside [0, len), or not I64 [1]: refused, and the state is left as it was.
  const int64_t before = loaded.position();
  for (const Tensor& bad : {Tensor::from_ints({len}, {1}, DType::I64), Tensor::from_ints({-1}, {1}, DType::I64),
                            Tensor::from_ints({0}, {1}, DType::I32), Tensor::from_ints({0, 0}, {2}, DType::I64)}) {
    dict["fp8.position"] = bad;
    EXPECT_THROW(loaded.load_state_dict(ctx, dict), Error) << bad.describe();
    EXPECT_EQ(loaded.position(), before);
  }
}

}  // namespace tessera::testing
