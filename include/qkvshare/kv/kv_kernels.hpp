#pragma once
// Tile coding of the KV pool: quantizing rows into a tile, describing a tile
// to the kernels layer's decode/score/sum kernels (which read it in place:
// docs/design.md rule 4), and the Hadamard rotation.
#include <cstddef>
#include <cstdint>

#include "qkvshare/kernels/kv_tiles.hpp"
#include "qkvshare/kv/kv_format.hpp"

namespace qkvshare {
class KvCodebook;
}

namespace qkvshare::kv {

// The centroids of pq tiles of one layer, KV head and K/V (KvCodebook::table
// and table_t); empty for the other codecs.
struct CodebookSlice {
  const float* table = nullptr;
  const float* table_t = nullptr;
};
// The slice of `book` for a tile of codec `c` (empty unless c is pq;
// Error(internal) when book is null), and the same from a format's codebook.
CodebookSlice codebook_slice(const KvCodebook* book, const KvCodec& c, int kind, int layer, int head);
CodebookSlice codebook_slice(const KvFormat& f, const KvCodec& c, int kind, int layer, int head);

// Quantization of a whole tile of `layout.tokens` rows (a full block). rows is
// [tokens][head_dim]. Scale/min are rounded to f16 first and the codes are
// computed against the rounded values, so decode(encode(x)) is as close as
// the stored parameters allow.
// A pq codec stores each sub-vector's nearest centroid of `book`.
void encode_tile(const KvCodec& codec, const TileLayout& layout, const float* rows, std::byte* tile,
                 CodebookSlice book = {});

// Writes row `j` of a float (f32/f16) tile.
void encode_row(const KvCodec& codec, const TileLayout& layout, const float* row, int j, std::byte* tile);

// The sparse outliers of a tile (KvCodec::outliers, TileLayout::n_outliers):
// element index[e] (row * head_dim + channel, ascending) is the dense codes'
// value plus fp16 residual[e]. Empty (n == 0) for codecs without them.
struct TileOutliers {
  const std::uint16_t* index = nullptr;
  const std::uint16_t* residual = nullptr;
  int n = 0;
};
TileOutliers tile_outliers(const TileLayout& layout, const std::byte* tile) noexcept;
// Adds the outliers of rows [0, n_rows) to those rows decoded from the codes
// alone (rows [n_rows][head_dim], as the decode kernels write them).
void add_outliers(const TileLayout& layout, const std::byte* tile, int n_rows, float* rows) noexcept;

// How the kernels see a tile of this codec (kernels/kv_tiles.hpp). The
// decode, score, weighted-sum and exp kernels live in the kernels layer and
// are reached through its one dispatch (kernels::tile_kernels).
kernels::TileCodes tile_codes(const KvCodec& codec, const TileLayout& layout, CodebookSlice book = {});

// Rows [0, n_rows) of a tile as f32 [n_rows][head_dim]: the scalar reference
// (kernels::decode_tile_ref), for code that needs the exact values.
void decode_tile_scalar(const KvCodec& codec, const TileLayout& layout, const std::byte* tile, int n_rows, float* out,
                        CodebookSlice book = {});

// Whether attention reads integer tiles on their codes (kernels/kv_tiles.hpp,
// "Attention on codes"; the default) or decodes each tile to f32 first (the
// path before it, kept to measure one against the other). Process-wide.
void set_codes_attention(bool on) noexcept;
bool codes_attention() noexcept;

// Whether decode steps read pq tiles through per-query lookup tables
// (kernels/kv_pq.hpp; with codes_attention) or decode them like the other
// tiles: the default, measured faster on this project's CPUs at head_dim 64
// (the lookups are scalar; docs/kv-quality.md "Product quantization").
// Process-wide.
void set_pq_lookup_tables(bool on) noexcept;
bool pq_lookup_tables() noexcept;

// Orthonormal rotation of one head: x <- H * diag(signs) * x / sqrt(n), n a
// power of two; unrotate is its inverse (and transpose). q.k is unchanged when
// both sides are rotated.
void rotate(float* x, int n) noexcept;
void unrotate(float* x, int n) noexcept;

}  // namespace qkvshare::kv
