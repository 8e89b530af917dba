#pragma once
// Internal: decoding product-quantized rows (TileCodes::pq_sub > 0), shared
// by the scalar reference and the SIMD levels' tile_decode. Internal linkage,
// as every header compiled into the ISA units (kernel_table.hpp says why).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "qkvshare/kernels/kv_tiles.hpp"

namespace qkvshare::kernels {
namespace {

// out[j][s * sub + e] = centroid code[j][s] of space s, channel e.
[[maybe_unused]] void decode_pq_rows(const TileCodes& t, const std::byte* tile, int n_rows, float* out) {
  const int sub = t.pq_sub, spaces = t.head_dim / sub;
  for (int j = 0; j < n_rows; ++j) {
    const auto* codes = reinterpret_cast<const std::uint8_t*>(tile + static_cast<std::size_t>(j) * t.row_bytes);
    float* o = out + static_cast<std::size_t>(j) * static_cast<std::size_t>(t.head_dim);
    for (int s = 0; s < spaces; ++s)
      std::memcpy(o + s * sub, t.centroids + (static_cast<std::size_t>(s) * 256 + codes[s]) * static_cast<std::size_t>(sub),
                  sizeof(float) * static_cast<std::size_t>(sub));
  }
}

}  // namespace
}  // namespace qkvshare::kernels
