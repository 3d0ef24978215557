// CUDA token embedding (backend/cuda/embedding.cu). Declarations only; usable from C++.
#pragma once

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// Forward: any one floating dtype for table and out (a row copy), or F32/BF16 in any
// combination (converted with round to nearest even).
bool embedding_forward_supported(const Tensor& table, const Tensor& out);
void embedding_forward(void* stream, const Tensor& ids, const Tensor& table, Tensor& out);

// Backward: d_out and d_table each F32 or BF16; d_table accumulates. Deterministic
// (sort by id, then one block per distinct id sums its rows in a fixed order).
bool embedding_backward_supported(const Tensor& d_out, const Tensor& d_table);
void embedding_backward(void* stream, const Tensor& ids, const Tensor& d_out, Tensor& d_table);

}  // namespace tessera::cuda
