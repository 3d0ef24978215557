// FP8 training recipes: their configuration, and the state of delayed scaling.
//
// A recipe says how the scale of each FP8 tensor is chosen (Transformer Engine's names):
//  - "delayed": per-tensor scale from a history of past amaxes, computed after the step
//    and used for the next one (DelayedScaling);
//  - "current": per-tensor scale from the tensor's own amax, just before casting
//    (Float8CurrentScaling);
//  - "block":   one scale per 1x128 tile of activations and gradients, per 128x128 tile of
//    weights, power-of-two scales by default (Float8BlockScaling, the DeepSeek-V3 recipe);
//  - "mxfp8":   OCP microscaling, 1x32 blocks with E8M0 scales (Blackwell only in hardware;
//    tessera has the CPU reference).
// This file holds configuration and host-side bookkeeping only; the casts themselves are the
// ops of tessera/ops/quantize.h.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <variant>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/ops/quantize.h"

namespace tessera::fp8 {

// Which FP8 format each tensor role uses. Hybrid (the usual choice) keeps E4M3's extra
// mantissa bit for forward tensors and gives gradients E5M2's wider range.
enum class Format { E4M3, Hybrid };

// Forward tensors: activations and weights. Gradient tensors: grad_output / grad_input.
enum class Role { Forward, Gradient };

// E4M3 for everything under Format::E4M3; under Hybrid, E5M2 for gradients.
DType fp8_dtype(Format format, Role role);

struct DelayedScalingConfig {
  enum class AmaxCompute { Max, MostRecent };
  int history_len = 1024;  // steps of amax kept per tensor
  AmaxCompute amax_compute = AmaxCompute::Max;
  float margin = 0;  // scale = fp8_max / amax / 2^margin: headroom for growth between updates
  Format format = Format::Hybrid;
};

struct CurrentScalingConfig {
  float margin = 0;
  Format format = Format::Hybrid;
  bool power_of_two_scales = false;
};

// Block sizes are fixed by the recipe (and by cuBLASLt's VEC128 / BLK128x128 scale modes).
struct BlockScalingConfig {
  Format format = Format::E4M3;  // TE's default for this recipe; Hybrid is allowed
  bool power_of_two_scales = true;
  BlockScaling activations() const { return BlockScaling::tile_1x128(power_of_two_scales); }
  BlockScaling gradients() const { return BlockScaling::tile_1x128(power_of_two_scales); }
  BlockScaling weights() const { return BlockScaling::tile_128x128(power_of_two_scales); }
};

struct Mxfp8Config {
  Format format = Format::E4M3;
};

// One of the four recipes, chosen by name. JSON form (e.g. a config's `fp8` section):
//   {"recipe": "delayed", "history_len": 16, "amax_compute": "max", "margin": 0, "format": "hybrid"}
// Only the keys of the chosen recipe are accepted; missing keys take the defaults above.
struct Recipe {
  std::variant<DelayedScalingConfig, CurrentScalingConfig, BlockScalingConfig, Mxfp8Config> config;
  // `lm_head` (any recipe; default false): the LM head's GEMMs in FP8 too, per-tensor scaled
  // whatever the recipe (TransformerLM::use_fp8_lm_head; docs/fp8.md, "FP8 LM head").
  bool lm_head = false;
  // `keep_weight_transpose` (any recipe; default false): keep each FP8 linear layer's
  // transposed weight codes from its forward until its backward, as before this option
  // existed. Off, the forward keeps only the weight's scale and backward_input re-casts W^T
  // from the (unchanged) BF16 weight with that scale: the same bits, out x in bytes per layer
  // less held at the peak, one more cast pass per weight (docs/fp8.md, "Memory").
  bool keep_weight_transpose = false;
  // `cache_weights` (any recipe; default true): under gradient accumulation, each FP8 weight
  // is cast once per optimizer step, in the first micro-batch, and its codes serve the later
  // ones (Transformer Engine's is_first_microbatch; fp8/weight_cache.h). The same bits as
  // casting every time; 2 bytes per FP8 weight parameter held for the step. No effect with
  // one micro-batch a step.
  bool cache_weights = true;
  // `defer_expert_wgrad` (delayed recipe only; default false): under gradient accumulation
  // the MoE experts' weight gradients are computed once per step, at the last micro-batch,
  // over every micro-batch's rows (one GEMM per expert with K = the step's rows, written with
  // beta 0 or added once), instead of one GEMM per micro-batch that reads and rewrites the
  // FP32 gradient. Holds each micro-batch's transposed FP8 codes of the experts' inputs and
  // output gradients until the step's end (docs/ops/moe.md, "Deferred weight gradients").
  // Needs cache_weights and a single-device run.
  bool defer_expert_wgrad = false;
  // `cast_in_optimizer` (delayed recipe only; default false): the optimizer's update of each
  // MoE expert weight also writes its FP8 codes (both orientations) for the next step, in the
  // same pass (Transformer Engine's FP8 primary weights, without dropping the BF16 copy), so
  // the forward and backward cast no expert weight. The codes take the memory of the BF16
  // copy the update leaves stale, so they cost none. Every step, including the first and one
  // after a resume or a rewind, records every expert's weight amax, so such runs repeat the
  // uninterrupted one to the bit (docs/ops/moe.md, "Casts in the optimizer"). Needs the plain
  // optimizer (not training.zero1).
  bool cast_in_optimizer = false;

  std::string name() const;  // "delayed", "current", "block" or "mxfp8"
  // `where` names the section in error messages, e.g. "fp8" gives "fp8.margin".
  static Recipe from_json(const nlohmann::json& j, const std::string& where = "fp8");
  nlohmann::json to_json() const;  // every key, so that from_json(to_json()) is the identity
};

// Amax history and scales of N per-tensor-scaled FP8 tensors under delayed scaling.
//
// Per step: quantize with scale(i), record(i, amax of what was quantized), then update()
// once after the step (after any cross-rank max of the amaxes), which sets the scales of
// the next step. The rules, following Transformer Engine's delayed_scaling.cu:
//  - record folds with max, so a tensor quantized several times in a step (micro-batches)
//    keeps the largest amax; a NaN amax is stored as NaN (sticky for that step);
//  - update takes the max over the whole window, ignoring NaN entries (as fmaxf does), or
//    the most recent entry; then, when that amax is finite and > 0,
//      scale = fp8_scale_from_amax(amax, dtype, margin) = fp8_max / amax / 2^margin,
//    else (0: nothing seen yet; NaN or Inf: an overflowed step) the previous scale is
//    kept. Note fp8_scale_from_amax itself returns 1 for such amaxes; keeping the previous
//    scale is the delayed recipe's own rule, since 1 would throw away a good statistic.
//  - scale_inv = 1 / scale; initial scales are 1.
//  - the ring then advances: the oldest entry is dropped and the new current slot is 0.
class DelayedScalingState {
 public:
  DelayedScalingState(const DelayedScalingConfig& config, std::vector<Role> roles);

  int64_t size() const { return static_cast<int64_t>(roles_.size()); }
  const DelayedScalingConfig& config() const { return config_; }
  Role role(int64_t i) const { return roles_.at(static_cast<size_t>(i)); }
  DType dtype(int64_t i) const { return fp8_dtype(config_.format, role(i)); }

  void record(int64_t i, float amax);
  void update();

  float scale(int64_t i) const;
  float scale_inv(int64_t i) const;
  // Amax recorded `steps_ago` updates back (0 = the current, not yet updated step).
  float history(int64_t i, int steps_ago) const;

  // Everything needed for an exact resume, as F32/I64 CPU tensors named
  // prefix + "amax_history" [N, history_len] (column = ring slot), "scale" [N],
  // "scale_inv" [N] and "position" I64 [1] (the current ring slot).
  std::map<std::string, Tensor> state_dict(const std::string& prefix = "fp8.") const;
  // Checks shapes against this state's N and history_len and throws naming the tensor.
  void load_state_dict(const std::map<std::string, Tensor>& tensors, const std::string& prefix = "fp8.");

 private:
  float& slot(int64_t i, int64_t s) { return history_[static_cast<size_t>(i * config_.history_len + s)]; }
  float slot(int64_t i, int64_t s) const { return history_[static_cast<size_t>(i * config_.history_len + s)]; }
  void check_index(int64_t i) const;

  DelayedScalingConfig config_;
  std::vector<Role> roles_;
  std::vector<float> history_;  // [N, history_len], row-major
  std::vector<float> scale_, scale_inv_;
  int64_t position_ = 0;  // ring slot of the current step
};

}  // namespace tessera::fp8
