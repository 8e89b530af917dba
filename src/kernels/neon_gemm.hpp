#pragma once
// Internal: the NEON matmul formats (gemm_tiles.hpp's F concept) for every
// weight type, included by isa_neon.cpp (base ARMv8-A: the integer dots are
// vmull_s8 + vpadalq_s16) and isa_neon_dot.cpp (+dotprod: sdot, 4 products
// per 32-bit lane in one instruction). The macro QKVSHARE_NEON_DOT selects
// the dot; everything else is the same text. Internal linkage, std-free
// (kernel_table.hpp says why).
//
// Quantized weights: a step is one 32-block as two int8x16 halves of signed
// codes, or for Q4_K, Q5_K and Q6_K a super-block (the super-block
// activations); the activations are the level-independent ActQ8 rows, so the
// integer sums are exact and only the float scaling order differs from the
// portable level.
#include <arm_neon.h>

#include <cstdint>
#include <cstring>

#include "gemm_tiles.hpp"
#include "kernel_table.hpp"
#include "kquant_scales.hpp"
#include "qkvshare/kernels/quant.hpp"  // block layouts only

namespace qkvshare::kernels::detail::QKVSHARE_NEON_NS {
namespace {

inline float half_to_float(std::uint16_t h) {
  __fp16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
}

// acc[i] += a[4i..4i+3] . b[4i..4i+3]
inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if QKVSHARE_NEON_DOT
  return vdotq_s32(acc, a, b);
#else
  return vpadalq_s16(vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b))), vmull_high_s8(a, b));
#endif
}

// ---- f32 activations: F32, F16, BF16 weights, 4 values a step ----
enum class Kind { f32, f16, bf16 };

template <Kind K>
struct FFloat {
  using Acc = float32x4_t;
  using W = float32x4_t;
  using X = float32x4_t;
  static constexpr int kElemBytes = K == Kind::f32 ? 4 : 2;
  static float32x4_t zero() { return vdupq_n_f32(0.0f); }
  static float reduce(float32x4_t v) { return vaddvq_f32(v); }
  static std::int64_t steps(std::int64_t cols) { return cols / 4; }
  static bool tail(std::int64_t cols) { return cols % 4 != 0; }
  static float32x4_t decode(const std::uint8_t* p) {
    if constexpr (K == Kind::f32) {
      return vld1q_f32(reinterpret_cast<const float*>(p));
    } else if constexpr (K == Kind::f16) {
      return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p))));
    } else {
      return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p)), 16));
    }
  }
  static float32x4_t load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    return decode(row + 4 * kElemBytes * s);
  }
  // The partial last step through a zeroed buffer (no read past the row).
  static float32x4_t load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) {
    alignas(16) std::uint8_t buf[16] = {};
    std::memcpy(buf, row + 4 * kElemBytes * s, static_cast<std::size_t>(a.cols % 4) * kElemBytes);
    return decode(buf);
  }
  static float32x4_t load_x(const GemmArgs& a, std::int64_t t, std::int64_t s) { return vld1q_f32(a.x + t * a.cols + 4 * s); }
  static float32x4_t load_x_tail(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    float buf[4] = {0, 0, 0, 0};
    std::memcpy(buf, a.x + t * a.cols + 4 * s, static_cast<std::size_t>(a.cols % 4) * sizeof(float));
    return vld1q_f32(buf);
  }
  static void mac(float32x4_t& acc, float32x4_t w, float32x4_t x) { acc = vfmaq_f32(acc, w, x); }
};

// ---- 8-bit activations in blocks of 32: Q8_0, Q4_0, Q4_1 weights ----
struct WQ {
  int8x16_t q0, q1;  // signed codes of elements 0..15 and 16..31 of the step
  float d;           // the block's scale
  float m;           // Q4_1's minimum (0 for the others)
};
struct XQ {
  int8x16_t q0, q1;
  float d;  // the block's scale
  float s;  // d * sum of the block's codes (Q4_1's min term)
};
// The Q4_1 min terms add to a scalar beside the vector, reduced together.
struct AccQ {
  float32x4_t v;
  float m;
};

template <bool kMin>
struct QBase {
  using Acc = AccQ;
  using W = WQ;
  using X = XQ;
  static AccQ zero() { return AccQ{vdupq_n_f32(0.0f), 0.0f}; }
  static float reduce(const AccQ& a) { return vaddvq_f32(a.v) + a.m; }
  static std::int64_t steps(std::int64_t cols) { return cols / 32; }
  static bool tail(std::int64_t) { return false; }
  static XQ load_x(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    const std::int64_t off = t * a.cols + 32 * s, blk = off / 32;
    XQ x;
    x.q0 = vld1q_s8(a.act.qs + off);
    x.q1 = vld1q_s8(a.act.qs + off + 16);
    x.d = a.act.d[blk];
    x.s = kMin ? a.act.s[blk] : 0.0f;
    return x;
  }
  static XQ load_x_tail(const GemmArgs& a, std::int64_t t, std::int64_t s) { return load_x(a, t, s); }
  static void mac(AccQ& acc, const WQ& w, const XQ& x) {
    const int32x4_t p = dot16(dot16(vdupq_n_s32(0), w.q0, x.q0), w.q1, x.q1);
    acc.v = vfmaq_n_f32(acc.v, vcvtq_f32_s32(p), w.d * x.d);
    if constexpr (kMin) acc.m += w.m * x.s;
  }
};

struct FQ8_0 : QBase<false> {
  static WQ load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(row) + s;
    WQ w;
    w.q0 = vld1q_s8(b->qs);
    w.q1 = vld1q_s8(b->qs + 16);
    w.d = half_to_float(b->d);
    w.m = 0.0f;
    return w;
  }
  static WQ load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
};

// Low nibbles are elements 0..15, high nibbles 16..31 (quant.hpp).
template <int kOffset>
inline void nibbles(const std::uint8_t* qs, WQ& w) {
  const uint8x16_t b = vld1q_u8(qs);
  const int8x16_t off = vdupq_n_s8(kOffset);
  w.q0 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0f))), off);
  w.q1 = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(b, 4)), off);
}

struct FQ4_0 : QBase<false> {
  static WQ load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ4_0* b = reinterpret_cast<const BlockQ4_0*>(row) + s;
    WQ w;
    nibbles<8>(b->qs, w);
    w.d = half_to_float(b->d);
    w.m = 0.0f;
    return w;
  }
  static WQ load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
};

struct FQ4_1 : QBase<true> {
  static WQ load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ4_1* b = reinterpret_cast<const BlockQ4_1*>(row) + s;
    WQ w;
    nibbles<0>(b->qs, w);
    w.d = half_to_float(b->d);
    w.m = half_to_float(b->m);
    return w;
  }
  static WQ load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
};

// 16 bits -> byte j = 0x10 where bit j is set (the 5th bit of Q5 codes).
inline uint8x16_t fifth_bits(std::uint32_t h16) {
  static constexpr std::uint8_t kBit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8x16_t bytes = vcombine_u8(vdup_n_u8(static_cast<std::uint8_t>(h16 & 0xff)),
                                       vdup_n_u8(static_cast<std::uint8_t>((h16 >> 8) & 0xff)));
  return vandq_u8(vtstq_u8(bytes, vld1q_u8(kBit)), vdupq_n_u8(0x10));
}

template <int kOffset>
inline void q5_codes(const std::uint8_t* qs, const std::uint8_t* qh, WQ& w) {
  std::uint32_t h;
  std::memcpy(&h, qh, 4);
  const uint8x16_t b = vld1q_u8(qs);
  const int8x16_t off = vdupq_n_s8(kOffset);
  w.q0 = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vandq_u8(b, vdupq_n_u8(0x0f)), fifth_bits(h))), off);
  w.q1 = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(b, 4), fifth_bits(h >> 16))), off);
}

struct FQ5_0 : QBase<false> {
  static WQ load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ5_0* b = reinterpret_cast<const BlockQ5_0*>(row) + s;
    WQ w;
    q5_codes<16>(b->qs, b->qh, w);
    w.d = half_to_float(b->d);
    w.m = 0.0f;
    return w;
  }
  static WQ load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
};

struct FQ5_1 : QBase<true> {
  static WQ load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ5_1* b = reinterpret_cast<const BlockQ5_1*>(row) + s;
    WQ w;
    q5_codes<0>(b->qs, b->qh, w);
    w.d = half_to_float(b->d);
    w.m = half_to_float(b->m);
    return w;
  }
  static WQ load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
};

// The IQ4 code book: nibbles looked up with tbl (values -127..113, signed dots hold them).
inline void iq4_codes(const std::uint8_t* qs, WQ& w) {
  const int8x16_t book = vld1q_s8(kIq4Values);
  const uint8x16_t b = vld1q_u8(qs);
  w.q0 = vqtbl1q_s8(book, vandq_u8(b, vdupq_n_u8(0x0f)));
  w.q1 = vqtbl1q_s8(book, vshrq_n_u8(b, 4));
}

struct FIQ4_NL : QBase<false> {
  static WQ load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockIQ4_NL* b = reinterpret_cast<const BlockIQ4_NL*>(row) + s;
    WQ w;
    iq4_codes(b->qs, w);
    w.d = half_to_float(b->d);
    w.m = 0.0f;
    return w;
  }
  static WQ load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
};

// Step j of a super-block: sub-block j (32 values) with its 6-bit scale.
struct FIQ4_XS : QBase<false> {
  static WQ load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockIQ4_XS* b = reinterpret_cast<const BlockIQ4_XS*>(row) + s / 8;
    const int j = static_cast<int>(s % 8);
    WQ w;
    iq4_codes(b->qs + 16 * j, w);
    w.d = half_to_float(b->d) * static_cast<float>(scale_iq4_xs(j, b->scales_h, b->scales_l));
    w.m = 0.0f;
    return w;
  }
  static WQ load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
};

// Q2_K and Q3_K: a step is 32 values, two groups of 16 with their own scales
// (and for Q2_K minimums, times the groups' activation sums, summed here).
struct WQ2 {
  int8x16_t q0, q1;
  float d0, d1;
  float m0, m1;
};
template <bool kMin>
struct QBase2 : QBase<false> {
  using W = WQ2;
  static void mac(AccQ& acc, const WQ2& w, const XQ& x) {
    const int32x4_t p0 = dot16(vdupq_n_s32(0), w.q0, x.q0), p1 = dot16(vdupq_n_s32(0), w.q1, x.q1);
    acc.v = vfmaq_n_f32(acc.v, vcvtq_f32_s32(p0), w.d0 * x.d);
    acc.v = vfmaq_n_f32(acc.v, vcvtq_f32_s32(p1), w.d1 * x.d);
    if constexpr (kMin)
      acc.m += x.d * (w.m0 * static_cast<float>(vaddlvq_s8(x.q0)) + w.m1 * static_cast<float>(vaddlvq_s8(x.q1)));
  }
};

// Step k: values 32k..32k+31 are bits 2(k % 4).. of qs[32 (k / 4) + l]; groups 2k, 2k + 1.
inline uint8x16_t two_bits(const std::uint8_t* qs, int k, int half) {
  const int8x16_t shift = vdupq_n_s8(static_cast<std::int8_t>(-2 * (k % 4)));
  return vandq_u8(vshlq_u8(vld1q_u8(qs + 32 * (k / 4) + 16 * half), shift), vdupq_n_u8(3));
}

struct FQ2_K : QBase2<true> {
  static WQ2 load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ2_K* b = reinterpret_cast<const BlockQ2_K*>(row) + s / 8;
    const int k = static_cast<int>(s % 8);
    WQ2 w;
    w.q0 = vreinterpretq_s8_u8(two_bits(b->qs, k, 0));
    w.q1 = vreinterpretq_s8_u8(two_bits(b->qs, k, 1));
    const float d = half_to_float(b->d), dmin = half_to_float(b->dmin);
    const int s0 = b->scales[2 * k], s1 = b->scales[2 * k + 1];
    w.d0 = d * static_cast<float>(s0 & 0x0f);
    w.d1 = d * static_cast<float>(s1 & 0x0f);
    w.m0 = -dmin * static_cast<float>(s0 >> 4);
    w.m1 = -dmin * static_cast<float>(s1 >> 4);
    return w;
  }
  static WQ2 load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
};

// Q3_K: the low 2 bits as Q2_K's; bit k of hmask[l] set means no -4 offset.
struct FQ3_K : QBase2<false> {
  static WQ2 load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ3_K* b = reinterpret_cast<const BlockQ3_K*>(row) + s / 8;
    const int k = static_cast<int>(s % 8);
    const int8x16_t hshift = vdupq_n_s8(static_cast<std::int8_t>(2 - k));  // bit k -> bit 2
    const auto code = [&](int half) {
      const uint8x16_t hi = vandq_u8(vshlq_u8(vld1q_u8(b->hmask + 16 * half), hshift), vdupq_n_u8(4));
      return vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(two_bits(b->qs, k, half), hi)), vdupq_n_s8(4));
    };
    WQ2 w;
    w.q0 = code(0);
    w.q1 = code(1);
    const float d = half_to_float(b->d);
    w.d0 = d * static_cast<float>(scale_q3_k(2 * k, b->scales));
    w.d1 = d * static_cast<float>(scale_q3_k(2 * k + 1, b->scales));
    w.m0 = w.m1 = 0.0f;
    return w;
  }
  static WQ2 load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
};

// ---- the super-block activations (ActQ8::dk, ggml's Q8_K): Q4_K, Q5_K, Q6_K ----
// A step is a super-block: 16 int8x16 groups of codes, each group's dot times
// its integer scale summed in 32 bits over the whole super-block (exact),
// then one conversion and one FMA with d * dk.
struct XS {
  const std::int8_t* q;  // the super-block's 256 codes
  float dk;
  const float* s;  // dk * sum of each block of 32 codes (the K45 minimums' term)
};

struct SuperBase {
  using Acc = float32x4_t;
  using X = XS;
  static float32x4_t zero() { return vdupq_n_f32(0.0f); }
  static float reduce(float32x4_t v) { return vaddvq_f32(v); }
  static std::int64_t steps(std::int64_t cols) { return cols / kQK_K; }
  static bool tail(std::int64_t) { return false; }
  static XS load_x(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    const std::int64_t sb = t * (a.cols / kQK_K) + s;
    return XS{a.act.qs + kQK_K * sb, a.act.dk[sb], a.act.s + 8 * sb};
  }
  static XS load_x_tail(const GemmArgs& a, std::int64_t t, std::int64_t s) { return load_x(a, t, s); }
};

// Q6_K: signed codes q - 32 in 16 groups of 16 with int8 scales (layout as in
// quant_ref.cpp's dequant_q6_k).
struct WS6 {
  int8x16_t q[16];
  std::int32_t sc[16];
  float d;
};
struct FQ6_K : SuperBase {
  using W = WS6;
  static WS6 load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ6_K* b = reinterpret_cast<const BlockQ6_K*>(row) + s;
    WS6 w;
    for (int j = 0; j < 8; ++j) {  // 32 values 32j.. : groups 2j, 2j + 1
      const int half = j / 4, sub = j % 4;
      const std::uint8_t* l = b->ql + 64 * half + 32 * (sub & 1);
      const std::uint8_t* h = b->qh + 32 * half;
      const int8x16_t lshift = vdupq_n_s8(static_cast<std::int8_t>(-4 * (sub >> 1)));
      const int8x16_t hshift = vdupq_n_s8(static_cast<std::int8_t>(-2 * sub));
      for (int k = 0; k < 2; ++k) {
        const uint8x16_t lo = vandq_u8(vshlq_u8(vld1q_u8(l + 16 * k), lshift), vdupq_n_u8(0x0f));
        const uint8x16_t hi = vandq_u8(vshlq_u8(vld1q_u8(h + 16 * k), hshift), vdupq_n_u8(3));
        w.q[2 * j + k] = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, vshlq_n_u8(hi, 4))), vdupq_n_s8(32));
      }
    }
    for (int g = 0; g < 16; ++g) w.sc[g] = b->scales[g];
    w.d = half_to_float(b->d);
    return w;
  }
  static WS6 load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
  static void mac(float32x4_t& acc, const WS6& w, const XS& x) {
    int32x4_t isum = vdupq_n_s32(0);
    for (int g = 0; g < 16; ++g)
      isum = vmlaq_n_s32(isum, dot16(vdupq_n_s32(0), w.q[g], vld1q_s8(x.q + 16 * g)), w.sc[g]);
    acc = vfmaq_n_f32(acc, vcvtq_f32_s32(isum), w.d * x.dk);
  }
};

// Q4_K / Q5_K: unsigned codes (<= 31, so signed dots hold them) in 8
// sub-blocks of 32 with 6-bit scales; the minimums' part from ActQ8::s.
struct WS45 {
  int8x16_t q[16];
  std::int32_t sc[8];
  float mins[8];  // -dmin * m_j
  float d;
};
template <class Block, bool kFive>
struct FK45 : SuperBase {
  using W = WS45;
  static WS45 load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const Block* b = reinterpret_cast<const Block*>(row) + s;
    WS45 w;
    std::uint8_t sm8[16];
    scales_mins_k4(b->scales, sm8);
    const float dmin = half_to_float(b->dmin);
    for (int j = 0; j < 8; ++j) {
      for (int k = 0; k < 2; ++k) {
        const uint8x16_t v = vld1q_u8(b->qs + 32 * (j / 2) + 16 * k);
        uint8x16_t u = (j % 2) ? vshrq_n_u8(v, 4) : vandq_u8(v, vdupq_n_u8(0x0f));
        if constexpr (kFive) {  // bit j of qh byte l: the 5th bit of value l of sub-block j
          const uint8x16_t h = vld1q_u8(b->qh + 16 * k);
          const int8x16_t shift = vdupq_n_s8(static_cast<std::int8_t>(4 - j));  // bit j -> bit 4
          u = vorrq_u8(u, vandq_u8(vshlq_u8(h, shift), vdupq_n_u8(0x10)));
        }
        w.q[2 * j + k] = vreinterpretq_s8_u8(u);
      }
      w.sc[j] = sm8[j];
      w.mins[j] = -dmin * static_cast<float>(sm8[8 + j]);
    }
    w.d = half_to_float(b->d);
    return w;
  }
  static WS45 load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
  static void mac(float32x4_t& acc, const WS45& w, const XS& x) {
    int32x4_t isum = vdupq_n_s32(0);
    for (int j = 0; j < 8; ++j) {
      const int32x4_t p = dot16(dot16(vdupq_n_s32(0), w.q[2 * j], vld1q_s8(x.q + 32 * j)), w.q[2 * j + 1],
                                vld1q_s8(x.q + 32 * j + 16));
      isum = vmlaq_n_s32(isum, p, w.sc[j]);
    }
    acc = vfmaq_n_f32(acc, vcvtq_f32_s32(isum), w.d * x.dk);
    acc = vfmaq_f32(acc, vld1q_f32(w.mins), vld1q_f32(x.s));
    acc = vfmaq_f32(acc, vld1q_f32(w.mins + 4), vld1q_f32(x.s + 4));
  }
};
using FQ4_K = FK45<BlockQ4_K, false>;
using FQ5_K = FK45<BlockQ5_K, true>;

}  // namespace

// The quantized matmul entry points of the including level: the same text for
// both, each compiled with its own dot (QKVSHARE_NEON_DOT).
void gemm_q8_0(const GemmArgs& a) { gemm_tiled<FQ8_0, 2, 2>(a); }
void gemm_q4_0(const GemmArgs& a) { gemm_tiled<FQ4_0, 2, 2>(a); }
void gemm_q4_1(const GemmArgs& a) { gemm_tiled<FQ4_1, 2, 2>(a); }
void gemm_q6_k(const GemmArgs& a) { gemm_tiled<FQ6_K, 2, 2>(a); }
void gemm_q5_0(const GemmArgs& a) { gemm_tiled<FQ5_0, 2, 2>(a); }
void gemm_q5_1(const GemmArgs& a) { gemm_tiled<FQ5_1, 2, 2>(a); }
void gemm_q2_k(const GemmArgs& a) { gemm_tiled<FQ2_K, 2, 2>(a); }
void gemm_q3_k(const GemmArgs& a) { gemm_tiled<FQ3_K, 2, 2>(a); }
void gemm_q4_k(const GemmArgs& a) { gemm_tiled<FQ4_K, 2, 2>(a); }
void gemm_q5_k(const GemmArgs& a) { gemm_tiled<FQ5_K, 2, 2>(a); }
void gemm_iq4_nl(const GemmArgs& a) { gemm_tiled<FIQ4_NL, 2, 2>(a); }
void gemm_iq4_xs(const GemmArgs& a) { gemm_tiled<FIQ4_XS, 2, 2>(a); }

}  // namespace qkvshare::kernels::detail::QKVSHARE_NEON_NS
