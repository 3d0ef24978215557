// CPU reference GEMM: c[M, N] = alpha * s * op(a) op(b) + beta * c + bias[N], with
// s = a_scale_inv * b_scale_inv; plus the bias gradient (column sums) and the sum of squares.
//
// Layout: row-major, contiguous. a is [M, K] ([K, M] when transposed), b is [K, N] ([N, K]
// when transposed); transposes are handled by the leading dimensions, never by copies.
// Inputs that are not the compute type (BF16, F16, FP8, or F64 in a float GEMM) are upcast
// once into a float temporary, so BLAS sgemm sees exactly the values the tensors hold.
#include "gemm.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "float_buffer.h"

#if TESSERA_WITH_BLAS
#include <cblas.h>
#endif

namespace tessera::cpu {
namespace {

// Block sizes of the portable loop: an A block of kMc x kKc and a B panel of kKc x kNc
// (512 KiB in float) stay in cache while every row of the A block sweeps the panel.
constexpr int64_t kMc = 64;
constexpr int64_t kKc = 256;
constexpr int64_t kNc = 512;

// c[M, N] += scale * op(a) op(b), c with leading dimension N.
template <typename T>
void blocked_multiply(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T scale, const T* a,
                      const T* b, T* c) {
  std::vector<T> b_panel(static_cast<size_t>(std::min(k, kKc) * std::min(n, kNc)));
  for (int64_t jc = 0; jc < n; jc += kNc) {
    const int64_t nc = std::min(kNc, n - jc);
    for (int64_t pc = 0; pc < k; pc += kKc) {
      const int64_t kc = std::min(kKc, k - pc);
      // Packing makes the innermost loop a unit-stride axpy whatever the transposes are.
#pragma omp parallel for schedule(static)
      for (int64_t p = 0; p < kc; ++p)
        for (int64_t j = 0; j < nc; ++j)
          b_panel[p * nc + j] = trans_b ? b[(jc + j) * k + (pc + p)] : b[(pc + p) * n + (jc + j)];

#pragma omp parallel
      {
        std::vector<T> a_block(static_cast<size_t>(kMc * kc));
#pragma omp for schedule(static)
        for (int64_t ic = 0; ic < m; ic += kMc) {
          const int64_t mc = std::min(kMc, m - ic);
          for (int64_t i = 0; i < mc; ++i)
            for (int64_t p = 0; p < kc; ++p)
              a_block[i * kc + p] = scale * (trans_a ? a[(pc + p) * m + (ic + i)] : a[(ic + i) * k + (pc + p)]);
          for (int64_t i = 0; i < mc; ++i) {
            T* c_row = c + (ic + i) * n + jc;
            for (int64_t p = 0; p < kc; ++p) {
              const T a_ip = a_block[i * kc + p];
              const T* b_row = b_panel.data() + p * nc;
              for (int64_t j = 0; j < nc; ++j) c_row[j] += a_ip * b_row[j];
            }
          }
        }
      }
    }
  }
}

#if TESSERA_WITH_BLAS
void blas_multiply(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float scale, const float* a,
                   const float* b, float* c) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k, scale,
              a, trans_a ? m : k, b, trans_b ? k : n, 1.0f, c, n);
}
void blas_multiply(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double scale, const double* a,
                   const double* b, double* c) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k, scale,
              a, trans_a ? m : k, b, trans_b ? k : n, 1.0, c, n);
}
#endif

template <typename T>
void gemm_typed(const Tensor& a, const Tensor& b, Tensor& c, const GemmOptions& options, const Tensor& bias,
                bool use_blas) {
  const int64_t m = c.size(0), n = c.size(1);
  const int64_t k = options.transpose_a ? a.size(0) : a.size(1);
  ReadBuffer<T> a_values(a), b_values(b), bias_values(bias);
  const bool read_c = options.beta != 0.0f;
  WriteBuffer<T> c_values(c, read_c);
  T* cp = c_values.data();
  const T beta = static_cast<T>(options.beta);
  const bool has_bias = bias.defined();

  // c = beta * c + bias first, so the multiply below only ever accumulates. With beta = 0
  // c is assigned, never multiplied: 0 * NaN would otherwise leak a poisoned output.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    T* row = cp + i * n;
    for (int64_t j = 0; j < n; ++j) {
      const T base = read_c ? beta * row[j] : T(0);
      row[j] = has_bias ? base + bias_values[j] : base;
    }
  }

  const T scale = static_cast<T>(options.alpha) * static_cast<T>(options.a_scale_inv) *
                  static_cast<T>(options.b_scale_inv);
  // scale = 0 skips the product, as BLAS does with alpha = 0, so both paths agree.
  if (m > 0 && n > 0 && k > 0 && scale != T(0)) {
#if TESSERA_WITH_BLAS
    // blasint may be 32-bit; larger problems take the portable loop.
    const bool fits = m <= INT_MAX && n <= INT_MAX && k <= INT_MAX;
    if (use_blas && fits) {
      blas_multiply(options.transpose_a, options.transpose_b, m, n, k, scale, a_values.data(), b_values.data(), cp);
    } else {
      blocked_multiply(options.transpose_a, options.transpose_b, m, n, k, scale, a_values.data(), b_values.data(), cp);
    }
#else
    (void)use_blas;
    blocked_multiply(options.transpose_a, options.transpose_b, m, n, k, scale, a_values.data(), b_values.data(), cp);
#endif
  }
  c_values.commit();
}

void gemm_any(const Tensor& a, const Tensor& b, Tensor& c, const GemmOptions& options, const Tensor& bias,
              bool use_blas) {
  const bool all_f64 = a.dtype() == DType::F64 && b.dtype() == DType::F64 && c.dtype() == DType::F64;
  if (all_f64) gemm_typed<double>(a, b, c, options, bias, use_blas);
  else gemm_typed<float>(a, b, c, options, bias, use_blas);
}

}  // namespace

void gemm(const Tensor& a, const Tensor& b, Tensor& c, const GemmOptions& options, const Tensor& bias) {
  gemm_any(a, b, c, options, bias, /*use_blas=*/true);
}

void gemm_portable(const Tensor& a, const Tensor& b, Tensor& c, const GemmOptions& options, const Tensor& bias) {
  gemm_any(a, b, c, options, bias, /*use_blas=*/false);
}

void bias_grad(const Tensor& dy, Tensor& dbias) {
  const int64_t n = dbias.numel();
  const int64_t m = n > 0 ? dy.numel() / n : 0;
  std::vector<double> sums(static_cast<size_t>(n), 0.0);
  dispatch_compute_type(dy.dtype(), [&](auto zero) {
    using T = decltype(zero);
    ReadBuffer<T> dy_values(dy);
    // Each thread owns a strip of columns and walks the rows in order: deterministic sums
    // that still read dy row by row.
    constexpr int64_t kStrip = 64;
#pragma omp parallel for schedule(static)
    for (int64_t j0 = 0; j0 < n; j0 += kStrip) {
      const int64_t j1 = std::min(n, j0 + kStrip);
      for (int64_t i = 0; i < m; ++i) {
        const T* row = dy_values.data() + i * n;
        for (int64_t j = j0; j < j1; ++j) sums[j] += static_cast<double>(row[j]);
      }
    }
  });
  void* out = dbias.raw_data();
  for (int64_t j = 0; j < n; ++j) store_element(out, dbias.dtype(), j, load_element(out, dbias.dtype(), j) + sums[j]);
}

void sum_of_squares(const Tensor& x, Tensor& out) {
  const int64_t total = x.numel();
  // Fixed-size chunks summed in chunk order: the same bits for any thread count.
  constexpr int64_t kChunk = 1 << 14;
  const int64_t chunks = (total + kChunk - 1) / kChunk;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
  const void* base = x.raw_data();
  const DType t = x.dtype();
#pragma omp parallel for schedule(static)
  for (int64_t ci = 0; ci < chunks; ++ci) {
    const int64_t begin = ci * kChunk, end = std::min(total, begin + kChunk);
    double s = 0;
    if (t == DType::F32) {
      const float* p = static_cast<const float*>(base);
      for (int64_t i = begin; i < end; ++i) s += static_cast<double>(p[i]) * p[i];
    } else if (t == DType::F64) {
      const double* p = static_cast<const double*>(base);
      for (int64_t i = begin; i < end; ++i) s += p[i] * p[i];
    } else {
      for (int64_t i = begin; i < end; ++i) {
        const double v = load_element(base, t, i);
        s += v * v;
      }
    }
    partial[ci] = s;
  }
  double sum = 0;
  for (double s : partial) sum += s;
  store_element(out.raw_data(), out.dtype(), 0, sum);
}

}  // namespace tessera::cpu
