#pragma once
// Internal: the scalar references of the types added after the first four
// (Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, IQ4_NL, IQ4_XS), split out of
// quant_ref.cpp to keep files readable; quant_ref.cpp dispatches to them.
#include <cstdint>

#include "qkvshare/tensor/tensor.hpp"

namespace qkvshare::kernels::detail {

// Each returns false when it does not handle `type`. n is a multiple of the block size.
// y = the dequantized values, in ggml's order of float operations (bit for bit
// what the PyPI gguf package's NumPy dequantization gives); with `min` set, the
// per-group minimum part of each value instead (0 for types without one).
bool dequantize_more_ref(GgmlType type, const std::uint8_t* src, float* y, std::int64_t n, bool min);
// Simple round-to-nearest quantizers (not ggml's searches): valid blocks for
// tests and synthetic models.
bool quantize_more_ref(GgmlType type, const float* x, std::uint8_t* dst, std::int64_t n);

}  // namespace qkvshare::kernels::detail
