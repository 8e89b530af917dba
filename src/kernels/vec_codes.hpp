#pragma once
// Internal: the integer side of the vector-width trait, for attention on KV
// codes (kv_codes.hpp). `VecCodes` extends the unit's `Vec` (vec.hpp) with
// 16-bit lanes; defined once per ISA unit, with internal linkage like Vec.
//
// VecCodes::W       2N int16 lanes; I (from Vec) N int32 lanes
// zeroi, zero16, set16, sub16, load16, store16
// codes16<Bits>(row, c): the 2N codes of channels c.. of a packed row (the
//   layout of Vec::codes), as int16 in channel order; c a multiple of 2N. May
//   read up to 16 bytes from the first code byte (a tile's parameters follow).
// dot16(acc, a, b): acc[k] + a[2k] * b[2k] + a[2k + 1] * b[2k + 1]
// hsum8_i(a, out): out[r] = sum of the lanes of a[r], for 8 vectors
// zip16(a, b, lo, hi): the pairs (a[c], b[c]) of all 2N channels in two
//   vectors, so that dot16 against pair16(w) adds w[0] * a[c] + w[1] * b[c]
//   per channel; unzip32(lo, hi, first, second) puts the two int32 results
//   of those dot16s back in channel order (channels c.. and c + N..)
// pair16(w): (w[0], w[1]) in every 32-bit lane
// to_float(I), narrow16(p, I): N int32 (within int16 range) stored as int16
// addi (int32 lanes), hmax (the largest float lane), narrow8 (N int32 as int8)
// deinterleave2(x, even, odd): 2N floats x -> x[0], x[2], .. and x[1], x[3], ..
// kValueBytes: value sums of 4- and 2-bit codes on bytes, with
// quads4(r): 4 rows' byte codes of 4N channels (r[k] = row k) -> r[k] holds
//   channels kN..kN+N-1, each as the 4 rows' bytes of one int32 lane
// quad8(w): the 4 bytes w[0..3] in every int32 lane (dot8's unsigned side)
// kRow2Quads: quads_row2(row, row_bytes, c, r) = quads4 of rows row.. row + 3
//   of 2-bit codes (channels c..), read from the packed bytes directly
//
// 8-bit lanes, for 4-bit key codes (one byte per code, 4 x more per
// instruction than int16): kRows8 rows per register, one per 128-bit lane.
// row4(row, c): channels c..c+4N-1 of a row of 4-bit codes, centred (code - 8),
//   as bytes in channel order (16 channels per 128-bit lane); row2 the same
//   for 2-bit codes (code - 2). A code byte b, widened to a 32-bit lane,
//   becomes b | b << 6 | b << 12 | b << 18: byte k of the lane then holds
//   bits 2k, 2k + 1 of b (channel 4i + k) in its two low bits.
// transpose8(r): r[0..kRows8) in place, so that lane L of r[k] is lane k of
//   the old r[L] (x86: 128-bit lanes; NEON: one lane, nothing to do)
// q8(q): 16 query bytes in every 128-bit lane, as dot8 wants them
// dot8(acc, q8, codes): acc[k] + the sum of 4 products of bytes 4k..4k+3;
//   where kOffset8, q8 holds q + 128 (x86's unsigned-by-signed dot) and the
//   caller subtracts 128 * dot8(0, ones8, codes)
// reduce4(a0..a3): lane 4L + k = the sum of the 4 int32 of a_k in lane L
#include <array>
#include <cstddef>
#include <cstdint>

#include "vec.hpp"

namespace qkvshare::kernels::detail {
namespace {

// For lane l of a chunk of Lanes codes of `Bits` bits: the two source bytes
// of the 16-bit window holding it (0xff: none, a table lookup gives 0) and
// the multiplier that shifts the code to the top of the lane, so that a
// right shift by 16 - Bits leaves just the code. Every source byte of a
// chunk lies within its first 16 bytes for Lanes * Bits <= 128.
template <int Bits, int Lanes>
struct CodeLanes {
  std::array<std::uint8_t, 2 * Lanes> bytes{};
  std::array<std::int16_t, Lanes> mult{};
};

template <int Bits, int Lanes>
constexpr CodeLanes<Bits, Lanes> make_code_lanes() {
  static_assert(Lanes * Bits <= 128, "a chunk's codes span more than one 16-byte load");
  CodeLanes<Bits, Lanes> t{};
  for (int l = 0; l < Lanes; ++l) {
    const int bit = l * Bits, byte = bit / 8, shift = bit % 8;
    t.bytes[static_cast<std::size_t>(2 * l)] = static_cast<std::uint8_t>(byte);
    t.bytes[static_cast<std::size_t>(2 * l + 1)] = shift + Bits > 8 ? static_cast<std::uint8_t>(byte + 1) : 0xff;
    t.mult[static_cast<std::size_t>(l)] = static_cast<std::int16_t>(1 << (16 - shift - Bits));
  }
  return t;
}

}  // namespace
}  // namespace qkvshare::kernels::detail

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
namespace qkvshare::kernels::detail::avx512 {
namespace {
struct VecCodes : Vec {
  using W = __m512i;
  using W8 = __m512i;
  static I zeroi() { return _mm512_setzero_si512(); }
  static W zero16() { return _mm512_setzero_si512(); }
  static W set16(std::int16_t x) { return _mm512_set1_epi16(x); }
  static W sub16(W a, W b) { return _mm512_sub_epi16(a, b); }
  static W load16(const std::int16_t* p) { return _mm512_loadu_si512(p); }
  static void store16(std::int16_t* p, W v) { _mm512_storeu_si512(p, v); }
  template <int Bits>
  static W codes16(const std::byte* row, int c) {
    const std::byte* src = row + c * Bits / 8;
    if constexpr (Bits == 8) {
      return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    } else {
      static constexpr CodeLanes<Bits, 32> t = make_code_lanes<Bits, 32>();
      // The chunk's bytes in every 128-bit lane; lane L picks the windows of its 8 codes.
      const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      const __m512i w = _mm512_shuffle_epi8(b, _mm512_loadu_si512(t.bytes.data()));
      return _mm512_srli_epi16(_mm512_mullo_epi16(w, _mm512_loadu_si512(t.mult.data())), 16 - Bits);
    }
  }
  static I dot16(I acc, W a, W b) { return _mm512_dpwssd_epi32(acc, a, b); }
  static void hsum8_i(const I* a, std::int32_t* out) {
    __m256i f[8];
    for (int r = 0; r < 8; ++r) f[r] = _mm256_add_epi32(_mm512_castsi512_si256(a[r]), _mm512_extracti64x4_epi64(a[r], 1));
    const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(f[0], f[1]), _mm256_hadd_epi32(f[2], f[3]));
    const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(f[4], f[5]), _mm256_hadd_epi32(f[6], f[7]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                                                                          _mm256_permute2x128_si256(u0, u1, 0x31)));
  }
  // unpack works within 128-bit lanes: lo holds channels 8L..8L+3 of lane L, hi 8L+4..8L+7.
  static void zip16(W a, W b, W& lo, W& hi) { lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b); }
  static void unzip32(I lo, I hi, I& first, I& second) {
    first = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi);
    second = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), hi);
  }
  static W pair16(const std::int16_t* w) {
    std::int32_t v;
    std::memcpy(&v, w, 4);
    return _mm512_set1_epi32(v);
  }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }
  static void narrow8(std::int8_t* p, I v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v)); }

  static constexpr int kRows8 = 4;
  static constexpr bool kOffset8 = true;
  static W row4(const std::byte* row, int c) {
    // Each code byte to a word; (w | w << 4) & 0x0f0f puts its low nibble in
    // the low byte and its high nibble in the high byte: channel order.
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c / 2)));
    const __m512i split = _mm512_ternarylogic_epi32(w, _mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x0f0f), 0xa8);
    return _mm512_sub_epi8(split, _mm512_set1_epi8(8));
  }
  static W row2(const std::byte* row, int c) {
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 4)));
    const __m512i spread = _mm512_ternarylogic_epi32(w, _mm512_slli_epi32(w, 6), _mm512_slli_epi32(w, 12), 0xfe);
    return _mm512_sub_epi8(_mm512_ternarylogic_epi32(spread, _mm512_slli_epi32(w, 18), _mm512_set1_epi8(3), 0xa8),
                           _mm512_set1_epi8(2));
  }
  static void transpose8(W* r) {
    const __m512i a = _mm512_shuffle_i64x2(r[0], r[1], 0x44), b = _mm512_shuffle_i64x2(r[0], r[1], 0xee);
    const __m512i c = _mm512_shuffle_i64x2(r[2], r[3], 0x44), d = _mm512_shuffle_i64x2(r[2], r[3], 0xee);
    r[0] = _mm512_shuffle_i64x2(a, c, 0x88), r[1] = _mm512_shuffle_i64x2(a, c, 0xdd);
    r[2] = _mm512_shuffle_i64x2(b, d, 0x88), r[3] = _mm512_shuffle_i64x2(b, d, 0xdd);
  }
  static W q8(const std::int8_t* q) {
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  static W ones8() { return _mm512_set1_epi8(1); }
  static I dot8(I acc, W q, W codes) { return _mm512_dpbusd_epi32(acc, q, codes); }
  static I reduce4(I a0, I a1, I a2, I a3) {
    const __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(u0, u1), _mm512_unpackhi_epi64(u0, u1));
  }
  static void narrow16(std::int16_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v)); }
  static constexpr bool kValueBytes = true;
  static W quad8(const std::int8_t* w) {
    std::int32_t v;
    std::memcpy(&v, w, 4);
    return _mm512_set1_epi32(v);
  }
  static void quads4(W* r) {
    const __m512i t0 = _mm512_unpacklo_epi8(r[0], r[1]), t1 = _mm512_unpackhi_epi8(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi8(r[2], r[3]), t3 = _mm512_unpackhi_epi8(r[2], r[3]);
    // Lane L of r[k]: channels 16L + 4k .. 16L + 4k + 3; transpose8 puts lane L's in r[L].
    r[0] = _mm512_unpacklo_epi16(t0, t2), r[1] = _mm512_unpackhi_epi16(t0, t2);
    r[2] = _mm512_unpacklo_epi16(t1, t3), r[3] = _mm512_unpackhi_epi16(t1, t3);
    transpose8(r);
  }
  // quads4 of 4 rows of 2-bit codes straight from the packed bytes: row r's
  // 16 bytes (channels c..c+63) in lane r; dword k of every row to each lane
  // (channels c+16k..), then byte 4k+L of row r to byte r of the 4 int32 of
  // lane L, each shifted to its channel's 2 bits.
  static constexpr bool kRow2Quads = true;
  static void quads_row2(const std::byte* row, std::size_t row_bytes, int c, W* r) {
    const std::byte* src = row + c / 4;
    __m512i packed;
    if (row_bytes == 16) {
      packed = _mm512_loadu_si512(src);
    } else {
      const auto row_at = [&](std::size_t k) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * row_bytes)); };
      packed = _mm512_inserti32x4(_mm512_castsi128_si512(row_at(0)), row_at(1), 1);
      packed = _mm512_inserti32x4(_mm512_inserti32x4(packed, row_at(2), 2), row_at(3), 3);
    }
    static constexpr std::array<std::uint8_t, 64> sel = [] {
      std::array<std::uint8_t, 64> a{};
      for (int L = 0; L < 4; ++L)
        for (int m = 0; m < 4; ++m)
          for (int rr = 0; rr < 4; ++rr) a[static_cast<std::size_t>(16 * L + 4 * m + rr)] = static_cast<std::uint8_t>(4 * rr + L);
      return a;
    }();
    const __m512i pick = _mm512_loadu_si512(sel.data());
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
    const __m512i mask = _mm512_set1_epi8(3), centre = _mm512_set1_epi8(2);
    for (int k = 0; k < 4; ++k) {
      const __m512i idx = _mm512_setr_epi32(k, 4 + k, 8 + k, 12 + k, k, 4 + k, 8 + k, 12 + k, k, 4 + k, 8 + k, 12 + k, k,
                                            4 + k, 8 + k, 12 + k);
      const __m512i x = _mm512_srlv_epi32(_mm512_shuffle_epi8(_mm512_permutexvar_epi32(idx, packed), pick), shifts);
      r[k] = _mm512_sub_epi8(_mm512_and_si512(x, mask), centre);
    }
  }
  static void deinterleave2(const float* x, float* even, float* odd) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    _mm512_storeu_ps(even, _mm512_permutex2var_ps(a, ie, b));
    _mm512_storeu_ps(odd, _mm512_permutex2var_ps(a, _mm512_add_epi32(ie, _mm512_set1_epi32(1)), b));
  }
};
}  // namespace
}  // namespace qkvshare::kernels::detail::avx512

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
namespace qkvshare::kernels::detail::avx2 {
namespace {
struct VecCodes : Vec {
  using W = __m256i;
  using W8 = __m256i;
  static I zeroi() { return _mm256_setzero_si256(); }
  static W zero16() { return _mm256_setzero_si256(); }
  static W set16(std::int16_t x) { return _mm256_set1_epi16(x); }
  static W sub16(W a, W b) { return _mm256_sub_epi16(a, b); }
  static W load16(const std::int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store16(std::int16_t* p, W v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  template <int Bits>
  static W codes16(const std::byte* row, int c) {
    const std::byte* src = row + c * Bits / 8;
    if constexpr (Bits == 8) {
      return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    } else {
      static constexpr CodeLanes<Bits, 16> t = make_code_lanes<Bits, 16>();
      const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      const __m256i w = _mm256_shuffle_epi8(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.bytes.data())));
      return _mm256_srli_epi16(_mm256_mullo_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.mult.data()))),
                               16 - Bits);
    }
  }
  static I dot16(I acc, W a, W b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
  static void hsum8_i(const I* a, std::int32_t* out) {
    const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                                                                          _mm256_permute2x128_si256(u0, u1, 0x31)));
  }
  static void zip16(W a, W b, W& lo, W& hi) { lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b); }
  static void unzip32(I lo, I hi, I& first, I& second) {
    first = _mm256_permute2x128_si256(lo, hi, 0x20), second = _mm256_permute2x128_si256(lo, hi, 0x31);
  }
  static W pair16(const std::int16_t* w) {
    std::int32_t v;
    std::memcpy(&v, w, 4);
    return _mm256_set1_epi32(v);
  }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static I addi(I a, I b) { return _mm256_add_epi32(a, b); }
  static void narrow8(std::int8_t* p, I v) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }

  static constexpr int kRows8 = 2;
  static constexpr bool kOffset8 = true;
  static W row4(const std::byte* row, int c) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2)));
    const __m256i split = _mm256_and_si256(_mm256_or_si256(w, _mm256_slli_epi16(w, 4)), _mm256_set1_epi16(0x0f0f));
    return _mm256_sub_epi8(split, _mm256_set1_epi8(8));
  }
  static W row2(const std::byte* row, int c) {
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 4)));
    const __m256i spread = _mm256_or_si256(_mm256_or_si256(w, _mm256_slli_epi32(w, 6)),
                                           _mm256_or_si256(_mm256_slli_epi32(w, 12), _mm256_slli_epi32(w, 18)));
    return _mm256_sub_epi8(_mm256_and_si256(spread, _mm256_set1_epi8(3)), _mm256_set1_epi8(2));
  }
  static void transpose8(W* r) {
    const __m256i a = _mm256_permute2x128_si256(r[0], r[1], 0x20), b = _mm256_permute2x128_si256(r[0], r[1], 0x31);
    r[0] = a, r[1] = b;
  }
  static W q8(const std::int8_t* q) {
    return _mm256_xor_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  static W ones8() { return _mm256_set1_epi8(1); }
  // maddubs cannot saturate here: |codes| <= 8, so two products stay below 4096.
  static I dot8(I acc, W q, W codes) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, codes), _mm256_set1_epi16(1)));
  }
  static I reduce4(I a0, I a1, I a2, I a3) {
    const __m256i u0 = _mm256_add_epi32(_mm256_unpacklo_epi32(a0, a1), _mm256_unpackhi_epi32(a0, a1));
    const __m256i u1 = _mm256_add_epi32(_mm256_unpacklo_epi32(a2, a3), _mm256_unpackhi_epi32(a2, a3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(u0, u1), _mm256_unpackhi_epi64(u0, u1));
  }
  static float hmax(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static void narrow16(std::int16_t* p, I v) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(v, v), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static constexpr bool kValueBytes = true;
  static W quad8(const std::int8_t* w) {
    std::int32_t v;
    std::memcpy(&v, w, 4);
    return _mm256_set1_epi32(v);
  }
  static void quads4(W* r) {
    const __m256i t0 = _mm256_unpacklo_epi8(r[0], r[1]), t1 = _mm256_unpackhi_epi8(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi8(r[2], r[3]), t3 = _mm256_unpackhi_epi8(r[2], r[3]);
    // Lane L: u0 channels 16L..16L+3, u1 +4.., u2 +8.., u3 +12..
    const __m256i u0 = _mm256_unpacklo_epi16(t0, t2), u1 = _mm256_unpackhi_epi16(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi16(t1, t3), u3 = _mm256_unpackhi_epi16(t1, t3);
    r[0] = _mm256_permute2x128_si256(u0, u1, 0x20), r[1] = _mm256_permute2x128_si256(u2, u3, 0x20);
    r[2] = _mm256_permute2x128_si256(u0, u1, 0x31), r[3] = _mm256_permute2x128_si256(u2, u3, 0x31);
  }
  static constexpr bool kRow2Quads = false;
  static void deinterleave2(const float* x, float* even, float* odd) {
    const __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8);
    // shuffle_ps works per 128-bit lane: (a0 a2 b0 b2 | a4 a6 b4 b6), then the 64-bit pairs in order.
    _mm256_storeu_ps(even, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8)));
    _mm256_storeu_ps(odd, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8)));
  }
};
}  // namespace
}  // namespace qkvshare::kernels::detail::avx2

#elif defined(__ARM_NEON) && defined(__aarch64__)
namespace qkvshare::kernels::detail::neon {
namespace {
struct VecCodes : Vec {
  using W = int16x8_t;
  static I zeroi() { return vdupq_n_s32(0); }
  static W zero16() { return vdupq_n_s16(0); }
  static W set16(std::int16_t x) { return vdupq_n_s16(x); }
  static W sub16(W a, W b) { return vsubq_s16(a, b); }
  static W load16(const std::int16_t* p) { return vld1q_s16(p); }
  static void store16(std::int16_t* p, W v) { vst1q_s16(p, v); }
  template <int Bits>
  static W codes16(const std::byte* row, int c) {
    const auto* src = reinterpret_cast<const std::uint8_t*>(row + c * Bits / 8);
    if constexpr (Bits == 8) {
      return vreinterpretq_s16_u16(vmovl_u8(vld1_u8(src)));
    } else {
      static constexpr CodeLanes<Bits, 8> t = make_code_lanes<Bits, 8>();
      const uint8x16_t w = vqtbl1q_u8(vld1q_u8(src), vld1q_u8(t.bytes.data()));
      const int16x8_t top = vmulq_s16(vreinterpretq_s16_u8(w), vld1q_s16(t.mult.data()));
      return vreinterpretq_s16_u16(vshrq_n_u16(vreinterpretq_u16_s16(top), 16 - Bits));
    }
  }
  // Adjacent pairs, as x86's madd.
  static I dot16(I acc, W a, W b) {
    return vaddq_s32(acc, vpaddq_s32(vmull_s16(vget_low_s16(a), vget_low_s16(b)), vmull_high_s16(a, b)));
  }
  static void hsum8_i(const I* a, std::int32_t* out) {
    vst1q_s32(out, vpaddq_s32(vpaddq_s32(a[0], a[1]), vpaddq_s32(a[2], a[3])));
    vst1q_s32(out + 4, vpaddq_s32(vpaddq_s32(a[4], a[5]), vpaddq_s32(a[6], a[7])));
  }
  static void zip16(W a, W b, W& lo, W& hi) { lo = vzip1q_s16(a, b), hi = vzip2q_s16(a, b); }
  static void unzip32(I lo, I hi, I& first, I& second) { first = lo, second = hi; }
  static W pair16(const std::int16_t* w) {
    std::int32_t v;
    std::memcpy(&v, w, 4);
    return vreinterpretq_s16_s32(vdupq_n_s32(v));
  }
  static F to_float(I v) { return vcvtq_f32_s32(v); }
  static I addi(I a, I b) { return vaddq_s32(a, b); }
  static float hmax(F v) { return vmaxvq_f32(v); }
  static void narrow8(std::int8_t* p, I v) {
    const int16x4_t h = vmovn_s32(v);
    const int8x8_t b = vmovn_s16(vcombine_s16(h, h));
    vst1_lane_s32(reinterpret_cast<std::int32_t*>(p), vreinterpret_s32_s8(b), 0);
  }

  using W8 = int8x16_t;
  static constexpr int kRows8 = 1;
  static constexpr bool kOffset8 = false;
  static W8 row4(const std::byte* row, int c) {
    const uint16x8_t w = vmovl_u8(vld1_u8(reinterpret_cast<const std::uint8_t*>(row + c / 2)));
    const uint16x8_t split = vandq_u16(vorrq_u16(w, vshlq_n_u16(w, 4)), vdupq_n_u16(0x0f0f));
    return vsubq_s8(vreinterpretq_s8_u16(split), vdupq_n_s8(8));
  }
  static W8 row2(const std::byte* row, int c) {
    std::uint32_t b;
    std::memcpy(&b, row + c / 4, 4);
    const uint32x4_t w = vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(b))));
    const uint32x4_t spread = vorrq_u32(vorrq_u32(w, vshlq_n_u32(w, 6)), vorrq_u32(vshlq_n_u32(w, 12), vshlq_n_u32(w, 18)));
    return vsubq_s8(vandq_s8(vreinterpretq_s8_u32(spread), vdupq_n_s8(3)), vdupq_n_s8(2));
  }
  static void transpose8(W8*) {}
  static W8 q8(const std::int8_t* q) { return vld1q_s8(q); }
  static W8 ones8() { return vdupq_n_s8(1); }
  static I dot8(I acc, W8 q, W8 codes) {
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(q), vget_low_s8(codes)));
    return vpadalq_s16(acc, vmull_high_s8(q, codes));
  }
  static I reduce4(I a0, I a1, I a2, I a3) { return vpaddq_s32(vpaddq_s32(a0, a1), vpaddq_s32(a2, a3)); }
  static void narrow16(std::int16_t* p, I v) { vst1_s16(p, vmovn_s32(v)); }
  // dot8 here sums bytes 2k, 2k + 1, 2k + 8, 2k + 9 into lane k: the value
  // sums keep int16 pairs (the same integers).
  static constexpr bool kValueBytes = false;
  static void deinterleave2(const float* x, float* even, float* odd) {
    const float32x4_t a = vld1q_f32(x), b = vld1q_f32(x + 4);
    vst1q_f32(even, vuzp1q_f32(a, b));
    vst1q_f32(odd, vuzp2q_f32(a, b));
  }
};
}  // namespace
}  // namespace qkvshare::kernels::detail::neon
#endif
