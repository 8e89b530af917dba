// AVX-512 + VNNI kernel of Q6_K weights and the activation quantizer (Q4_0,
// Q4_1 and Q8_0 are in isa_avx512_rows.cpp). Built with AVX-512 flags
// (src/CMakeLists.txt) and reached only through isa.cpp after the CPU check.
// Q6_K runs row-major (gemm_tiles.hpp) with the super-block activations
// (kernel_table.hpp ActQ8::dk, ggml's Q8_K): a step is a super-block, its
// codes turned into unsigned bytes u = q + 32. Per 64-value chunk, maddubs
// sums u * x in 16 bits (at most 2 * 63 * 127) and vpdpwssd multiplies each
// group of 16's sums by its int8 scale into 32-bit lanes; the offset, 32 *
// sc_g * (sum of group g's activation codes, ActQ8::g16), is taken off in
// integers too, so a super-block is exact until one conversion and one FMA
// with d * dk.
#include "act_q8_store.hpp"
#include "simd_intrin.hpp"

#include "gemm_tiles.hpp"
#include "kernel_table.hpp"
#include "qkvshare/kernels/quant.hpp"  // block layouts only

namespace qkvshare::kernels::detail::avx512 {
namespace {

struct WQ6 {
  __m512i q[4];   // chunk c: values 64c..64c+63 as u = q + 32
  __m512i sc[4];  // chunk c: 16-bit lane i holds the scale of group 4c + i / 8
  __m512i off;    // lane g: 32 * sc_g
  __m512 d;
};
struct XQ6 {
  const std::int8_t* q;  // the super-block's 256 codes
  __m512i g16;           // lane g: sum of group g's codes
  __m512 dk;
};

// 16-bit lanes 8k..8k+7 take element 4c + k of a vector.
inline __m512i group_index16(int c) {
  const __m512i k = _mm512_set_epi32(0x30003, 0x30003, 0x30003, 0x30003, 0x20002, 0x20002, 0x20002, 0x20002,
                                     0x10001, 0x10001, 0x10001, 0x10001, 0, 0, 0, 0);
  return _mm512_add_epi16(k, _mm512_set1_epi16(static_cast<short>(4 * c)));
}

struct FQ6_K {
  using Acc = __m512;
  using W = WQ6;
  using X = XQ6;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }
  static std::int64_t steps(std::int64_t cols) { return cols / kQK_K; }
  static bool tail(std::int64_t) { return false; }
  static XQ6 load_x(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    const std::int64_t sb = t * (a.cols / kQK_K) + s;
    return {a.act.qs + kQK_K * sb, _mm512_loadu_si512(a.act.g16 + 16 * sb), _mm512_set1_ps(a.act.dk[sb])};
  }
  static XQ6 load_x_tail(const GemmArgs& a, std::int64_t t, std::int64_t s) { return load_x(a, t, s); }
  static void mac(__m512& acc, const WQ6& w, const XQ6& x) {
    __m512i isum = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_mullo_epi32(w.off, x.g16));
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(w.q[c], _mm512_loadu_si512(x.q + 64 * c)), w.sc[c]);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(w.d, x.dk), acc);
  }
  static WQ6 load_w(const std::uint8_t* row, std::int64_t s, const GemmArgs&) {
    const BlockQ6_K* b = reinterpret_cast<const BlockQ6_K*>(row) + s;
    WQ6 w;
    for (int c = 0; c < 4; ++c) {  // layout in quant_ref.cpp's dequant_q6_k
      const int half = c >> 1;     // which 128 values; within them low or high nibbles
      const __m512i l = _mm512_loadu_si512(b->ql + 64 * half);
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * half));
      __m512i lo, hx;
      if (c & 1) {
        lo = _mm512_and_si512(_mm512_srli_epi16(l, 4), _mm512_set1_epi8(0x0f));
        hx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(h, 4)), _mm256_srli_epi16(h, 6), 1);
      } else {
        lo = _mm512_and_si512(l, _mm512_set1_epi8(0x0f));
        hx = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
      }
      w.q[c] = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(hx, _mm512_set1_epi8(3)), 4));
    }
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
    for (int c = 0; c < 4; ++c) w.sc[c] = _mm512_permutexvar_epi16(group_index16(c), sc16);
    w.off = _mm512_slli_epi32(_mm512_cvtepi8_epi32(sc8), 5);
    w.d = _mm512_set1_ps(_cvtsh_ss(b->d));
    return w;
  }
  static WQ6 load_w_tail(const std::uint8_t* row, std::int64_t s, const GemmArgs& a) { return load_w(row, s, a); }
};

void quantize_block_rows(const float* x, std::int64_t n, std::int32_t bias_mult, const ActQ8Out& o) {
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
    o.d[b] = db;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x0, vid), lo), hi));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x1, vid), lo), hi));
    const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(q0)), _mm512_cvtepi32_epi8(q1), 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.qs + 32 * b), q);
    store_act_sums(o, b, q, db, bias_mult);
  }
}

}  // namespace

void gemm_q6_k(const GemmArgs& a) { gemm_tiled<FQ6_K, 2, 3>(a); }
void quantize_act(const float* x, std::int64_t n, std::int32_t bias_mult, const ActQ8Out& out) {
  quantize_block_rows(x, n, bias_mult, out);
}

}  // namespace qkvshare::kernels::detail::avx512
