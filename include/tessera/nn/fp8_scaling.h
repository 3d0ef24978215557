// FP8 for the linear layers of a model: the recipe and the scaling state they share.
//
// A linear layer in FP8 quantizes three tensors: its input and its weight (forward role,
// E4M3) and the gradient of its output (gradient role: E5M2 under the hybrid format). Each
// is per-tensor scaled, either from its own amax just before the cast ("current": one amax
// pass and a one-thread scale kernel, nothing read by the host) or from the amax history of
// earlier steps ("delayed": DeviceDelayedScaling, whose update runs once per step in one
// launch). The GEMMs then run in FP8 with FP32 accumulation (fp8_gemm: cuBLASLt on CUDA, the
// dequantized reference on the CPU), the forward one with fast accumulation as Transformer
// Engine does, the backward ones without. Block scaling and MXFP8 are not wired into the
// layers yet.
#pragma once

#include <memory>
#include <optional>

#include "tessera/fp8/device_scaling.h"
#include "tessera/fp8/quantized_tensor.h"
#include "tessera/fp8/recipe.h"

namespace tessera::nn {

class Fp8Scaling {
 public:
  // Which of a linear layer's three tensors.
  enum Slot { kInput = 0, kWeight = 1, kGradOutput = 2 };

  // State for `num_linears` layers on ctx.device. Recipes "current" and "delayed" only:
  // others throw naming the recipe.
  Fp8Scaling(Context& ctx, const fp8::Recipe& recipe, int64_t num_linears);

  const fp8::Recipe& recipe() const { return recipe_; }
  int64_t num_linears() const { return num_linears_; }
  DType dtype(Slot slot) const;

  // x cast to FP8 with its transposed copy, scaled as the recipe says, for tensor `slot` of
  // linear `layer`. Under delayed scaling the amax lands in the state's pending slot.
  fp8::QuantizedTensor quantize(Context& ctx, const Tensor& x, int64_t layer, Slot slot);

  // For a cast made outside quantize (a norm writing FP8 straight into the linear layer,
  // ops/norm.h's *_forward_fp8): what tensor `slot` of `layer` is cast with. Delayed scaling:
  // its current scale and the pending amax slot the cast writes (the cast can run at once).
  // Current scaling: scale undefined and a fresh amax, which the cast must fill first (the
  // norm's statistics pass); current_scale then gives the scale to cast with.
  struct CastTarget {
    Tensor scale, amax;
  };
  CastTarget cast_target(Context& ctx, int64_t layer, Slot slot);
  bool scale_known_before_cast() const { return delayed_.has_value(); }
  Tensor current_scale(Context& ctx, const Tensor& amax, Slot slot) const;

  // After each micro-batch / once per step (delayed scaling's bookkeeping; no-ops for current).
  void end_micro_batch(Context& ctx);
  void end_step(Context& ctx);

  // Delayed scaling's state, for checkpoints (empty for current scaling).
  std::map<std::string, Tensor> state_dict() const;
  void load_state_dict(Context& ctx, const std::map<std::string, Tensor>& tensors);

 private:
  fp8::Recipe recipe_;
  int64_t num_linears_;
  std::optional<fp8::DeviceDelayedScaling> delayed_;
  float margin_ = 0;
  bool power_of_two_ = false;
};

// The FP8 setting of one linear layer: the shared state and the layer's index in it.
struct Fp8Binding {
  std::shared_ptr<Fp8Scaling> scaling;
  int64_t layer = 0;
};

}  // namespace tessera::nn
