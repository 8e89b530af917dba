#pragma once
// Internal: the vector-width trait of the SIMD level this translation unit is
// compiled for, so that a kernel body is written once (kv_tiles.hpp,
// vec_math.hpp) and instantiated by every level. Include it only from ISA
// units. Exactly one `Vec` is defined per unit, chosen by the unit's -m flags,
// inside the level's namespace and an anonymous one: internal linkage, so no
// other unit can end up calling this unit's copy (kernel_table.hpp says why).
//
// Vec::F            float vector of Vec::N lanes; Vec::I the int32 vector
// zero, set1, loadu, storeu, add, sub, mul, fmadd (a * b + c), min, max
// round (to nearest even), trunc (toward zero), div, select_lt(a, b, x, y)
// (lanes of x where a < b, else of y), to_int (of an integral F), half (I >> 1), isub,
// pow2i (2^k for k in the normal exponent range)
// hsum (sum of the lanes), hsum8 (out[r] = hsum(a[r]) for 8 vectors)
// load_f16 (N f16 values), f16x8 (exactly 8 f16 values to 8 floats in memory)
// store_f16 (N floats to f16, round to nearest even), any_nan
// codes<Bits>(row, c): the N codes of elements c.. of a packed row (pack_row in
//   kv_kernels.cpp: 8 elements per Bits bytes, element i of a unit at bit
//   i * Bits; c a multiple of N). May read up to 3 bytes past a unit: a tile's
//   parameters follow its codes.
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include "simd_intrin.hpp"
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
namespace qkvshare::kernels::detail::avx512 {
namespace {
struct Vec {
  using F = __m512;
  using I = __m512i;
  static constexpr int N = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F swap_pairs(F a) { return _mm512_permute_ps(a, 0xB1); }  // lanes (0 1)(2 3)... exchanged
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F trunc(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F select_lt(F a, F b, F x, F y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x); }
  static I to_int(F x) { return _mm512_cvtps_epi32(x); }
  static I half(I k) { return _mm512_srai_epi32(k, 1); }
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static F pow2i(I k) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k, _mm512_set1_epi32(127)), 23)); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static __m256 fold(F a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }
  static void hsum8(const F* a, float* out) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(fold(a[0]), fold(a[1])), _mm256_hadd_ps(fold(a[2]), fold(a[3])));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(fold(a[4]), fold(a[5])), _mm256_hadd_ps(fold(a[6]), fold(a[7])));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
  }
  static F load_f16(const std::uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store_f16(std::uint16_t* p, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static bool any_nan(F v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
  static void f16x8(const std::uint16_t* p, float* out) {
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  template <int Bits>
  static F codes(const std::byte* row, int c) {
    const std::byte* units = row + (c / 8) * Bits;
    if constexpr (Bits == 8) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(units))));
    } else {
      std::uint32_t w0, w1;
      std::memcpy(&w0, units, 4);
      std::memcpy(&w1, units + Bits, 4);
      const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(static_cast<int>(w0))),
                                               _mm256_set1_epi32(static_cast<int>(w1)), 1);
      const __m512i shifts = _mm512_setr_epi32(0, Bits, 2 * Bits, 3 * Bits, 4 * Bits, 5 * Bits, 6 * Bits, 7 * Bits, 0,
                                               Bits, 2 * Bits, 3 * Bits, 4 * Bits, 5 * Bits, 6 * Bits, 7 * Bits);
      const __m512i v = _mm512_srlv_epi32(words, shifts);
      return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32((1 << Bits) - 1)));
    }
  }
};
}  // namespace
}  // namespace qkvshare::kernels::detail::avx512

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
namespace qkvshare::kernels::detail::avx2 {
namespace {
struct Vec {
  using F = __m256;
  using I = __m256i;
  static constexpr int N = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F swap_pairs(F a) { return _mm256_permute_ps(a, 0xB1); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F trunc(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F select_lt(F a, F b, F x, F y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  static I to_int(F x) { return _mm256_cvtps_epi32(x); }
  static I half(I k) { return _mm256_srai_epi32(k, 1); }
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static F pow2i(I k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)); }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // One transpose-and-add instead of eight horizontal sums.
  static void hsum8(const F* a, float* out) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
  }
  static F load_f16(const std::uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store_f16(std::uint16_t* p, F v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static bool any_nan(F v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
  static void f16x8(const std::uint16_t* p, float* out) { _mm256_storeu_ps(out, load_f16(p)); }
  // A broadcast 32-bit word shifted by i * Bits per lane, then masked.
  template <int Bits>
  static F codes(const std::byte* row, int c) {
    const std::byte* unit = row + (c / 8) * Bits;
    if constexpr (Bits == 8) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit))));
    } else {
      std::uint32_t w;
      std::memcpy(&w, unit, 4);
      const __m256i shifts = _mm256_setr_epi32(0, Bits, 2 * Bits, 3 * Bits, 4 * Bits, 5 * Bits, 6 * Bits, 7 * Bits);
      const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts);
      return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((1 << Bits) - 1)));
    }
  }
};
}  // namespace
}  // namespace qkvshare::kernels::detail::avx2

#elif defined(__ARM_NEON) && defined(__aarch64__)
namespace qkvshare::kernels::detail::neon {
namespace {
struct Vec {
  using F = float32x4_t;
  using I = int32x4_t;
  static constexpr int N = 4;
  static F zero() { return vdupq_n_f32(0.0f); }
  static F set1(float x) { return vdupq_n_f32(x); }
  static F loadu(const float* p) { return vld1q_f32(p); }
  static void storeu(float* p, F v) { vst1q_f32(p, v); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F fmadd(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  static F swap_pairs(F a) { return vrev64q_f32(a); }
  static F min(F a, F b) { return vminq_f32(a, b); }
  static F max(F a, F b) { return vmaxq_f32(a, b); }
  static F round(F x) { return vrndnq_f32(x); }
  static F trunc(F x) { return vrndq_f32(x); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  static F select_lt(F a, F b, F x, F y) { return vbslq_f32(vcltq_f32(a, b), x, y); }
  static I to_int(F x) { return vcvtnq_s32_f32(x); }
  static I half(I k) { return vshrq_n_s32(k, 1); }
  static I isub(I a, I b) { return vsubq_s32(a, b); }
  static F pow2i(I k) { return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k, vdupq_n_s32(127)), 23)); }
  static float hsum(F v) { return vaddvq_f32(v); }
  static void hsum8(const F* a, float* out) {
    vst1q_f32(out, vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3])));
    vst1q_f32(out + 4, vpaddq_f32(vpaddq_f32(a[4], a[5]), vpaddq_f32(a[6], a[7])));
  }
  static F load_f16(const std::uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  static void store_f16(std::uint16_t* p, F v) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v))); }
  static bool any_nan(F v) { return vminvq_u32(vceqq_f32(v, v)) == 0; }
  static void f16x8(const std::uint16_t* p, float* out) {
    vst1q_f32(out, load_f16(p));
    vst1q_f32(out + 4, load_f16(p + 4));
  }
  // Half a unit: the 32-bit word of the unit shifted to element c % 8, then
  // per-lane shifts by i * Bits (negative vshl = right shift) and a mask.
  template <int Bits>
  static F codes(const std::byte* row, int c) {
    if constexpr (Bits == 8) {
      std::uint32_t w;
      std::memcpy(&w, row + c, 4);
      const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(w));
      return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(b))));
    } else {
      std::uint32_t w;
      std::memcpy(&w, row + (c / 8) * Bits, 4);
      w >>= (c % 8) * Bits;
      const int32x4_t shifts = {0, -Bits, -2 * Bits, -3 * Bits};
      const uint32x4_t v = vshlq_u32(vdupq_n_u32(w), shifts);
      return vcvtq_f32_u32(vandq_u32(v, vdupq_n_u32((1u << Bits) - 1u)));
    }
  }
};
}  // namespace
}  // namespace qkvshare::kernels::detail::neon
#endif
