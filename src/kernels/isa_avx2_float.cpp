// AVX2 kernels with f32 activations: F32, F16 and BF16 weights (decoded to
// f32 in registers, FMA), attention of one head over f32 keys/values, and
// SwiGLU; the last two with a vector exp.
// Built with AVX2/FMA/F16C flags; reached only through isa.cpp after the CPU
// check. AVX2 has no masked 16-bit loads, so a partial last step of 8 values
// goes through a zeroed buffer.
#include "simd_intrin.hpp"

#include <cstring>

#include "gemm_tiles.hpp"
#include "kernel_table.hpp"
#include "vec_math.hpp"

namespace qkvshare::kernels::detail::avx2 {
namespace {

enum class Kind { f32, f16, bf16 };

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Loads the first n (< 8) floats of p, the rest zero.
inline __m256 load_partial(const float* p, std::int64_t n) {
  float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(buf, p, static_cast<std::size_t>(n) * sizeof(float));
  return _mm256_loadu_ps(buf);
}

template <Kind K>
struct FFloat {
  using Acc = __m256;
  using W = __m256;
  using X = __m256;
  static __m256 zero() { return _mm256_setzero_ps(); }
  static float reduce(__m256 v) { return hsum(v); }
  static std::int64_t steps(std::int64_t cols) { return cols / 8; }
  static bool tail(std::int64_t cols) { return cols % 8 != 0; }
  static __m256 decode(__m128i h) {
    if constexpr (K == Kind::f16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static __m256 load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    if constexpr (K == Kind::f32) return _mm256_loadu_ps(reinterpret_cast<const float*>(row + 32 * s));
    return decode(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * s)));
  }
  static __m256 load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) {
    const std::int64_t n = a.cols % 8;
    if constexpr (K == Kind::f32) return load_partial(reinterpret_cast<const float*>(row + 32 * s), n);
    std::uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(buf, row + 16 * s, static_cast<std::size_t>(n) * 2);
    return decode(_mm_loadu_si128(reinterpret_cast<const __m128i*>(buf)));
  }
  static __m256 load_x(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    return _mm256_loadu_ps(a.x + t * a.cols + 8 * s);
  }
  static __m256 load_x_tail(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    return load_partial(a.x + t * a.cols + 8 * s, a.cols % 8);
  }
  static void mac(__m256& acc, __m256 w, __m256 x) { acc = _mm256_fmadd_ps(w, x, acc); }
};


// The one vector exp (vec_math.hpp).
inline __m256 exp_ps(__m256 x) { return vexp<Vec>(x); }


}  // namespace

void gelu_mul(float* gate, const float* up, std::int64_t n) { gelu_mul_rows<Vec>(gate, up, n); }

void silu_mul(float* gate, const float* up, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(gate + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
  if (i < n) {
    float buf[8];
    const __m256 g = load_partial(gate + i, n - i);
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(buf, _mm256_mul_ps(s, load_partial(up + i, n - i)));
    for (std::int64_t j = 0; j < n - i; ++j) gate[i + j] = buf[j];
  }
}

void gemm_f32(const GemmArgs& a) { gemm_tiled<FFloat<Kind::f32>, 4, 2>(a); }
void gemm_f16(const GemmArgs& a) { gemm_tiled<FFloat<Kind::f16>, 4, 2>(a); }
void gemm_bf16(const GemmArgs& a) { gemm_tiled<FFloat<Kind::bf16>, 4, 2>(a); }


}  // namespace qkvshare::kernels::detail::avx2
