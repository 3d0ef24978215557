// CPU reference: LayerNorm and RMSNorm over the last dimension, forward and backward.
//
// Layout: x, y, dy, dx are row-major [rows, C] (every leading dimension flattened, the
// normalized dimension last and contiguous); gamma/beta/dgamma/dbeta are [C]; mean/rstd
// hold one value per row in the compute type. Row statistics and the column sums of the
// parameter gradients accumulate in double; per-element math runs in the compute type
// (double for F64 inputs, float otherwise).
//
// The fused residual-add ops are, on the CPU, literally add() and the plain op composed: the
// definition the GPU's single-pass kernels are held to, rounding included.
#include "norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "elementwise.h"
#include "float_buffer.h"

namespace tessera::cpu {
namespace {

// Below this many elements a parallel region costs more than it saves (and stalls badly on
// a loaded machine), so small tensors stay on one thread.
constexpr int64_t kMinParallelElements = 1 << 15;

// The parameter gradients are column sums over all rows. Rows are cut into a fixed number
// of chunks whose partial sums are added in chunk order, so the result is the same for
// every OpenMP thread count.
constexpr int64_t kMaxRowChunks = 64;

struct RowChunks {
  int64_t rows;
  int64_t count;
  explicit RowChunks(int64_t rows) : rows(rows), count(std::min(rows, kMaxRowChunks)) {}
  int64_t begin(int64_t chunk) const { return rows * chunk / count; }
};

// Adds the per-chunk partial column sums (chunk-major, [count, cols]) into `out`.
template <typename T>
void accumulate_chunks(const std::vector<double>& partial, int64_t count, int64_t cols, WriteBuffer<T>& out) {
  for (int64_t c = 0; c < cols; ++c) {
    double sum = 0;
    for (int64_t k = 0; k < count; ++k) sum += partial[k * cols + c];
    out[c] = static_cast<T>(static_cast<double>(out[c]) + sum);
  }
}

int64_t rows_of(const Tensor& x, int64_t cols) { return cols == 0 ? 0 : x.numel() / cols; }

}  // namespace

void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y, Tensor& mean,
                       Tensor& rstd) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = x.size(-1), rows = rows_of(x, cols);
    const bool has_beta = beta.defined();
    ReadBuffer<T> in(x), g(gamma), b(beta);
    WriteBuffer<T> out(y), mean_out(mean), rstd_out(rstd);
#pragma omp parallel for schedule(static) if (x.numel() >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = in.data() + r * cols;
      double sum = 0;
      for (int64_t c = 0; c < cols; ++c) sum += xr[c];
      const double mu = sum / static_cast<double>(cols);
      // Two passes: the variance of centered values does not cancel catastrophically.
      double squares = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double d = static_cast<double>(xr[c]) - mu;
        squares += d * d;
      }
      const double inv_std = 1.0 / std::sqrt(squares / static_cast<double>(cols) + eps);
      // Normalize with the stored (rounded) statistics so backward sees exactly this xhat.
      const T mu_t = static_cast<T>(mu), rstd_t = static_cast<T>(inv_std);
      mean_out[r] = mu_t;
      rstd_out[r] = rstd_t;
      T* yr = out.data() + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        const T normalized = (xr[c] - mu_t) * rstd_t;
        yr[c] = normalized * g[c] + (has_beta ? b[c] : T(0));
      }
    }
    out.commit();
    mean_out.commit();
    rstd_out.commit();
  });
}

void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = x.size(-1), rows = rows_of(x, cols);
    const bool has_dbeta = dbeta.defined();
    ReadBuffer<T> in(x), grad_out(dy), g(gamma), mean_in(mean), rstd_in(rstd);
    WriteBuffer<T> grad_in(dx), dgamma_out(dgamma, /*load_existing=*/true), dbeta_out(dbeta, /*load_existing=*/true);
    const RowChunks chunks(rows);
    std::vector<double> dgamma_partial(static_cast<size_t>(chunks.count * cols), 0.0);
    std::vector<double> dbeta_partial(has_dbeta ? static_cast<size_t>(chunks.count * cols) : 0, 0.0);
    const double inv_cols = 1.0 / static_cast<double>(cols);
#pragma omp parallel for schedule(dynamic) if (x.numel() >= kMinParallelElements)
    for (int64_t k = 0; k < chunks.count; ++k) {
      double* dgamma_k = dgamma_partial.data() + k * cols;
      double* dbeta_k = has_dbeta ? dbeta_partial.data() + k * cols : nullptr;
      for (int64_t r = chunks.begin(k); r < chunks.begin(k + 1); ++r) {
        const T* xr = in.data() + r * cols;
        const T* dyr = grad_out.data() + r * cols;
        const T mu = mean_in[r], inv_std = rstd_in[r];
        double sum_g = 0, sum_g_xhat = 0;
        for (int64_t c = 0; c < cols; ++c) {
          const T xhat = (xr[c] - mu) * inv_std;
          const T gc = dyr[c] * g[c];
          sum_g += gc;
          sum_g_xhat += static_cast<double>(gc) * xhat;
          dgamma_k[c] += static_cast<double>(dyr[c]) * xhat;
          if (has_dbeta) dbeta_k[c] += dyr[c];
        }
        const T mean_g = static_cast<T>(sum_g * inv_cols), mean_g_xhat = static_cast<T>(sum_g_xhat * inv_cols);
        // Written last, after every read of this row, so dx may share memory with dy.
        T* dxr = grad_in.data() + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          const T xhat = (xr[c] - mu) * inv_std;
          dxr[c] = inv_std * (dyr[c] * g[c] - mean_g - xhat * mean_g_xhat);
        }
      }
    }
    accumulate_chunks(dgamma_partial, chunks.count, cols, dgamma_out);
    if (has_dbeta) accumulate_chunks(dbeta_partial, chunks.count, cols, dbeta_out);
    grad_in.commit();
    dgamma_out.commit();
    dbeta_out.commit();
  });
}

void rmsnorm_forward(const Tensor& x, const Tensor& gamma, double eps, Tensor& y, Tensor& rstd) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = x.size(-1), rows = rows_of(x, cols);
    ReadBuffer<T> in(x), g(gamma);
    WriteBuffer<T> out(y), rstd_out(rstd);
#pragma omp parallel for schedule(static) if (x.numel() >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = in.data() + r * cols;
      double squares = 0;
      for (int64_t c = 0; c < cols; ++c) squares += static_cast<double>(xr[c]) * xr[c];
      const T rstd_t = static_cast<T>(1.0 / std::sqrt(squares / static_cast<double>(cols) + eps));
      rstd_out[r] = rstd_t;
      T* yr = out.data() + r * cols;
      for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * rstd_t * g[c];
    }
    out.commit();
    rstd_out.commit();
  });
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd, Tensor& dx,
                      Tensor& dgamma) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = x.size(-1), rows = rows_of(x, cols);
    ReadBuffer<T> in(x), grad_out(dy), g(gamma), rstd_in(rstd);
    WriteBuffer<T> grad_in(dx), dgamma_out(dgamma, /*load_existing=*/true);
    const RowChunks chunks(rows);
    std::vector<double> dgamma_partial(static_cast<size_t>(chunks.count * cols), 0.0);
    const double inv_cols = 1.0 / static_cast<double>(cols);
#pragma omp parallel for schedule(dynamic) if (x.numel() >= kMinParallelElements)
    for (int64_t k = 0; k < chunks.count; ++k) {
      double* dgamma_k = dgamma_partial.data() + k * cols;
      for (int64_t r = chunks.begin(k); r < chunks.begin(k + 1); ++r) {
        const T* xr = in.data() + r * cols;
        const T* dyr = grad_out.data() + r * cols;
        const T inv_std = rstd_in[r];
        double sum_g_xhat = 0;
        for (int64_t c = 0; c < cols; ++c) {
          const T xhat = xr[c] * inv_std;
          sum_g_xhat += static_cast<double>(dyr[c] * g[c]) * xhat;
          dgamma_k[c] += static_cast<double>(dyr[c]) * xhat;
        }
        const T mean_g_xhat = static_cast<T>(sum_g_xhat * inv_cols);
        T* dxr = grad_in.data() + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          const T xhat = xr[c] * inv_std;
          dxr[c] = inv_std * (dyr[c] * g[c] - xhat * mean_g_xhat);
        }
      }
    }
    accumulate_chunks(dgamma_partial, chunks.count, cols, dgamma_out);
    grad_in.commit();
    dgamma_out.commit();
  });
}

// The last loops of layernorm_forward and rmsnorm_forward, on statistics read back.
void norm_apply(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean, const Tensor& rstd,
                Tensor& y) {
  dispatch_compute_type(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const int64_t cols = x.size(-1), rows = rows_of(x, cols);
    const bool layer = mean.defined(), has_beta = beta.defined();
    ReadBuffer<T> in(x), g(gamma), b(beta), mean_in(mean), rstd_in(rstd);
    WriteBuffer<T> out(y);
#pragma omp parallel for schedule(static) if (x.numel() >= kMinParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = in.data() + r * cols;
      T* yr = out.data() + r * cols;
      const T rstd_t = rstd_in[r];
      if (layer) {
        const T mu_t = mean_in[r];
        for (int64_t c = 0; c < cols; ++c) {
          const T normalized = (xr[c] - mu_t) * rstd_t;
          yr[c] = normalized * g[c] + (has_beta ? b[c] : T(0));
        }
      } else {
        for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * rstd_t * g[c];
      }
    }
    out.commit();
  });
}

void add_layernorm_forward(const Tensor& x, const Tensor& residual, const Tensor& gamma, const Tensor& beta, double eps,
                           Tensor& sum_out, Tensor& y, Tensor& mean, Tensor& rstd) {
  add(x, residual, sum_out);
  layernorm_forward(sum_out, gamma, beta, eps, y, mean, rstd);
}

void add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& gamma, double eps, Tensor& sum_out,
                         Tensor& y, Tensor& rstd) {
  add(x, residual, sum_out);
  rmsnorm_forward(sum_out, gamma, eps, y, rstd);
}

// The norm's dx goes to a temporary of dx's dtype first, so it is rounded to that dtype
// before the add, as the unfused ops round it; dx may then be any of the inputs.
void layernorm_backward_add(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                            const Tensor& rstd, const Tensor& d_residual_in, Tensor& dx, Tensor& dgamma,
                            Tensor& dbeta) {
  Tensor through_norm = Tensor::empty(dx.shape(), dx.dtype());
  layernorm_backward(dy, x, gamma, mean, rstd, through_norm, dgamma, dbeta);
  add(through_norm, d_residual_in, dx);
}

void rmsnorm_backward_add(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                          const Tensor& d_residual_in, Tensor& dx, Tensor& dgamma) {
  Tensor through_norm = Tensor::empty(dx.shape(), dx.dtype());
  rmsnorm_backward(dy, x, gamma, rstd, through_norm, dgamma);
  add(through_norm, d_residual_in, dx);
}

}  // namespace tessera::cpu
