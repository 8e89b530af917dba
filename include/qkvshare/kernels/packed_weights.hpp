#pragma once
// Weights repacked once for the matmul kernels. A Q4_0 matrix is read 16 rows
// at a time; as stored, block b of those rows lies in 16 runs of 18 bytes one
// row apart, and each block's scales are gathered and its codes transposed
// before use. Packed, a tile's block b is one run: the 16 rows' f16 scales
// (32 bytes), then four 64-byte vectors whose 32-bit lane r holds bytes
// 4c..4c+3 of row r's codes (vector c). Same size as the rows; the results of
// the packed kernel are bit for bit those of the rows it was packed from.
// Measured on the Llama-3.2-1B shape (docs/benchmarks.md, "Packed Q4_0
// weights"): decode reads the packed layout about 1.5x as fast.
#include <cstddef>
#include <cstdint>

#include "qkvshare/tensor/tensor.hpp"

namespace qkvshare::kernels {

inline constexpr int kPackedTileRows = 16;

// Whether `w` can be packed and the active kernel level reads packed tiles:
// Q4_0, rows a multiple of kPackedTileRows, and packing not turned off.
bool packs(const TensorView& w) noexcept;

// Writes tiles [tile_begin, tile_end) of `w` (rows 16 * tile ..) into `out`,
// which holds w.nbytes bytes for the whole matrix.
void pack_tiles(const TensorView& w, std::int64_t tile_begin, std::int64_t tile_end, std::uint8_t* out);

// Off: models loaded afterwards keep their rows as stored (to measure both
// ways, and for tests). On by default.
void set_weight_packing(bool on) noexcept;
bool weight_packing() noexcept;

}  // namespace qkvshare::kernels
