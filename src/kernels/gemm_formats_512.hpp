#pragma once
// Internal: 512-bit formats (gemm_tiles.hpp) of Q4_K and Q5_K for the AVX-512
// level, one super-block (256 values) per step. Include it only from an
// AVX-512 unit: everything has internal linkage (kernel_table.hpp says why).
//
// gemm_formats_256.hpp's FK45 takes one 32-value sub-block per step and
// unpacks its 6-bit scale and minimum with scalar code each time, for every
// row: decode spent more time there than on the bytes (bench_kernels
// matvec/Q4_K/8192x2048: 9.7 GB/s, where Q6_K reaches 29). Here a row's 8
// scales and 8 minimums are unpacked once per super-block (scales_mins_k4)
// and widened into one vector; each
// 64-value chunk (sub-blocks 2c and 2c+1: the low and high nibbles of the
// same 32 bytes) takes its pair of scales from it with one permute.
//
// Per 32-bit lane (4 values): acc += float(sum u x) * (d * sc) * dx, with the
// activations' per-lane dl (ActQ8); the minimums' part, (-dmin * m_j) * (dx *
// sum x) per sub-block j, is added once per super-block from the activations'
// block sums (ActQ8::s): one FMA where a lane-by-lane sum took four, with
// their permutes and loads.
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
  __m512i q[4];  // chunk c: 64 codes, the 32 of sub-block 2c then the 32 of 2c + 1
  __m512 dm;     // lanes 0-7: d * sc_j; lanes 8-15: -dmin * m_j
};
struct X {
  const std::int8_t* q;  // the super-block's 256 activation codes
  const float* dl;       // its 64 lanes' block scales
  const float* s;        // its 8 blocks' d * sum of the block's codes
};

// Lanes 0-7 take element 2c of a vector, lanes 8-15 element 2c + 1.
inline __m512i pair_index(int c) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * c)), _mm256_set1_epi32(2 * c + 1), 1);
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
    const std::int64_t off = t * a.cols + kQK_K * s;
    return X{a.act.qs + off, a.act.dl + off / 4, a.act.s + off / 32};
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
    const __m512 sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sm8))));
    const __m512 dd = _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(b->d)), _mm256_set1_ps(-_cvtsh_ss(b->dmin)), 1);
    w.dm = _mm512_mul_ps(sm, dd);
    return w;
  }
  static W load_w_tail(const std::uint8_t*, std::int64_t, const GemmArgs&) { return W{}; }  // tail() is false
  static void mac(__m512& acc, const W& w, const X& x) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i xq = _mm512_loadu_si512(x.q + 64 * c);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.q[c], xq);
      const __m512 d = _mm512_permutexvar_ps(pair_index(c), w.dm);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d, _mm512_loadu_ps(x.dl + 16 * c)), acc);
    }
    // Lanes 8-15: (-dmin * m_j) * s_j; lanes 0-7 add d * sc_j * 0.
    acc = _mm512_fmadd_ps(w.dm, _mm512_insertf32x8(_mm512_setzero_ps(), _mm256_loadu_ps(x.s), 1), acc);
  }
};
using FQ4_K = FK45<BlockQ4_K, false>;
using FQ5_K = FK45<BlockQ5_K, true>;

}  // namespace f512
}  // namespace
}  // namespace qkvshare::kernels::detail::avx512
