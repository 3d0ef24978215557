// Rotary position embedding (Hugging Face "rotate_half" convention) on the GPU, forward and
// backward (the rotation by -angle), with the table precision and rounding of the CPU
// reference (backend/cpu/rope.cpp).
//
// Layout: [B, T, H, D], D even, each token's H * D values packed and tokens at a common
// stride (contiguous, or Q / K sliced from a fused QKV projection, which makes the split
// and the rotation one pass); element i of a head vector pairs with i + D/2.
// A first kernel builds the [T, D/2] cosine and sine tables in double (pow, sincos) and
// rounds them once to float, exactly as the reference does; the table is small (8 bytes per
// entry, T*D/2 entries, shared by every batch row and head) and stays in L2. The rotation
// kernel then runs in float with explicit round-to-nearest intrinsics (nvcc would otherwise
// contract a*c - b*s into an FMA the reference does not use), each thread owning VEC pairs:
// 16-byte loads of both halves when D/2 and the pointers allow, scalar otherwise. A thread
// reads both halves of its pairs before writing them, so the output may be the input.
//
// Floor (H200, ~4.1 TB/s): read x and write y once, 2 passes of the activation (e.g. Llama
// q at 16384 tokens x 32 heads x 128 BF16: 268 MB, ~65 us) plus the table (T*D/2*8 bytes).
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda_check.h"
#include "rope.h"
#include "tessera/core/numeric.h"

namespace tessera::cuda {

namespace {

constexpr int kRotateThreads = 256;
constexpr int kTableThreads = 64;

// N consecutive elements of T (float or uint16_t BF16 bits) converted to and from float;
// p aligned to N elements (16 bytes at most).
template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float* v) {
  if constexpr (N == 1) {
    if constexpr (std::is_same_v<T, float>) v[0] = *p;
    else v[0] = bf16_bits_to_float(*p);
  } else if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int k = 0; k < N; k += 4) {
      const float4 q = *reinterpret_cast<const float4*>(p + k);
      v[k] = q.x, v[k + 1] = q.y, v[k + 2] = q.z, v[k + 3] = q.w;
    }
  } else {
    static_assert(N == 8, "BF16 vectors are 8 elements");
    const uint4 q = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // little endian: element 2k is the low half
      v[2 * k] = __uint_as_float(w[k] << 16);
      v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float* v) {
  if constexpr (N == 1) {
    if constexpr (std::is_same_v<T, float>) *p = v[0];
    else *p = float_to_bf16_bits(v[0]);
  } else if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int k = 0; k < N; k += 4) *reinterpret_cast<float4*>(p + k) = make_float4(v[k], v[k + 1], v[k + 2], v[k + 3]);
  } else {
    static_assert(N == 8, "BF16 vectors are 8 elements");
    uint32_t w[4];
    floats_to_bf16_pairs<8>(v, w);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// cos_t[t, i] = cos(angle), sin_t[t, i] = direction * sin(angle) with
// angle = (t + offset) * theta^(-2i/D): thread = frequency i (its pow computed once),
// blockIdx.y = a run of t_per_block positions.
__global__ void rope_table_kernel(float* cos_t, float* sin_t, int64_t seq, int64_t half, int64_t dim, double theta,
                                  int64_t offset, double direction, int64_t t_per_block) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= half) return;
  const double inv_freq = pow(theta, -2.0 * double(i) / double(dim));
  const int64_t t_begin = int64_t(blockIdx.y) * t_per_block;
  const int64_t t_end = t_begin + t_per_block < seq ? t_begin + t_per_block : seq;
  for (int64_t t = t_begin; t < t_end; ++t) {
    double s, c;
    sincos(double(t + offset) * inv_freq, &s, &c);
    cos_t[t * half + i] = float(c);
    sin_t[t * half + i] = float(direction * s);
  }
}

// blockDim = (tx, ty): ty tokens (b, t) per block, tx threads per token stepping over its
// heads * half / VEC pair vectors. y[i] = x[i]*c - x[i+half]*s, y[i+half] = x[i+half]*c + x[i]*s
// (s already carries the direction).
template <typename T, int VEC>
__global__ void __launch_bounds__(kRotateThreads)
    rope_rotate_kernel(const T* in, T* out, const float* cos_t, const float* sin_t, int tokens, int seq, int heads,
                       int half, int64_t in_token_stride, int64_t out_token_stride) {
  const int token = blockIdx.x * blockDim.y + threadIdx.y;
  if (token >= tokens) return;
  const int t = token % seq, vectors_per_head = half / VEC, per_token = heads * vectors_per_head;
  const float* ct = cos_t + int64_t(t) * half;
  const float* st = sin_t + int64_t(t) * half;
  for (int k = threadIdx.x; k < per_token; k += blockDim.x) {
    const int h = k / vectors_per_head, i = (k - h * vectors_per_head) * VEC;
    const int64_t head = int64_t(h) * (2 * int64_t(half)) + i;
    const int64_t in_base = int64_t(token) * in_token_stride + head, out_base = int64_t(token) * out_token_stride + head;
    float a[VEC], b[VEC], c[VEC], s[VEC], ya[VEC], yb[VEC];
    load_vec<T, VEC>(in + in_base, a);
    load_vec<T, VEC>(in + in_base + half, b);
    load_vec<float, VEC>(ct + i, c);
    load_vec<float, VEC>(st + i, s);
#pragma unroll
    for (int k2 = 0; k2 < VEC; ++k2) {
      ya[k2] = __fsub_rn(__fmul_rn(a[k2], c[k2]), __fmul_rn(b[k2], s[k2]));
      yb[k2] = __fadd_rn(__fmul_rn(b[k2], c[k2]), __fmul_rn(a[k2], s[k2]));
    }
    store_vec<T, VEC>(out + out_base, ya);
    store_vec<T, VEC>(out + out_base + half, yb);
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T, int VEC>
void launch_rotate(cudaStream_t s, const Tensor& in, Tensor& out, const float* cos_t, const float* sin_t, int tokens,
                   int seq, int heads, int half) {
  const int per_token = heads * (half / VEC);
  int tx = 1;
  while (tx < per_token && tx < kRotateThreads) tx *= 2;
  const dim3 block(tx, kRotateThreads / tx);  // narrow tokens share a block, so no lane idles
  // Tokens at a stride (1 for a contiguous tensor's H * D): Q or K sliced from a fused QKV.
  rope_rotate_kernel<T, VEC><<<unsigned(ceil_div(tokens, block.y)), block, 0, s>>>(
      in.data<T>(), out.data<T>(), cos_t, sin_t, tokens, seq, heads, half, in.stride(1), out.stride(1));
}

void rotate(void* stream, const Tensor& in, Tensor& out, const RopeOptions& options, int direction, const char* op) {
  if (in.numel() == 0) return;
  const int64_t batch = in.size(0), seq = in.size(1), heads = in.size(2), dim = in.size(3), half = dim / 2;
  const int64_t tokens = batch * seq;
  TESSERA_CHECK(tokens <= 0x7fffffff && heads * dim <= 0x7fffffff, op, " on CUDA: ", in.describe(),
                " exceeds the kernel's 32-bit token and head indexing");
  auto s = static_cast<cudaStream_t>(stream);

  // Temporary table; it goes back to the caching allocator on return, and the allocator's
  // reuse is ordered on the stream like every temporary of the CUDA backend.
  Tensor table = Tensor::empty({2 * seq * half}, DType::F32, in.device());
  float* cos_t = table.data<float>();
  float* sin_t = cos_t + seq * half;
  const int64_t t_per_block = seq > 16 * 65535 ? ceil_div(seq, 65535) : 16;
  const dim3 table_grid(unsigned(ceil_div(half, kTableThreads)), unsigned(ceil_div(seq, t_per_block)));
  rope_table_kernel<<<table_grid, kTableThreads, 0, s>>>(cos_t, sin_t, seq, half, dim, double(options.theta),
                                                         options.position_offset, double(direction), t_per_block);
  TESSERA_CUDA_CHECK_LAUNCH();

  const auto n_tokens = int(tokens), n_seq = int(seq), n_heads = int(heads), n_half = int(half);
  // 16-byte vectors need every token's start aligned too: token strides in whole vectors.
  const auto strides_allow = [&](int64_t vec) { return in.stride(1) % vec == 0 && out.stride(1) % vec == 0; };
  if (in.dtype() == DType::F32) {
    if (half % 4 == 0 && strides_allow(4) && aligned16(in.raw_data()) && aligned16(out.raw_data()))
      launch_rotate<float, 4>(s, in, out, cos_t, sin_t, n_tokens, n_seq, n_heads, n_half);
    else launch_rotate<float, 1>(s, in, out, cos_t, sin_t, n_tokens, n_seq, n_heads, n_half);
  } else {
    if (half % 8 == 0 && strides_allow(8) && aligned16(in.raw_data()) && aligned16(out.raw_data()))
      launch_rotate<uint16_t, 8>(s, in, out, cos_t, sin_t, n_tokens, n_seq, n_heads, n_half);
    else launch_rotate<uint16_t, 1>(s, in, out, cos_t, sin_t, n_tokens, n_seq, n_heads, n_half);
  }
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool rope_supported(const Tensor& in, const Tensor& out) {
  return (in.dtype() == DType::F32 || in.dtype() == DType::BF16) && out.dtype() == in.dtype();
}

void rope_forward(void* stream, const Tensor& x, Tensor& y, const RopeOptions& options) {
  rotate(stream, x, y, options, 1, "rope_forward");
}

void rope_backward(void* stream, const Tensor& dy, Tensor& dx, const RopeOptions& options) {
  rotate(stream, dy, dx, options, -1, "rope_backward");
}

}  // namespace tessera::cuda
