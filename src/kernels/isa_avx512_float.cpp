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


}  // namespace qkvshare::kernels::detail::avx512
