// MLP: Linear -> GELU -> Linear (GPT-2) or Linear -> SwiGLU -> Linear (Llama). For SwiGLU the
// first Linear produces [gate | up] side by side (2 * ffn outputs), the layout swiglu wants.
#pragma once

#include "tessera/nn/linear.h"

namespace tessera::nn {

enum class Activation { GELU, SwiGLU };

class MLP {
 public:
  struct Saved {
    Linear::Saved fc_in, proj_in;
    Tensor h_pre;   // fc output, before the activation (released by backward_input)
    Tensor d_h_pre; // filled by backward_input, consumed by backward_weight (not kept when fc
                    // runs in per-tensor FP8: its weight gradient reads fc_in.dy_fp8, which
                    // the fused SwiGLU / GELU backward writes without d_h_pre ever existing in
                    // BF16, and a bias gradient came out of that cast: fc_in.bias_grad_done)
  };
  MLP(const std::string& name, int64_t hidden, int64_t ffn, Activation activation, bool bias, DType dtype,
      const ParallelContext& parallel = {});

  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const;
  // The FP8 forward from an input already cast for fc (tensor kInput of fc's binding, e.g. by
  // a norm with an FP8 output: LayerNormMLP); as forward when fc runs in FP8. backward_input
  // and backward_weight are the same for both.
  Tensor forward(Context& ctx, const fp8::QuantizedTensor& x, Saved& saved) const;
  Tensor backward_input(Context& ctx, const Tensor& dy, Saved& saved) const;
  void backward_weight(Context& ctx, const Tensor& dy, const Saved& saved);
  void parameters(ParameterList& out);

  // SwiGLU and GELU in per-tensor FP8 (current or delayed scaling): the activation writes
  // proj's FP8 input, and its backward fc's FP8 output gradient (SwiGLU: when fc has no bias;
  // GELU: with fc's bias gradient from the same pass when it has one), straight from
  // one kernel each (ops/activation.h's swiglu_*_fp8; current scaling adds an amax pass over
  // the same values), instead of writing h / d_h_pre in BF16 for the layers to cast. The
  // bytes are the same either way; on by default, the switch is for tests and benchmarks.
  // Process-wide (read when a forward or backward runs).
  static void set_fused_fp8_activation(bool on);
  static bool fused_fp8_activation();

  Activation activation;
  // SwiGLU in BF16: proj's weight gradient needs h = swiglu(h_pre), N x ffn. With this on the
  // forward drops h once proj has used it, and backward_input writes it again in the pass of
  // the activation's backward that reads h_pre anyway (swiglu_backward's y: same bits), so
  // no layer holds h between its forward and its backward. Costs one more write of h per
  // step; saves N x ffn x 2 bytes per layer at the activation peak (2 GiB for the
  // Llama-3.2-1B shape at B=4, T=2048). Config: model.recompute_activation.
  bool recompute_activation = false;
  Linear fc, proj;
};

}  // namespace tessera::nn
