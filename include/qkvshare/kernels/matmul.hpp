#pragma once
// Products of a weight matrix (stored format, one row per output) with
// activations: y[t][r] = W.row(r) . x[t] for t < n_tokens.
#include <cstdint>

#include "qkvshare/core/thread_pool.hpp"
#include "qkvshare/model/tensor.hpp"

namespace qkvshare::kernels {

void matmul(ThreadPool& pool, const TensorView& w, const float* x, std::int64_t n_tokens, float* y);
// Scalar reference, single-threaded.
void matmul_ref(const TensorView& w, const float* x, std::int64_t n_tokens, float* y);
// Copies row `r` of w into dst as floats (embedding lookup).
void dequantize_row(const TensorView& w, std::int64_t r, float* dst);

}  // namespace qkvshare::kernels
