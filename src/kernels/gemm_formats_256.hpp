#pragma once
// Internal: 256-bit formats (gemm_tiles.hpp) of the weight types Q5_0, Q5_1,
// Q2_K, Q3_K, Q4_K, Q5_K, IQ4_NL and IQ4_XS with 8-bit activations (Q4_K and
// Q5_K: the super-block kind, see FK45). Included
// by isa_avx2_more.cpp (maddubs + madd) and isa_avx512_more.cpp (vpdpbusd on
// ymm registers, AVX-512VL + VNNI); everything has internal linkage, so each
// unit compiles its own copy with its own flags (kernel_table.hpp says why).
//
// A step is 32 values of a row, i.e. one activation block. Each weight step
// becomes 32 byte codes and, per 32-bit lane (4 values), a scale d and for
// the asymmetric types a minimum m, so that the lane's part of the dot is
//   offset types (Q5_0, Q3_K): d * dx * (sum u x + bias)  u = q + offset >= 0
//   min types (Q5_1, Q2_K, Q4_K, Q5_K): d * dx * sum u x + m * (dx * sum x)
//   signed types (IQ4_NL, IQ4_XS): d * dx * sum q x, q the signed code-book
//     value: maddubs with the sign trick (|q| <= 127), or vpdpbusd on u = q + 128
//     with ActQ8::bias = -128 * sum x (the activation kind of Q8_0).
// Sub-block scales of 16 values (Q2_K, Q3_K) fill lanes 0-3 and 4-7 apart.
// The AVX2 unit of Q4_0, Q4_1 and Q8_0 (isa_avx2_quant.cpp) builds its
// formats on Base too: offset, min and signed codes respectively.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gemm_tiles.hpp"
#include "kernel_table.hpp"
#include "kquant_scales.hpp"
#include "qkvshare/kernels/quant.hpp"  // block layouts only
#include "simd_intrin.hpp"

// The including unit names its ISA namespace (avx2, avx512) first, so that
// every symbol made from these formats carries it (tests/kernels/check_isa_isolation.sh).
#ifndef QKVSHARE_F256_ISA
#error "define QKVSHARE_F256_ISA (the unit's ISA namespace) before including gemm_formats_256.hpp"
#endif
namespace qkvshare::kernels::detail::QKVSHARE_F256_ISA {
namespace {
namespace f256 {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A weight step: unsigned codes and the scale per lane; the min kind adds its
// minimum (WMin), the others leave it out of the decoded-step buffers.
struct W {
  __m256i q;
  __m256 d;
};
struct WMin : W {
  __m256 m;
};
struct X {
  __m256i q;
  __m256 dl;
  __m256i bias;
  __m256 xs;
};

enum class Kind { offset, min, signed_codes };

template <Kind K>
struct Base {
  using Acc = __m256;
  using W = std::conditional_t<K == Kind::min, WMin, f256::W>;
  using X = f256::X;
  static constexpr bool kBias = K == Kind::offset || (K == Kind::signed_codes && kVnni);
  static __m256 zero() { return _mm256_setzero_ps(); }
  static float reduce(__m256 v) { return hsum(v); }
  static std::int64_t steps(std::int64_t cols) { return cols / 32; }
  static bool tail(std::int64_t) { return false; }
  static X load_x(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    const std::int64_t off = t * a.cols + 32 * s;
    X x{};
    x.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.act.qs + off));
    x.dl = _mm256_loadu_ps(a.act.dl + off / 4);
    if constexpr (K == Kind::min) x.xs = _mm256_loadu_ps(a.act.xs + off / 4);
    if constexpr (kBias) x.bias = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.act.bias + off / 4));
    return x;
  }
  static X load_x_tail(const GemmArgs& a, std::int64_t t, std::int64_t s) { return load_x(a, t, s); }
  static void mac(__m256& acc, const W& w, const X& x) {
    __m256i p;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    p = _mm256_dpbusd_epi32(kBias ? x.bias : _mm256_setzero_si256(), w.q, x.q);
#else
    __m256i p16;
    if constexpr (K == Kind::signed_codes)
      p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w.q, w.q), _mm256_sign_epi8(x.q, w.q));
    else
      p16 = _mm256_maddubs_epi16(w.q, x.q);
    p = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
    if constexpr (kBias) p = _mm256_add_epi32(p, x.bias);
#endif
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(w.d, x.dl), acc);
    if constexpr (K == Kind::min) acc = _mm256_fmadd_ps(w.m, x.xs, acc);
  }
  // Signed codes as the multiply wants them (see the file comment).
  static __m256i codes(__m256i q) {
    if constexpr (K == Kind::signed_codes && kVnni) return _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
    return q;
  }
  static W load_w_tail(const std::uint8_t*, std::int64_t, const GemmArgs&) { return W{}; }  // tail() is false
};

// 16 bytes -> 32 codes: low nibbles (values 0-15), then high nibbles (16-31).
inline __m256i nibbles16(const std::uint8_t* qs) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(a, 4), a), _mm256_set1_epi8(0x0f));
}
// 32 bytes -> bits [shift, shift + width) of each.
inline __m256i bit_field(const std::uint8_t* p, int shift, int mask) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(static_cast<char>(mask)));
}
// 32 bits -> byte j = 0x10 where bit j is set (the 5th bit of Q5 codes).
inline __m256i fifth_bits(const std::uint8_t* qh) {
  std::uint32_t h;
  std::memcpy(&h, qh, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h)), shuf);
  b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}
inline __m256 halves(float lo, float hi) { return _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo)); }
inline __m256i iq4_lookup(__m256i idx) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values));
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), idx);
}

template <class Block>
const Block* block(const std::uint8_t* row, std::int64_t i) {
  return reinterpret_cast<const Block*>(row) + i;
}

struct FQ5_0 : Base<Kind::offset> {
  static W load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ5_0* b = block<BlockQ5_0>(row, s);
    W w{};
    w.q = _mm256_or_si256(nibbles16(b->qs), fifth_bits(b->qh));
    w.d = _mm256_set1_ps(_cvtsh_ss(b->d));
    return w;
  }
};

struct FQ5_1 : Base<Kind::min> {
  static W load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ5_1* b = block<BlockQ5_1>(row, s);
    W w{};
    w.q = _mm256_or_si256(nibbles16(b->qs), fifth_bits(b->qh));
    w.d = _mm256_set1_ps(_cvtsh_ss(b->d));
    w.m = _mm256_set1_ps(_cvtsh_ss(b->m));
    return w;
  }
};

// Q4_K / Q5_K with the super-block activations (ActQ8::dk): a step is a
// super-block. Sub-block j's products are summed in 16 bits (maddubs: at most
// 2 * 31 * 127), times its 6-bit scale in 32 (madd), over the whole
// super-block before one conversion and one FMA with d * dk; the minimums'
// part is one FMA of their factors with the blocks' sums (ActQ8::s).
// Used at the AVX2 level; the AVX-512 level runs them on 16-row tiles (isa_avx512_rows.cpp).
template <class Block, bool kFive>
struct FK45 {
  using Acc = __m256;
  struct W {
    __m256i q[8];   // sub-block j: 32 codes
    __m256i sc[8];  // sub-block j: its scale in every 16-bit lane
    __m256 d;
    __m256 mins;  // lane j: -dmin * m_j
  };
  struct X {
    const std::int8_t* q;
    __m256 dk;
    __m256 s;  // lane j: dk * sum of block j's codes
  };
  static __m256 zero() { return _mm256_setzero_ps(); }
  static float reduce(__m256 v) { return hsum(v); }
  static std::int64_t steps(std::int64_t cols) { return cols / kQK_K; }
  static bool tail(std::int64_t) { return false; }
  static X load_x(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    const std::int64_t sb = t * (a.cols / kQK_K) + s;
    return X{a.act.qs + kQK_K * sb, _mm256_set1_ps(a.act.dk[sb]), _mm256_loadu_ps(a.act.s + 8 * sb)};
  }
  static X load_x_tail(const GemmArgs& a, std::int64_t t, std::int64_t s) { return load_x(a, t, s); }
  static W load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const Block* b = block<Block>(row, s);
    W w;
    alignas(16) std::uint8_t sm8[16];
    scales_mins_k4(b->scales, sm8);
    for (int j = 0; j < 8; ++j) {
      w.q[j] = bit_field(b->qs + 32 * (j / 2), 4 * (j % 2), 0x0f);
      if constexpr (kFive) w.q[j] = _mm256_or_si256(w.q[j], _mm256_slli_epi16(bit_field(b->qh, j, 1), 4));
      w.sc[j] = _mm256_set1_epi16(static_cast<short>(sm8[j]));
    }
    w.d = _mm256_set1_ps(_cvtsh_ss(b->d));
    const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm8 + 8));
    w.mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8)), _mm256_set1_ps(-_cvtsh_ss(b->dmin)));
    return w;
  }
  static W load_w_tail(const std::uint8_t*, std::int64_t, const GemmArgs&) { return W{}; }  // tail() is false
  static void mac(__m256& acc, const W& w, const X& x) {
    __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + 32 * j));
      isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(w.q[j], xq), w.sc[j]));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(w.d, x.dk), acc);
    acc = _mm256_fmadd_ps(w.mins, x.s, acc);
  }
};
using FQ4_K = FK45<BlockQ4_K, false>;
using FQ5_K = FK45<BlockQ5_K, true>;

// Step k of a super-block: values 32k..32k+31, groups 2k and 2k+1.
struct FQ2_K : Base<Kind::min> {
  static W load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ2_K* b = block<BlockQ2_K>(row, s / 8);
    const int k = static_cast<int>(s % 8);
    W w{};
    w.q = bit_field(b->qs + 32 * (k / 4), 2 * (k % 4), 3);
    const float d = _cvtsh_ss(b->d), dmin = _cvtsh_ss(b->dmin);
    const int s0 = b->scales[2 * k], s1 = b->scales[2 * k + 1];
    w.d = halves(d * static_cast<float>(s0 & 0x0f), d * static_cast<float>(s1 & 0x0f));
    w.m = halves(-dmin * static_cast<float>(s0 >> 4), -dmin * static_cast<float>(s1 >> 4));
    return w;
  }
};

struct FQ3_K : Base<Kind::offset> {
  static W load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ3_K* b = block<BlockQ3_K>(row, s / 8);
    const int k = static_cast<int>(s % 8);
    W w{};
    const __m256i lo = bit_field(b->qs + 32 * (k / 4), 2 * (k % 4), 3);
    w.q = _mm256_or_si256(lo, _mm256_slli_epi16(bit_field(b->hmask, k, 1), 2));  // u = code + 4
    const float d = _cvtsh_ss(b->d);
    w.d = halves(d * static_cast<float>(scale_q3_k(2 * k, b->scales)),
                 d * static_cast<float>(scale_q3_k(2 * k + 1, b->scales)));
    return w;
  }
};

struct FIQ4_NL : Base<Kind::signed_codes> {
  static W load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockIQ4_NL* b = block<BlockIQ4_NL>(row, s);
    W w{};
    w.q = codes(iq4_lookup(nibbles16(b->qs)));
    w.d = _mm256_set1_ps(_cvtsh_ss(b->d));
    return w;
  }
};

struct FIQ4_XS : Base<Kind::signed_codes> {
  static W load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockIQ4_XS* b = block<BlockIQ4_XS>(row, s / 8);
    const int j = static_cast<int>(s % 8);
    W w{};
    w.q = codes(iq4_lookup(nibbles16(b->qs + 16 * j)));
    w.d = _mm256_set1_ps(_cvtsh_ss(b->d) * static_cast<float>(scale_iq4_xs(j, b->scales_h, b->scales_l)));
    return w;
  }
};

}  // namespace f256
}  // namespace
}  // namespace qkvshare::kernels::detail::QKVSHARE_F256_ISA
