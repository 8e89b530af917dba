#pragma once
// The encoder's half of dense-and-sparse tiles (KvCodec::outliers); readers
// use tile_outliers / add_outliers (qkvshare/kv/kv_kernels.hpp).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "qkvshare/kv/kv_kernels.hpp"

namespace qkvshare::kv {

// Picks layout.n_outliers elements of a full tile's rows [tokens][head_dim]:
// one at a time, the end of a (scale, min) series (a channel, or a row's
// group) whose removal narrows that series' range the most. Clamps each into
// what remains of its series' range in `rows`, so the dense codes are fitted
// without it, and returns the element indices in ascending order.
std::vector<std::uint16_t> take_outliers(const KvCodec& codec, const TileLayout& layout, float* rows);

// Writes the outliers' indices and fp16 residuals (original value minus the
// value the tile's dense codes, already encoded, decode to).
void store_outliers(const KvCodec& codec, const TileLayout& layout, const std::vector<std::uint16_t>& index,
                    const float* original, std::byte* tile);

}  // namespace qkvshare::kv
