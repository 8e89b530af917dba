#pragma once
// Internal: the KV tile kernels (qkvshare/kernels/kv_tiles.hpp) written once
// over the vector-width trait of vec.hpp; each ISA unit instantiates them with
// its own Vec. Internal linkage, std-free (kernel_table.hpp says why).
// Requires head_dim % Vec::N == 0 and head_dim <= kTileMaxHeadDim; a level
// whose width does not divide the head hands the call to a narrower level.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "qkvshare/kernels/kv_tiles.hpp"
#include "kv_params.hpp"
#include "pq_rows.hpp"
#include "vec_math.hpp"

namespace qkvshare::kernels::detail {
namespace {

constexpr int kTileParamBatch = 512;  // (scale, min) pairs converted at a time

template <class V, int Bits>
void tile_decode_codes(const TileCodes& t, const std::byte* tile, int n_rows, float* out) {
  using F = typename V::F;
  const int D = t.head_dim;
  const auto* scales = reinterpret_cast<const std::uint16_t*>(tile + t.param_offset);
  const auto* mins = scales + t.param_stride;
  alignas(64) float sf[kTileMaxHeadDim], mf[kTileMaxHeadDim];
  const auto row_at = [&](int j) { return tile + static_cast<std::size_t>(j) * t.row_bytes; };
  // One row against per-channel (scale, min) in sf, mf.
  const auto channel_row = [&](int j) {
    const std::byte* row = row_at(j);
    float* o = out + static_cast<std::size_t>(j) * D;
    for (int c = 0; c < D; c += V::N)
      V::storeu(o + c, V::fmadd(V::template codes<Bits>(row, c), V::loadu(sf + c), V::loadu(mf + c)));
  };
  if (t.per_channel) {
    // The channel parameters once per tile, then one fma per vector of each row.
    if (t.byte_params) byte_params_f32(t, tile, 0, D, sf, mf);
    else for (int c = 0; c < D; c += 8) V::f16x8(scales + c, sf + c), V::f16x8(mins + c, mf + c);
    for (int j = 0; j < n_rows; ++j) channel_row(j);
    return;
  }
  const int G = t.group, groups = D / G;
  // The (scale, min) pairs of a batch of rows in f32 first (8 at a time: the
  // parameter arrays are padded to 8), so each group is one broadcast.
  alignas(64) float ps[kTileParamBatch + 8], pm[kTileParamBatch + 8];
  const int rows_per_batch = kTileParamBatch / groups;
  for (int j0 = 0; j0 < n_rows; j0 += rows_per_batch) {
    const int j1 = j0 + rows_per_batch < n_rows ? j0 + rows_per_batch : n_rows;
    const int p0 = j0 * groups, np = (j1 - j0) * groups;
    if (t.byte_params) byte_params_f32(t, tile, p0, np, ps, pm);
    else for (int i = 0; i < np; i += 8) V::f16x8(scales + p0 + i, ps + i), V::f16x8(mins + p0 + i, pm + i);
    for (int j = j0; j < j1; ++j) {
      const float* sg = ps + (j - j0) * groups;
      const float* mg = pm + (j - j0) * groups;
      if (G % V::N == 0) {
        const std::byte* row = row_at(j);
        float* o = out + static_cast<std::size_t>(j) * D;
        for (int g = 0; g < groups; ++g) {
          const F s = V::set1(sg[g]), m = V::set1(mg[g]);
          for (int c = g * G; c < (g + 1) * G; c += V::N) V::storeu(o + c, V::fmadd(V::template codes<Bits>(row, c), s, m));
        }
      } else {  // groups narrower than a vector: the row's parameters per channel
        for (int c = 0; c < D; ++c) sf[c] = sg[c / G], mf[c] = mg[c / G];
        channel_row(j);
      }
    }
  }
}

template <class V>
void tile_decode(const TileCodes& t, const std::byte* tile, int n_rows, float* out) {
  if (t.pq_sub > 0) return decode_pq_rows(t, tile, n_rows, out);  // copies of centroids: nothing to vectorize
  const std::size_t n = static_cast<std::size_t>(n_rows) * static_cast<std::size_t>(t.head_dim);
  switch (t.bits) {
    case 32: std::memcpy(out, tile, n * 4); return;
    case 16: {
      const auto* h = reinterpret_cast<const std::uint16_t*>(tile);
      for (std::size_t i = 0; i < n; i += V::N) V::storeu(out + i, V::load_f16(h + i));
      return;
    }
    case 8: tile_decode_codes<V, 8>(t, tile, n_rows, out); return;
    case 4: tile_decode_codes<V, 4>(t, tile, n_rows, out); return;
    case 3: tile_decode_codes<V, 3>(t, tile, n_rows, out); return;
    case 2: tile_decode_codes<V, 2>(t, tile, n_rows, out); return;
    default: return;  // the kv layer never describes another width (tile_codes checks)
  }
}

// 8 rows at a time, each with its own accumulator, reduced together.
template <class V>
float tile_scores(const float* q, const float* rows, int n_rows, int D, float scale, float* s) {
  using F = typename V::F;
  float m = -__builtin_inff();
  int j = 0;
  for (; j + 8 <= n_rows; j += 8) {
    const float* k = rows + static_cast<std::ptrdiff_t>(j) * D;
    F a[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) a[r] = V::zero();
    for (int c = 0; c < D; c += V::N) {
      const F qv = V::loadu(q + c);
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) a[r] = V::fmadd(qv, V::loadu(k + r * D + c), a[r]);
    }
    float sum[8];
    V::hsum8(a, sum);
    for (int r = 0; r < 8; ++r) {
      s[j + r] = sum[r] * scale;
      m = s[j + r] > m ? s[j + r] : m;
    }
  }
  for (; j < n_rows; ++j) {
    const float* k = rows + static_cast<std::ptrdiff_t>(j) * D;
    F a = V::zero();
    for (int c = 0; c < D; c += V::N) a = V::fmadd(V::loadu(q + c), V::loadu(k + c), a);
    s[j] = V::hsum(a) * scale;
    m = s[j] > m ? s[j] : m;
  }
  return m;
}

// NV vectors of the output stay in registers over all rows.
template <class V, int NV>
void tile_weighted_sum_nv(float* o, const float* p, const float* rows, int n_rows, int stride) {
  typename V::F acc[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) acc[v] = V::loadu(o + V::N * v);
  for (int j = 0; j < n_rows; ++j) {
    const typename V::F w = V::set1(p[j]);
    const float* r = rows + static_cast<std::ptrdiff_t>(j) * stride;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[v] = V::fmadd(w, V::loadu(r + V::N * v), acc[v]);
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) V::storeu(o + V::N * v, acc[v]);
}

template <class V>
void tile_weighted_sum(float* o, const float* p, const float* rows, int n_rows, int D) {
  for (int c0 = 0; c0 < D; c0 += 8 * V::N) {
    const int left = (D - c0) / V::N;
    switch (left < 8 ? left : 8) {
      case 1: tile_weighted_sum_nv<V, 1>(o + c0, p, rows + c0, n_rows, D); break;
      case 2: tile_weighted_sum_nv<V, 2>(o + c0, p, rows + c0, n_rows, D); break;
      case 3: tile_weighted_sum_nv<V, 3>(o + c0, p, rows + c0, n_rows, D); break;
      case 4: tile_weighted_sum_nv<V, 4>(o + c0, p, rows + c0, n_rows, D); break;
      case 5: tile_weighted_sum_nv<V, 5>(o + c0, p, rows + c0, n_rows, D); break;
      case 6: tile_weighted_sum_nv<V, 6>(o + c0, p, rows + c0, n_rows, D); break;
      case 7: tile_weighted_sum_nv<V, 7>(o + c0, p, rows + c0, n_rows, D); break;
      default: tile_weighted_sum_nv<V, 8>(o + c0, p, rows + c0, n_rows, D); break;
    }
  }
}

// kv_tiles.hpp's TileEncodeF16Fn. The hardware keeps a NaN's payload where
// the reference writes one quiet NaN: a vector holding a NaN goes to the
// reference.
template <class V>
void tile_encode_f16(const float* x, std::size_t n, std::uint16_t* out) {
  std::size_t i = 0;
  for (; i + V::N <= n; i += V::N) {
    const typename V::F v = V::loadu(x + i);
    if (V::any_nan(v)) encode_f16_ref(x + i, V::N, out + i);
    else V::store_f16(out + i, v);
  }
  if (i < n) encode_f16_ref(x + i, n - i, out + i);
}

// kv_tiles.hpp's TileRopeFn. Neox needs head_dim / 2 to be a multiple of N.
template <class V>
void tile_rope(float* rows, int n_rows, int head_dim, const float* table, std::ptrdiff_t table_step, RopeStyle style) {
  using F = typename V::F;
  const int half = head_dim / 2;
  for (int r = 0; r < n_rows; ++r) {
    float* x = rows + static_cast<std::ptrdiff_t>(r) * head_dim;
    const float* C = table + r * table_step;
    const float* S = C + head_dim;
    if (style == RopeStyle::neox) {
      for (int c = 0; c < half; c += V::N) {
        const F a = V::loadu(x + c), b = V::loadu(x + half + c);
        V::storeu(x + c, V::fmadd(a, V::loadu(C + c), V::mul(b, V::loadu(S + c))));
        V::storeu(x + half + c, V::fmadd(b, V::loadu(C + half + c), V::mul(a, V::loadu(S + half + c))));
      }
    } else {
      for (int c = 0; c < head_dim; c += V::N) {
        const F a = V::loadu(x + c);
        V::storeu(x + c, V::fmadd(a, V::loadu(C + c), V::mul(V::swap_pairs(a), V::loadu(S + c))));
      }
    }
  }
}

// kv_tiles.hpp's TileMaxFn: lane-wise std::max(acc, x) in four chains (one
// would wait on each select's latency), then the lanes the same way.
template <class V>
float tile_max(const float* x, int n, float m) {
  using F = typename V::F;
  const auto keep_max = [](F acc, F v) { return V::select_lt(acc, v, v, acc); };
  int i = 0;
  if (n >= 4 * V::N) {
    F a[4] = {V::set1(m), V::set1(m), V::set1(m), V::set1(m)};
    for (; i + 4 * V::N <= n; i += 4 * V::N)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) a[k] = keep_max(a[k], V::loadu(x + i + k * V::N));
    const F r = keep_max(keep_max(a[0], a[1]), keep_max(a[2], a[3]));
    alignas(64) float lanes[V::N];
    V::storeu(lanes, r);
    for (int k = 0; k < V::N; ++k) m = m < lanes[k] ? lanes[k] : m;  // every lane started from m
  }
  for (; i < n; ++i) m = m < x[i] ? x[i] : m;
  return m;
}

// The partial last vector goes through a buffer padded with -inf (exp gives 0).
template <class V>
float tile_exp_sum(float* x, int n, float max) {
  using F = typename V::F;
  const F vm = V::set1(max);
  F acc = V::zero();
  int i = 0;
  for (; i + V::N <= n; i += V::N) {
    const F e = vexp<V>(V::sub(V::loadu(x + i), vm));
    V::storeu(x + i, e);
    acc = V::add(acc, e);
  }
  if (i < n) {
    float buf[V::N];
    for (int k = 0; k < V::N; ++k) buf[k] = i + k < n ? x[i + k] : -__builtin_inff();
    const F e = vexp<V>(V::sub(V::loadu(buf), vm));
    V::storeu(buf, e);
    acc = V::add(acc, e);
    for (int k = 0; i + k < n; ++k) x[i + k] = buf[k];
  }
  return V::hsum(acc);
}

// kv_tiles.hpp's TileFitFn over V::N series at a time (the reference takes
// the remaining lanes); the same operations in the same order as
// fit_ranges_ref, lane by lane.
template <class V>
void tile_fit(const float* x, int n, std::ptrdiff_t stride, int lanes, int qmax, float* lo, float* hi) {
  using F = typename V::F;
  const float step = qmax <= 3 ? 0.04f : 0.02f;
  const F top = V::set1(static_cast<float>(qmax)), half = V::set1(0.5f), zero = V::zero(),
          cap = V::set1(static_cast<float>(qmax) + 0.25f);
  int s = 0;
  for (; s + V::N <= lanes; s += V::N) {
    const float* xs = x + s;
    F l0 = V::loadu(xs), h0 = l0;
    for (int i = 1; i < n; ++i) {
      const F v = V::loadu(xs + i * stride);
      l0 = V::min(l0, v);
      h0 = V::max(h0, v);
    }
    l0 = V::add(l0, zero);  // -0 to +0: levels disagree on the sign of min(-0, +0)
    h0 = V::add(h0, zero);
    const auto error = [&](F l, F h) {
      const F sc = V::div(V::sub(h, l), top), inv = V::div(top, V::sub(h, l));
      F e = zero;
      for (int i = 0; i < n; ++i) {
        const F v = V::loadu(xs + i * stride);
        const F t = V::min(V::max(V::add(unfused(V::mul(V::sub(v, l), inv)), half), zero), cap);
        const F d = V::sub(v, V::add(unfused(V::mul(V::trunc(t), sc)), l));
        e = V::add(e, unfused(V::mul(d, d)));
      }
      return e;
    };
    const F rs = V::mul(V::sub(h0, l0), V::set1(step));
    F best = error(l0, h0), bl = l0, bh = h0;
    for (int a = 0; a < 6; ++a)
      for (int b = 0; b < 6; ++b) {
        const F l = V::add(l0, unfused(V::mul(rs, V::set1(static_cast<float>(a)))));
        const F h = V::sub(h0, unfused(V::mul(rs, V::set1(static_cast<float>(b)))));
        const F e = error(l, h);
        bl = V::select_lt(e, best, l, bl);
        bh = V::select_lt(e, best, h, bh);
        best = V::select_lt(e, best, e, best);
      }
    // A constant (or nearly constant) series keeps its full range.
    const F floor = V::set1(kFitMinRange), width = V::sub(h0, l0);
    V::storeu(lo + s, V::select_lt(floor, width, bl, l0));
    V::storeu(hi + s, V::select_lt(floor, width, bh, h0));
  }
  if (s < lanes) fit_ranges_ref(x + s, n, stride, lanes - s, qmax, lo + s, hi + s);
}
}  // namespace
}  // namespace qkvshare::kernels::detail

// The level's entry points (kernel_table.hpp) over its own Vec, for a level
// whose width divides every head (AVX2, NEON); AVX-512 writes its own to hand
// narrower heads to AVX2.
#define QKVSHARE_DEFINE_TILE_KERNELS                                                                      \
  void tile_decode(const TileCodes& t, const std::byte* tile, int n_rows, float* out) {                   \
    detail::tile_decode<Vec>(t, tile, n_rows, out);                                                       \
  }                                                                                                       \
  float tile_scores(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s) {  \
    return detail::tile_scores<Vec>(q, rows, n_rows, head_dim, scale, s);                                 \
  }                                                                                                       \
  void tile_weighted_sum(float* o, const float* p, const float* rows, int n_rows, int head_dim) {          \
    detail::tile_weighted_sum<Vec>(o, p, rows, n_rows, head_dim);                                         \
  }                                                                                                       \
  float tile_exp_sum(float* x, int n, float max) { return detail::tile_exp_sum<Vec>(x, n, max); }            \
  float tile_max(const float* x, int n, float m) { return detail::tile_max<Vec>(x, n, m); }                  \
  void tile_rope(float* rows, int n_rows, int head_dim, const float* table, std::ptrdiff_t step,        \
                 RopeStyle style) {                                                                       \
    if ((head_dim / 2) % Vec::N != 0) return rope_rows_ref(rows, n_rows, head_dim, table, step, style);   \
    detail::tile_rope<Vec>(rows, n_rows, head_dim, table, step, style);                                   \
  }                                                                                                       \
  void tile_fit(const float* x, int n, std::ptrdiff_t stride, int lanes, int qmax, float* lo, float* hi) {  \
    detail::tile_fit<Vec>(x, n, stride, lanes, qmax, lo, hi);                                             \
  }                                                                                                       \
  void tile_encode_f16(const float* x, std::size_t n, std::uint16_t* out) {                               \
    detail::tile_encode_f16<Vec>(x, n, out);                                                              \
  }
