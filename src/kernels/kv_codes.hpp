#pragma once
// Internal: attention on KV codes (qkvshare/kernels/kv_tiles.hpp, "Attention
// on codes") written once over VecCodes (vec_codes.hpp); each ISA unit
// instantiates it. Internal linkage, std-free, like kv_tiles.hpp.
#include <cstddef>
#include <cstdint>

#include "kv_params.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"
#include "vec_codes.hpp"

namespace qkvshare::kernels::detail {
namespace {

constexpr int kCodeRowGroup = 8;   // rows whose codes are unpacked together (score side)

// The tile's (scale, min) pairs [first, first + n) as f32, 8 at a time (the
// arrays are padded to 8; first a multiple of 8).
template <class V>
void code_params(const TileCodes& t, const std::byte* tile, int first, int n, float* sf, float* mf) {
  if (t.byte_params) return byte_params_f32(t, tile, first, n, sf, mf);
  const auto* scales = reinterpret_cast<const std::uint16_t*>(tile + t.param_offset) + first;
  const auto* mins = scales + t.param_stride;
  for (int c = 0; c < n; c += 8) V::f16x8(scales + c, sf + c), V::f16x8(mins + c, mf + c);
}

// Rounds x[0, n) (n a multiple of N, padded with zeros), whose largest |x|
// is m, to codes of |x| max -> qmax; returns the step (0 when every x is 0).
template <class V, class Out>
float round_codes_to(const float* x, int n, float m, int qmax, Out* out) {
  const float inv = m > 0.0f ? static_cast<float>(qmax) / m : 0.0f;
  const typename V::F vi = V::set1(inv);
  for (int i = 0; i < n; i += V::N) {
    const typename V::I codes = V::to_int(V::round(V::mul(V::loadu(x + i), vi)));
    if constexpr (sizeof(Out) == 2) V::narrow16(out + i, codes);
    else V::narrow8(out + i, codes);
  }
  return m / static_cast<float>(qmax);
}

template <class V>
typename V::F abs_max(typename V::F m, typename V::F v) {
  return V::max(m, V::max(v, V::sub(V::zero(), v)));
}

template <class V>
void tile_query_codes(const TileCodes& t, const std::byte* tile, const float* q, int nq, float score_scale,
                      void* qc, float* ab) {
  const int D = t.head_dim;
  alignas(64) float sf[kTileMaxHeadDim], mf[kTileMaxHeadDim], qs[kTileMaxHeadDim];
  code_params<V>(t, tile, 0, D, sf, mf);
  // The centre's share of each value goes with the minimum.
  const typename V::F centre = V::set1(static_cast<float>(1 << (t.bits - 1)));
  for (int c = 0; c < D; c += V::N) V::storeu(mf + c, V::fmadd(centre, V::loadu(sf + c), V::loadu(mf + c)));
  for (int i = 0; i < nq; ++i) {
    const float* qi = q + static_cast<std::size_t>(i) * D;
    typename V::F bias = V::zero(), mx = V::zero();
    for (int c = 0; c < D; c += V::N) {
      const typename V::F v = V::mul(V::loadu(qi + c), V::loadu(sf + c));
      V::storeu(qs + c, v);
      mx = abs_max<V>(mx, v);
      bias = V::fmadd(V::loadu(qi + c), V::loadu(mf + c), bias);
    }
    const std::size_t at = static_cast<std::size_t>(i) * D;
    const float m = V::hmax(mx);
    const int qmax = query_code_max(t.bits, D);
    const float step = byte_query_codes(t.bits) ? round_codes_to<V>(qs, D, m, qmax, static_cast<std::int8_t*>(qc) + at)
                                   : round_codes_to<V>(qs, D, m, qmax, static_cast<std::int16_t*>(qc) + at);
    ab[2 * i] = score_scale * step;
    ab[2 * i + 1] = score_scale * V::hsum(bias);
  }
}

template <class V, int Bits>
void tile_code_scores_bits(const TileCodes& t, const std::byte* tile, int lo, int hi, const std::int16_t* qc,
                           const float* ab, int nq, float* s, std::size_t s_stride) {
  using I = typename V::I;
  constexpr int L = 2 * V::N;
  const int D = t.head_dim;
  alignas(64) std::int16_t cb[kCodeRowGroup * kTileMaxHeadDim];
  const typename V::W centre = V::set16(static_cast<std::int16_t>(1 << (Bits - 1)));
  for (int j0 = lo; j0 < hi; j0 += kCodeRowGroup) {
    const int nr = hi - j0 < kCodeRowGroup ? hi - j0 : kCodeRowGroup;
    for (int r = 0; r < kCodeRowGroup; ++r) {
      const std::byte* row = tile + static_cast<std::size_t>(j0 + r) * t.row_bytes;
      for (int c = 0; c < D; c += L) V::store16(cb + r * D + c, r < nr ? V::sub16(V::template codes16<Bits>(row, c), centre) : V::zero16());
    }
    for (int i = 0; i < nq; ++i) {
      const std::int16_t* qi = qc + static_cast<std::size_t>(i) * D;
      I acc[kCodeRowGroup];
#pragma GCC unroll 8
      for (int r = 0; r < kCodeRowGroup; ++r) acc[r] = V::zeroi();
      for (int c = 0; c < D; c += L) {
        const typename V::W qv = V::load16(qi + c);
#pragma GCC unroll 8
        for (int r = 0; r < kCodeRowGroup; ++r) acc[r] = V::dot16(acc[r], V::load16(cb + r * D + c), qv);
      }
      alignas(32) std::int32_t sum[kCodeRowGroup];
      V::hsum8_i(acc, sum);
      float* si = s + static_cast<std::size_t>(i) * s_stride + j0;
      for (int r = 0; r < nr; ++r) si[r] = __builtin_fmaf(ab[2 * i], static_cast<float>(sum[r]), ab[2 * i + 1]);
    }
  }
}

constexpr int kSumBatch = 4;  // queries whose weighted sums share each load of the codes

// One group's channels [c0, c0 + G) of NB queries' weighted sums over a
// window: each query's int16 weights (w16 + u * kCodeWindow, in pairs of
// rows) against the zipped code pairs, out[u][c] += step[u] * sum + bias[u].
// Each pair of code vectors is loaded once for all NB queries; few queries
// also split the pairs over U sums each, so that about eight sums are in
// flight (one chain would wait on the dot product's latency). The sums are
// integers, exact in any order: the result does not depend on NB.
template <class V, int NB>
void code_sum_batch(const std::int16_t* zipped, int D, int padded, int c0, int G, const std::int16_t* w16,
                    const float* step, const float* bias, float* const* out) {
  using I = typename V::I;
  using W = typename V::W;
  constexpr int L = 2 * V::N, U = NB >= 3 ? 1 : NB == 2 ? 2 : 4;  // padded is a multiple of 4
  for (int c = c0; c < c0 + G; c += L) {
    I al[NB * U], ah[NB * U];
#pragma GCC unroll 8
    for (int a = 0; a < NB * U; ++a) al[a] = V::zeroi(), ah[a] = V::zeroi();
    for (int pr = 0; pr < padded; pr += U) {
#pragma GCC unroll 4
      for (int k = 0; k < U; ++k) {
        const std::int16_t* z = zipped + (static_cast<std::size_t>(pr + k) * 2 * D + 2 * c);
        const W zl = V::load16(z), zh = V::load16(z + L);
#pragma GCC unroll 4
        for (int u = 0; u < NB; ++u) {
          const W wv = V::pair16(w16 + u * kCodeWindow + 2 * (pr + k));
          al[u * U + k] = V::dot16(al[u * U + k], zl, wv);
          ah[u * U + k] = V::dot16(ah[u * U + k], zh, wv);
        }
      }
    }
#pragma GCC unroll 4
    for (int u = 0; u < NB; ++u) {
      I sl = al[u * U], sh = ah[u * U];
      for (int k = 1; k < U; ++k) sl = V::addi(sl, al[u * U + k]), sh = V::addi(sh, ah[u * U + k]);
      I first, second;
      V::unzip32(sl, sh, first, second);
      const typename V::F vstep = V::set1(step[u]), vbias = V::set1(bias[u]);
      float* oi = out[u];
      V::storeu(oi + c, V::add(V::loadu(oi + c), V::fmadd(vstep, V::to_float(first), vbias)));
      V::storeu(oi + c + V::N, V::add(V::loadu(oi + c + V::N), V::fmadd(vstep, V::to_float(second), vbias)));
    }
  }
}

// A window's scales and minimums by group, [group][row] (zero outside rows
// [kmin, kmax) of the window), the centre's share folded into the minimum.
struct WindowRows {
  int kmin, kmax;
  bool full;
};
template <class V, int Bits>
WindowRows window_scales(const TileCodes& t, const std::byte* tile, int lo, int j0, int j1, float* sfg, float* mfg) {
  const int groups = t.head_dim / t.group;
  alignas(64) float ps[kCodeWindow * kTileMaxHeadDim / 8 + 16], pm[kCodeWindow * kTileMaxHeadDim / 8 + 16];
  // The window's (scale, min) pairs, from the multiple of 8 before its first.
  const int p0 = (j0 * groups) & ~7, p1 = (j1 * groups + 7) & ~7;
  code_params<V>(t, tile, p0, p1 - p0, ps, pm);
  const WindowRows r{lo > j0 ? lo - j0 : 0, j1 - j0, lo <= j0 && j1 - j0 == kCodeWindow};
  // [row][group] -> [group][row] (rows past the window are overwritten below).
  const float* ps0 = ps + (j0 * groups - p0);
  const float* pm0 = pm + (j0 * groups - p0);
  if (groups == 1) {
    for (int k = 0; k < kCodeWindow; k += V::N) V::storeu(sfg + k, V::loadu(ps0 + k)), V::storeu(mfg + k, V::loadu(pm0 + k));
  } else if (groups == 2) {  // the usual case (64-channel heads in groups of 32): one shuffle, not a scalar gather
    for (int k = 0; k < kCodeWindow; k += V::N) {
      V::deinterleave2(ps0 + 2 * k, sfg + k, sfg + kCodeWindow + k);
      V::deinterleave2(pm0 + 2 * k, mfg + k, mfg + kCodeWindow + k);
    }
  } else {
    for (int g = 0; g < groups; ++g)
      for (int k = 0; k < kCodeWindow; ++k)
        sfg[g * kCodeWindow + k] = ps0[k * groups + g], mfg[g * kCodeWindow + k] = pm0[k * groups + g];
  }
  const typename V::F centre = V::set1(static_cast<float>(1 << (Bits - 1)));
  for (int g = 0; g < groups; ++g) {
    float* sf = sfg + g * kCodeWindow;
    float* mf = mfg + g * kCodeWindow;
    if (!r.full)
      for (int k = 0; k < kCodeWindow; ++k)
        if (k < r.kmin || k >= r.kmax) sf[k] = 0.0f, mf[k] = 0.0f;
    for (int k = 0; k < kCodeWindow; k += V::N) V::storeu(mf + k, V::fmadd(centre, V::loadu(sf + k), V::loadu(mf + k)));
  }
  return r;
}

// Query i's weights over the window at j0 for one group (scales sf, minimums
// mf): p * scale rounded to codes of |w| max -> qmax; returns the step and
// sets the group's bias (the minimums' share, summed in float).
template <class V, class Out>
float window_weights(const float* pi, int j0, const WindowRows& r, const float* sf, const float* mf, int qmax, Out* out,
                     float& bias) {
  using F = typename V::F;
  alignas(64) float pw[kCodeWindow], w[kCodeWindow];
  const float* pv = pi + j0;  // the window's weights, zero outside [lo, hi)
  if (!r.full) {
    for (int k = 0; k < kCodeWindow; ++k) pw[k] = k >= r.kmin && k < r.kmax ? pi[j0 + k] : 0.0f;
    pv = pw;
  }
  F b = V::zero(), mx = V::zero();
  for (int k = 0; k < kCodeWindow; k += V::N) {
    const F wk = V::mul(V::loadu(pv + k), V::loadu(sf + k));
    V::storeu(w + k, wk);
    mx = abs_max<V>(mx, wk);
    b = V::fmadd(V::loadu(pv + k), V::loadu(mf + k), b);
  }
  bias = V::hsum(b);
  return round_codes_to<V>(w, kCodeWindow, V::hmax(mx), qmax, out);
}

template <class V, int Bits>
void tile_code_sum_pairs(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p, std::size_t p_stride,
                         int nq, float* o) {
  using W = typename V::W;
  constexpr int L = 2 * V::N;
  static_assert(kCodeWindow % V::N == 0, "a window is whole vectors");
  const int D = t.head_dim, G = t.group, groups = D / G;
  // Pairs of rows (j, j + 1) zipped channel by channel: [pair][D / L][lo, hi][L].
  alignas(64) std::int16_t zipped[kCodeWindow / 2 * 2 * kTileMaxHeadDim];
  alignas(64) float sfg[kTileMaxHeadDim / 16 * kCodeWindow], mfg[kTileMaxHeadDim / 16 * kCodeWindow];
  alignas(64) std::int16_t w16[kSumBatch * kCodeWindow];
  const W centre = V::set16(static_cast<std::int16_t>(1 << (Bits - 1)));
  for (int j0 = lo & ~3; j0 < hi; j0 += kCodeWindow) {
    const int j1 = j0 + kCodeWindow < hi ? j0 + kCodeWindow : hi, pairs = (j1 - j0 + 1) / 2;
    const int padded = (pairs + 3) & ~3;  // pairs past the rows are zero
    for (int pr = 0; pr < padded; ++pr) {
      const int ja = j0 + 2 * pr, jb = ja + 1;
      const std::byte* ra = tile + static_cast<std::size_t>(ja) * t.row_bytes;
      const std::byte* rb = ra + t.row_bytes;
      for (int c = 0; c < D; c += L) {
        const W a = ja >= lo && ja < j1 ? V::sub16(V::template codes16<Bits>(ra, c), centre) : V::zero16();
        const W b = jb < j1 ? V::sub16(V::template codes16<Bits>(rb, c), centre) : V::zero16();
        W zl, zh;
        V::zip16(a, b, zl, zh);
        std::int16_t* z = zipped + (static_cast<std::size_t>(pr) * 2 * D + 2 * c);
        V::store16(z, zl), V::store16(z + L, zh);
      }
    }
    const WindowRows r = window_scales<V, Bits>(t, tile, lo, j0, j1, sfg, mfg);
    for (int g = 0; g < groups; ++g) {
      // Queries in batches of up to kSumBatch, which share each load of the codes.
      for (int i0 = 0; i0 < nq; i0 += kSumBatch) {
        const int nb = nq - i0 < kSumBatch ? nq - i0 : kSumBatch;
        float step[kSumBatch], vbias[kSumBatch];
        float* out[kSumBatch];
        for (int u = 0; u < nb; ++u) {
          const int i = i0 + u;
          step[u] = window_weights<V>(p + static_cast<std::size_t>(i) * p_stride, j0, r, sfg + g * kCodeWindow,
                                      mfg + g * kCodeWindow, value_weight_max(Bits), w16 + u * kCodeWindow, vbias[u]);
          out[u] = o + static_cast<std::size_t>(i) * D;
        }
        switch (nb) {
          case 1: code_sum_batch<V, 1>(zipped, D, padded, g * G, G, w16, step, vbias, out); break;
          case 2: code_sum_batch<V, 2>(zipped, D, padded, g * G, G, w16, step, vbias, out); break;
          case 3: code_sum_batch<V, 3>(zipped, D, padded, g * G, G, w16, step, vbias, out); break;
          default: code_sum_batch<V, 4>(zipped, D, padded, g * G, G, w16, step, vbias, out); break;
        }
      }
    }
  }
}

// 4-N channels of a row of 4- or 2-bit codes as centred bytes (row4 / row2).
template <class V, int Bits>
typename V::W8 byte_codes(const std::byte* row, int c) {
  if constexpr (Bits == 4) return V::row4(row, c);
  else return V::row2(row, c);
}

// NB queries' value sums over a window of quads (4 rows each, interleaved
// per channel by V::quads4: quads[q][chunk][k] holds channels chunk * 4N +
// kN..), every group at once: out[u][c] += step[u][g] * sum + bias[u][g].
// A register's N channels lie in one group (G is a multiple of 16).
template <class V, int NB>
void code_sum_quads(const typename V::W8* quads, int D, int nquads, int G, const std::int8_t* w8, const float* step,
                    const float* bias, float* const* out) {
  using I = typename V::I;
  constexpr int CH = 4 * V::N;
  const int groups = D / G, chunks = D / CH;
  for (int ch = 0; ch < chunks; ++ch) {
    int g[4];
    for (int k = 0; k < 4; ++k) g[k] = (ch * CH + k * V::N) / G;
    I acc[NB][4];
#pragma GCC unroll 4
    for (int u = 0; u < NB; ++u)
      for (int k = 0; k < 4; ++k) acc[u][k] = V::zeroi();
    for (int q = 0; q < nquads; ++q) {
      const typename V::W8* z = quads + (static_cast<std::size_t>(q) * chunks + ch) * 4;
#pragma GCC unroll 4
      for (int u = 0; u < NB; ++u) {
        const std::int8_t* wu = w8 + u * groups * kCodeWindow + 4 * q;
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) acc[u][k] = V::dot8(acc[u][k], V::quad8(wu + g[k] * kCodeWindow), z[k]);
      }
    }
    for (int u = 0; u < NB; ++u)
      for (int k = 0; k < 4; ++k) {
        const int at = u * groups + g[k];
        float* oc = out[u] + ch * CH + k * V::N;
        V::storeu(oc, V::add(V::loadu(oc), V::fmadd(V::set1(step[at]), V::to_float(acc[u][k]), V::set1(bias[at]))));
      }
  }
}

// 4- and 2-bit values on bytes: four rows per int32 lane, so that one dot8
// adds four rows' codes under their weights (7 bits, as every level rounds
// them for these widths: the same integers as tile_code_sum_pairs).
template <class V, int Bits>
void tile_code_sum_quads(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p, std::size_t p_stride,
                         int nq, float* o) {
  using W8 = typename V::W8;
  constexpr int CH = 4 * V::N;
  const int D = t.head_dim, G = t.group, groups = D / G, chunks = D / CH;
  alignas(64) W8 quads[kCodeWindow * kTileMaxHeadDim / CH];
  alignas(64) float sfg[kTileMaxHeadDim / 16 * kCodeWindow], mfg[kTileMaxHeadDim / 16 * kCodeWindow];
  alignas(64) std::int8_t w8[kSumBatch * kTileMaxHeadDim / 16 * kCodeWindow];
  float step[kSumBatch * kTileMaxHeadDim / 16], bias[kSumBatch * kTileMaxHeadDim / 16];
  for (int j0 = lo & ~3; j0 < hi; j0 += kCodeWindow) {
    const int j1 = j0 + kCodeWindow < hi ? j0 + kCodeWindow : hi, nquads = (j1 - j0 + 3) / 4;
    for (int q = 0; q < nquads; ++q)
      for (int ch = 0; ch < chunks; ++ch) {
        W8* z = quads + (static_cast<std::size_t>(q) * chunks + ch) * 4;
        if constexpr (Bits == 2 && V::kRow2Quads) {
          if (j0 + 4 * q + 3 < j1) {
            V::quads_row2(tile + static_cast<std::size_t>(j0 + 4 * q) * t.row_bytes, t.row_bytes, ch * CH, z);
            continue;
          }
        }
        for (int k = 0; k < 4; ++k) {  // rows before lo weigh 0; rows past j1 may lie past the tile
          const int j = j0 + 4 * q + k;
          z[k] = j < j1 ? byte_codes<V, Bits>(tile + static_cast<std::size_t>(j) * t.row_bytes, ch * CH) : V::zero16();
        }
        V::quads4(z);
      }
    const WindowRows r = window_scales<V, Bits>(t, tile, lo, j0, j1, sfg, mfg);
    for (int i0 = 0; i0 < nq; i0 += kSumBatch) {
      const int nb = nq - i0 < kSumBatch ? nq - i0 : kSumBatch;
      float* out[kSumBatch];
      for (int u = 0; u < nb; ++u) {
        const float* pi = p + static_cast<std::size_t>(i0 + u) * p_stride;
        for (int g = 0; g < groups; ++g)
          step[u * groups + g] = window_weights<V>(pi, j0, r, sfg + g * kCodeWindow, mfg + g * kCodeWindow,
                                                   value_weight_max(Bits), w8 + (u * groups + g) * kCodeWindow,
                                                   bias[u * groups + g]);
        out[u] = o + static_cast<std::size_t>(i0 + u) * D;
      }
      switch (nb) {
        case 1: code_sum_quads<V, 1>(quads, D, nquads, G, w8, step, bias, out); break;
        case 2: code_sum_quads<V, 2>(quads, D, nquads, G, w8, step, bias, out); break;
        case 3: code_sum_quads<V, 3>(quads, D, nquads, G, w8, step, bias, out); break;
        default: code_sum_quads<V, 4>(quads, D, nquads, G, w8, step, bias, out); break;
      }
    }
  }
}

template <class V, int Bits>
void tile_code_sum_bits(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p, std::size_t p_stride,
                        int nq, float* o) {
  if constexpr (V::kValueBytes && byte_value_weights(Bits)) {
    if (t.head_dim % (4 * V::N) == 0) return tile_code_sum_quads<V, Bits>(t, tile, lo, hi, p, p_stride, nq, o);
  }
  tile_code_sum_pairs<V, Bits>(t, tile, lo, hi, p, p_stride, nq, o);
}

// 4- and 2-bit keys on bytes: rows in groups of 4 kRows8, row j0 + 4L + k in
// lane L of register k, so that one reduce4 gives the group's scores in row order.
template <class V, int Bits>
void tile_code_scores_bytes(const TileCodes& t, const std::byte* tile, int lo, int hi, const std::int8_t* qc,
                            const float* ab, int nq, float* s, std::size_t s_stride) {
  using I = typename V::I;
  using W8 = typename V::W8;
  constexpr int R = V::kRows8, GR = 4 * R, CH = 4 * V::N;  // rows per group, channels per register
  const int D = t.head_dim, chunks = D / 16;
  // The group's codes: [k][16-channel chunk][R lanes of 16 bytes].
  alignas(64) std::int8_t cb[4 * kTileMaxHeadDim * R];
  alignas(64) std::byte pad[GR * kTileMaxHeadDim / 2 + 64];  // a last group's rows, zero past hi
  for (int j0 = lo; j0 < hi; j0 += GR) {
    const int nr = hi - j0 < GR ? hi - j0 : GR;
    const std::byte* rows = tile + static_cast<std::size_t>(j0) * t.row_bytes;
    if (nr < GR) {
      __builtin_memset(pad, Bits == 4 ? 0x88 : 0xaa, sizeof pad);  // every code centred 0
      __builtin_memcpy(pad, rows, static_cast<std::size_t>(nr) * t.row_bytes);
      rows = pad;
    }
    for (int k = 0; k < 4; ++k)
      for (int c = 0; c < D; c += CH) {
        W8 r[R];
#pragma GCC unroll 4
        for (int L = 0; L < R; ++L) r[L] = byte_codes<V, Bits>(rows + static_cast<std::size_t>(4 * L + k) * t.row_bytes, c);
        V::transpose8(r);
#pragma GCC unroll 4
        for (int L = 0; L < R; ++L)
          __builtin_memcpy(cb + (static_cast<std::size_t>(k) * chunks + c / 16 + L) * 16 * R, &r[L], sizeof(W8));
      }
    const auto codes_at = [&](int k, int ch) {
      W8 v;
      __builtin_memcpy(&v, cb + (static_cast<std::size_t>(k) * chunks + ch) * 16 * R, sizeof(W8));
      return v;
    };
    I offset = V::zeroi();
    if constexpr (V::kOffset8) {  // 128 * the rows' sums of centred codes
      I a[4] = {V::zeroi(), V::zeroi(), V::zeroi(), V::zeroi()};
      for (int ch = 0; ch < chunks; ++ch)
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) a[k] = V::dot8(a[k], V::ones8(), codes_at(k, ch));
      offset = V::reduce4(a[0], a[1], a[2], a[3]);
      for (int b = 0; b < 7; ++b) offset = V::addi(offset, offset);
    }
    for (int i = 0; i < nq; ++i) {
      const std::int8_t* qi = qc + static_cast<std::size_t>(i) * D;
      I a[4] = {V::zeroi(), V::zeroi(), V::zeroi(), V::zeroi()};
      for (int ch = 0; ch < chunks; ++ch) {
        const W8 qv = V::q8(qi + 16 * ch);
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) a[k] = V::dot8(a[k], qv, codes_at(k, ch));
      }
      const I sum = V::isub(V::reduce4(a[0], a[1], a[2], a[3]), offset);
      const typename V::F score = V::fmadd(V::set1(ab[2 * i]), V::to_float(sum), V::set1(ab[2 * i + 1]));
      float* si = s + static_cast<std::size_t>(i) * s_stride + j0;
      if (nr == GR) {
        V::storeu(si, score);
      } else {
        alignas(64) float out[GR];
        V::storeu(out, score);
        for (int r = 0; r < nr; ++r) si[r] = out[r];
      }
    }
  }
}

template <class V>
void tile_code_scores(const TileCodes& t, const std::byte* tile, int lo, int hi, const void* qc, const float* ab,
                      int nq, float* s, std::size_t s_stride) {
  const auto* q16 = static_cast<const std::int16_t*>(qc);
  const auto* q8 = static_cast<const std::int8_t*>(qc);
  // A head narrower than the level's byte register: the reference does it.
  if (byte_query_codes(t.bits) && t.head_dim % (4 * V::N) != 0) return code_scores_ref(t, tile, lo, hi, qc, ab, nq, s, s_stride);
  switch (t.bits) {
    case 8: return tile_code_scores_bits<V, 8>(t, tile, lo, hi, q16, ab, nq, s, s_stride);
    case 4: return tile_code_scores_bytes<V, 4>(t, tile, lo, hi, q8, ab, nq, s, s_stride);
    case 3: return tile_code_scores_bits<V, 3>(t, tile, lo, hi, q16, ab, nq, s, s_stride);
    case 2: return tile_code_scores_bytes<V, 2>(t, tile, lo, hi, q8, ab, nq, s, s_stride);
    default: return;  // codes_keys_ok excludes the rest
  }
}

template <class V>
void tile_code_sum(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p, std::size_t p_stride,
                   int nq, float* o) {
  switch (t.bits) {
    case 8: return tile_code_sum_bits<V, 8>(t, tile, lo, hi, p, p_stride, nq, o);
    case 4: return tile_code_sum_bits<V, 4>(t, tile, lo, hi, p, p_stride, nq, o);
    case 3: return tile_code_sum_bits<V, 3>(t, tile, lo, hi, p, p_stride, nq, o);
    case 2: return tile_code_sum_bits<V, 2>(t, tile, lo, hi, p, p_stride, nq, o);
    default: return;  // codes_values_ok excludes the rest
  }
}

}  // namespace
}  // namespace qkvshare::kernels::detail

// The level's entry points (kernel_table.hpp) over its own VecCodes, for a
// level whose 2N lanes divide every head and group the caller allows (AVX2:
// 16, NEON: 8); AVX-512 writes its own to hand narrower ones to AVX2.
#define QKVSHARE_DEFINE_CODE_KERNELS                                                                              \
  void tile_query_codes(const TileCodes& t, const std::byte* tile, const float* q, int nq, float score_scale,      \
                        void* qc, float* ab) {                                                                    \
    detail::tile_query_codes<VecCodes>(t, tile, q, nq, score_scale, qc, ab);                                      \
  }                                                                                                               \
  void tile_code_scores(const TileCodes& t, const std::byte* tile, int lo, int hi, const void* qc,                 \
                        const float* ab, int nq, float* s, std::size_t s_stride) {                                \
    detail::tile_code_scores<VecCodes>(t, tile, lo, hi, qc, ab, nq, s, s_stride);                                 \
  }                                                                                                               \
  void tile_code_sum(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p,                    \
                     std::size_t p_stride, int nq, float* o) {                                                    \
    detail::tile_code_sum<VecCodes>(t, tile, lo, hi, p, p_stride, nq, o);                                         \
  }
