// Scalar references of the KV tile kernels (kv_tiles.hpp), and the portable
// level's versions of them. The SIMD bodies in kv_tiles.hpp are tested
// against these.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/half.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"
#include "qkvshare/kernels/ops.hpp"
#include "kv_params.hpp"
#include "pq_rows.hpp"

namespace qkvshare::kernels {

namespace {

int unpack_code(const std::byte* row, int i, int bits) {
  const int u = i / 8, k = i % 8;
  std::uint64_t word = 0;
  for (int b = 0; b < bits; ++b) word |= static_cast<std::uint64_t>(row[u * bits + b]) << (8 * b);
  return static_cast<int>((word >> (k * bits)) & ((1u << bits) - 1u));
}

// Element c of a row of b-bit codes under pair p of the tile: fma, like the
// SIMD levels, so that every level decodes to the same bits.
inline float decode_code(const TileCodes& t, const std::byte* tile, const std::byte* row, int c, int p) {
  float scale = 0.0f, min = 0.0f;
  tile_param_ref(t, tile, p, scale, min);
  return std::fma(static_cast<float>(unpack_code(row, c, t.bits)), scale, min);
}

}  // namespace

void tile_param_ref(const TileCodes& t, const std::byte* tile, int p, float& scale, float& min) {
  if (t.byte_params) return detail::byte_params_f32(t, tile, p, 1, &scale, &min);
  const auto* scales = reinterpret_cast<const std::uint16_t*>(tile + t.param_offset);
  scale = fp16_to_fp32(scales[p]);
  min = fp16_to_fp32(scales[t.param_stride + static_cast<std::size_t>(p)]);
}

float byte_param_scale(std::uint8_t u, int scale_exp) noexcept {
  return detail::byte_scale(u, static_cast<std::uint32_t>(scale_exp + 127) << 23);
}

float byte_param_min(std::uint8_t u, float min_lo, float min_step) noexcept {
  return detail::byte_min(u, detail::ByteParamGrid{min_lo, min_step, 0});
}

float decode_element_ref(const TileCodes& t, const std::byte* tile, int j, int c) {
  const int p = t.per_channel ? c : j * (t.head_dim / t.group) + c / t.group;
  return decode_code(t, tile, tile + static_cast<std::size_t>(j) * t.row_bytes, c, p);
}

void decode_tile_ref(const TileCodes& t, const std::byte* tile, int n_rows, float* out) {
  const int D = t.head_dim;
  const std::size_t n = static_cast<std::size_t>(n_rows) * static_cast<std::size_t>(D);
  if (t.bits == 32) {
    std::memcpy(out, tile, n * sizeof(float));
    return;
  }
  if (t.bits == 16) {
    const auto* h = reinterpret_cast<const std::uint16_t*>(tile);
    for (std::size_t i = 0; i < n; ++i) out[i] = fp16_to_fp32(h[i]);
    return;
  }
  if (t.pq_sub > 0) {
    decode_pq_rows(t, tile, n_rows, out);
    return;
  }
  const int G = t.per_channel ? 1 : t.group, groups = t.per_channel ? 1 : D / G;
  for (int j = 0; j < n_rows; ++j) {
    const std::byte* row = tile + static_cast<std::size_t>(j) * t.row_bytes;
    for (int c = 0; c < D; ++c) {
      out[static_cast<std::size_t>(j) * D + c] = decode_code(t, tile, row, c, t.per_channel ? c : j * groups + c / G);
    }
  }
}

float scores_ref(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s) {
  float m = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n_rows; ++j) {
    const float* k = rows + static_cast<std::ptrdiff_t>(j) * head_dim;
    float acc = 0.0f;
    for (int c = 0; c < head_dim; ++c) acc += q[c] * k[c];
    s[j] = acc * scale;
    m = std::max(m, s[j]);
  }
  return m;
}

void weighted_sum_ref(float* o, const float* p, const float* rows, int n_rows, int head_dim) {
  for (int j = 0; j < n_rows; ++j) {
    const float* v = rows + static_cast<std::ptrdiff_t>(j) * head_dim;
    for (int c = 0; c < head_dim; ++c) o[c] += p[j] * v[c];
  }
}

void rope_table_row(float pos, const float* inv_freq, int head_dim, RopeStyle style, float* row) {
  const int half = head_dim / 2;
  float* C = row;
  float* S = row + head_dim;
  std::vector<float> cs(static_cast<std::size_t>(head_dim));
  rope_angles(pos, inv_freq, head_dim, cs.data(), cs.data() + half);
  for (int i = 0; i < half; ++i) {
    const int a = style == RopeStyle::interleaved ? 2 * i : i;
    const int b = style == RopeStyle::interleaved ? 2 * i + 1 : i + half;
    C[a] = C[b] = cs[static_cast<std::size_t>(i)];
    S[a] = -cs[static_cast<std::size_t>(half + i)];
    S[b] = cs[static_cast<std::size_t>(half + i)];
  }
}

void rope_rows_ref(float* rows, int n_rows, int head_dim, const float* table, std::ptrdiff_t table_step, RopeStyle style) {
  const int half = head_dim / 2;
  float x[kTileMaxHeadDim];  // the row before it turns (this is the portable level's kernel: no allocation)
  for (int r = 0; r < n_rows; ++r) {
    float* row = rows + static_cast<std::ptrdiff_t>(r) * head_dim;
    const float* C = table + r * table_step;
    const float* S = C + head_dim;
    std::copy(row, row + head_dim, x);
    for (int c = 0; c < head_dim; ++c) {
      const int p = style == RopeStyle::interleaved ? c ^ 1 : (c + half) % head_dim;
      row[c] = std::fma(x[c], C[c], x[p] * S[c]);
    }
  }
}

// Series are taken 64 at a time, each step looping over them innermost, so
// that the compiler vectorizes the reference itself (the portable level
// runs it): the operations of one series stay in the order the kernels
// follow. A range narrower than kFitMinRange is not searched (no division
// by it can overflow).
void fit_ranges_ref(const float* x, int n, std::ptrdiff_t stride, int lanes, int qmax, float* lo, float* hi) {
  constexpr int kChunk = 64;
  const float top = static_cast<float>(qmax), cap = top + 0.25f, step = qmax <= 3 ? 0.04f : 0.02f;
  for (int s0 = 0; s0 < lanes; s0 += kChunk) {
    const int m = std::min(kChunk, lanes - s0);
    const float* xs = x + s0;
    float l0[kChunk], h0[kChunk], rs[kChunk], l[kChunk], h[kChunk], sc[kChunk], inv[kChunk], e[kChunk], best[kChunk],
        bl[kChunk], bh[kChunk];
    for (int s = 0; s < m; ++s) l0[s] = h0[s] = xs[s];
    for (int i = 1; i < n; ++i)
      for (int s = 0; s < m; ++s) {
        l0[s] = std::min(l0[s], xs[i * stride + s]);
        h0[s] = std::max(h0[s], xs[i * stride + s]);
      }
    for (int s = 0; s < m; ++s) {
      l0[s] += 0.0f;  // -0 to +0, as every level does
      h0[s] += 0.0f;
      rs[s] = (h0[s] - l0[s]) * step;
    }
    // Candidate -1 is the full range, then the 6 x 6 clipped ones.
    for (int k = -1; k < 36; ++k) {
      const float a = k < 0 ? 0.0f : static_cast<float>(k / 6), b = k < 0 ? 0.0f : static_cast<float>(k % 6);
      for (int s = 0; s < m; ++s) {
        l[s] = l0[s] + rs[s] * a;
        h[s] = h0[s] - rs[s] * b;
        sc[s] = (h[s] - l[s]) / top;
        // (A series too narrow to search gets no inverse: its errors are
        // never read, and no NaN reaches the integer conversion below.)
        inv[s] = h[s] - l[s] > 0.5f * kFitMinRange ? top / (h[s] - l[s]) : 0.0f;
        e[s] = 0.0f;
      }
      for (int i = 0; i < n; ++i)
        for (int s = 0; s < m; ++s) {
          const float v = xs[i * stride + s];
          const float t = std::min(std::max((v - l[s]) * inv[s] + 0.5f, 0.0f), cap);
          const float d = v - (static_cast<float>(static_cast<int>(t)) * sc[s] + l[s]);
          e[s] += d * d;
        }
      for (int s = 0; s < m; ++s)
        if (k < 0 || e[s] < best[s]) best[s] = e[s], bl[s] = l[s], bh[s] = h[s];
    }
    for (int s = 0; s < m; ++s) {
      const bool searched = h0[s] - l0[s] > kFitMinRange;
      lo[s0 + s] = searched ? bl[s] : l0[s];
      hi[s0 + s] = searched ? bh[s] : h0[s];
    }
  }
}

float max_ref(const float* x, int n, float m) {
  for (int i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

float exp_sum_ref(float* x, int n, float max) {
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  return sum;
}

namespace {

// The rounding of round_codes (kv_codes.hpp): |x| max -> qmax.
template <class Out>
float round_codes_ref(const float* x, int n, int qmax, Out* out) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) m = std::max(m, std::abs(x[i]));
  const float inv = m > 0.0f ? static_cast<float>(qmax) / m : 0.0f;
  for (int i = 0; i < n; ++i) out[i] = static_cast<Out>(std::nearbyint(x[i] * inv));
  return m / static_cast<float>(qmax);
}

// Query code c of query i, in the layout query_codes writes.
int query_code(const TileCodes& t, const void* qc, std::size_t at) {
  return byte_query_codes(t.bits) ? static_cast<const std::int8_t*>(qc)[at] : static_cast<const std::int16_t*>(qc)[at];
}

float centre_of(int bits) { return static_cast<float>(1 << (bits - 1)); }

}  // namespace

void query_codes_ref(const TileCodes& t, const std::byte* tile, const float* q, int nq, float score_scale,
                     void* qc, float* ab) {
  const int D = t.head_dim;
  std::vector<float> qs(static_cast<std::size_t>(D));
  for (int i = 0; i < nq; ++i) {
    const float* qi = q + static_cast<std::size_t>(i) * D;
    float bias = 0.0f;
    for (int c = 0; c < D; ++c) {
      float sc = 0.0f, mn = 0.0f;
      tile_param_ref(t, tile, c, sc, mn);
      qs[static_cast<std::size_t>(c)] = qi[c] * sc;
      bias += qi[c] * std::fma(centre_of(t.bits), sc, mn);
    }
    const std::size_t at = static_cast<std::size_t>(i) * D;
    const int qmax = query_code_max(t.bits, D);
    const float step = byte_query_codes(t.bits) ? round_codes_ref(qs.data(), D, qmax, static_cast<std::int8_t*>(qc) + at)
                                   : round_codes_ref(qs.data(), D, qmax, static_cast<std::int16_t*>(qc) + at);
    ab[2 * i] = score_scale * step;
    ab[2 * i + 1] = score_scale * bias;
  }
}

namespace {

// Centred codes of rows [lo, hi): [j - lo][c].
std::vector<int> centred_codes(const TileCodes& t, const std::byte* tile, int lo, int hi) {
  const int D = t.head_dim;
  std::vector<int> out(static_cast<std::size_t>(hi - lo) * static_cast<std::size_t>(D));
  for (int j = lo; j < hi; ++j)
    for (int c = 0; c < D; ++c)
      out[static_cast<std::size_t>(j - lo) * D + c] =
          unpack_code(tile + static_cast<std::size_t>(j) * t.row_bytes, c, t.bits) - (1 << (t.bits - 1));
  return out;
}

}  // namespace

void code_scores_ref(const TileCodes& t, const std::byte* tile, int lo, int hi, const void* qc, const float* ab,
                     int nq, float* s, std::size_t s_stride) {
  const int D = t.head_dim;
  if (hi <= lo) return;
  const std::vector<int> codes = centred_codes(t, tile, lo, hi);
  for (int i = 0; i < nq; ++i)
    for (int j = lo; j < hi; ++j) {
      const int* row = &codes[static_cast<std::size_t>(j - lo) * D];
      std::int32_t sum = 0;
      for (int c = 0; c < D; ++c) sum += query_code(t, qc, static_cast<std::size_t>(i) * D + c) * row[c];
      s[static_cast<std::size_t>(i) * s_stride + j] = std::fma(ab[2 * i], static_cast<float>(sum), ab[2 * i + 1]);
    }
}

void code_sum_ref(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p, std::size_t p_stride,
                  int nq, float* o) {
  const int D = t.head_dim, G = t.group, groups = D / G;
  std::vector<float> w(kCodeWindow);
  std::vector<std::int16_t> w16(kCodeWindow);
  if (hi <= lo) return;
  const std::vector<int> codes = centred_codes(t, tile, lo, hi);
  for (int j0 = lo & ~3; j0 < hi; j0 += kCodeWindow) {
    const int j1 = std::min(j0 + kCodeWindow, hi), ja = std::max(j0, lo);
    for (int i = 0; i < nq; ++i)
      for (int g = 0; g < groups; ++g) {
        const float* pi = p + static_cast<std::size_t>(i) * p_stride;
        float bias = 0.0f;
        std::fill(w.begin(), w.end(), 0.0f);
        for (int j = ja; j < j1; ++j) {
          float sc = 0.0f, mn = 0.0f;
          tile_param_ref(t, tile, j * groups + g, sc, mn);
          w[static_cast<std::size_t>(j - j0)] = pi[j] * sc;
          bias += pi[j] * std::fma(centre_of(t.bits), sc, mn);
        }
        const float step = round_codes_ref(w.data(), kCodeWindow, value_weight_max(t.bits), w16.data());
        for (int c = g * G; c < (g + 1) * G; ++c) {
          std::int32_t sum = 0;
          for (int j = ja; j < j1; ++j)
            sum += w16[static_cast<std::size_t>(j - j0)] * codes[static_cast<std::size_t>(j - lo) * D + c];
          o[static_cast<std::size_t>(i) * D + c] += std::fma(step, static_cast<float>(sum), bias);
        }
      }
  }
}

void encode_f16_ref(const float* x, std::size_t n, std::uint16_t* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = fp32_to_fp16(x[i]);
}

}  // namespace qkvshare::kernels
