// AVX-512 (F, BW, DQ, VL) versions of the tile kernels: 16 lanes. Heads
// whose size is not a multiple of 16 use the AVX2 versions (every AVX-512 CPU
// has AVX2). Like the AVX2 file, the functions carry their own target and run
// only after the run-time check.
// GCC 12 flags the deliberately undefined lanes inside its own AVX-512
// intrinsics (_mm512_undefined_ps) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstring>
#include <limits>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_kernels.hpp"

namespace qkvshare::kv {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")

namespace {

constexpr int kMaxHeadDim = 1024;
constexpr int kParamBatch = 512;  // (scale, min) pairs converted at a time

inline __m512 load_f16x16(const std::uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 codes = two 8-code units (see pack_row in kv_kernels.cpp).
template <int Bits>
inline __m512 unpack16(const std::byte* units) {
  if constexpr (Bits == 8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(units))));
  } else {
    std::uint32_t w0, w1;
    std::memcpy(&w0, units, 4);  // may read past the codes: the tile's params follow them
    std::memcpy(&w1, units + Bits, 4);
    const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(static_cast<int>(w0))),
                                             _mm256_set1_epi32(static_cast<int>(w1)), 1);
    const __m512i shifts = _mm512_setr_epi32(0, Bits, 2 * Bits, 3 * Bits, 4 * Bits, 5 * Bits, 6 * Bits, 7 * Bits, 0,
                                             Bits, 2 * Bits, 3 * Bits, 4 * Bits, 5 * Bits, 6 * Bits, 7 * Bits);
    const __m512i v = _mm512_srlv_epi32(words, shifts);
    return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32((1 << Bits) - 1)));
  }
}

// 32 4-bit codes (16 bytes: byte k holds elements 2k and 2k + 1): one widening
// load, low and high nibbles, and two lane interleaves into element order.
inline void unpack32_4bit(const std::byte* p, __m512& first, __m512& second) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(b, 4);
  const __m512i i0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  first = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, i0, hi));
  second = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, i1, hi));
}

// One row: out[v] = code[v] * s(v) + m(v) for the 16-lane vectors of the row.
template <int Bits, typename Params>
inline void decode_row(const std::byte* row, float* o, int vecs, const Params& params) {
  int v = 0;
  if constexpr (Bits == 4) {
    for (; v + 2 <= vecs; v += 2) {
      __m512 a, b;
      unpack32_4bit(row + v * 8, a, b);
      __m512 s, m;
      params(v, s, m);
      _mm512_storeu_ps(o + v * 16, _mm512_fmadd_ps(a, s, m));
      params(v + 1, s, m);
      _mm512_storeu_ps(o + v * 16 + 16, _mm512_fmadd_ps(b, s, m));
    }
  }
  for (; v < vecs; ++v) {
    __m512 s, m;
    params(v, s, m);
    _mm512_storeu_ps(o + v * 16, _mm512_fmadd_ps(unpack16<Bits>(row + v * 2 * Bits), s, m));
  }
}

template <int Bits>
void decode_quant(const KvCodec& codec, const TileLayout& l, const std::byte* tile, int n_rows, float* out) {
  const int D = l.head_dim, vecs = D / 16;
  const auto* scales = reinterpret_cast<const std::uint16_t*>(tile + l.param_offset);
  const auto* mins = scales + l.param_stride;
  if (codec.axis == KvAxis::channel) {
    alignas(64) float sf[kMaxHeadDim], mf[kMaxHeadDim];
    for (int v = 0; v < vecs; ++v) {
      _mm512_store_ps(sf + v * 16, load_f16x16(scales + v * 16));
      _mm512_store_ps(mf + v * 16, load_f16x16(mins + v * 16));
    }
    const auto params = [&](int v, __m512& s, __m512& m) {
      s = _mm512_load_ps(sf + v * 16);
      m = _mm512_load_ps(mf + v * 16);
    };
    for (int j = 0; j < n_rows; ++j)
      decode_row<Bits>(tile + static_cast<std::size_t>(j) * l.row_bytes, out + static_cast<std::size_t>(j) * D, vecs,
                       params);
    return;
  }
  const int G = effective_group(codec, D), groups = D / G;
  // All (scale, min) pairs of a batch of rows in f32 first: one broadcast load per group.
  alignas(64) float sf[kParamBatch + 16], mf[kParamBatch + 16];
  const int rows_per_batch = kParamBatch / groups;
  // The group of each 8-lane half: both halves of a vector may lie in different groups.
  int ga[kMaxHeadDim / 16], gb[kMaxHeadDim / 16];
  for (int v = 0; v < vecs; ++v) ga[v] = v * 16 / G, gb[v] = (v * 16 + 8) / G;
  for (int j0 = 0; j0 < n_rows; j0 += rows_per_batch) {
    const int j1 = j0 + rows_per_batch < n_rows ? j0 + rows_per_batch : n_rows;
    const int p0 = j0 * groups, np = (j1 - j0) * groups;
    for (int i = 0; i < np; i += 8) {  // 8 at a time: the param arrays are padded to 8
      _mm256_store_ps(sf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + p0 + i))));
      _mm256_store_ps(mf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + p0 + i))));
    }
    for (int j = j0; j < j1; ++j) {
      const float* sg = sf + (j - j0) * groups;
      const float* mg = mf + (j - j0) * groups;
      const auto params = [&](int v, __m512& s, __m512& m) {
        s = _mm512_set1_ps(sg[ga[v]]);
        m = _mm512_set1_ps(mg[ga[v]]);
        if (gb[v] != ga[v]) {
          s = _mm512_insertf32x8(s, _mm256_set1_ps(sg[gb[v]]), 1);
          m = _mm512_insertf32x8(m, _mm256_set1_ps(mg[gb[v]]), 1);
        }
      };
      decode_row<Bits>(tile + static_cast<std::size_t>(j) * l.row_bytes, out + static_cast<std::size_t>(j) * D, vecs,
                       params);
    }
  }
}

// NV vectors of the output stay in registers over all rows.
template <int NV>
void weighted_sum_nv(float* o, const float* p, const float* rows, int n_rows, int stride) {
  __m512 acc[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) acc[v] = _mm512_loadu_ps(o + 16 * v);
  for (int j = 0; j < n_rows; ++j) {
    const __m512 w = _mm512_set1_ps(p[j]);
    const float* r = rows + static_cast<std::ptrdiff_t>(j) * stride;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(r + 16 * v), acc[v]);
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + 16 * v, acc[v]);
}

inline __m256 fold(__m512 a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }

}  // namespace

void decode_tile_avx512(const KvCodec& codec, const TileLayout& l, const std::byte* tile, int n_rows, float* out) {
  if (l.head_dim % 16 != 0 || l.head_dim > kMaxHeadDim || n_rows < 0 || n_rows > l.tokens) {
    decode_tile_avx2(codec, l, tile, n_rows, out);
    return;
  }
  const std::size_t n = static_cast<std::size_t>(n_rows) * static_cast<std::size_t>(l.head_dim);
  switch (codec.type) {
    case KvType::f32: std::memcpy(out, tile, n * 4); return;
    case KvType::f16: {
      const auto* h = reinterpret_cast<const std::uint16_t*>(tile);
      for (std::size_t i = 0; i < n; i += 16) _mm512_storeu_ps(out + i, load_f16x16(h + i));
      return;
    }
    case KvType::q8: decode_quant<8>(codec, l, tile, n_rows, out); return;
    case KvType::q4: decode_quant<4>(codec, l, tile, n_rows, out); return;
    case KvType::q3: decode_quant<3>(codec, l, tile, n_rows, out); return;
    case KvType::q2: decode_quant<2>(codec, l, tile, n_rows, out); return;
  }
}

float scores_avx512(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s) {
  if (head_dim % 16 != 0) return scores_avx2(q, rows, n_rows, head_dim, scale, s);
  const __m256 vs = _mm256_set1_ps(scale);
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int j = 0;
  for (; j + 8 <= n_rows; j += 8) {
    const float* k = rows + static_cast<std::ptrdiff_t>(j) * head_dim;
    __m512 a[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) a[r] = _mm512_setzero_ps();
    for (int c = 0; c < head_dim; c += 16) {
      const __m512 qv = _mm512_loadu_ps(q + c);
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) a[r] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + r * head_dim + c), a[r]);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(fold(a[0]), fold(a[1])), _mm256_hadd_ps(fold(a[2]), fold(a[3])));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(fold(a[4]), fold(a[5])), _mm256_hadd_ps(fold(a[6]), fold(a[7])));
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    const __m256 sc = _mm256_mul_ps(sum, vs);
    vmax = _mm256_max_ps(vmax, sc);
    _mm256_storeu_ps(s + j, sc);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float m8 = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float tail = j < n_rows ? scores_avx2(q, rows + static_cast<std::ptrdiff_t>(j) * head_dim, n_rows - j, head_dim,
                                              scale, s + j)
                                : -std::numeric_limits<float>::infinity();
  return m8 > tail ? m8 : tail;
}

void weighted_sum_avx512(float* o, const float* p, const float* rows, int n_rows, int head_dim) {
  if (head_dim % 16 != 0) {
    weighted_sum_avx2(o, p, rows, n_rows, head_dim);
    return;
  }
  for (int c0 = 0; c0 < head_dim; c0 += 128) {
    const int left = (head_dim - c0) / 16;
    switch (left < 8 ? left : 8) {
      case 1: weighted_sum_nv<1>(o + c0, p, rows + c0, n_rows, head_dim); break;
      case 2: weighted_sum_nv<2>(o + c0, p, rows + c0, n_rows, head_dim); break;
      case 3: weighted_sum_nv<3>(o + c0, p, rows + c0, n_rows, head_dim); break;
      case 4: weighted_sum_nv<4>(o + c0, p, rows + c0, n_rows, head_dim); break;
      case 5: weighted_sum_nv<5>(o + c0, p, rows + c0, n_rows, head_dim); break;
      case 6: weighted_sum_nv<6>(o + c0, p, rows + c0, n_rows, head_dim); break;
      case 7: weighted_sum_nv<7>(o + c0, p, rows + c0, n_rows, head_dim); break;
      default: weighted_sum_nv<8>(o + c0, p, rows + c0, n_rows, head_dim); break;
    }
  }
}

#pragma GCC pop_options

}  // namespace qkvshare::kv
