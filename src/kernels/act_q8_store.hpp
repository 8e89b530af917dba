#pragma once
// The tail of activation quantization shared by the AVX2 and AVX-512 units:
// given one block's 32 codes, writes its per-group and per-block sums. Internal
// linkage on purpose: each ISA unit compiles its own copy with its own flags,
// so the linker can never hand the AVX-512 build of it to the AVX2 path.
#include <cstdint>

#include "kernel_table.hpp"
#include "simd_intrin.hpp"

namespace qkvshare::kernels::detail {
namespace {

inline void store_act_sums(const ActQ8Out& o, std::int64_t b, __m256i q8, float db, std::int32_t bias_mult) {
  const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8), _mm256_set1_epi16(1));  // per 4
  _mm256_storeu_ps(o.dl + 8 * b, _mm256_set1_ps(db));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.bias + 8 * b), _mm256_mullo_epi32(sums, _mm256_set1_epi32(bias_mult)));
  _mm256_storeu_ps(o.xs + 8 * b, _mm256_mul_ps(_mm256_set1_ps(db), _mm256_cvtepi32_ps(sums)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
  const int block_sum = _mm_cvtsi128_si32(s4);
  o.bsum[b] = bias_mult * block_sum;
  o.s[b] = db * static_cast<float>(block_sum);
}

}  // namespace
}  // namespace qkvshare::kernels::detail
