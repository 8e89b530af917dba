// Tile coding of the KV pool (the encoders) and the description of a tile
// for the kernels layer, which decodes it (kernels/kv_tiles.hpp).
#include "qkvshare/kv/kv_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "pq_nearest.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/half.hpp"
#include "qkvshare/kv/kv_codebook.hpp"

namespace qkvshare::kv {

namespace {

std::uint16_t* scales_of(const TileLayout& l, std::byte* tile) {
  return reinterpret_cast<std::uint16_t*>(tile + l.param_offset);
}
std::uint16_t* mins_of(const TileLayout& l, std::byte* tile) {
  return reinterpret_cast<std::uint16_t*>(tile + l.param_offset + 2 * l.param_stride);
}


// Stores `count` codes of `bits` bits at `row`: 8 elements per `bits` bytes,
// element i of a unit at bit i * bits (little endian). The layout is the same
// for 2, 3, 4 and 8 bits, so one SIMD unpacker (broadcast, shift, mask) reads all.
void pack_row(const std::uint8_t* codes, int count, int bits, std::byte* row) {
  for (int u = 0; u < count / 8; ++u) {
    std::uint64_t word = 0;
    for (int i = 0; i < 8; ++i) word |= static_cast<std::uint64_t>(codes[u * 8 + i]) << (i * bits);
    for (int b = 0; b < bits; ++b) row[u * bits + b] = static_cast<std::byte>((word >> (8 * b)) & 0xffu);
  }
}

// inv = 1 / scale (0 when the scale is 0: every code is 0).
float inverse(float s) { return s > 0.0f && std::isfinite(s) ? 1.0f / s : 0.0f; }

// Round half up by truncation (codes below 0 clamp to 0 anyway): unlike
// nearbyint it compiles to plain SSE2 conversions, and the grid search of
// fit_params calls it 36 times per value.
inline float code_of(float x, float inv, float m, float qmax) {
  return static_cast<float>(static_cast<int>(std::min(std::max((x - m) * inv + 0.5f, 0.0f), qmax + 0.25f)));
}
std::uint8_t quantize_one(float x, float inv, float m, int qmax) {
  return static_cast<std::uint8_t>(code_of(x, inv, m, static_cast<float>(qmax)));
}

// (scale, min) for `lo`..`hi`, both rounded to f16 as stored. The scale is
// computed from the rounded min so the top code still reaches hi.
void params_for(float lo, float hi, int qmax, std::uint16_t& s16, std::uint16_t& m16) {
  m16 = fp32_to_fp16(lo);
  s16 = fp32_to_fp16(std::max(hi - fp16_to_fp32(m16), 0.0f) / static_cast<float>(qmax));
}

// (scale, min) for n values x[i * stride]. At 8 bits the full range is used;
// at 2-4 bits clipping a little of either end usually lowers the squared
// error (the extremes are rare and a coarse grid wastes codes on them), so a
// 6 x 6 grid of ranges clipped at either end is tried and the best kept.
void fit_params(const float* x, int n, int stride, int qmax, std::uint16_t& s16, std::uint16_t& m16) {
  float v[4096];  // the values, contiguous, so the error loop below vectorizes
  QKV_CHECK(n <= 4096);
  float lo = x[0], hi = x[0];
  for (int i = 0; i < n; ++i) {
    v[i] = x[i * stride];
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
  }
  params_for(lo, hi, qmax, s16, m16);
  if (qmax >= 255 || !(hi > lo)) return;
  // The search compares unrounded ranges (cheap); only the winner is rounded to f16.
  const float top = static_cast<float>(qmax);
  const auto sse = [&](float l, float h) {
    const float sc = (h - l) / top, inv = top / (h - l);
    float e = 0.0f;
#pragma omp simd reduction(+ : e)
    for (int i = 0; i < n; ++i) {
      const float d = v[i] - (code_of(v[i], inv, l, top) * sc + l);
      e += d * d;
    }
    return e;
  };
  float best = sse(lo, hi), best_lo = lo, best_hi = hi;
  const float range = hi - lo, step = qmax <= 3 ? 0.04f : 0.02f;
  for (int a = 0; a < 6; ++a)
    for (int b = 0; b < 6; ++b) {
      const float l = lo + range * step * static_cast<float>(a), h = hi - range * step * static_cast<float>(b);
      const float e = sse(l, h);
      if (e < best) best = e, best_lo = l, best_hi = h;
    }
  // Keep the rounded winner only if it still beats the rounded full range.
  const auto sse16 = [&](std::uint16_t s_, std::uint16_t m_) {
    const float sc = fp16_to_fp32(s_), mn = fp16_to_fp32(m_), inv = inverse(sc);
    float e = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float d = v[i] - (code_of(v[i], inv, mn, top) * sc + mn);
      e += d * d;
    }
    return e;
  };
  std::uint16_t s_ = 0, m_ = 0;
  params_for(best_lo, best_hi, qmax, s_, m_);
  if (sse16(s_, m_) < sse16(s16, m16)) s16 = s_, m16 = m_;
}

// Each sub-vector's nearest centroid (pq_nearest.hpp), one byte per index.
void encode_pq_tile(int sub, const TileLayout& l, const float* rows, std::byte* tile, const float* table_t) {
  constexpr int C = KvCodebook::kCentroids;
  const int spaces = l.head_dim / sub;
  std::vector<float> norms(static_cast<std::size_t>(spaces) * C), d(C);
  for (int s = 0; s < spaces; ++s) centroid_norms(table_t + static_cast<std::size_t>(s) * sub * C, sub, &norms[static_cast<std::size_t>(s) * C]);
  for (int j = 0; j < l.tokens; ++j) {
    const float* x = rows + static_cast<std::size_t>(j) * l.head_dim;
    auto* codes = reinterpret_cast<std::uint8_t*>(tile + static_cast<std::size_t>(j) * l.row_bytes);
    for (int s = 0; s < spaces; ++s)
      codes[s] = static_cast<std::uint8_t>(nearest_centroid(x + s * sub, table_t + static_cast<std::size_t>(s) * sub * C,
                                                            &norms[static_cast<std::size_t>(s) * C], sub, d.data()));
  }
}

}  // namespace

void encode_row(const KvCodec& codec, const TileLayout& l, const float* row, int j, std::byte* tile) {
  QKV_CHECK(!codec.quantized() && j >= 0 && j < l.tokens);
  std::byte* dst = tile + static_cast<std::size_t>(j) * l.row_bytes;
  if (codec.type == KvType::f32) {
    std::memcpy(dst, row, l.row_bytes);
  } else {
    auto* h = reinterpret_cast<std::uint16_t*>(dst);
    for (int c = 0; c < l.head_dim; ++c) h[c] = fp32_to_fp16(row[c]);
  }
}

CodebookSlice codebook_slice(const KvCodebook* book, const KvCodec& c, int kind, int layer, int head) {
  if (!c.pq()) return {};
  QKV_CHECK(book != nullptr);
  return {book->table(kind, layer, head), book->table_t(kind, layer, head)};
}

CodebookSlice codebook_slice(const KvFormat& f, const KvCodec& c, int kind, int layer, int head) {
  return codebook_slice(f.book.get(), c, kind, layer, head);
}

void encode_tile(const KvCodec& codec, const TileLayout& l, const float* rows, std::byte* tile, CodebookSlice book) {
  const int T = l.tokens, D = l.head_dim;
  if (!codec.quantized()) {
    for (int j = 0; j < T; ++j) encode_row(codec, l, rows + static_cast<std::size_t>(j) * D, j, tile);
    return;
  }
  if (codec.pq()) {
    QKV_CHECK(book.table_t != nullptr);
    encode_pq_tile(codec.group, l, rows, tile, book.table_t);
    return;
  }
  const int bits = codec.bits(), qmax = (1 << bits) - 1;
  std::uint16_t* scales = scales_of(l, tile);
  std::uint16_t* mins = mins_of(l, tile);
  std::uint8_t codes[4096];
  QKV_CHECK(D <= 4096);
  if (codec.axis == KvAxis::channel) {
    float inv[4096];
    for (int c = 0; c < D; ++c) {
      fit_params(rows + c, T, D, qmax, scales[c], mins[c]);
      inv[c] = inverse(fp16_to_fp32(scales[c]));
    }
    for (int j = 0; j < T; ++j) {
      for (int c = 0; c < D; ++c)
        codes[c] = quantize_one(rows[j * D + c], inv[c], fp16_to_fp32(mins[c]), qmax);
      pack_row(codes, D, bits, tile + static_cast<std::size_t>(j) * l.row_bytes);
    }
    return;
  }
  const int G = effective_group(codec, D), groups = D / G;
  for (int j = 0; j < T; ++j) {
    const float* x = rows + static_cast<std::size_t>(j) * D;
    for (int g = 0; g < groups; ++g) {
      const float* xg = x + g * G;
      const std::size_t p = static_cast<std::size_t>(j * groups + g);
      fit_params(xg, G, 1, qmax, scales[p], mins[p]);
      const float inv = inverse(fp16_to_fp32(scales[p])), m = fp16_to_fp32(mins[p]);
      for (int c = 0; c < G; ++c) codes[g * G + c] = quantize_one(xg[c], inv, m, qmax);
    }
    pack_row(codes, D, bits, tile + static_cast<std::size_t>(j) * l.row_bytes);
  }
}

kernels::TileCodes tile_codes(const KvCodec& codec, const TileLayout& l, CodebookSlice book) {
  kernels::TileCodes t;
  t.bits = codec.bits();
  if (codec.pq()) {
    QKV_CHECK(book.table != nullptr && book.table_t != nullptr);
    t.pq_sub = codec.group;
    t.centroids = book.table;
    t.centroids_t = book.table_t;
  } else {
    QKV_CHECK(t.bits == 32 || t.bits == 16 || t.bits == 8 || t.bits == 4 || t.bits == 3 || t.bits == 2);
  }
  QKV_CHECK(l.head_dim > 0 && l.head_dim % 8 == 0 && l.head_dim <= kernels::kTileMaxHeadDim);
  t.per_channel = codec.scaled() && codec.axis == KvAxis::channel;
  t.group = codec.scaled() && !t.per_channel ? effective_group(codec, l.head_dim) : 0;
  t.head_dim = l.head_dim;
  t.row_bytes = l.row_bytes;
  t.param_offset = l.param_offset;
  t.param_stride = l.param_stride;
  return t;
}

void decode_tile_scalar(const KvCodec& codec, const TileLayout& l, const std::byte* tile, int n_rows, float* out,
                        CodebookSlice book) {
  QKV_CHECK(n_rows >= 0 && n_rows <= l.tokens);
  kernels::decode_tile_ref(tile_codes(codec, l, book), tile, n_rows, out);
}

namespace {

// A fixed pseudo-random sign per channel. Part of the stored format: changing
// it changes what rotated blocks mean.
float sign_of(int i) noexcept {
  const std::uint64_t h = 0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(i + 1);
  return (h >> 63) != 0 ? -1.0f : 1.0f;
}

void fwht(float* x, int n) noexcept {
  for (int len = 1; len < n; len <<= 1)
    for (int i = 0; i < n; i += 2 * len)
      for (int j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
}

}  // namespace

void rotate(float* x, int n) noexcept {
  for (int i = 0; i < n; ++i) x[i] *= sign_of(i);
  fwht(x, n);
  const float s = 1.0f / std::sqrt(static_cast<float>(n));
  for (int i = 0; i < n; ++i) x[i] *= s;
}

void unrotate(float* x, int n) noexcept {
  fwht(x, n);
  const float s = 1.0f / std::sqrt(static_cast<float>(n));
  for (int i = 0; i < n; ++i) x[i] *= s * sign_of(i);
}

}  // namespace qkvshare::kv
