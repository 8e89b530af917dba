#pragma once
// Tile kernels of the KV pool: coding rows into a tile, decoding a tile into a
// block-sized f32 scratch (never more: DESIGN.md rule 4), the dot/axpy steps
// of attention, and the Hadamard rotation. Each has a scalar reference; the
// SIMD versions (AVX2 + FMA + F16C, chosen at run time) must agree with it:
// decoding bit for bit, scores and sums up to float summation order.
#include <cstddef>
#include <cstdint>

#include "qkvshare/kv/kv_format.hpp"

namespace qkvshare::kv {

// Quantization of a whole tile of `layout.tokens` rows (a full block). rows is
// [tokens][head_dim]. Scale/min are rounded to f16 first and the codes are
// computed against the rounded values, so decode(encode(x)) is as close as
// the stored parameters allow.
void encode_tile(const KvCodec& codec, const TileLayout& layout, const float* rows, std::byte* tile);

// Writes row `j` of a float (f32/f16) tile.
void encode_row(const KvCodec& codec, const TileLayout& layout, const float* row, int j, std::byte* tile);

// Rows [0, n_rows) of a tile as f32 [n_rows][head_dim].
void decode_tile_scalar(const KvCodec& codec, const TileLayout& layout, const std::byte* tile, int n_rows, float* out);
void decode_tile_simd(const KvCodec& codec, const TileLayout& layout, const std::byte* tile, int n_rows, float* out);

// s[j] = scale * (q . rows[j]) for j < n_rows; rows are head_dim floats
// (head_dim % 8 == 0 for the SIMD version). Returns the largest s[j].
float scores_scalar(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s);
float scores_simd(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s);
// o[head_dim] += sum over j < n_rows of p[j] * rows[j].
void weighted_sum_scalar(float* o, const float* p, const float* rows, int n_rows, int head_dim);
void weighted_sum_simd(float* o, const float* p, const float* rows, int n_rows, int head_dim);
// x[i] = exp(x[i] - max), returns the sum (SIMD: polynomial exp, ~2 ulp).
float exp_sum_scalar(float* x, int n, float max);
float exp_sum_simd(float* x, int n, float max);

// True when this CPU runs the SIMD versions (AVX2, FMA, F16C).
bool simd_supported() noexcept;

// Orthonormal rotation of one head: x <- H * diag(signs) * x / sqrt(n), n a
// power of two; unrotate is its inverse (and transpose). q.k is unchanged when
// both sides are rotated.
void rotate(float* x, int n) noexcept;
void unrotate(float* x, int n) noexcept;

}  // namespace qkvshare::kv
