// Linear: y = x W^T + b over the last dimension. W is [out, in] (PyTorch's layout).
#pragma once

#include "tessera/nn/parameter.h"

namespace tessera::nn {

class Linear {
 public:
  struct Saved {
    Tensor x;  // [N, in]
  };

  Linear(const std::string& name, int64_t in_features, int64_t out_features, bool bias, DType dtype,
         const ParallelContext& parallel = {});

  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const;              // x [N, in] -> [N, out]
  Tensor backward_input(Context& ctx, const Tensor& dy, const Saved& saved) const;  // -> dx [N, in]
  void backward_weight(Context& ctx, const Tensor& dy, const Saved& saved);
  void parameters(ParameterList& out);

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Parameter weight, bias;  // bias undefined when the layer has none

 private:
  int64_t in_, out_;
};

}  // namespace tessera::nn
