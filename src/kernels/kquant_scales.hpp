#pragma once
// Internal: unpacking of the packed sub-block scales of the k-quant formats,
// shared by the scalar references, the portable kernels and the SIMD units.
// Internal linkage on purpose (see kernel_table.hpp): each ISA unit compiles
// its own copy with its own flags. Plain integer code, no std templates.
#include <cstdint>

namespace qkvshare::kernels::detail {
namespace {

// Q4_K / Q5_K: scale and min of sub-block j (of 8, 32 values each), 6 bits
// each, packed in 12 bytes (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const std::uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K / Q5_K: all 8 scales (out[0..7]) and 8 mins (out[8..15]) of a
// super-block at once, the values scale_min_k4 gives one by one (ggml's
// arrangement of the 12 bytes with 32-bit masks): what a kernel that takes a
// whole super-block per step unpacks once.
inline void scales_mins_k4(const std::uint8_t* q, std::uint8_t out[16]) {
  constexpr std::uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  std::uint32_t u[4];
  __builtin_memcpy(u, q, 12);
  u[3] = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);
  const std::uint32_t mins_lo = u[1] & kLow6;
  u[1] = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);
  u[2] = mins_lo;
  u[0] &= kLow6;
  __builtin_memcpy(out, u, 16);
}

// Q3_K: signed scale of group i (of 16, 16 values each): low 4 bits in bytes
// 0-7 (low nibbles for i < 8, high ones after), high 2 bits in bytes 8-11.
inline int scale_q3_k(int i, const std::uint8_t* s) {
  const int lo = i < 8 ? (s[i] & 0x0f) : (s[i - 8] >> 4);
  const int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}

// IQ4_XS: signed scale of sub-block j (of 8, 32 values each).
inline int scale_iq4_xs(int j, std::uint16_t scales_h, const std::uint8_t* scales_l) {
  const int lo = (scales_l[j / 2] >> (4 * (j % 2))) & 0x0f;
  const int hi = (scales_h >> (2 * j)) & 3;
  return (lo | (hi << 4)) - 32;
}

}  // namespace
}  // namespace qkvshare::kernels::detail
