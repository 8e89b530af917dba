// Elementwise ops: SwiGLU at every ISA level against the std::exp reference,
// and RoPE's split form against the plain formula, bit for bit.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <span>

#include "kernel_test_util.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"
#include "qkvshare/kernels/ops.hpp"

namespace qkvshare::kernels::testing {
namespace {

using GatedFn = void (*)(float* gate, const float* up, std::int64_t n);

// A gated activation (gate = act(gate) * up) at every ISA level against its
// scalar reference, on random gates of scale 4 and the given edge values,
// within 6 ulp (see the two tests), for lengths that leave vector tails.
void expect_gated_matches(GatedFn fn, GatedFn ref_fn, std::span<const float> edge, unsigned seed) {
  std::mt19937 rng(seed);
  auto g = normal(1000, 4.0f, rng);
  const auto up = normal(g.size(), 1.0f, rng);
  std::copy(edge.begin(), edge.end(), g.begin());
  std::vector<float> ref = g;
  ref_fn(ref.data(), up.data(), static_cast<std::int64_t>(g.size()));
  for (Isa isa : available_isas())
    for (std::int64_t n : {1, 7, 17, 1000}) {
      const IsaGuard guard(isa);
      std::vector<float> out = g;
      fn(out.data(), up.data(), n);
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_LE(std::fabs(static_cast<double>(out[i]) - ref[i]), 6.0 * kU * std::fabs(ref[i]) + 1e-37)
            << isa_name(isa) << " g " << g[i] << " up " << up[i] << " got " << out[i] << " ref " << ref[i];
      for (std::size_t i = static_cast<std::size_t>(n); i < g.size(); ++i) ASSERT_EQ(out[i], g[i]) << "wrote past n";
    }
}

// silu(g) * u = g * u / (1 + exp(-g)). The vector exp errs by at most 2 ulp,
// which 1 + exp(-g) passes on damped (relative error <= 2u), then the
// division and the product round once each: 4u relative, 6u with slack.
TEST(OpsIsa, SiluMulMatchesTheReference) {
  const float edge[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 20.0f, -20.0f, 87.0f, -87.0f, 88.5f, -88.5f, 89.0f, -89.0f,
                        100.0f, -100.0f, 104.0f, -104.0f, 1e30f, -1e30f};
  expect_gated_matches(silu_mul, silu_mul_ref, edge, 23);
}

// gelu(g) * u = g * u / (1 + exp(-2y)): y is computed in the same separate
// roundings on every level, so only the exp (2 ulp) differs; 1 + e damps it
// and the division and product add 2u, as for SiluMul. Where 1 + e is e
// (g below about -5) its 2 ulp pass on whole: 6u still holds.
TEST(OpsIsa, GeluMulMatchesTheReference) {
  const float edge[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 3.0f, -3.0f, 10.0f, -10.0f, 20.0f, -20.0f, 50.0f, -50.0f,
                        1e10f, -1e10f, 1e30f, -1e30f};
  expect_gated_matches(gelu_mul, gelu_mul_ref, edge, 31);
  // Known values of the tanh form: gelu(1) = 0.841192, gelu(-1) = -0.158808, gelu(3) = 2.996363.
  std::vector<float> x = {1.0f, -1.0f, 3.0f}, ones(3, 1.0f);
  gelu_mul_ref(x.data(), ones.data(), 3);
  EXPECT_NEAR(x[0], 0.841192f, 1e-6f);
  EXPECT_NEAR(x[1], -0.158808f, 1e-6f);
  EXPECT_NEAR(x[2], 2.996363f, 1e-6f);
}

TEST(OpsIsa, RopeEqualsThePerHeadFormulaExactly) {
  std::mt19937 rng(29);
  for (RopeStyle style : {RopeStyle::interleaved, RopeStyle::neox})
    for (int hd : {8, 64, 128}) {
      const int heads = 3;
      std::vector<float> inv(static_cast<std::size_t>(hd / 2));
      for (int i = 0; i < hd / 2; ++i) inv[i] = std::pow(10000.0f, -2.0f * static_cast<float>(i) / static_cast<float>(hd));
      const auto x = normal(static_cast<std::size_t>(heads * hd), 1.0f, rng);
      for (float pos : {0.0f, 1.0f, 37.0f, 4095.0f}) {
        std::vector<float> expect = x, got = x;
        for (int h = 0; h < heads; ++h)
          for (int i = 0; i < hd / 2; ++i) {
            const float c = std::cos(pos * inv[i]), s = std::sin(pos * inv[i]);
            const int a = style == RopeStyle::interleaved ? 2 * i : i;
            const int b = style == RopeStyle::interleaved ? 2 * i + 1 : i + hd / 2;
            float* v = expect.data() + h * hd;
            const float v0 = v[a], v1 = v[b];
            v[a] = v0 * c - v1 * s;
            v[b] = v0 * s + v1 * c;
          }
        rope(got.data(), heads, hd, pos, inv.data(), style);
        EXPECT_EQ(got, expect) << "head_dim " << hd << " pos " << pos;
      }
    }
}

// The RoPE of stored key rows (keys=pre): every level gives the reference's
// bits (one fused multiply-add per element), on random rows and on rows of
// zeros, huge and tiny values, for head sizes whose half is and is not a
// multiple of a level's width; and the reference is the engine's RoPE to
// rounding (the same angles; 2 roundings against 3).
TEST(OpsIsa, KeyRowRopeMatchesTheReferenceOnEveryLevel) {
  std::mt19937 rng(31);
  for (RopeStyle style : {RopeStyle::interleaved, RopeStyle::neox})
    for (int hd : {8, 16, 24, 32, 64, 128}) {
      std::vector<float> inv(static_cast<std::size_t>(hd / 2));
      for (int i = 0; i < hd / 2; ++i) inv[i] = std::pow(10000.0f, -2.0f * static_cast<float>(i) / static_cast<float>(hd));
      const int rows = 33, pos0 = 4000;
      std::vector<float> table(static_cast<std::size_t>(rows) * 2 * hd);
      for (int r = 0; r < rows; ++r)
        rope_table_row(static_cast<float>(pos0 + r), inv.data(), hd, style, &table[static_cast<std::size_t>(r) * 2 * hd]);
      auto x = normal(static_cast<std::size_t>(rows * hd), 3.0f, rng);
      for (int c = 0; c < hd; ++c) {
        x[static_cast<std::size_t>(c)] = 0.0f;                 // row 0: zeros
        x[static_cast<std::size_t>(hd + c)] = c % 2 ? 3e38f : -1e-38f;  // row 1: near the ends of the range
      }
      std::vector<float> ref = x;
      rope_rows_ref(ref.data(), rows, hd, table.data(), 2 * hd, style);
      for (int r = 2; r < rows; ++r) {  // the engine's RoPE of the same row
        std::vector<float> e(x.begin() + r * hd, x.begin() + (r + 1) * hd);
        rope(e.data(), 1, hd, static_cast<float>(pos0 + r), inv.data(), style);
        for (int c = 0; c < hd; ++c)
          ASSERT_NEAR(ref[static_cast<std::size_t>(r * hd + c)], e[static_cast<std::size_t>(c)], 1e-5f) << hd << " row " << r;
      }
      for (Isa isa : available_isas()) {
        std::vector<float> got = x;
        tile_kernels(isa).rope(got.data(), rows, hd, table.data(), 2 * hd, style);
        for (std::size_t i = 0; i < got.size(); ++i)
          ASSERT_EQ(std::memcmp(&got[i], &ref[i], sizeof(float)), 0)
              << isa_name(isa) << " head_dim " << hd << " at " << i << ": " << got[i] << " vs " << ref[i];
        // Every row by the same angles (a step of 0: the queries of keys=block), row 5's.
        std::vector<float> same = x, same_ref = x;
        rope_rows_ref(same_ref.data(), rows, hd, &table[5 * 2 * static_cast<std::size_t>(hd)], 0, style);
        tile_kernels(isa).rope(same.data(), rows, hd, &table[5 * 2 * static_cast<std::size_t>(hd)], 0, style);
        ASSERT_EQ(0, std::memcmp(same.data(), same_ref.data(), same.size() * sizeof(float))) << isa_name(isa);
        for (int c = 0; c < hd; ++c)
          ASSERT_EQ(same_ref[static_cast<std::size_t>(5 * hd + c)], ref[static_cast<std::size_t>(5 * hd + c)]);
      }
    }
}

}  // namespace
}  // namespace qkvshare::kernels::testing
