#pragma once
// Weights repacked once for the matmul kernels. The AVX-512 kernels read a
// Q4_0, Q4_1 or Q8_0 matrix 16 rows at a time; as stored, block b of those
// rows lies in 16 runs one row apart, and each block's scales are gathered and
// its codes transposed before use. Packed, a tile's block b is one run: the
// 16 rows' f16 scales (32 bytes; Q4_1 then its 16 minimums), then 64-byte
// code vectors whose 32-bit lane r holds bytes 4c..4c+3 of row r's codes
// (vector c; 4 of them for 4-bit codes, 8 for Q8_0, whose bytes are stored
// XOR 0x80 as the kernel reads them). Same size as the rows; the packed
// kernels give bit for bit the results of the rows they were packed from.
// Measured (docs/benchmarks.md, "Packed weights"): decode 1.5x as fast on the
// Llama-3.2-1B shape (Q4_0), 1.2x on SmolLM2-135M (Q4_1).
#include <cstddef>
#include <cstdint>

#include "qkvshare/tensor/tensor.hpp"

namespace qkvshare::kernels {

inline constexpr int kPackedTileRows = 16;

// Whether `w` can be packed and the active kernel level reads packed tiles:
// Q4_0, Q4_1 or Q8_0, rows a multiple of kPackedTileRows, and packing not
// turned off.
bool packs(const TensorView& w) noexcept;

// Writes tiles [tile_begin, tile_end) of `w` (rows 16 * tile ..) into `out`,
// which holds w.nbytes bytes for the whole matrix.
void pack_tiles(const TensorView& w, std::int64_t tile_begin, std::int64_t tile_end, std::uint8_t* out);

// Row r of `w` as the file stores it, from w.packed (row_bytes bytes).
void unpack_row(const TensorView& w, std::int64_t r, std::uint8_t* out);

// Off: models loaded afterwards keep their rows as stored (to measure both
// ways, and for tests). On by default.
void set_weight_packing(bool on) noexcept;
bool weight_packing() noexcept;

}  // namespace qkvshare::kernels
