#pragma once
// Products of a weight matrix (stored format, one row per output) with
// activations: y[t][r] = W.row(r) . x[t] for t < n_tokens.
//
// F32, F16 and BF16 weights multiply f32 activations. The block-quantized
// types multiply activations rounded to 8 bits per block of
// activation_block(type) values (as llama.cpp does): each dot is then off by
// at most sum_b amax_b / 254 * sum_{i in b} |w_i| plus f32 rounding
// (tests/kernels derives the bound). The kernels come from the active ISA
// level (kernels/isa.hpp).
#include <cstddef>
#include <cstdint>
#include <span>

#include "qkvshare/core/thread_pool.hpp"
#include "qkvshare/tensor/tensor.hpp"

namespace qkvshare::kernels {

// Values per 8-bit activation scale for weights of `type`: 0 for the float
// types (f32 activations), 256 for Q4_K, Q5_K and Q6_K (ggml's Q8_K), 32 for
// the other block types.
int activation_block(GgmlType type) noexcept;

void matmul(ThreadPool& pool, const TensorView& w, const float* x, std::int64_t n_tokens, float* y);

// One output of matmul_multi: y[t * w.rows() + r].
struct MatmulOut {
  const TensorView* w;
  float* y;
};
inline constexpr std::size_t kMaxMatmulOuts = 8;
// Several weights with the same number of columns applied to the same
// activations (Q, K, V; gate, up): the activations are quantized once and one
// parallel_for covers all their rows, instead of one per weight.
void matmul_multi(ThreadPool& pool, std::span<const MatmulOut> outs, const float* x, std::int64_t n_tokens);

// Scalar reference, single-threaded: dequantized weights times f32
// activations, summed in double.
void matmul_ref(const TensorView& w, const float* x, std::int64_t n_tokens, float* y);
// The same reference dots spread over the pool's threads: f32 activations,
// no 8-bit rounding. Several times slower than matmul; it lets the whole
// forward pass be checked against float references (EngineOptions::exact_matmul).
void matmul_exact(ThreadPool& pool, const TensorView& w, const float* x, std::int64_t n_tokens, float* y);
// Copies row `r` of w into dst as floats (embedding lookup).
void dequantize_row(const TensorView& w, std::int64_t r, float* dst);

}  // namespace qkvshare::kernels
