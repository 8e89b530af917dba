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
#include "qkvshare/tensor/tensor.hpp"  // RopeStyle

namespace qkvshare::kernels {

// How a tile stores `head_dim`-wide rows: f32 or f16 values, or `bits`-bit
// codes (2, 3, 4, 8) packed 8 elements per `bits` bytes (element i of a unit
// at bit i * bits), followed at param_offset by f16 scales and, param_stride
// halves later, f16 mins: x = code * scale + min. The (scale, min) pairs are
// per channel, or per row in groups of `group` channels (a multiple of 8).
// head_dim is a multiple of 8, at most kTileMaxHeadDim.
// With byte_params the pairs are one byte each instead, on a grid the tile
// sets (as k-quants keep 6-bit scales under an f16 one): at param_offset a
// 12-byte header (f32 min_lo, f32 min_step, i16 scale exponent, 2 bytes of
// zero), then param_stride scale bytes, then param_stride min bytes:
//   scale = 2^(exp + (u >> 5)) * (1 + (u & 31) / 32)  (f32 bits (u << 18) + ((exp + 127) << 23)),
//           and 0 for u = 0,
//   min   = fma(u, min_step, min_lo).
// Both decode exactly the same on every level; the encoder codes against the
// decoded values, so the bytes lose nothing beyond the coarser grid.
inline constexpr int kTileMaxHeadDim = 1024;  // the SIMD bodies' scratch
inline constexpr std::size_t kByteParamHeader = 12;

struct TileCodes {
  int bits = 32;  // 32: f32 rows, 16: f16 rows, else codes (pq: 8 / pq_sub)
  bool per_channel = false;
  int group = 0;
  int head_dim = 0;
  std::size_t row_bytes = 0;
  std::size_t param_offset = 0;
  std::size_t param_stride = 0;
  bool byte_params = false;  // one-byte (scale, min) pairs after a 12-byte header
  // Product quantization (kv_pq.hpp): row j is head_dim / pq_sub byte indices
  // into the centroids of its sub-spaces, [spaces][256][pq_sub] (and
  // transposed, [spaces][pq_sub][256]); no parameters.
  int pq_sub = 0;
  const float* centroids = nullptr;
  const float* centroids_t = nullptr;
};

// Rows [0, n_rows) of a tile as f32 [n_rows][head_dim].
using TileDecodeFn = void (*)(const TileCodes& codes, const std::byte* tile, int n_rows, float* out);
// s[j] = scale * (q . rows[j]) for j < n_rows; returns the largest s[j].
using TileScoresFn = float (*)(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s);
// o[head_dim] += sum over j < n_rows of p[j] * rows[j].
using TileWeightedSumFn = void (*)(float* o, const float* p, const float* rows, int n_rows, int head_dim);
// x[i] = exp(x[i] - max), returns the sum (SIMD: the one vector exp, ~2 ulp).
using TileExpSumFn = float (*)(float* x, int n, float max);

// Attention on the codes, without a decoded copy (where a tile holds integer
// codes; see codes_keys_ok / codes_values_ok). Codes are centred first
// (code - 2^(bits-1), the offset moved into the minimums), which keeps the
// integer sums and their rounding error small:
// - keys per channel: each query is folded with the tile's channel scales and
//   rounded to 16-bit integers once per tile (query_codes), so that a row's
//   score is one integer dot product over its codes:
//   s_j = a * (qc . centred codes_j) + b, with a, b per query and tile (b
//   carries the minimums: b = scale * sum_c q_c * (min_c + 2^(bits-1) scale_c));
// - values per token in groups: the weights p_j * scale_jg are rounded to
//   16-bit integers per query, group and window of rows, the centred codes
//   summed under them in integers, and the minimums added once: code_sum.
// Rounding maps the largest |x| to code_weight_max(head_dim) (sums of
// 8-bit codes stay within int32), far below the codes' own error.
inline constexpr int code_weight_max(int n_terms) noexcept { return n_terms <= 512 ? 32767 : 16383; }
// Queries against 4-bit and 2-bit keys are rounded to bytes (+-127): one
// dot-product instruction then covers 4x the channels, and the query's
// rounding error stays a small fraction of the keys' own. 8-bit keys (whose
// error is of the order of a byte query's) and 3-bit keys (whose codes do
// not fall on byte boundaries) keep 16 bits.
inline constexpr bool byte_query_codes(int bits) noexcept { return bits == 4 || bits == 2; }
inline constexpr int query_code_max(int bits, int head_dim) noexcept {
  return byte_query_codes(bits) ? 127 : code_weight_max(head_dim);
}
// Value weights are rounded per window of kCodeWindow rows, from a multiple
// of 4: to 7 bits for 4- and 2-bit values (whose codes are then summed as
// bytes, four rows per dot-product instruction, where the level can; the
// weights' rounding error stays far below the codes' own), else to 16 bits.
inline constexpr int kCodeWindow = 32;
inline constexpr bool byte_value_weights(int bits) noexcept { return bits == 4 || bits == 2; }
inline constexpr int value_weight_max(int bits) noexcept {
  return byte_value_weights(bits) ? 127 : code_weight_max(kCodeWindow);
}

// q [nq][head_dim] -> qc [nq][head_dim] (int8 for 4- and 2-bit keys, else int16:
// query_code_max) and ab [nq][2] such that
// ab[2i] * (qc_i . codes_j) + ab[2i + 1] ~ score_scale * (q_i . decoded row_j).
using TileQueryCodesFn = void (*)(const TileCodes& t, const std::byte* tile, const float* q, int nq, float score_scale,
                                  void* qc, float* ab);
// s[i * s_stride + j] for rows j in [lo, hi) and queries i < nq.
using TileCodeScoresFn = void (*)(const TileCodes& t, const std::byte* tile, int lo, int hi, const void* qc,
                                  const float* ab, int nq, float* s, std::size_t s_stride);
// o[i * head_dim + c] += sum over j in [lo, hi) of p[i * p_stride + j] * row_j[c].
using TileCodeSumFn = void (*)(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p,
                               std::size_t p_stride, int nq, float* o);

// Whether a tile's keys / values can go through the code kernels.
inline bool codes_keys_ok(const TileCodes& t) noexcept {
  return t.pq_sub == 0 && t.per_channel && (t.bits == 8 || t.bits == 4 || t.bits == 3 || t.bits == 2) && t.head_dim % 16 == 0;
}
inline bool codes_values_ok(const TileCodes& t) noexcept {
  return t.pq_sub == 0 && !t.per_channel && (t.bits == 8 || t.bits == 4 || t.bits == 3 || t.bits == 2) && t.group % 16 == 0 &&
         t.head_dim % 16 == 0;
}

// RoPE of decoded key rows stored before it (KvFormat keys=pre) or of
// queries (keys=block): row r becomes x * C + partner(x) * S with
// [C: head_dim][S: head_dim] = table + r * table_step (rope_table_row; a step
// of 0 turns every row by the same angles) and partner(x)[c] = x[c ^ 1]
// (interleaved pairs) or x[(c + head_dim / 2) % head_dim] (neox halves); one
// fused multiply-add per element, so every level gives the reference's bits.
using TileRopeFn = void (*)(float* rows, int n_rows, int head_dim, const float* table, std::ptrdiff_t table_step,
                            RopeStyle style);
// The table row of position `pos` for TileRopeFn: C = cos of each channel's
// pair angle, S = -sin for the first of a pair and +sin for the second
// (kernels::rope_angles: the engine's own angles).
void rope_table_row(float pos, const float* inv_freq, int head_dim, RopeStyle style, float* row);

// The range search of an asymmetric b-bit code (qmax = 2^b - 1, 3..127) for
// `lanes` independent series at once: series s holds x[i * stride + s],
// i in [0, n). For each: its full range [l, h], then the 6 x 6 grid of ranges
// clipped by a, b steps of `step` (0.04 of the range for qmax <= 3, else
// 0.02) off either end; the range whose codes have the least squared error
// (code = floor(min(max((x - l) / (h - l) * qmax + 0.5, 0), qmax + 0.25)),
// error summed over i in order) is written to lo[s], hi[s]; a series whose
// range is kFitMinRange or less keeps its full range. Every operation is rounded as the reference
// writes it, lane by lane, so every level gives the reference's bits. The
// series of a tile: its channels (per-channel keys: stride = head_dim) or
// its rows (per-token groups, transposed first).
using TileFitFn = void (*)(const float* x, int n, std::ptrdiff_t stride, int lanes, int qmax, float* lo, float* hi);
inline constexpr float kFitMinRange = 1e-30f;

// n floats to f16 (round to nearest even, overflow to infinity, subnormals
// kept), bit for bit fp32_to_fp16 (core/half.hpp) on every level, NaNs
// included: the KV pool's f16 rows and hot copies.
using TileEncodeF16Fn = void (*)(const float* x, std::size_t n, std::uint16_t* out);

// The largest of m and x[0, n) (m when n <= 0), by the rule of std::max(m, x):
// a NaN in x is passed over, a NaN m is kept; exact on every level, except
// which zero comes back when +0 and -0 tie. A softmax's maximum, once per
// query over all the scores it sees.
using TileMaxFn = float (*)(const float* x, int n, float m);

struct TileKernels {
  TileDecodeFn decode = nullptr;
  TileScoresFn scores = nullptr;
  TileWeightedSumFn weighted_sum = nullptr;
  TileExpSumFn exp_sum = nullptr;
  TileQueryCodesFn query_codes = nullptr;
  TileCodeScoresFn code_scores = nullptr;
  TileCodeSumFn code_sum = nullptr;
  TileRopeFn rope = nullptr;
  TileFitFn fit = nullptr;
  TileEncodeF16Fn encode_f16 = nullptr;
  TileMaxFn max = nullptr;
};

// The kernels of one level (throws Error(invalid_argument) where it is not
// available), and of the active level.
const TileKernels& tile_kernels(Isa isa);
const TileKernels& tile_kernels() noexcept;

// The scalar references.
void decode_tile_ref(const TileCodes& codes, const std::byte* tile, int n_rows, float* out);
// Element (row j, channel c) of an integer-code tile, exactly as decode_tile_ref gives it.
float decode_element_ref(const TileCodes& codes, const std::byte* tile, int j, int c);
// (scale, min) pair p of an integer-code tile as f32, exactly as every level decodes it.
void tile_param_ref(const TileCodes& codes, const std::byte* tile, int p, float& scale, float& min);
// A byte parameter's value on a tile's grid (the formulas above), for encoders.
float byte_param_scale(std::uint8_t u, int scale_exp) noexcept;
float byte_param_min(std::uint8_t u, float min_lo, float min_step) noexcept;
float scores_ref(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s);
void weighted_sum_ref(float* o, const float* p, const float* rows, int n_rows, int head_dim);
float exp_sum_ref(float* x, int n, float max);
void query_codes_ref(const TileCodes& t, const std::byte* tile, const float* q, int nq, float score_scale,
                     void* qc, float* ab);
void code_scores_ref(const TileCodes& t, const std::byte* tile, int lo, int hi, const void* qc, const float* ab,
                     int nq, float* s, std::size_t s_stride);
void code_sum_ref(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p, std::size_t p_stride,
                  int nq, float* o);
void rope_rows_ref(float* rows, int n_rows, int head_dim, const float* table, std::ptrdiff_t table_step, RopeStyle style);
void fit_ranges_ref(const float* x, int n, std::ptrdiff_t stride, int lanes, int qmax, float* lo, float* hi);
void encode_f16_ref(const float* x, std::size_t n, std::uint16_t* out);
float max_ref(const float* x, int n, float m);

}  // namespace qkvshare::kernels
