#pragma once
// Tile kernels of the KV pool: coding rows into a tile, decoding a tile into a
// block-sized f32 scratch (never more: docs/design.md rule 4), the score and
// weighted-sum steps of attention, and the Hadamard rotation. Each has a
// scalar reference; the SIMD versions (AVX2, AVX-512, chosen at run time)
// must agree with it: decoding bit for bit, scores and sums up to float
// summation order.
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
// s[j] = scale * (q . rows[j]) for j < n_rows; rows are head_dim floats.
// Returns the largest s[j].
float scores_scalar(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s);
// o[head_dim] += sum over j < n_rows of p[j] * rows[j].
void weighted_sum_scalar(float* o, const float* p, const float* rows, int n_rows, int head_dim);
// x[i] = exp(x[i] - max), returns the sum (SIMD: polynomial exp, ~2 ulp).
float exp_sum_scalar(float* x, int n, float max);

// The same for AVX2 + FMA + F16C (8 lanes) and AVX-512 (16 lanes; heads
// that are not a multiple of 16 fall back to AVX2). Call only when supported.
void decode_tile_avx2(const KvCodec& codec, const TileLayout& layout, const std::byte* tile, int n_rows, float* out);
float scores_avx2(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s);
void weighted_sum_avx2(float* o, const float* p, const float* rows, int n_rows, int head_dim);
float exp_sum_avx2(float* x, int n, float max);
void decode_tile_avx512(const KvCodec& codec, const TileLayout& layout, const std::byte* tile, int n_rows, float* out);
float scores_avx512(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s);
void weighted_sum_avx512(float* o, const float* p, const float* rows, int n_rows, int head_dim);

enum class KvIsa { scalar, avx2, avx512 };

struct KvKernels {
  void (*decode)(const KvCodec&, const TileLayout&, const std::byte*, int, float*);
  float (*scores)(const float*, const float*, int, int, float, float*);
  void (*weighted_sum)(float*, const float*, const float*, int, int);
  float (*exp_sum)(float*, int, float);
};

// Whether this CPU (and OS) runs an ISA's kernels.
bool kv_isa_supported(KvIsa isa) noexcept;
KvIsa best_kv_isa() noexcept;
// Throws Error(unsupported) for an ISA this CPU lacks.
const KvKernels& kv_kernels(KvIsa isa);

// Orthonormal rotation of one head: x <- H * diag(signs) * x / sqrt(n), n a
// power of two; unrotate is its inverse (and transpose). q.k is unchanged when
// both sides are rotated.
void rotate(float* x, int n) noexcept;
void unrotate(float* x, int n) noexcept;

}  // namespace qkvshare::kv
