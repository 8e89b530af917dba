// AVX-512 + VNNI kernels of the 8-bit-activation dots (Q8_0, Q4_0, Q4_1,
// Q6_K weights) and the activation quantizer. Built with AVX-512 flags
// (src/CMakeLists.txt) and reached only through avx512_table() after the CPU
// check in isa.cpp. Every weight step is 64 values (two 32-blocks, or a
// quarter of a Q6_K super-block) turned into unsigned bytes u; vpdpbusd sums
// u * x in 32-bit lanes of 4 values, whose start value ActQ8::bias removes the
// offset of u (kernel_table.hpp). A lane is then scaled by d_w * d_x in f32.
#include "simd_intrin.hpp"

#include <type_traits>

#include "gemm_tiles.hpp"
#include "kernel_table.hpp"
#include "qkvshare/kernels/quant.hpp"  // block layouts only

namespace qkvshare::kernels::detail::avx512 {
namespace {

// Spreads v[0] over lanes 0-7 and v[1] over lanes 8-15: one scale per block.
inline __m512 spread2(__m128 v) {
  return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                               _mm512_castps128_ps512(v));
}

// The 2 x 32 4-bit codes of two Q4 blocks as bytes in element order.
inline __m512i nibbles_pair(const std::uint8_t* qs0, const std::uint8_t* qs1) {
  const __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs0))),
                                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs1)), 1);
  const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(ab), _mm256_srli_epi16(ab, 4), 1);  // a b a>>4 b>>4
  const __m512i m = _mm512_and_si512(v, _mm512_set1_epi8(0x0f));
  return _mm512_shuffle_i64x2(m, m, _MM_SHUFFLE(3, 1, 2, 0));  // a_lo a_hi b_lo b_hi
}

inline __m128i two_u16(const void* p0, const void* p1) {
  return _mm_unpacklo_epi16(_mm_loadu_si16(p0), _mm_loadu_si16(p1));
}

// A weight step: unsigned codes and the scale per lane; Q4_1 adds its
// minimum (WQMin), the others leave it out of the decoded-step buffers.
struct WQ {
  __m512i q;
  __m512 d;
};
struct WQMin : WQ {
  __m512 m;
};
struct XQ {
  __m512i q;
  __m512 dl;
  __m512i bias;
  __m512 xs;
};

template <bool kMin>
struct QBase {
  using Acc = __m512;
  using W = std::conditional_t<kMin, WQMin, WQ>;
  using X = XQ;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }
  static XQ load_x(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    const std::int64_t off = t * a.cols + 64 * s;
    XQ x{};
    x.q = _mm512_loadu_si512(a.act.qs + off);
    x.dl = _mm512_loadu_ps(a.act.dl + off / 4);
    if constexpr (kMin)
      x.xs = _mm512_loadu_ps(a.act.xs + off / 4);
    else
      x.bias = _mm512_loadu_si512(a.act.bias + off / 4);
    return x;
  }
  // The last, single block: lanes 8-15 load as zero and so add nothing.
  static XQ load_x_tail(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    const std::int64_t off = t * a.cols + 64 * s;
    XQ x{};
    x.q = _mm512_maskz_loadu_epi8(0xffffffffULL, a.act.qs + off);
    x.dl = _mm512_maskz_loadu_ps(0x00ff, a.act.dl + off / 4);
    if constexpr (kMin)
      x.xs = _mm512_maskz_loadu_ps(0x00ff, a.act.xs + off / 4);
    else
      x.bias = _mm512_maskz_loadu_epi32(0x00ff, a.act.bias + off / 4);
    return x;
  }
  static void mac(__m512& acc, const W& w, const XQ& x) {
    const __m512i p = _mm512_dpbusd_epi32(kMin ? _mm512_setzero_si512() : x.bias, w.q, x.q);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(w.d, x.dl), acc);
    if constexpr (kMin) acc = _mm512_fmadd_ps(w.m, x.xs, acc);
  }
};

// Formats of 32-blocks: a step is a pair of blocks; an odd last block is
// paired with itself and its second copy meets zero activations.
template <class Block, class Derived, bool kMin>
struct PairFormat : QBase<kMin> {
  static std::int64_t steps(std::int64_t cols) { return cols / 64; }
  static bool tail(std::int64_t cols) { return cols % 64 != 0; }
  static const Block* blk(const std::uint8_t* row, std::int64_t b) { return reinterpret_cast<const Block*>(row) + b; }
  static auto load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    return Derived::pair(blk(row, 2 * s), blk(row, 2 * s + 1));
  }
  static auto load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    return Derived::pair(blk(row, 2 * s), blk(row, 2 * s));
  }
};

struct FQ4_0 : PairFormat<BlockQ4_0, FQ4_0, false> {
  static WQ pair(const BlockQ4_0* b0, const BlockQ4_0* b1) {
    WQ w{};
    w.q = nibbles_pair(b0->qs, b1->qs);
    w.d = spread2(_mm_cvtph_ps(two_u16(b0, b1)));
    return w;
  }
};

struct FQ4_1 : PairFormat<BlockQ4_1, FQ4_1, true> {
  static WQMin pair(const BlockQ4_1* b0, const BlockQ4_1* b1) {
    WQMin w{};
    w.q = nibbles_pair(b0->qs, b1->qs);
    // d and m are the first 4 bytes of a block: [d0 m0 d1 m1] as floats.
    const __m512 dm = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_unpacklo_epi32(_mm_loadu_si32(b0), _mm_loadu_si32(b1))));
    w.d = _mm512_permutexvar_ps(_mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0), dm);
    w.m = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1), dm);
    return w;
  }
};

struct FQ8_0 : PairFormat<BlockQ8_0, FQ8_0, false> {
  static WQ pair(const BlockQ8_0* b0, const BlockQ8_0* b1) {
    WQ w{};
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0->qs))),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1->qs)), 1);
    w.q = _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80)));  // q + 128
    w.d = spread2(_mm_cvtph_ps(two_u16(&b0->d, &b1->d)));
    return w;
  }
};

// A step is a quarter (64 values, 4 groups of 16) of a super-block.
struct FQ6_K : QBase<false> {
  static std::int64_t steps(std::int64_t cols) { return cols / 64; }
  static bool tail(std::int64_t) { return false; }
  static WQ load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ6_K* b = reinterpret_cast<const BlockQ6_K*>(row) + s / 4;
    const int k = static_cast<int>(s % 4);
    const int half = k >> 1;  // which 128 values; within them low or high nibbles
    const __m512i l = _mm512_loadu_si512(b->ql + 64 * half);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * half));
    __m512i lo, hx;
    if (k & 1) {
      lo = _mm512_and_si512(_mm512_srli_epi16(l, 4), _mm512_set1_epi8(0x0f));
      hx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(h, 4)), _mm256_srli_epi16(h, 6), 1);
    } else {
      lo = _mm512_and_si512(l, _mm512_set1_epi8(0x0f));
      hx = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
    }
    WQ w{};
    w.q = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(hx, _mm512_set1_epi8(3)), 4));
    const __m128 sc = _mm_mul_ps(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_loadu_si32(b->scales + 4 * k))),
                                 _mm_set1_ps(_cvtsh_ss(b->d)));
    w.d = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                _mm512_castps128_ps512(sc));
    return w;
  }
  static WQ load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
};

void quantize_block_rows(const float* x, std::int64_t n, std::int32_t bias_mult, std::int8_t* qs, float* d,
                         float* dl, std::int32_t* bias, float* xs) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (std::int64_t b = 0; b < n / 32; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b);
    const __m512 x1 = _mm512_loadu_ps(x + 32 * b + 16);
    // maxps(|x|, m) keeps m where |x| is NaN, as std::max(m, |x|) does in the portable level.
    __m512 m = _mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_setzero_ps());
    m = _mm512_max_ps(_mm512_andnot_ps(sign, x1), m);
    const float amax = _mm512_reduce_max_ps(m);
    float db = amax / 127.0f;
    float id = 1.0f / db;
    if (!(amax >= kActFlush)) db = id = 0.0f;
    d[b] = db;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x0, vid), lo), hi));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x1, vid), lo), hi));
    const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(q0)), _mm512_cvtepi32_epi8(q1), 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + 32 * b), q);
    const __m256i sums =
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));  // per 4 values
    _mm256_storeu_ps(dl + 8 * b, _mm256_set1_ps(db));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bias + 8 * b), _mm256_mullo_epi32(sums, _mm256_set1_epi32(bias_mult)));
    _mm256_storeu_ps(xs + 8 * b, _mm256_mul_ps(_mm256_set1_ps(db), _mm256_cvtepi32_ps(sums)));
  }
}

}  // namespace

void gemm_q8_0(const GemmArgs& a) { gemm_tiled<FQ8_0, 4, 3>(a); }
void gemm_q4_0(const GemmArgs& a) { gemm_tiled<FQ4_0, 4, 3>(a); }
void gemm_q4_1(const GemmArgs& a) { gemm_tiled<FQ4_1, 4, 2>(a); }
void gemm_q6_k(const GemmArgs& a) { gemm_tiled<FQ6_K, 4, 3>(a); }
void quantize_act(const float* x, std::int64_t n, std::int32_t bias_mult, std::int8_t* qs, float* d, float* dl,
                  std::int32_t* bias, float* xs) {
  quantize_block_rows(x, n, bias_mult, qs, d, dl, bias, xs);
}

}  // namespace qkvshare::kernels::detail::avx512
