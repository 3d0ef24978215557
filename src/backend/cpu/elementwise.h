#pragma once
#include "tessera/core/tensor.h"
namespace tessera::cpu {
void add(const Tensor& a, const Tensor& b, Tensor& out);
void scale(const Tensor& in, float alpha, Tensor& out);
void cast(const Tensor& in, Tensor& out);
void transpose_2d(const Tensor& in, Tensor& out);
}  // namespace tessera::cpu
