#pragma once
// Tile kernels of quantized attention: decoding a KV tile into a block-sized
// f32 scratch (never more: docs/design.md rule 4), the score and
// weighted-sum steps, and exp_sum. The kv layer owns the formats and the
// encoders; it describes a tile to these kernels with TileCodes. Each kernel
// has a scalar reference (*_ref, also the portable level); the SIMD levels are
// one body over a vector-width trait (src/kernels/kv_tiles.hpp), reached
// through the same run-time dispatch as the matmul kernels (isa.hpp), and must
// agree with the reference: decoding bit for bit, scores and sums up to float
// summation order.
#include <cstddef>
#include <cstdint>

#include "qkvshare/kernels/isa.hpp"

namespace qkvshare::kernels {

// How a tile stores `head_dim`-wide rows: f32 or f16 values, or `bits`-bit
// codes (2, 3, 4, 8) packed 8 elements per `bits` bytes (element i of a unit
// at bit i * bits), followed at param_offset by f16 scales and, param_stride
// halves later, f16 mins: x = code * scale + min. The (scale, min) pairs are
// per channel, or per row in groups of `group` channels (a multiple of 8).
// head_dim is a multiple of 8, at most kTileMaxHeadDim.
inline constexpr int kTileMaxHeadDim = 1024;  // the SIMD bodies' scratch

struct TileCodes {
  int bits = 32;  // 32: f32 rows, 16: f16 rows, else codes
  bool per_channel = false;
  int group = 0;
  int head_dim = 0;
  std::size_t row_bytes = 0;
  std::size_t param_offset = 0;
  std::size_t param_stride = 0;
};

// Rows [0, n_rows) of a tile as f32 [n_rows][head_dim].
using TileDecodeFn = void (*)(const TileCodes& codes, const std::byte* tile, int n_rows, float* out);
// s[j] = scale * (q . rows[j]) for j < n_rows; returns the largest s[j].
using TileScoresFn = float (*)(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s);
// o[head_dim] += sum over j < n_rows of p[j] * rows[j].
using TileWeightedSumFn = void (*)(float* o, const float* p, const float* rows, int n_rows, int head_dim);
// x[i] = exp(x[i] - max), returns the sum (SIMD: the one vector exp, ~2 ulp).
using TileExpSumFn = float (*)(float* x, int n, float max);

struct TileKernels {
  TileDecodeFn decode = nullptr;
  TileScoresFn scores = nullptr;
  TileWeightedSumFn weighted_sum = nullptr;
  TileExpSumFn exp_sum = nullptr;
};

// The kernels of one level (throws Error(invalid_argument) where it is not
// available), and of the active level.
const TileKernels& tile_kernels(Isa isa);
const TileKernels& tile_kernels() noexcept;

// The scalar references.
void decode_tile_ref(const TileCodes& codes, const std::byte* tile, int n_rows, float* out);
float scores_ref(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s);
void weighted_sum_ref(float* o, const float* p, const float* rows, int n_rows, int head_dim);
float exp_sum_ref(float* x, int n, float max);

}  // namespace qkvshare::kernels
