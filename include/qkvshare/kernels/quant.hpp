#pragma once
// Weight block formats (ggml layouts) and their scalar reference kernels. The
// fast paths in kernels/ are tested against these (docs/design.md rule 3).
#include <cstdint>

#include "qkvshare/tensor/tensor.hpp"

namespace qkvshare::kernels {

inline constexpr int kQK = 32;    // elements per Q4_0 / Q4_1 / Q8_0 block
inline constexpr int kQK_K = 256;  // elements per k-quant super-block

#pragma pack(push, 1)
struct BlockQ4_0 {
  std::uint16_t d;          // f16 scale
  std::uint8_t qs[kQK / 2];  // x[j] = (lo nibble of qs[j] - 8) * d, x[j+16] = (hi nibble - 8) * d
};
struct BlockQ4_1 {
  std::uint16_t d;  // f16 scale
  std::uint16_t m;  // f16 minimum: x = q * d + m
  std::uint8_t qs[kQK / 2];
};
struct BlockQ8_0 {
  std::uint16_t d;
  std::int8_t qs[kQK];
};
struct BlockQ6_K {
  std::uint8_t ql[kQK_K / 2];      // low 4 bits of the 6-bit quants
  std::uint8_t qh[kQK_K / 4];      // high 2 bits
  std::int8_t scales[kQK_K / 16];  // 8-bit scale per 16 elements
  std::uint16_t d;                 // f16 super-block scale
};
#pragma pack(pop)
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34 &&
              sizeof(BlockQ6_K) == 210);

// n must be a multiple of the type's block size.
void dequantize_row_ref(GgmlType type, const std::uint8_t* src, float* dst, std::int64_t n);
float dot_row_ref(GgmlType type, const std::uint8_t* row, const float* x, std::int64_t n);

// Scalar quantizers (round to nearest, the ggml reference schemes); used to
// make test data and synthetic models.
void quantize_row_ref(GgmlType type, const float* src, std::uint8_t* dst, std::int64_t n);

}  // namespace qkvshare::kernels
