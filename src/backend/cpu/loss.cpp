// CPU reference cross-entropy: per-row log-sum-exp, mean negative log-likelihood over the
// rows whose target is not ignore_index, and its gradient (softmax - one-hot) / n_valid.
//
// Layout: logits and d_logits are [N, V] row-major with the vocabulary contiguous. Rows
// are independent, so OpenMP splits over rows; each thread upcasts one row at a time
// rather than the whole [N, V] matrix, which for a real vocabulary would be gigabytes.
#include "loss.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "float_buffer.h"

namespace tessera::cpu {
namespace {

struct CheckedTargets {
  std::vector<int64_t> target;
  std::vector<char> valid;
  int64_t n_valid = 0;
};

CheckedTargets load_targets(const Tensor& targets, int64_t vocab, int64_t ignore_index, const char* op) {
  const int64_t n = targets.numel();
  CheckedTargets out;
  out.target.resize(static_cast<size_t>(n));
  out.valid.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = targets.dtype() == DType::I64 ? targets.data<int64_t>()[i] : targets.data<int32_t>()[i];
    out.target[i] = t;
    out.valid[i] = t != ignore_index;
    TESSERA_CHECK(t == ignore_index || (t >= 0 && t < vocab), op, ": target ", t, " at row ", i,
                  " is outside the vocabulary [0, ", vocab, ") and is not ignore_index ", ignore_index);
    out.n_valid += out.valid[i];
  }
  return out;
}

// Row `row` of a [rows, width] tensor in the compute type T: a pointer into the tensor
// when it already holds T, otherwise an upcast copy in `scratch`.
template <typename T>
const T* read_row(const Tensor& t, int64_t row, int64_t width, std::vector<T>& scratch) {
  if (t.dtype() == dtype_of<T>()) return t.data<T>() + row * width;
  scratch.resize(static_cast<size_t>(width));
  for (int64_t v = 0; v < width; ++v) scratch[v] = static_cast<T>(load_element(t.raw_data(), t.dtype(), row * width + v));
  return scratch.data();
}

}  // namespace

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse,
                           const CrossEntropyOptions& options) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const CheckedTargets tg = load_targets(targets, vocab, options.ignore_index, "cross_entropy_forward");
  std::vector<double> row_loss(static_cast<size_t>(rows), 0.0);
  dispatch_compute_type(logits.dtype(), [&](auto zero) {
    using T = decltype(zero);
#pragma omp parallel
    {
      std::vector<T> scratch;
#pragma omp for schedule(static)
      for (int64_t n = 0; n < rows; ++n) {
        const T* x = read_row(logits, n, vocab, scratch);
        T row_max = -std::numeric_limits<T>::infinity();
        for (int64_t v = 0; v < vocab; ++v) row_max = std::max(row_max, x[v]);
        // Subtracting the max keeps every exp in (0, 1]: no overflow for large logits.
        double sum = 0;
        for (int64_t v = 0; v < vocab; ++v) sum += static_cast<double>(std::exp(x[v] - row_max));
        const double row_lse = static_cast<double>(row_max) + std::log(sum);
        store_element(lse.raw_data(), lse.dtype(), n, row_lse);
        if (tg.valid[n]) row_loss[n] = row_lse - static_cast<double>(x[tg.target[n]]);
      }
    }
  });
  // Summed in row order so the loss is the same for any thread count.
  double total = 0;
  for (int64_t n = 0; n < rows; ++n) total += row_loss[n];
  store_element(loss.raw_data(), loss.dtype(), 0, tg.n_valid > 0 ? total / static_cast<double>(tg.n_valid) : 0.0);
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, float d_loss,
                            Tensor& d_logits, const CrossEntropyOptions& options) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const CheckedTargets tg = load_targets(targets, vocab, options.ignore_index, "cross_entropy_backward");
  const double scale = tg.n_valid > 0 ? static_cast<double>(d_loss) / static_cast<double>(tg.n_valid) : 0.0;
  dispatch_compute_type(logits.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const bool direct_out = d_logits.dtype() == dtype_of<T>();
    const T row_scale = static_cast<T>(scale);
#pragma omp parallel
    {
      std::vector<T> in_scratch, out_scratch(direct_out ? 0 : static_cast<size_t>(vocab));
#pragma omp for schedule(static)
      for (int64_t n = 0; n < rows; ++n) {
        T* g = direct_out ? d_logits.data<T>() + n * vocab : out_scratch.data();
        if (!tg.valid[n]) {
          for (int64_t v = 0; v < vocab; ++v) g[v] = T(0);
        } else {
          const T* x = read_row(logits, n, vocab, in_scratch);
          const T row_lse = static_cast<T>(load_element(lse.raw_data(), lse.dtype(), n));
          for (int64_t v = 0; v < vocab; ++v) g[v] = row_scale * std::exp(x[v] - row_lse);
          g[tg.target[n]] -= row_scale;
        }
        if (!direct_out)
          for (int64_t v = 0; v < vocab; ++v) store_element(d_logits.raw_data(), d_logits.dtype(), n * vocab + v, g[v]);
      }
    }
  });
}

}  // namespace tessera::cpu
