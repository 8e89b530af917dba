// AVX-512 + VNNI kernel of Q6_K weights and the activation quantizer (Q4_0,
// Q4_1 and Q8_0 are in isa_avx512_rows.cpp). Built with AVX-512 flags
// (src/CMakeLists.txt) and reached only through isa.cpp after the CPU check.
// Q6_K runs row-major (gemm_tiles.hpp): a step is 64 values of a row turned
// into unsigned bytes u; vpdpbusd sums u * x in 32-bit lanes of 4 values,
// whose start value ActQ8::bias removes the offset of u (kernel_table.hpp); a
// lane is then scaled by d_w * sc_group * d_x in f32.
#include "act_q8_store.hpp"
#include "simd_intrin.hpp"

#include "gemm_tiles.hpp"
#include "kernel_table.hpp"
#include "qkvshare/kernels/quant.hpp"  // block layouts only

namespace qkvshare::kernels::detail::avx512 {
namespace {

// A weight step: 64 unsigned codes and the scale per 32-bit lane.
struct WQ {
  __m512i q;
  __m512 d;
};
struct XQ {
  __m512i q;
  __m512 dl;
  __m512i bias;
};

// A step is a quarter (64 values, 4 groups of 16) of a super-block.
struct FQ6_K {
  using Acc = __m512;
  using W = WQ;
  using X = XQ;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }
  static std::int64_t steps(std::int64_t cols) { return cols / 64; }
  static bool tail(std::int64_t) { return false; }
  static XQ load_x(const GemmArgs& a, std::int64_t t, std::int64_t s) {
    const std::int64_t off = t * a.cols + 64 * s;
    return {_mm512_loadu_si512(a.act.qs + off), _mm512_loadu_ps(a.act.dl + off / 4),
            _mm512_loadu_si512(a.act.bias + off / 4)};
  }
  static XQ load_x_tail(const GemmArgs& a, std::int64_t t, std::int64_t s) { return load_x(a, t, s); }
  static void mac(__m512& acc, const WQ& w, const XQ& x) {
    const __m512i p = _mm512_dpbusd_epi32(x.bias, w.q, x.q);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(w.d, x.dl), acc);
  }
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

void gemm_q6_k(const GemmArgs& a) { gemm_tiled<FQ6_K, 4, 3>(a); }
void quantize_act(const float* x, std::int64_t n, std::int32_t bias_mult, const ActQ8Out& out) {
  quantize_block_rows(x, n, bias_mult, out);
}

}  // namespace qkvshare::kernels::detail::avx512
