// Linear: y = x W^T + b over the last dimension. W is [out, in] (PyTorch's layout).
//
// With an FP8 binding (use_fp8) and BF16 tensors whose sizes the FP8 GEMMs take (rows, in
// and out multiples of 16, for every recipe), the three GEMMs run in FP8: x and W cast as the
// recipe says for the forward, the output gradient cast in backward_input; the casts are kept
// in Saved so each is made once (except W^T, which backward_input casts again unless the
// binding keeps it: Fp8Scaling::keep_weight_transpose). Under gradient accumulation with
// fp8.cache_weights the weight's casts are made once per step (Fp8Scaling::begin_step). Otherwise, or without a binding, the layer runs in its own
// dtype. Per recipe (Fp8Scaling::kind):
//  - per-tensor (current, delayed): QuantizedTensor casts, fp8_gemm;
//  - block: y = x W^T with x in 1x128 blocks along in and W in 128x128 tiles; dx = dy W with
//    dy in 1x128 blocks along out and W^T's tiles; dW = dy^T x with dy^T and x^T in 1x128
//    blocks along the tokens (column-wise casts quantized from the tensors themselves, not
//    transposes of the row-wise codes); fp8_gemm_blockwise (cuBLASLt VEC128 / BLK128x128);
//  - mxfp8: the same orientations with 1x32 E8M0 blocks, emulated (mxfp8_gemm_emulated: BF16
//    GEMM of the dequantized operands).
#pragma once

#include "tessera/nn/fp8_scaling.h"
#include "tessera/nn/parameter.h"

namespace tessera::nn {

class Linear {
 public:
  struct Saved {
    Tensor x;  // [N, in] (not kept by the FP8 path, which keeps x_fp8)
    bool fp8 = false;
    // After forward only the transposed copies (data_t) are kept: the backward GEMMs read
    // nothing else, and the row-wise copies would double the FP8 path's saved bytes.
    // Unless the binding keeps the weight's transpose (Fp8Scaling::keep_weight_transpose),
    // w_fp8 keeps nothing (nor w_block / w_mx): backward_input re-casts W^T from the BF16
    // weight, per-tensor recipes with w_scale, the scale the forward cast W with (F32 [1]),
    // the block and mxfp8 casts from the weight alone; the same codes either way.
    fp8::QuantizedTensor x_fp8, w_fp8;
    Tensor w_scale;
    // Cast by backward_input, read by backward_weight (as the layers' d_qkv / d_h_pre are);
    // backward_input drops its row-wise copy after the dx GEMM.
    mutable fp8::QuantizedTensor dy_fp8;
    // Per-tensor FP8 with a bias: backward_input(Tensor) added the bias gradient in dy's cast
    // (fp8::quantize_with_transpose_and_bias_grad), so backward_weight does not sum dy again.
    mutable bool bias_grad_done = false;
    // The same three casts under the block and mxfp8 recipes (fp8 is true for them too; kind
    // says which set is used), with the same copies kept and dropped.
    Fp8Scaling::Kind kind = Fp8Scaling::Kind::PerTensor;
    fp8::BlockQuantizedTensor x_block, w_block;
    mutable fp8::BlockQuantizedTensor dy_block;
    fp8::MxQuantizedTensor x_mx, w_mx;
    mutable fp8::MxQuantizedTensor dy_mx;
  };

  Linear(const std::string& name, int64_t in_features, int64_t out_features, bool bias, DType dtype,
         const ParallelContext& parallel = {});

  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const;              // x [N, in] -> [N, out]
  // The FP8 forward from an input already cast for this layer (tensor kInput of its binding,
  // e.g. by a norm with an FP8 output: LayerNormLinear), kept as saved.x_fp8. Needs a binding
  // of a per-tensor recipe and the sizes runs_fp8 asks for (rows, in, out multiples of 16;
  // BF16 weight).
  Tensor forward(Context& ctx, const fp8::QuantizedTensor& x, Saved& saved) const;
  Tensor backward_input(Context& ctx, const Tensor& dy, const Saved& saved) const;  // -> dx [N, in]
  // The per-tensor FP8 backward from an output gradient already cast for this layer (tensor
  // kGradOutput of its binding, with its transposed copy: e.g. by the SwiGLU backward with
  // an FP8 output, MLP), kept as saved.dy_fp8 for backward_weight (whose dy argument is then
  // not read). Needs a forward that ran in per-tensor FP8. A layer with a bias also needs
  // its bias gradient: from backward_weight's BF16 dy, unless the caller accumulated it into
  // bias.grad itself and set saved.bias_grad_done (MLP's fused GELU backward does: its cast
  // sums d_h_pre's columns; the fused SwiGLU backward runs only without fc bias). The
  // backward_input(Tensor) above, with a bias, casts dy with its bias gradient in one pass.
  Tensor backward_input(Context& ctx, const fp8::QuantizedTensor& dy, const Saved& saved) const;
  void backward_weight(Context& ctx, const Tensor& dy, const Saved& saved);
  void parameters(ParameterList& out);

  // Run this layer's GEMMs in FP8 (see above); an empty binding turns FP8 off.
  // Binding a recipe makes the bias gradient eager (its casts add into it: see the constructor).
  void use_fp8(Fp8Binding binding) {
    fp8_ = std::move(binding);
    bias.grad_overwrite_ok = bias.value.defined() && !fp8_.scaling;
  }
  const Fp8Binding& fp8_binding() const { return fp8_; }
  // Whether forward(x) takes the FP8 path (any recipe).
  bool runs_fp8(const Tensor& x) const;
  // The same for an input of `rows` rows of `dtype` (what a norm in front of it produces).
  bool runs_fp8(int64_t rows, DType dtype) const;

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Parameter weight, bias;  // bias undefined when the layer has none

 private:
  Tensor forward_block(Context& ctx, const Tensor& x, Saved& saved) const;
  Tensor forward_mx(Context& ctx, const Tensor& x, Saved& saved) const;
  // W^T's codes for dx = dy W: the kept copy, or the re-cast (see Saved).
  fp8::QuantizedTensor weight_t(Context& ctx, const Saved& saved) const;
  fp8::BlockQuantizedTensor weight_t_block(Context& ctx, const Saved& saved) const;
  fp8::MxQuantizedTensor weight_t_mx(Context& ctx, const Saved& saved) const;
  bool keep_weight_transpose() const { return fp8_.scaling && fp8_.scaling->keep_weight_transpose(); }
  // Whether this step's weight casts are kept by the binding's open weight cache (which then
  // holds W^T's codes until the step ends: the saved copy keeps them, no re-cast). A cache
  // open only to serve fp8.cast_in_optimizer's expert casts keeps none of these.
  bool weights_cached() const { return fp8_.scaling && fp8_.scaling->weight_cache()->keeps_new(); }

  int64_t in_, out_;
  Fp8Binding fp8_;
};

}  // namespace tessera::nn
