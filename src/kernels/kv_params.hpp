#pragma once
// Internal: a tile's (scale, min) pairs as f32, in either stored form
// (qkvshare/kernels/kv_tiles.hpp: f16 pairs, or bytes on the tile's grid).
// Included by the ISA units and the scalar reference alike, so every level
// decodes the pairs to the same bits. Internal linkage, std-free
// (kernel_table.hpp says why): builtins only.
#include <cstddef>
#include <cstdint>

#include "qkvshare/kernels/kv_tiles.hpp"

namespace qkvshare::kernels::detail {
namespace {

struct ByteParamGrid {
  float min_lo, min_step;
  std::uint32_t scale_bias;  // (exp + 127) << 23: added to (u << 18)
};

inline ByteParamGrid byte_param_grid(const std::byte* params) {
  ByteParamGrid g;
  __builtin_memcpy(&g.min_lo, params, 4);
  __builtin_memcpy(&g.min_step, params + 4, 4);
  std::int16_t e;
  __builtin_memcpy(&e, params + 8, 2);
  g.scale_bias = static_cast<std::uint32_t>(e + 127) << 23;
  return g;
}

// Byte 0 is a zero scale (a constant series, as an f16 pair stores it).
inline float byte_scale(std::uint8_t u, std::uint32_t bias) {
  const std::uint32_t bits = u == 0 ? 0u : (static_cast<std::uint32_t>(u) << 18) + bias;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

inline float byte_min(std::uint8_t u, const ByteParamGrid& g) {
  return __builtin_fmaf(static_cast<float>(u), g.min_step, g.min_lo);
}

// Pairs [first, first + n) of a byte-parameter tile: a plain loop, which
// each ISA unit's compiler vectorizes with its own instructions.
inline void byte_params_f32(const TileCodes& t, const std::byte* tile, int first, int n, float* sf, float* mf) {
  const std::byte* params = tile + t.param_offset;
  const ByteParamGrid g = byte_param_grid(params);
  const auto* su = reinterpret_cast<const std::uint8_t*>(params + kByteParamHeader) + first;
  const auto* mu = su + t.param_stride;
  for (int i = 0; i < n; ++i) sf[i] = byte_scale(su[i], g.scale_bias);
  for (int i = 0; i < n; ++i) mf[i] = byte_min(mu[i], g);
}

}  // namespace
}  // namespace qkvshare::kernels::detail
