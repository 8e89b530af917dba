// AVX2 + FMA + F16C versions of the tile kernels, and the run-time choice of
// ISA. The library is built for the baseline ISA, so these functions carry
// their own target and are only called after the CPU check.
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_kernels.hpp"

namespace qkvshare::kv {

namespace {

bool cpu_has_avx2() noexcept {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
  const bool f16c = (c & (1u << 29)) != 0;
  return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_avx512() noexcept {
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

}  // namespace

bool kv_isa_supported(KvIsa isa) noexcept {
  static const bool avx2 = cpu_has_avx2(), avx512 = cpu_has_avx512();
  switch (isa) {
    case KvIsa::scalar: return true;
    case KvIsa::avx2: return avx2;
    case KvIsa::avx512: return avx512;
  }
  return false;
}

KvIsa best_kv_isa() noexcept {
  return kv_isa_supported(KvIsa::avx512) ? KvIsa::avx512 : kv_isa_supported(KvIsa::avx2) ? KvIsa::avx2 : KvIsa::scalar;
}

const KvKernels& kv_kernels(KvIsa isa) {
  static const KvKernels scalar{decode_tile_scalar, scores_scalar, weighted_sum_scalar, exp_sum_scalar};
  static const KvKernels avx2{decode_tile_avx2, scores_avx2, weighted_sum_avx2, exp_sum_avx2};
  static const KvKernels avx512{decode_tile_avx512, scores_avx512, weighted_sum_avx512, exp_sum_avx2};
  if (!kv_isa_supported(isa)) fail(ErrorCode::unsupported, "KV kernels: this CPU lacks the requested SIMD level");
  return isa == KvIsa::avx512 ? avx512 : isa == KvIsa::avx2 ? avx2 : scalar;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {

inline __m256 load_f16x8(const std::uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 codes of `bits` bits from one unit (see pack_row in kv_kernels.cpp): a
// broadcast 32-bit word shifted by i * bits per lane, then masked.
template <int Bits>
inline __m256 unpack8(const std::byte* unit) {
  if constexpr (Bits == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  } else {
    std::uint32_t w;
    std::memcpy(&w, unit, 4);  // may read past a 2/3-byte unit: the tile's params follow the codes
    const __m256i shifts = _mm256_setr_epi32(0, Bits, 2 * Bits, 3 * Bits, 4 * Bits, 5 * Bits, 6 * Bits, 7 * Bits);
    const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts);
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((1 << Bits) - 1)));
  }
}

constexpr int kMaxHeadDim = 1024;
constexpr int kParamBatch = 512;  // (scale, min) pairs converted at a time

template <int Bits>
void decode_quant(const KvCodec& codec, const TileLayout& l, const std::byte* tile, int n_rows, float* out) {
  const int D = l.head_dim, units = D / 8;
  const auto* scales = reinterpret_cast<const std::uint16_t*>(tile + l.param_offset);
  const auto* mins = scales + l.param_stride;
  if (codec.axis == KvAxis::channel) {
    // The channel parameters once per tile, then one fma per 8 elements of each row.
    alignas(32) float sf[kMaxHeadDim], mf[kMaxHeadDim];
    for (int u = 0; u < units; ++u) {
      _mm256_store_ps(sf + u * 8, load_f16x8(scales + u * 8));
      _mm256_store_ps(mf + u * 8, load_f16x8(mins + u * 8));
    }
    for (int j = 0; j < n_rows; ++j) {
      const std::byte* row = tile + static_cast<std::size_t>(j) * l.row_bytes;
      float* o = out + static_cast<std::size_t>(j) * D;
      for (int u = 0; u < units; ++u) {
        const __m256 x = unpack8<Bits>(row + u * Bits);
        _mm256_storeu_ps(o + u * 8, _mm256_fmadd_ps(x, _mm256_load_ps(sf + u * 8), _mm256_load_ps(mf + u * 8)));
      }
    }
    return;
  }
  const int G = effective_group(codec, D), groups = D / G, upg = G / 8;
  // All (scale, min) pairs of the rows in f32 first, in batches of rows, so
  // each group is one broadcast load.
  alignas(32) float sf[kParamBatch + 8], mf[kParamBatch + 8];
  const int rows_per_batch = kParamBatch / groups;
  for (int j0 = 0; j0 < n_rows; j0 += rows_per_batch) {
    const int j1 = j0 + rows_per_batch < n_rows ? j0 + rows_per_batch : n_rows;
    const int p0 = j0 * groups, np = (j1 - j0) * groups;
    for (int i = 0; i < np; i += 8) {
      _mm256_store_ps(sf + i, load_f16x8(scales + p0 + i));  // may read a little past: params end inside the tile
      _mm256_store_ps(mf + i, load_f16x8(mins + p0 + i));
    }
    for (int j = j0; j < j1; ++j) {
      const std::byte* row = tile + static_cast<std::size_t>(j) * l.row_bytes;
      float* o = out + static_cast<std::size_t>(j) * D;
      for (int g = 0; g < groups; ++g) {
        const int p = (j - j0) * groups + g;
        const __m256 sv = _mm256_broadcast_ss(sf + p), mv = _mm256_broadcast_ss(mf + p);
        for (int u = g * upg; u < (g + 1) * upg; ++u)
          _mm256_storeu_ps(o + u * 8, _mm256_fmadd_ps(unpack8<Bits>(row + u * Bits), sv, mv));
      }
    }
  }
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// exp(x) for x <= 0 (scores minus their max): Cephes-style range reduction
// and a degree-6 polynomial, about 2 ulp.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

}  // namespace

void decode_tile_avx2(const KvCodec& codec, const TileLayout& l, const std::byte* tile, int n_rows, float* out) {
  QKV_CHECK(n_rows >= 0 && n_rows <= l.tokens && l.head_dim <= kMaxHeadDim);
  const std::size_t n = static_cast<std::size_t>(n_rows) * static_cast<std::size_t>(l.head_dim);
  switch (codec.type) {
    case KvType::f32: std::memcpy(out, tile, n * 4); return;
    case KvType::f16: {
      const auto* h = reinterpret_cast<const std::uint16_t*>(tile);
      for (std::size_t i = 0; i < n; i += 8) _mm256_storeu_ps(out + i, load_f16x8(h + i));
      return;
    }
    case KvType::q8: decode_quant<8>(codec, l, tile, n_rows, out); return;
    case KvType::q4: decode_quant<4>(codec, l, tile, n_rows, out); return;
    case KvType::q3: decode_quant<3>(codec, l, tile, n_rows, out); return;
    case KvType::q2: decode_quant<2>(codec, l, tile, n_rows, out); return;
  }
}

// 8 rows at a time, each with its own accumulator, reduced together: one
// transpose-and-add instead of eight horizontal sums.
float scores_avx2(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s) {
  const __m256 vs = _mm256_set1_ps(scale);
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int j = 0;
  for (; j + 8 <= n_rows; j += 8) {
    const float* k = rows + static_cast<std::ptrdiff_t>(j) * head_dim;
    __m256 a[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
    for (int c = 0; c < head_dim; c += 8) {
      const __m256 qv = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + r * head_dim + c), a[r]);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    const __m256 sc = _mm256_mul_ps(sum, vs);
    vmax = _mm256_max_ps(vmax, sc);
    _mm256_storeu_ps(s + j, sc);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4)));
  for (; j < n_rows; ++j) {
    const float* k = rows + static_cast<std::ptrdiff_t>(j) * head_dim;
    __m256 a = _mm256_setzero_ps();
    for (int c = 0; c < head_dim; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), a);
    s[j] = hsum(a) * scale;
    m = std::max(m, s[j]);
  }
  return m;
}

namespace {

// NV vectors of the output stay in registers over all rows.
template <int NV>
void weighted_sum_nv(float* o, const float* p, const float* rows, int n_rows, int stride) {
  __m256 acc[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_loadu_ps(o + 8 * v);
  for (int j = 0; j < n_rows; ++j) {
    const __m256 w = _mm256_set1_ps(p[j]);
    const float* r = rows + static_cast<std::ptrdiff_t>(j) * stride;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8 * v), acc[v]);
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + 8 * v, acc[v]);
}

}  // namespace

void weighted_sum_avx2(float* o, const float* p, const float* rows, int n_rows, int head_dim) {
  for (int c0 = 0; c0 < head_dim; c0 += 64) {
    switch (std::min(8, (head_dim - c0) / 8)) {
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

float exp_sum_avx2(float* x, int n, float max) {
  const __m256 vm = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  return sum;
}

#pragma GCC pop_options

}  // namespace qkvshare::kv
