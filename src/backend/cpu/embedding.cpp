// CPU reference embedding: out[t, :] = table[ids[t], :] and its scatter-add backward.
//
// Layout: ids flattened to T positions (row-major), table [V, C] and out [T, C] row-major
// with the channel dimension contiguous. The backward splits the channels into strips,
// one strip per thread, so repeated ids never race and the sums are deterministic.
#include "embedding.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "float_buffer.h"

namespace tessera::cpu {
namespace {

// "[i, j, k]": the multi-index of flat position `flat` in `shape`.
std::string position_string(const Shape& shape, int64_t flat) {
  Shape index(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    index[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  return shape_to_string(index);
}

// The ids as int64, checked against [0, vocab) before any output is written.
std::vector<int64_t> load_checked_ids(const Tensor& ids, int64_t vocab, const char* op) {
  const int64_t n = ids.numel();
  std::vector<int64_t> out(static_cast<size_t>(n));
  if (ids.dtype() == DType::I64) std::memcpy(out.data(), ids.raw_data(), static_cast<size_t>(n) * sizeof(int64_t));
  else {
    const int32_t* p = ids.data<int32_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = p[i];
  }
  for (int64_t i = 0; i < n; ++i) {
    TESSERA_CHECK(out[i] >= 0 && out[i] < vocab, op, ": id ", out[i], " at position ", position_string(ids.shape(), i),
                  " (flat ", i, ") of ids ", ids.describe(), " is outside the vocabulary [0, ", vocab, ")");
  }
  return out;
}

}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  const int64_t vocab = table.size(0), channels = table.size(1);
  const std::vector<int64_t> id = load_checked_ids(ids, vocab, "embedding_forward");
  const int64_t tokens = static_cast<int64_t>(id.size());
  const char* src = static_cast<const char*>(table.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  if (table.dtype() == out.dtype()) {
    const size_t row_bytes = static_cast<size_t>(channels) * dtype_size(table.dtype());
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) std::memcpy(dst + t * row_bytes, src + id[t] * row_bytes, row_bytes);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < channels; ++c)
      store_element(dst, out.dtype(), t * channels + c, load_element(src, table.dtype(), id[t] * channels + c));
}

void embedding_backward(const Tensor& ids, const Tensor& d_out, Tensor& d_table) {
  const int64_t vocab = d_table.size(0), channels = d_table.size(1);
  const std::vector<int64_t> id = load_checked_ids(ids, vocab, "embedding_backward");
  const int64_t tokens = static_cast<int64_t>(id.size());
  dispatch_compute_type(d_table.dtype(), [&](auto zero) {
    using T = decltype(zero);
    ReadBuffer<T> grad(d_out);
    WriteBuffer<T> table_grad(d_table, /*load_existing=*/true);
    T* dt = table_grad.data();
    // 16 channels per strip: wide enough for a vector of adds, narrow enough that a
    // 768-channel model still spreads over dozens of threads.
    constexpr int64_t kStrip = 16;
#pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < channels; c0 += kStrip) {
      const int64_t c1 = std::min(channels, c0 + kStrip);
      for (int64_t t = 0; t < tokens; ++t) {
        T* row = dt + id[t] * channels;
        const T* g = grad.data() + t * channels;
        for (int64_t c = c0; c < c1; ++c) row[c] += g[c];
      }
    }
    table_grad.commit();
  });
}

}  // namespace tessera::cpu
