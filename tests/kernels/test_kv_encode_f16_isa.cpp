// f32 -> f16 of the KV pool's rows (TileKernels::encode_f16): every level
// writes the reference's bits (core/half.hpp's fp32_to_fp16) for whole
// vectors and tails, ties, values that round to subnormals, zero or infinity,
// and NaNs, wherever they sit in a vector.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernel_test_util.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"

namespace qkvshare::kernels::testing {
namespace {

std::vector<float> edge_values() {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.0f, 65520.0f, -65520.0f, 1e6f, inf, -inf,
                          6.1035156e-05f,  // smallest normal f16
                          5.9604645e-08f,  // smallest subnormal f16
                          2.9802322e-08f,  // half of it: a tie, rounds to zero (even)
                          2.9802326e-08f,  // just above the tie: rounds up
                          8.940697e-08f,   // 1.5 subnormal steps: a tie, rounds to 2 steps
                          1e-30f, -1e-10f, std::numeric_limits<float>::denorm_min()};
  // Ties between neighbouring normal f16 values, both parities.
  for (int m : {0, 1, 2, 3, 1023})
    v.push_back(std::bit_cast<float>(0x3f800000u + (static_cast<std::uint32_t>(m) << 13) + 0x1000u));
  return v;
}

TEST(KvEncodeF16Isa, EveryLevelGivesTheReferenceBits) {
  std::mt19937 rng(47);
  const std::vector<float> edges = edge_values();
  for (const std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{15}, std::size_t{16},
                              std::size_t{33}, std::size_t{64}, std::size_t{200}}) {
    for (int trial = 0; trial < 4; ++trial) {
      auto x = normal(n, trial == 3 ? 3e4f : 1.5f, rng);
      for (std::size_t i = 0; i < n; i += 3) x[i] = edges[(i / 3 + static_cast<std::size_t>(trial)) % edges.size()];
      if (trial == 1) x[n / 2] = std::numeric_limits<float>::quiet_NaN();
      if (trial == 2) x[n - 1] = -std::bit_cast<float>(0x7fa00001u);  // a signalling NaN with a payload
      std::vector<std::uint16_t> ref(n);
      encode_f16_ref(x.data(), n, ref.data());
      for (Isa isa : available_isas()) {
        std::vector<std::uint16_t> out(n + 1, 0xabcd);
        tile_kernels(isa).encode_f16(x.data(), n, out.data());
        ASSERT_EQ(0, std::memcmp(out.data(), ref.data(), n * sizeof(std::uint16_t)))
            << isa_name(isa) << " n " << n << " trial " << trial;
        ASSERT_EQ(out[n], 0xabcd) << isa_name(isa) << ": wrote past n";
      }
    }
  }
}

TEST(KvEncodeF16Isa, ReferenceRoundsToNearestEven) {
  const std::vector<float> x = {1.0f, std::bit_cast<float>(0x3f801000u), std::bit_cast<float>(0x3f803000u), 65520.0f,
                                2.9802322e-08f, std::numeric_limits<float>::quiet_NaN()};
  std::vector<std::uint16_t> h(x.size());
  encode_f16_ref(x.data(), x.size(), h.data());
  EXPECT_EQ(h[0], 0x3c00);  // 1
  EXPECT_EQ(h[1], 0x3c00);  // halfway between 1 and 1 + 2^-10: to the even one
  EXPECT_EQ(h[2], 0x3c02);  // halfway between 1 + 2^-10 and 1 + 2^-9: to the even one
  EXPECT_EQ(h[3], 0x7c00);  // past the largest finite half: infinity
  EXPECT_EQ(h[4], 0x0000);  // half the smallest subnormal: zero
  EXPECT_EQ(h[5] & 0x7c00, 0x7c00);
  EXPECT_NE(h[5] & 0x03ff, 0);  // still a NaN
}

}  // namespace
}  // namespace qkvshare::kernels::testing
