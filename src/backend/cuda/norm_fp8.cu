// LayerNorm / RMSNorm (and their fused residual-add forms) with an FP8 output: the norm
// kernels of norm_kernels.cuh with Fp8Sink as their output sink, so each y vector, rounded
// to x's dtype exactly as the plain op stores it, is multiplied by the per-tensor scale,
// converted to E4M3 (fp8_cvt.cuh: the bytes of quantize_per_tensor) and folded into the
// amax, in the pass that computes it; y itself is written only when a copy is asked for.
// mean/rstd (and the sum of the add forms) are written as by the plain ops, for backward.
//
// Delayed scaling knows the scale before the pass: one launch. Current scaling needs the
// amax of y first: a statistics pass (q undefined: mean, rstd, the sum, amax; no y), the
// one-thread scale kernel (fp8/device_scaling.h), then norm_apply_fp8, which recomputes y
// from x and the saved statistics with the forward's exact operations and casts it.
//
// Layout: as norm.cu: x, residual, sum, y contiguous [rows, C], all F32 or all BF16; q E4M3
// [rows, C]; gamma, beta [C] F32 or BF16 each; mean, rstd, scale, amax F32.
//
// Floor (H200, ~4.1 TB/s), per element of a BF16 activation: delayed: read x, write q:
// 3 B (16384 x 4096: 201 MB, ~49 us) against 7 B for the norm then the cast (4 + 3; the cast
// with transpose adds 1 B either way); current: 2 B (statistics) + 3 B (apply) against
// 4 + 2 (amax) + 3. The add forms add the residual read and the sum write (4 B). The
// transposed copy for the weight gradient is a separate byte transpose (2 B), except after
// current scaling's apply pass, which can write it itself (norm_apply_fp8_transpose: apply
// 2 + 1 B and transpose 1 + 1 B become 2 + 2 B, and the 32 x 32 single-byte transpose, far
// from its floor, goes). Not measured yet; the kernels are the plain norms' with a cheaper
// store, so expect their percentages.
#include "norm.h"
#include "norm_fp8.h"
#include "code_tile.cuh"
#include "fp8_cvt.cuh"
#include "norm_launch.cuh"

namespace tessera::cuda {

namespace {

// The output sink of the FP8 forms (norm_kernels.cuh's sink interface).
template <typename T>
struct Fp8Sink {
  uint8_t* q;             // null: statistics only
  T* y;                   // optional copy of y in T
  const float* scale;     // read when q is set
  uint32_t* amax_bits;    // optional, zeroed before the launch
  float s;
  uint32_t m;

  __device__ __forceinline__ void begin() {
    s = q ? *scale : 1.0f;
    m = 0;
  }
  template <int N>
  __device__ __forceinline__ void store(int64_t i, const float* v) {
    float r[N];  // y as stored in T, which is what the reference quantizes
#pragma unroll
    for (int k = 0; k < N; ++k) {
      r[k] = round_to_storage<T>(v[k]);
      m = max(m, fp8cvt::abs_bits(r[k]));
    }
    if (y) store_vec<T, N>(y + i, r);
    if (!q) return;
    if constexpr (N % 4 == 0) {
      uint32_t words[N / 4];
      fp8cvt::quantize_words<true, N>(r, s, words);
      store_words<N>(q + i, words);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) q[i + k] = fp8cvt::encode_scaled<true>(r[k], s);
    }
  }
  __device__ __forceinline__ void finish() {
    if (amax_bits) fp8cvt::block_atomic_max(m, amax_bits);
  }
  bool aligned_for(int vec) const { return aligned(q, size_t(vec)) && (!y || aligned(y, 16)); }
};

template <typename T>
Fp8Sink<T> make_fp8_sink(Tensor& q, Tensor& y, const Tensor& scale, Tensor& amax) {
  return {q.defined() ? q.data<uint8_t>() : nullptr, y.defined() ? y.data<T>() : nullptr,
          q.defined() ? scale.data<float>() : nullptr, amax.defined() ? amax.data<uint32_t>() : nullptr, 0.0f, 0u};
}

template <bool kLayer, bool kAdd>
void forward_fp8(void* stream, const Tensor& x, const Tensor* residual, Tensor* sum, const Tensor& gamma,
                 const Tensor& beta, float eps, const Tensor& scale, Tensor& q, Tensor& amax, Tensor& y, Tensor* mean,
                 Tensor& rstd) {
  if (amax.defined())
    TESSERA_CUDA_CHECK(cudaMemsetAsync(amax.raw_data(), 0, sizeof(uint32_t), static_cast<cudaStream_t>(stream)));
  norm_forward_to<kLayer, kAdd>(
      stream, x, residual, sum, gamma, beta, eps,
      [&](auto* tag) { return make_fp8_sink<std::remove_pointer_t<decltype(tag)>>(q, y, scale, amax); }, mean, rstd);
}

constexpr int kApplyThreads = 256;

// Row groups of blockDim.x threads (blockDim.y groups per block) loop over rows; y as in
// norm_forward_kernel's last loop, from the saved float statistics.
template <typename T, int VEC, bool kLayer>
__global__ void __launch_bounds__(kApplyThreads)
    norm_apply_fp8_kernel(const T* x, Param gamma, Param beta, const float* mean, const float* rstd,
                          Fp8Sink<T> sink, int64_t rows, int64_t cols) {
  sink.begin();
  const int64_t vectors = cols / VEC;
  for (int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; row < rows;
       row += int64_t(gridDim.x) * blockDim.y) {
    const float mu = kLayer ? mean[row] : 0.0f, r = rstd[row];
    for (int64_t j = threadIdx.x; j < vectors; j += blockDim.x) {
      const int64_t c = j * VEC;
      float v[VEC], out[VEC];
      load_vec<T, VEC>(x + row * cols + c, v);
      normalize_vec<VEC, kLayer>(v, mu, r, gamma, beta, c, out);
      sink.template store<VEC>(row * cols + c, out);
    }
  }
}

// ---- The apply pass with the transposed copy (current scaling's second pass) --------------
//
// norm_apply_fp8_kernel's values (the same float operations, rounded to BF16 the same way,
// the same cast), written as q [rows, C] and q_t [C, rows] from one pass: cast_transpose.cu's
// tiling (64 x 128 tiles, codes through an XOR-swizzled shared tile of 32-bit words, 8 x 4
// byte blocks transposed in registers). BF16 x with C % 8 == 0 and rows % 8 == 0 only; the
// op applies then transposes otherwise. Replaces apply (2 B read + 1 B written per element)
// and the byte transpose (1 + 1 B, which ran far from its floor: 32 x 32 tiles of single
// bytes, ~40 us per 8192 x 2048 copy against ~8 us) with 2 + 2 B.
static_assert(kApplyThreads == code_tile::kThreads, "the transposed store maps 256 threads");
constexpr int kTrRows = code_tile::kRows, kTrCols = code_tile::kCols, kTrWords = code_tile::kWords, kTrVec = 8;
constexpr int kTrVecPerRow = kTrCols / kTrVec, kTrUnits = kTrRows * kTrVecPerRow / kApplyThreads;

template <bool kLayer>
__global__ void __launch_bounds__(kApplyThreads, 2)
    norm_apply_fp8_transpose_kernel(const uint16_t* x, Param gamma, Param beta, const float* mean, const float* rstd,
                                    const float* scale, uint8_t* q, uint8_t* q_t, int64_t rows, int64_t cols,
                                    int64_t tiles_across, int64_t tiles) {
  __shared__ uint32_t tile[kTrRows][kTrWords];
  const float s = *scale;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_across) * kTrRows, c0 = (t % tiles_across) * kTrCols;
    uint32_t raw[kTrUnits][4];
#pragma unroll
    for (int k = 0; k < kTrUnits; ++k) {
      const int id = int(threadIdx.x) + k * kApplyThreads, row = id / kTrVecPerRow, vec = id % kTrVecPerRow;
      const int64_t r = r0 + row, c = c0 + int64_t(vec) * kTrVec;
      if (r < rows && c < cols) load_words<16>(x + r * cols + c, raw[k]);
    }
#pragma unroll
    for (int k = 0; k < kTrUnits; ++k) {
      const int id = int(threadIdx.x) + k * kApplyThreads, row = id / kTrVecPerRow, vec = id % kTrVecPerRow;
      const int64_t r = r0 + row, c = c0 + int64_t(vec) * kTrVec;
      if (r >= rows || c >= cols) continue;
      const float mu = kLayer ? mean[r] : 0.0f, rr = rstd[r];
      float v[kTrVec], out[kTrVec];
      unpack_raw<uint16_t, kTrVec>(raw[k], v);
      normalize_vec<kTrVec, kLayer>(v, mu, rr, gamma, beta, c, out);
#pragma unroll
      for (int e = 0; e < kTrVec; ++e) out[e] = round_to_storage<uint16_t>(out[e]);
      uint32_t words[2];
      fp8cvt::quantize_words<true, kTrVec>(out, s, words);
      *reinterpret_cast<uint2*>(q + r * cols + c) = make_uint2(words[0], words[1]);
      tile[row][code_tile::swizzle(row, 2 * vec)] = words[0];
      tile[row][code_tile::swizzle(row, 2 * vec + 1)] = words[1];
    }
    __syncthreads();
    code_tile::store_transposed(tile, q_t, rows, r0, c0, cols);  // C % 8 == 0 and rows % 8 == 0
    __syncthreads();  // the tile is rewritten by the next iteration
  }
}

}  // namespace

bool norm_apply_fp8_transpose_supported(const Tensor& x, const Tensor& q, const Tensor& q_t, const Tensor& gamma,
                                        const Tensor& beta) {
  return x.dtype() == DType::BF16 && x.dim() == 2 && x.is_contiguous() && x.size(0) % 8 == 0 &&
         x.size(1) % kTrVec == 0 && aligned(x.raw_data(), 16) && q.dtype() == DType::E4M3 &&
         q_t.dtype() == DType::E4M3 && q.is_contiguous() && q_t.is_contiguous() && aligned(q.raw_data(), 8) &&
         aligned(q_t.raw_data(), 8) && norm_fp8_supported(x, q, Tensor(), gamma, beta) &&
         param_aligned(gamma, kTrVec) && param_aligned(beta, kTrVec);
}

void norm_apply_fp8_transpose(void* stream, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                              const Tensor& mean, const Tensor& rstd, const Tensor& scale, Tensor& q, Tensor& q_t) {
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
  const int64_t across = ceil_div(cols, kTrCols), tiles = ceil_div(rows, kTrRows) * across;
  const int64_t wave = int64_t(device_query(nullptr, 0, x.device().index)) * 2;
  const unsigned blocks = unsigned(std::min(tiles, wave));
  auto s = static_cast<cudaStream_t>(stream);
  const float* mean_ptr = mean.defined() ? mean.data<float>() : nullptr;
  auto run = [&](auto layer_tag) {
    norm_apply_fp8_transpose_kernel<decltype(layer_tag)::value><<<blocks, kApplyThreads, 0, s>>>(
        static_cast<const uint16_t*>(x.raw_data()), param_of(gamma), param_of(beta), mean_ptr, rstd.data<float>(),
        scale.data<float>(), q.data<uint8_t>(), q_t.data<uint8_t>(), rows, cols, across, tiles);
  };
  if (mean_ptr) run(std::true_type{});
  else run(std::false_type{});
  TESSERA_CUDA_CHECK_LAUNCH();
}

bool norm_fp8_supported(const Tensor& x, const Tensor& q, const Tensor& y, const Tensor& gamma, const Tensor& beta) {
  if (q.defined() && q.dtype() != DType::E4M3) return false;
  return y.defined() ? norm_supported({&x, &y}, {&gamma, &beta}, {}) : norm_supported({&x}, {&gamma, &beta}, {});
}

void layernorm_forward_fp8(void* stream, const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                           const Tensor& scale, Tensor& q, Tensor& amax, Tensor& y, Tensor& mean, Tensor& rstd) {
  forward_fp8<true, false>(stream, x, nullptr, nullptr, gamma, beta, eps, scale, q, amax, y, &mean, rstd);
}

void rmsnorm_forward_fp8(void* stream, const Tensor& x, const Tensor& gamma, float eps, const Tensor& scale, Tensor& q,
                         Tensor& amax, Tensor& y, Tensor& rstd) {
  forward_fp8<false, false>(stream, x, nullptr, nullptr, gamma, Tensor(), eps, scale, q, amax, y, nullptr, rstd);
}

void add_layernorm_forward_fp8(void* stream, const Tensor& x, const Tensor& residual, const Tensor& gamma,
                               const Tensor& beta, float eps, const Tensor& scale, Tensor& sum, Tensor& q,
                               Tensor& amax, Tensor& y, Tensor& mean, Tensor& rstd) {
  forward_fp8<true, true>(stream, x, &residual, &sum, gamma, beta, eps, scale, q, amax, y, &mean, rstd);
}

void add_rmsnorm_forward_fp8(void* stream, const Tensor& x, const Tensor& residual, const Tensor& gamma, float eps,
                             const Tensor& scale, Tensor& sum, Tensor& q, Tensor& amax, Tensor& y, Tensor& rstd) {
  forward_fp8<false, true>(stream, x, &residual, &sum, gamma, Tensor(), eps, scale, q, amax, y, nullptr, rstd);
}

void norm_apply_fp8(void* stream, const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean,
                    const Tensor& rstd, const Tensor& scale, Tensor& q) {
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  if (rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const Param g = param_of(gamma), b = param_of(beta);
  const float* mean_ptr = mean.defined() ? mean.data<float>() : nullptr;
  const int64_t wave = int64_t(device_query(nullptr, 0, x.device().index)) * (2048 / kApplyThreads);
  Tensor no_y, no_amax;
  dispatch_storage(x.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int kVec = 16 / sizeof(T);
    const Fp8Sink<T> sink = make_fp8_sink<T>(q, no_y, scale, no_amax);
    const bool vectorized = cols % kVec == 0 && aligned(x.raw_data(), 16) && sink.aligned_for(kVec) &&
                            param_aligned(gamma, kVec) && param_aligned(beta, kVec);
    auto launch = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      int tpr = 1;
      while (tpr < cols / VEC && tpr < kApplyThreads) tpr *= 2;
      const int rpb = kApplyThreads / tpr;
      const unsigned blocks = unsigned(std::min(ceil_div(rows, rpb), wave));
      auto run = [&](auto layer_tag) {
        norm_apply_fp8_kernel<T, VEC, decltype(layer_tag)::value><<<blocks, dim3(tpr, rpb), 0, s>>>(
            x.data<T>(), g, b, mean_ptr, rstd.data<float>(), sink, rows, cols);
      };
      if (mean_ptr) run(std::true_type{});
      else run(std::false_type{});
    };
    if (vectorized) launch(Int<kVec>{});
    else launch(Int<1>{});
  });
  TESSERA_CUDA_CHECK_LAUNCH();
}

}  // namespace tessera::cuda
