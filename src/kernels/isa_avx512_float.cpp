// AVX-512 kernels with f32 activations: F32, F16 and BF16 weights (decoded
// to f32 in registers, FMA), attention of one head over f32 keys/values, and
// SwiGLU; the last two with a vector exp.
// Built with AVX-512 flags; reached only through isa.cpp after the CPU check.
#include "simd_intrin.hpp"

#include "gemm_tiles.hpp"
#include "kernel_table.hpp"
#include "vec_math.hpp"

namespace qkvshare::kernels::detail::avx512 {
namespace {

enum class Kind { f32, f16, bf16 };

inline __mmask16 tail_mask(std::int64_t n) { return static_cast<__mmask16>((1u << (n % 16)) - 1u); }
// Lanes of [i, i + 16) that lie below n.
inline __mmask16 tail_mask_at(std::int64_t n, std::int64_t i) {
  return n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1u);
}

// A step is 16 values; a partial last step loads through a mask (no read past the row).
template <Kind K>
struct FFloat {
  using Acc = __m512;
  using W = __m512;
  using X = __m512;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }
  static std::int64_t steps(std::int64_t cols) { return cols / 16; }
  static bool tail(std::int64_t cols) { return cols % 16 != 0; }
  static __m512 decode(__m256i h) {
    if constexpr (K == Kind::f16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __m512 load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    if constexpr (K == Kind::f32) return _mm512_loadu_ps(row + 64 * s);
    return decode(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * s)));
  }
  static __m512 load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) {
    if constexpr (K == Kind::f32) return _mm512_maskz_loadu_ps(tail_mask(a.cols), row + 64 * s);
    return decode(_mm256_maskz_loadu_epi16(tail_mask(a.cols), row + 32 * s));
  }
  static __m512 load_x(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    return _mm512_loadu_ps(a.x + t * a.cols + 16 * s);
  }
  static __m512 load_x_tail(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    return _mm512_maskz_loadu_ps(tail_mask(a.cols), a.x + t * a.cols + 16 * s);
  }
  static void mac(__m512& acc, __m512 w, __m512 x) { acc = _mm512_fmadd_ps(w, x, acc); }
};

// The one vector exp (vec_math.hpp).
inline __m512 exp_ps(__m512 x) { return vexp<Vec>(x); }

// In place, as kernels::softmax (every entry -inf gives the uniform distribution).
void softmax_ps(float* x, int n) {
  __m512 m = _mm512_set1_ps(-__builtin_inff());
  for (int i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, tail_mask_at(n, i), x + i));
  const float max = _mm512_reduce_max_ps(m);
  if (max == -__builtin_inff()) {
    for (int i = 0; i < n; ++i) x[i] = 1.0f / static_cast<float>(n);
    return;
  }
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask_at(n, i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), _mm512_set1_ps(max)));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    _mm512_mask_storeu_ps(x + i, k, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask_at(n, i);
    _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv));
  }
}

// r[j] = sum of a[j]'s lanes for 16 vectors: pairs of unpacks, then of
// 128-bit lane shuffles, halve the vectors four times (45 instructions where
// 16 separate reductions take about 130).
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k)
    b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * k]), _mm512_castps_pd(b[2 * k + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * k]), _mm512_castps_pd(b[2 * k + 1]));
    c[k] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // lane L: partial sums of keys 4k..4k+3
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Head vectors of up to 16 * NV values stay in registers: q while the scores
// are computed (16 keys at a time), the output while the values are summed
// (two keys at a time into two sets of sums, for independent FMA chains).
template <int NV>
void attend_nv(const float* q, const float* keys, const float* values, std::int64_t stride, int n_keys,
               int head_dim, float scale, float* scores, float* out) {
  __mmask16 mask[NV];
  __m512 qv[NV];
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) {
    mask[i] = tail_mask_at(head_dim, 16 * i);
    qv[i] = _mm512_maskz_loadu_ps(mask[i], q + 16 * i);
  }
  const auto dot = [&](const float* k) {
    __m512 acc = _mm512_mul_ps(qv[0], _mm512_maskz_loadu_ps(mask[0], k));
#pragma GCC unroll 8
    for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(qv[i], _mm512_maskz_loadu_ps(mask[i], k + 16 * i), acc);
    return acc;
  };
  int j = 0;
  for (; j + 16 <= n_keys; j += 16) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) acc[u] = dot(keys + (j + u) * stride);
    _mm512_storeu_ps(scores + j, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
  }
  for (; j < n_keys; ++j) scores[j] = _mm512_reduce_add_ps(dot(keys + j * stride)) * scale;
  softmax_ps(scores, n_keys);
  __m512 o[2][NV];
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) o[0][i] = o[1][i] = _mm512_setzero_ps();
  j = 0;
  for (; j + 2 <= n_keys; j += 2)
#pragma GCC unroll 2
    for (int u = 0; u < 2; ++u) {
      const float* v = values + (j + u) * stride;
      const __m512 p = _mm512_set1_ps(scores[j + u]);
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) o[u][i] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(mask[i], v + 16 * i), o[u][i]);
    }
  if (j < n_keys) {
    const float* v = values + j * stride;
    const __m512 p = _mm512_set1_ps(scores[j]);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) o[0][i] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(mask[i], v + 16 * i), o[0][i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) _mm512_mask_storeu_ps(out + 16 * i, mask[i], _mm512_add_ps(o[0][i], o[1][i]));
}

// Any head size: the output accumulates in memory.
void attend_any(const float* q, const float* keys, const float* values, std::int64_t stride, int n_keys,
                int head_dim, float scale, float* scores, float* out) {
  for (int j = 0; j < n_keys; ++j) {
    const float* k = keys + j * stride;
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < head_dim; i += 16) {
      const __mmask16 m = tail_mask_at(head_dim, i);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + i), _mm512_maskz_loadu_ps(m, k + i), acc);
    }
    scores[j] = _mm512_reduce_add_ps(acc) * scale;
  }
  softmax_ps(scores, n_keys);
  for (int i = 0; i < head_dim; i += 16) {
    const __mmask16 m = tail_mask_at(head_dim, i);
    __m512 o = _mm512_setzero_ps();
    for (int j = 0; j < n_keys; ++j)
      o = _mm512_fmadd_ps(_mm512_set1_ps(scores[j]), _mm512_maskz_loadu_ps(m, values + j * stride + i), o);
    _mm512_mask_storeu_ps(out + i, m, o);
  }
}

}  // namespace

void gelu_mul(float* gate, const float* up, std::int64_t n) { gelu_mul_rows<Vec>(gate, up, n); }

void silu_mul(float* gate, const float* up, std::int64_t n) {
  for (std::int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask_at(n, i);
    const __m512 g = _mm512_maskz_loadu_ps(k, gate + i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_mask_storeu_ps(gate + i, k, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, up + i)));
  }
}

void gemm_f32(const GemmArgs& a) { gemm_tiled<FFloat<Kind::f32>, 4, 4>(a); }
void gemm_f16(const GemmArgs& a) { gemm_tiled<FFloat<Kind::f16>, 4, 4>(a); }
void gemm_bf16(const GemmArgs& a) { gemm_tiled<FFloat<Kind::bf16>, 4, 4>(a); }

void attend(const float* q, const float* keys, const float* values, std::int64_t stride, int n_keys, int head_dim,
            float scale, float* scores, float* out) {
  switch ((head_dim + 15) / 16) {
    case 1: return attend_nv<1>(q, keys, values, stride, n_keys, head_dim, scale, scores, out);
    case 2: return attend_nv<2>(q, keys, values, stride, n_keys, head_dim, scale, scores, out);
    case 4: return attend_nv<4>(q, keys, values, stride, n_keys, head_dim, scale, scores, out);
    case 8: return attend_nv<8>(q, keys, values, stride, n_keys, head_dim, scale, scores, out);
    default: return attend_any(q, keys, values, stride, n_keys, head_dim, scale, scores, out);
  }
}

}  // namespace qkvshare::kernels::detail::avx512
