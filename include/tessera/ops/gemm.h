// Matrix multiply (GEMM) and the two reductions that go with linear layers: the bias
// gradient and the sum of squares behind global gradient-norm clipping.
//
// All matrices are row-major and contiguous. Outputs are preallocated by the caller.
//
// GEMM has no backward of its own: a linear layer y = x W^T + b is differentiated with
// more GEMMs, following the gradient rule of every op (activation gradients are
// overwritten, parameter gradients accumulate):
//   dx  = dy W              gemm(dy, W, dx)                                   (beta = 0)
//   dW += dy^T x            gemm(dy, x, dW, {.transpose_a = true, .beta = 1})
//   db += sum_rows(dy)      bias_grad(dy, db)
// The last two in one call, and on CUDA one cuBLASLt GEMM: linear_weight_grad(dy, x, dW, db).
#pragma once

#include <string>
#include <vector>

#include "tessera/core/context.h"
#include "tessera/core/tensor.h"

namespace tessera {

// What the GEMM does to its result before writing it (see gemm_bias_gelu below).
// BiasGrad: the bias argument RECEIVES the row sums of op(a), bias[i] = sum_k op(a)[i, k]
// (cuBLASLt's BGRADB), which for dW = dy^T x are the bias gradient's column sums of dy.
enum class GemmEpilogue { None, Gelu, GeluBackward, BiasGrad };

struct GemmOptions {
  bool transpose_a = false;  // op(a) = a^T, so a is stored as [K, M]
  bool transpose_b = false;  // op(b) = b^T, so b is stored as [N, K]
  float alpha = 1, beta = 0;
  // Dequantization factors, multiplied into the product: FP8 operands hold x * scale, so
  // scale_inv = 1 / scale recovers x. They apply to any dtype and are 1 when unused.
  float a_scale_inv = 1, b_scale_inv = 1;
};

// c[M, N] = alpha * a_scale_inv * b_scale_inv * op(a) op(b) + beta * c + bias[N]
//
// op(a) is [M, K], op(b) is [K, N]. bias is optional (undefined tensor = none), 1-D [N],
// any floating dtype, added to every row.
// Dtypes: a, b in F64, F32, BF16, F16, E4M3, E5M2; c in F64, F32, BF16.
// Computes in double when a, b and c are all F64, otherwise in float (low-precision inputs
// are upcast exactly, products accumulate in FP32).
// beta = 0 overwrites c without reading it, so NaN or garbage in c does not leak through.
// c must not overlap a, b or bias in memory.
void gemm(Context& ctx, const Tensor& a, const Tensor& b, Tensor& c, const GemmOptions& options = {},
          const Tensor& bias = Tensor());

// The MLP's first linear layer and its activation in one pass over the output:
//   pre = op(a) op(b) + bias        c = gelu(pre)   (GPT-2's tanh GELU, as gelu_forward)
// pre and c share shape [M, N] and dtype; bias is optional. pre is what the backward needs.
// On CUDA with BF16 tensors the GELU runs in cuBLASLt's epilogue; otherwise it is the GEMM
// followed by gelu_forward, which is also the reference.
void gemm_bias_gelu(Context& ctx, const Tensor& a, const Tensor& b, const Tensor& bias, Tensor& pre, Tensor& c,
                    const GemmOptions& options = {});

// The GELU's input gradient fused into the GEMM that makes its output gradient:
//   c = (op(a) op(b)) * gelu'(pre)
// i.e. gelu_backward(pre, op(a) op(b)). alpha applies to the product; beta must be 0.
void gemm_gelu_backward(Context& ctx, const Tensor& a, const Tensor& b, const Tensor& pre, Tensor& c,
                        const GemmOptions& options = {});

// dbias[n] += sum_m dy[m, n]. dy is [M, N], dbias is [N]; any floating dtypes.
// A parameter gradient, so it ACCUMULATES into dbias (zero it before the first micro-batch).
// Column sums are accumulated in double.
void bias_grad(Context& ctx, const Tensor& dy, Tensor& dbias);

// A linear layer's parameter gradients in one call:
//   dweight[N, K] += dy^T x          dbias[N] += sum_m dy[m, n]
// dy [M, N], x [M, K]; dbias may be undefined (no bias). Both ACCUMULATE. The CPU reference
// is gemm(dy, x, dweight, {.transpose_a = true, .beta = 1}) followed by bias_grad. On CUDA
// (BF16 or F32 dy and x, F32 gradients) the column sums come out of the weight GEMM's
// epilogue (cuBLASLt BGRADB, FP32 sums) instead of a second pass over dy; where cuBLASLt
// offers no such kernel for the shape, the two ops run as on the CPU. accumulate_weight
// false OVERWRITES dweight instead (beta 0: its old contents are never read), the first
// gradient of a step after a lazy zero_grad (nn::Parameter::grad_unwritten); accumulate_bias
// false likewise overwrites dbias (on CUDA the epilogue writes the column sums straight into
// it: no scratch vector, no add).
void linear_weight_grad(Context& ctx, const Tensor& dy, const Tensor& x, Tensor& dweight, Tensor& dbias,
                        bool accumulate_weight = true, bool accumulate_bias = true);

// out[0] = sum_i x[i]^2 over every element of x (any shape, any floating dtype).
// out is [1], F32 or F64, and is overwritten. Accumulates in double, in a fixed order, so
// the result does not depend on the number of threads. Square root of the sum over all
// gradients gives the global gradient norm used for clipping.
void sum_of_squares(Context& ctx, const Tensor& x, Tensor& out);

// GEMM autotuning on CUDA (the cuBLASLt GEMMs of gemm, linear_weight_grad and fp8_gemm).
// Off (the default), every shape runs the algorithm cuBLASLt's heuristic ranks first, which
// is what PyTorch runs. On, the second call of each shape (shape, strides, dtypes, epilogue,
// beta, alignment) times the heuristic's first eight candidates on the call's own operands
// (CUDA events, best of three rounds) and keeps the fastest when it beats the first by more
// than 1%; the call then runs as usual, so results are those of the chosen algorithm. A
// GEMM that reads c (beta != 0) is timed into a scratch output (cudaMalloc'd and freed, so
// it stays out of the caching allocator); others into c, which the real call overwrites.
// Nothing is timed while a stream is being captured into a CUDA graph, and at most 512
// shapes per device are tuned (MoE experts' row counts change every step).
// Because the choice comes from timing, two runs may pick different algorithms and so
// differ in the last bits; leave it off where runs must be bit-identical.
// The initial setting comes from the environment variable TESSERA_GEMM_AUTOTUNE (0 or 1);
// `tessera train` sets it from training.gemm_autotune.
void set_gemm_autotune(bool on);
bool gemm_autotune();
// One line per tuned shape, in order (empty on the CPU and while autotuning is off).
std::vector<std::string> gemm_autotune_log();

}  // namespace tessera
