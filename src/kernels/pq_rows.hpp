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

// out[j][s * Sub + e] = centroid code[j][s] of space s, channel e. The
// copies have a size known at compile time, so they are a load and a store.
template <int Sub>
void decode_pq_rows_of(const TileCodes& t, const std::byte* tile, int n_rows, float* out) {
  const int spaces = t.head_dim / Sub;
  for (int j = 0; j < n_rows; ++j) {
    const auto* codes = reinterpret_cast<const std::uint8_t*>(tile + static_cast<std::size_t>(j) * t.row_bytes);
    float* o = out + static_cast<std::size_t>(j) * static_cast<std::size_t>(t.head_dim);
    for (int s = 0; s < spaces; ++s)
      std::memcpy(o + s * Sub, t.centroids + (static_cast<std::size_t>(s) * 256 + codes[s]) * Sub, sizeof(float) * Sub);
  }
}

[[maybe_unused]] void decode_pq_rows(const TileCodes& t, const std::byte* tile, int n_rows, float* out) {
  switch (t.pq_sub) {
    case 2: return decode_pq_rows_of<2>(t, tile, n_rows, out);
    case 4: return decode_pq_rows_of<4>(t, tile, n_rows, out);
    default: return decode_pq_rows_of<8>(t, tile, n_rows, out);  // the kv layer describes 2, 4 or 8
  }
}

}  // namespace
}  // namespace qkvshare::kernels
