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
}  // namespace qkvshare::kernels::detail::QKVSHARE_NEON_NS
