#pragma once
// Internal: 512-bit formats (gemm_tiles.hpp) of Q4_K and Q5_K for the AVX-512
// level, one super-block (256 values) per step, with the super-block
// activations (kernel_table.hpp ActQ8::dk, ggml's Q8_K). Include it only from
// an AVX-512 unit: everything has internal linkage (kernel_table.hpp says why).
//
// A row's 8 scales and 8 minimums are unpacked once per super-block
// (scales_mins_k4). Each 64-value chunk c holds sub-blocks 2c and 2c + 1 (the
// low and high nibbles of the same 32 bytes); its products are summed in 16
// bits (maddubs: at most 2 * 31 * 127) and, times the pair of 6-bit scales,
// into 32-bit lanes (vpdpwssd), over the whole super-block. Then one
// conversion and one FMA with d * dk, and one FMA of the minimums' factors
// (-dmin * m_j) with the activation blocks' sums (ActQ8::s): ggml's
// arithmetic with Q8_K, where blocks of 32 activations each with its own f32
// scale took a conversion, a permute and two multiplies per 64 values.
#include <cstdint>
#include <cstring>

#include "gemm_tiles.hpp"
#include "kernel_table.hpp"
#include "kquant_scales.hpp"
#include "qkvshare/kernels/quant.hpp"  // block layouts only
#include "simd_intrin.hpp"

namespace qkvshare::kernels::detail::avx512 {
namespace {
namespace f512 {

struct W {
  __m512i q[4];   // chunk c: 64 codes, the 32 of sub-block 2c then the 32 of 2c + 1
  __m512i sc[4];  // chunk c: sc_2c in 16-bit lanes 0-15, sc_2c+1 in lanes 16-31
  __m512 d;
  __m512 mins;  // lanes 0-7: -dmin * m_j; lanes 8-15: 0
};
struct X {
  const std::int8_t* q;  // the super-block's 256 activation codes
  __m512 dk;
  __m512 s;  // lanes 0-7: dk * sum of block j's codes; lanes 8-15: 0
};

// 16-bit lanes 0-15 take element 2c of a vector, lanes 16-31 element 2c + 1.
inline __m512i pair_index16(int c) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<short>(2 * c))),
                            _mm256_set1_epi16(static_cast<short>(2 * c + 1)), 1);
}

template <class Block, bool kFive>
struct FK45 {
  using Acc = __m512;
  using W = f512::W;
  using X = f512::X;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }
  static std::int64_t steps(std::int64_t cols) { return cols / kQK_K; }
  static bool tail(std::int64_t) { return false; }
  static X load_x(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    const std::int64_t sb = t * (a.cols / kQK_K) + s;
    return X{a.act.qs + kQK_K * sb, _mm512_set1_ps(a.act.dk[sb]), _mm512_maskz_loadu_ps(0xff, a.act.s + 8 * sb)};
  }
  static X load_x_tail(const GemmArgs& a, std::int64_t t, std::int64_t s) { return load_x(a, t, s); }
  static W load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const Block* b = reinterpret_cast<const Block*>(row) + s;
    W w;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256i h = _mm256_setzero_si256();
    if constexpr (kFive) h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh));
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * c));
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if constexpr (kFive) {  // bit 2c / 2c + 1 of qh byte l: the 5th bit of value l of those sub-blocks
        const __m256i one = _mm256_set1_epi8(1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * c), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * c + 1), one), 4));
      }
      w.q[c] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    alignas(16) std::uint8_t sm8[16];
    scales_mins_k4(b->scales, sm8);
    const __m128i sm = _mm_load_si128(reinterpret_cast<const __m128i*>(sm8));
    const __m512i sc16 = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(sm));
    for (int c = 0; c < 4; ++c) w.sc[c] = _mm512_permutexvar_epi16(pair_index16(c), sc16);
    w.d = _mm512_set1_ps(_cvtsh_ss(b->d));
    const __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
    w.mins = _mm512_mul_ps(m, _mm512_set1_ps(-_cvtsh_ss(b->dmin)));
    return w;
  }
  static W load_w_tail(const std::uint8_t*, std::int64_t, const GemmArgs&) { return W{}; }  // tail() is false
  static void mac(__m512& acc, const W& w, const X& x) {
    __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i xq = _mm512_loadu_si512(x.q + 64 * c);
      isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(w.q[c], xq), w.sc[c]);
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(w.d, x.dk), acc);
    acc = _mm512_fmadd_ps(w.mins, x.s, acc);
  }
};
using FQ4_K = FK45<BlockQ4_K, false>;
using FQ5_K = FK45<BlockQ5_K, true>;

}  // namespace f512
}  // namespace
}  // namespace qkvshare::kernels::detail::avx512
