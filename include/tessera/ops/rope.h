// Rotary position embedding (RoPE) in the Hugging Face Llama convention ("rotate_half").
//
// x is a contiguous [B, T, H, D] tensor (batch, time, heads, head dim) with D even. Within
// each head vector the pairs (i, i + D/2), i < D/2, are rotated by the angle
//   angle(t, i) = (t + position_offset) * inv_freq_i,   inv_freq_i = theta^(-2i / D),
// i.e. with c = cos(angle), s = sin(angle):
//   y[i]       = x[i] * c - x[i + D/2] * s
//   y[i + D/2] = x[i + D/2] * c + x[i] * s
// Angles, cosines and sines are computed in double and rounded once to the compute type
// (double when the input is F64, float otherwise), so long positions stay accurate.
//
// Gradient rule: RoPE has no parameters; dx is OVERWRITTEN.
#pragma once

#include <cstdint>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

struct RopeOptions {
  float theta = 10000.0f;       // base of the frequencies; must be > 0
  int64_t position_offset = 0;  // position of token t is t + position_offset (KV-cache decoding); >= 0
};

// y (any floating dtype, x's shape) = x rotated as above. y may be the same tensor as x.
void rope_forward(Context& ctx, const Tensor& x, Tensor& y, const RopeOptions& options = {});

// The transpose of the rotation, i.e. the rotation by -angle:
//   dx[i] = dy[i] * c + dy[i + D/2] * s,   dx[i + D/2] = dy[i + D/2] * c - dy[i] * s.
// dx may be the same tensor as dy.
void rope_backward(Context& ctx, const Tensor& dy, Tensor& dx, const RopeOptions& options = {});

}  // namespace tessera
