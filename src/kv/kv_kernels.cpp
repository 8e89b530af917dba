// Tile coding of the KV pool (the encoders) and the description of a tile
// for the kernels layer, which decodes it (kernels/kv_tiles.hpp).
#include "qkvshare/kv/kv_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kv_outliers.hpp"
#include "pq_nearest.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/half.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"
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
// nearbyint it compiles to plain SSE2 conversions (the range search,
// kernels::TileFitFn, rounds its codes the same way).
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

// (scale, min) of each of `lanes` series x[i * stride + s], i in [0, n),
// written to s16/m16[s * out_stride]. At 8 bits the full range is used; at
// 2-4 bits clipping a little of either end usually lowers the squared error
// (outliers no longer stretch the scale): the dispatched range search
// (kernels::TileFitFn, every series at once) picks the clipped range, and
// it is kept only if, rounded to f16, it still beats the rounded full range.
void fit_series(const float* x, int n, std::ptrdiff_t stride, int lanes, int qmax, std::uint16_t* s16,
                std::uint16_t* m16, std::ptrdiff_t out_stride) {
  QKV_CHECK(lanes <= 4096);
  float lo[4096], hi[4096], full_lo[4096], full_hi[4096];
  for (int s = 0; s < lanes; ++s) {
    float l = x[s], h = x[s];
    for (int i = 1; i < n; ++i) {
      l = std::min(l, x[i * stride + s]);
      h = std::max(h, x[i * stride + s]);
    }
    full_lo[s] = l + 0.0f;  // as the search sees it (kernels/kv_tiles.hpp)
    full_hi[s] = h + 0.0f;
    params_for(full_lo[s], full_hi[s], qmax, s16[s * out_stride], m16[s * out_stride]);
  }
  if (qmax >= 255) return;
  kernels::tile_kernels().fit(x, n, stride, lanes, qmax, lo, hi);
  const float top = static_cast<float>(qmax);
  // The squared error of series s's codes under a stored (scale, min) pair.
  const auto sse16 = [&](int s, std::uint16_t s_, std::uint16_t m_) {
    const float sc = fp16_to_fp32(s_), mn = fp16_to_fp32(m_), inv = inverse(sc);
    float e = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float v = x[i * stride + s];
      const float d = v - (code_of(v, inv, mn, top) * sc + mn);
      e += d * d;
    }
    return e;
  };
  for (int s = 0; s < lanes; ++s) {
    if (!(full_hi[s] > full_lo[s])) continue;
    std::uint16_t s_ = 0, m_ = 0;
    params_for(lo[s], hi[s], qmax, s_, m_);
    std::uint16_t& S = s16[s * out_stride];
    std::uint16_t& M = m16[s * out_stride];
    if (sse16(s, s_, m_) < sse16(s, S, M)) S = s_, M = m_;
  }
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
    kernels::tile_kernels().encode_f16(row, static_cast<std::size_t>(l.head_dim), reinterpret_cast<std::uint16_t*>(dst));
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

namespace {

// Byte parameters (kernels/kv_tiles.hpp): the tile's grid from its f16
// pairs, then each pair moved onto it: of the grid points around it (the min
// rounded down or up, the scale to the level at or above what keeps the top
// of the series' chosen range, or one level either side), the pair whose
// codes give the series the least squared error (`sse`). `sc`, `mn` get the
// decoded pairs the codes are then made with.
template <typename Sse>
void store_byte_params(const TileLayout& l, int qmax, const std::uint16_t* s16, const std::uint16_t* m16,
                       std::byte* tile, float* sc, float* mn, Sse sse) {
  const std::size_t n = l.n_params;
  const auto finite_or_0 = [](float x) { return std::isfinite(x) ? x : 0.0f; };
  // The f16 pairs in f32 (non-finite as 0), into the outputs until the grid's are known.
  float lo = std::numeric_limits<float>::infinity(), hi = -lo, smax = 0.0f;
  for (std::size_t p = 0; p < n; ++p) {
    sc[p] = finite_or_0(fp16_to_fp32(s16[p])), mn[p] = finite_or_0(fp16_to_fp32(m16[p]));
    lo = std::min(lo, mn[p]), hi = std::max(hi, mn[p]), smax = std::max(smax, sc[p]);
  }
  if (n == 0) lo = hi = 0.0f;
  float step = (hi - lo) / 255.0f;
  if (!std::isfinite(step)) step = 0.0f;
  while (step > 0.0f && std::fma(255.0f, step, lo) < hi) step = std::nextafter(step, std::numeric_limits<float>::infinity());
  // The top octave holds the largest scale: exp + 7 = floor(log2(smax)); f16
  // scales are 0 or within [2^-24, 2^16), so exp stays within [-31, 8].
  int e = -31;
  if (smax > 0.0f) {
    int top = 0;
    std::frexp(smax, &top);
    e = std::clamp(top - 1 - 7, -31, 8);
  }
  std::byte* params = tile + l.param_offset;
  const std::int16_t e16 = static_cast<std::int16_t>(e);
  std::memcpy(params, &lo, 4);
  std::memcpy(params + 4, &step, 4);
  std::memcpy(params + 8, &e16, 2);
  std::memset(params + 10, 0, 2);
  const std::uint32_t bias = static_cast<std::uint32_t>(e + 127) << 23;  // a level's f32 bits: (u << 18) + bias
  const auto scale_of = [&](std::uint32_t u) { return kernels::byte_param_scale(static_cast<std::uint8_t>(u), e); };
  const auto min_of = [&](std::uint32_t u) { return kernels::byte_param_min(static_cast<std::uint8_t>(u), lo, step); };
  auto* su = reinterpret_cast<std::uint8_t*>(params + kernels::kByteParamHeader);
  auto* mu = su + l.param_stride;
  for (std::size_t p = 0; p < n; ++p) {
    const float m = mn[p], s = sc[p];
    const float top = std::fma(static_cast<float>(qmax), s, m);
    const float f = step > 0.0f ? (m - lo) / step : 0.0f;
    std::uint32_t um0 = !(f > 0.0f) ? 0u : f >= 255.0f ? 255u : static_cast<std::uint32_t>(f);
    while (um0 > 0 && min_of(um0) > m) --um0;
    float best = std::numeric_limits<float>::infinity();
    std::uint32_t best_s = 0, best_m = um0;
    for (std::uint32_t um = um0; um <= std::min(um0 + 1, 255u); ++um) {
      const float need = std::max((top - min_of(um)) / static_cast<float>(qmax), 0.0f);
      std::uint32_t us = 0;
      if (need > 0.0f && s > 0.0f) {  // the smallest level at or above it (rounded up from its f32 bits)
        std::uint32_t nb;
        std::memcpy(&nb, &need, 4);
        us = nb <= bias ? 1u : std::clamp<std::uint32_t>((nb - bias + (1u << 18) - 1) >> 18, 1u, 255u);
        while (us < 255 && scale_of(us) < need) ++us;
      }
      for (std::uint32_t u = us > 1 ? us - 1 : us; u <= std::min(us + 1, 255u); ++u) {
        if ((u == 0) != (us == 0)) continue;  // a zero scale only for a constant series
        const float err = sse(p, scale_of(u), min_of(um));
        if (err < best) best = err, best_s = u, best_m = um;
      }
    }
    su[p] = static_cast<std::uint8_t>(best_s);
    mu[p] = static_cast<std::uint8_t>(best_m);
    sc[p] = scale_of(best_s);
    mn[p] = min_of(best_m);
  }
}

// The dense codes, scales and mins of an integer tile.
void encode_scaled_tile(const KvCodec& codec, const TileLayout& l, const float* rows, std::byte* tile) {
  const int T = l.tokens, D = l.head_dim;
  const int bits = codec.bits(), qmax = (1 << bits) - 1;
  // The pairs in f16 (in place, or staged for byte parameters), then as the
  // decoders will see them.
  thread_local std::vector<std::uint16_t> staged;
  thread_local std::vector<float> sc, mn;
  if (l.byte_params) staged.assign(2 * l.param_stride, 0);
  std::uint16_t* scales = l.byte_params ? staged.data() : scales_of(l, tile);
  std::uint16_t* mins = l.byte_params ? staged.data() + l.param_stride : mins_of(l, tile);
  std::uint8_t codes[4096];
  QKV_CHECK(D <= 4096);
  const int G = codec.axis == KvAxis::channel ? 1 : effective_group(codec, D), groups = D / G;
  if (codec.axis == KvAxis::channel) {  // the series are the channels
    fit_series(rows, T, D, D, qmax, scales, mins, 1);
  } else if (qmax >= 255) {  // per token, the full range of each group: no search, nothing to transpose
    for (int j = 0; j < T; ++j)
      for (int g = 0; g < groups; ++g)
        fit_series(rows + static_cast<std::size_t>(j) * D + g * G, G, 1, 1, qmax, scales + j * groups + g,
                   mins + j * groups + g, 1);
  } else {
    // Per token: the series are the rows' groups, one group of every row at
    // a time, transposed so that the rows lie side by side.
    std::vector<float> cols(static_cast<std::size_t>(G) * T);
    for (int g = 0; g < groups; ++g) {
      for (int j = 0; j < T; ++j)
        for (int c = 0; c < G; ++c)
          cols[static_cast<std::size_t>(c) * T + j] = rows[static_cast<std::size_t>(j) * D + g * G + c];
      fit_series(cols.data(), G, T, T, qmax, scales + g, mins + g, groups);
    }
  }
  sc.resize(l.n_params), mn.resize(l.n_params);
  if (l.byte_params) {
    const float top = static_cast<float>(qmax);
    // The squared error of pair p's series under (scale, min): a channel over
    // the rows, or a row's group.
    const auto sse = [&](std::size_t p, float scale, float min) {
      const float inv = inverse(scale);
      float e = 0.0f;
      const auto add = [&](float v) {
        const float d = v - (code_of(v, inv, min, top) * scale + min);
        e += d * d;
      };
      if (codec.axis == KvAxis::channel) {
        for (int j = 0; j < T; ++j) add(rows[static_cast<std::size_t>(j) * D + p]);
      } else {
        const float* x = rows + (p / static_cast<std::size_t>(groups)) * D + (p % static_cast<std::size_t>(groups)) * G;
        for (int c = 0; c < G; ++c) add(x[c]);
      }
      return e;
    };
    store_byte_params(l, qmax, scales, mins, tile, sc.data(), mn.data(), sse);
  } else {
    for (std::size_t p = 0; p < l.n_params; ++p) sc[p] = fp16_to_fp32(scales[p]), mn[p] = fp16_to_fp32(mins[p]);
  }
  for (float& s : sc) s = inverse(s);  // from here on, sc holds 1 / scale
  for (int j = 0; j < T; ++j) {
    const float* x = rows + static_cast<std::size_t>(j) * D;
    if (codec.axis == KvAxis::channel) {
      for (int c = 0; c < D; ++c) codes[c] = quantize_one(x[c], sc[static_cast<std::size_t>(c)], mn[static_cast<std::size_t>(c)], qmax);
    } else {
      for (int g = 0; g < groups; ++g) {
        const std::size_t p = static_cast<std::size_t>(j * groups + g);
        for (int c = 0; c < G; ++c) codes[g * G + c] = quantize_one(x[g * G + c], sc[p], mn[p], qmax);
      }
    }
    pack_row(codes, D, bits, tile + static_cast<std::size_t>(j) * l.row_bytes);
  }
}

}  // namespace

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
  if (l.n_outliers == 0) {
    encode_scaled_tile(codec, l, rows, tile);
    return;
  }
  thread_local std::vector<float> dense;
  dense.assign(rows, rows + static_cast<std::ptrdiff_t>(T) * D);
  const std::vector<std::uint16_t> index = take_outliers(codec, l, dense.data());
  encode_scaled_tile(codec, l, dense.data(), tile);
  store_outliers(codec, l, index, rows, tile);
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
  t.byte_params = l.byte_params;
  return t;
}

void decode_tile_scalar(const KvCodec& codec, const TileLayout& l, const std::byte* tile, int n_rows, float* out,
                        CodebookSlice book) {
  QKV_CHECK(n_rows >= 0 && n_rows <= l.tokens);
  kernels::decode_tile_ref(tile_codes(codec, l, book), tile, n_rows, out);
  add_outliers(l, tile, n_rows, out);
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
