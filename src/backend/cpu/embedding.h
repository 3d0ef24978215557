#pragma once
#include "tessera/core/tensor.h"
namespace tessera::cpu {
// Both throw Error for an id outside [0, V) before touching any output.
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& d_out, Tensor& d_table);
}  // namespace tessera::cpu
