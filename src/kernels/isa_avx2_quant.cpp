// AVX2 kernels of the 8-bit-activation dots (Q8_0, Q4_0, Q4_1, Q6_K weights)
// and the activation quantizer. Built with AVX2/FMA/F16C flags; reached only
// through isa.cpp after the CPU check. A step is one 32-block (Q6_K: a
// super-block, see FQ6_K): maddubs multiplies unsigned codes u by the int8
// activations into int16 pairs, madd sums pairs into 32-bit lanes of 4 values,
// ActQ8::bias removes the offset of u, and each lane is scaled by d_w * d_x.
// maddubs saturates at 32767, so u must stay small (<= 63, true of Q4 and Q6);
// Q8_0 instead uses the sign trick (|w| times x with w's sign), <= 128 * 127 * 2.
#include "act_q8_store.hpp"
#include "simd_intrin.hpp"

#include "gemm_tiles.hpp"
#include "kernel_table.hpp"
#define QKVSHARE_F256_ISA avx2
#include "gemm_formats_256.hpp"  // Base: the 256-bit step of 8-bit activations
#include "qkvshare/kernels/quant.hpp"  // block layouts only

namespace qkvshare::kernels::detail::avx2 {
namespace {

using f256::hsum;
using f256::Kind;

struct FQ4_0 : f256::Base<Kind::offset> {
  static W load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ4_0* b = reinterpret_cast<const BlockQ4_0*>(row) + s;
    W w{};
    w.q = f256::nibbles16(b->qs);
    w.d = _mm256_set1_ps(_cvtsh_ss(b->d));
    return w;
  }
};

struct FQ4_1 : f256::Base<Kind::min> {
  static W load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ4_1* b = reinterpret_cast<const BlockQ4_1*>(row) + s;
    W w{};
    w.q = f256::nibbles16(b->qs);
    w.d = _mm256_set1_ps(_cvtsh_ss(b->d));
    w.m = _mm256_set1_ps(_cvtsh_ss(b->m));
    return w;
  }
};

struct FQ8_0 : f256::Base<Kind::signed_codes> {  // no VNNI here: the sign trick, no bias
  static W load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(row) + s;
    W w{};
    w.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs));
    w.d = _mm256_set1_ps(_cvtsh_ss(b->d));
    return w;
  }
};

// A step is 32 values of a super-block: two groups of 16 with their own scales.
// Q6_K with the super-block activations (kernel_table.hpp ActQ8::dk): a step
// is a super-block, as u = q + 32 in 8 chunks of 32 values (layout in
// quant_ref.cpp's dequant_q6_k). Chunk j's maddubs sums (at most 2 * 63 *
// 127) times its two groups' int8 scales go into 32-bit lanes (madd); the
// offset, 32 * sc_g * (sum of group g's codes, ActQ8::g16), comes off in
// integers, so a super-block is exact until one conversion and one FMA.
struct FQ6_K {
  using Acc = __m256;
  struct W {
    __m256i q[8];
    __m256i sc[8];   // chunk j: groups 2j (16-bit lanes 0-7) and 2j + 1 (lanes 8-15)
    __m256i off[2];  // lane g of off[g / 8]: 32 * sc_g
    __m256 d;
  };
  struct X {
    const std::int8_t* q;
    const std::int32_t* g16;
    __m256 dk;
  };
  static __m256 zero() { return _mm256_setzero_ps(); }
  static float reduce(__m256 v) { return hsum(v); }
  static std::int64_t steps(std::int64_t cols) { return cols / kQK_K; }
  static bool tail(std::int64_t) { return false; }
  static X load_x(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    const std::int64_t sb = t * (a.cols / kQK_K) + s;
    return X{a.act.qs + kQK_K * sb, a.act.g16 + 16 * sb, _mm256_set1_ps(a.act.dk[sb])};
  }
  static X load_x_tail(const GemmArgs& a, std::int64_t t, std::int64_t s) { return load_x(a, t, s); }
  static W load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ6_K* b = reinterpret_cast<const BlockQ6_K*>(row) + s;
    W w;
    for (int j = 0; j < 8; ++j) {
      const int half = j / 4, sub = j % 4;
      const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->ql + 64 * half + 32 * (sub & 1)));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * half));
      const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(l, _mm_cvtsi32_si128(4 * (sub >> 1))), _mm256_set1_epi8(0x0f));
      const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * sub)), _mm256_set1_epi8(3));
      w.q[j] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
      w.sc[j] = _mm256_set_m128i(_mm_set1_epi16(b->scales[2 * j + 1]), _mm_set1_epi16(b->scales[2 * j]));
    }
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
    w.off[0] = _mm256_slli_epi32(_mm256_cvtepi8_epi32(sc8), 5);
    w.off[1] = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)), 5);
    w.d = _mm256_set1_ps(_cvtsh_ss(b->d));
    return w;
  }
  static W load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
  static void mac(__m256& acc, const W& w, const X& x) {
    const __m256i g0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.g16));
    const __m256i g1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.g16 + 8));
    __m256i isum = _mm256_sub_epi32(_mm256_setzero_si256(),
                                    _mm256_add_epi32(_mm256_mullo_epi32(w.off[0], g0), _mm256_mullo_epi32(w.off[1], g1)));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + 32 * j));
      isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(w.q[j], xq), w.sc[j]));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(w.d, x.dk), acc);
  }
};

void quantize_block_rows(const float* x, std::int64_t n, std::int32_t bias_mult, const ActQ8Out& o) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (std::int64_t b = 0; b < n / 32; ++b) {
    __m256 v[4];
    // maxps(|x|, m) keeps m where |x| is NaN, as std::max(m, |x|) does in the portable level.
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
      m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    float db = amax / 127.0f;
    float id = 1.0f / db;
    if (!(amax >= kActFlush)) db = id = 0.0f;
    o.d[b] = db;
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)), _mm256_set1_ps(-127.0f)),
                                              _mm256_set1_ps(127.0f)));
    // packs work within 128-bit lanes; the permute restores element order.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i q8 = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.qs + 32 * b), q8);
    store_act_sums(o, b, q8, db, bias_mult);
  }
}

}  // namespace

void gemm_q8_0(const GemmArgs& a) { gemm_tiled<FQ8_0, 2, 2>(a); }
void gemm_q4_0(const GemmArgs& a) { gemm_tiled<FQ4_0, 2, 2>(a); }
void gemm_q4_1(const GemmArgs& a) { gemm_tiled<FQ4_1, 2, 2>(a); }
void gemm_q6_k(const GemmArgs& a) { gemm_tiled<FQ6_K, 2, 2>(a); }
void quantize_act(const float* x, std::int64_t n, std::int32_t bias_mult, const ActQ8Out& out) {
  quantize_block_rows(x, n, bias_mult, out);
}

}  // namespace qkvshare::kernels::detail::avx2
