#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "qkvshare/core/half.hpp"

namespace qkvshare {
namespace {

// The scalar conversions are checked against the CPU's own conversion
// instructions (x86 F16C, ARM64 fcvt through __fp16) over every half value
// and a sweep of floats.
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("f16c"))) std::uint16_t hw_to_half(float f) {
  return static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float hw_to_float(std::uint16_t h) { return _cvtsh_ss(h); }
bool hw_half() { return __builtin_cpu_supports("f16c"); }
#elif defined(__aarch64__)
std::uint16_t hw_to_half(float f) {
  const __fp16 h = static_cast<__fp16>(f);
  std::uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}
float hw_to_float(std::uint16_t bits) {
  __fp16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}
bool hw_half() { return true; }
#else
std::uint16_t hw_to_half(float) { return 0; }
float hw_to_float(std::uint16_t) { return 0.0f; }
bool hw_half() { return false; }
#endif

TEST(Half, EveryHalfConvertsToTheSameFloatAsF16C) {
  if (!hw_half()) GTEST_SKIP() << "no hardware half conversion on this CPU";
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float want = hw_to_float(static_cast<std::uint16_t>(h));
    const float got = fp16_to_fp32(static_cast<std::uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(want), std::bit_cast<std::uint32_t>(got)) << h;
    }
  }
}

TEST(Half, FloatToHalfRoundsLikeF16C) {
  if (!hw_half()) GTEST_SKIP() << "no hardware half conversion on this CPU";
  // Every 97th float bit pattern covers normals, subnormals, ties, overflow and NaN.
  for (std::uint64_t bits = 0; bits <= 0xffffffffull; bits += 97) {
    const float f = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
    const std::uint16_t want = hw_to_half(f);
    const std::uint16_t got = fp32_to_fp16(f);
    if (std::isnan(f)) {
      ASSERT_EQ(got & 0x7c00u, 0x7c00u);
      ASSERT_NE(got & 0x03ffu, 0u);
    } else {
      ASSERT_EQ(want, got) << std::hex << bits;
    }
  }
}

TEST(Half, Bf16RoundTripAndRounding) {
  EXPECT_EQ(bf16_to_fp32(fp32_to_bf16(1.0f)), 1.0f);
  EXPECT_EQ(bf16_to_fp32(fp32_to_bf16(-3.5f)), -3.5f);
  // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: round to even gives 1.
  EXPECT_EQ(bf16_to_fp32(fp32_to_bf16(1.0f + 1.0f / 256.0f)), 1.0f);
  EXPECT_TRUE(std::isnan(bf16_to_fp32(fp32_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(bf16_to_fp32(fp32_to_bf16(INFINITY))));
}

}  // namespace
}  // namespace qkvshare
