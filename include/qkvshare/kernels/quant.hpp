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
struct BlockQ5_0 {
  std::uint16_t d;
  std::uint8_t qh[4];        // bit j: 5th bit of code j
  std::uint8_t qs[kQK / 2];  // low 4 bits as in Q4_0: x = (code - 16) * d
};
struct BlockQ5_1 {
  std::uint16_t d;
  std::uint16_t m;  // x = code * d + m
  std::uint8_t qh[4];
  std::uint8_t qs[kQK / 2];
};
struct BlockQ2_K {
  std::uint8_t scales[kQK_K / 16];  // per 16 values: low nibble scale, high nibble min
  std::uint8_t qs[kQK_K / 4];       // 2-bit codes
  std::uint16_t d;                  // x = d * scale * code - dmin * min
  std::uint16_t dmin;
};
struct BlockQ3_K {
  std::uint8_t hmask[kQK_K / 8];  // 3rd bit of each code
  std::uint8_t qs[kQK_K / 4];     // low 2 bits
  std::uint8_t scales[12];        // 16 6-bit scales (minus 32)
  std::uint16_t d;                // x = d * scale * (code - 4)
};
struct BlockQ4_K {
  std::uint16_t d;  // x = d * scale * code - dmin * min, per 32 values
  std::uint16_t dmin;
  std::uint8_t scales[12];  // 8 6-bit scales and 8 6-bit mins
  std::uint8_t qs[kQK_K / 2];
};
struct BlockQ5_K {
  std::uint16_t d;
  std::uint16_t dmin;
  std::uint8_t scales[12];
  std::uint8_t qh[kQK_K / 8];  // bit j of byte l: 5th bit of value l of sub-block j
  std::uint8_t qs[kQK_K / 2];
};
struct BlockIQ4_NL {
  std::uint16_t d;  // x = d * kIq4Values[code]
  std::uint8_t qs[kQK / 2];
};
struct BlockIQ4_XS {
  std::uint16_t d;
  std::uint16_t scales_h;           // high 2 bits of the 8 sub-block scales
  std::uint8_t scales_l[kQK_K / 64];  // low 4 bits; x = d * (scale - 32) * kIq4Values[code]
  std::uint8_t qs[kQK_K / 2];
};
#pragma pack(pop)
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34 &&
              sizeof(BlockQ6_K) == 210 && sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24 &&
              sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144 &&
              sizeof(BlockQ5_K) == 176 && sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136);

// The non-linear 4-bit code book of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl).
inline constexpr std::int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

// n must be a multiple of the type's block size.
void dequantize_row_ref(GgmlType type, const std::uint8_t* src, float* dst, std::int64_t n);
// The part of each dequantized value that is a per-group minimum (Q4_1, Q5_1,
// Q2_K, Q4_K, Q5_K: x = d q + m, this writes m; 0 for the other types). The
// tests bound the kernels' f32 rounding by |d q| + |m|, not |x|.
void dequantize_row_min_ref(GgmlType type, const std::uint8_t* src, float* dst, std::int64_t n);
float dot_row_ref(GgmlType type, const std::uint8_t* row, const float* x, std::int64_t n);

// Scalar quantizers (round to nearest, the ggml reference schemes); used to
// make test data and synthetic models.
void quantize_row_ref(GgmlType type, const float* src, std::uint8_t* dst, std::int64_t n);

}  // namespace qkvshare::kernels
