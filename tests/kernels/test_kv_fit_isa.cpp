// The range search of the KV encoders (TileKernels::fit): every level gives
// the reference's bits, for any number of series (whole vectors and tails),
// strides wider than the series, constant and too narrow series, signed
// zeros and outliers; and the reference picks a range that codes its series with no
// more squared error than the full range does.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kernel_test_util.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"

namespace qkvshare::kernels::testing {
namespace {

// The squared error of one series' codes under range [l, h], as the reference defines it.
double coded_error(const std::vector<float>& x, int n, std::ptrdiff_t stride, int s, float l, float h, int qmax) {
  const float top = static_cast<float>(qmax), sc = (h - l) / top, inv = top / (h - l);
  double e = 0;
  for (int i = 0; i < n; ++i) {
    const float v = x[static_cast<std::size_t>(i * stride + s)];
    const float code = std::trunc(std::min(std::max((v - l) * inv + 0.5f, 0.0f), top + 0.25f));
    const double d = v - (code * sc + l);
    e += d * d;
  }
  return e;
}

TEST(KvFitIsa, EveryLevelGivesTheReferenceBits) {
  std::mt19937 rng(41);
  for (const int qmax : {3, 7, 15})
    for (const int n : {1, 2, 8, 32})
      for (const int lanes : {1, 7, 8, 16, 24, 37, 64})
        for (const int pad : {0, 5}) {
          const std::ptrdiff_t stride = lanes + pad;
          auto x = normal(static_cast<std::size_t>(n * stride), 2.0f, rng);
          for (int i = 0; i < n; ++i) {
            x[static_cast<std::size_t>(i * stride)] = 1.5f;  // series 0: constant
            if (lanes > 1) x[static_cast<std::size_t>(i * stride + 1)] = i % 2 ? 0.0f : -0.0f;  // series 1: signed zeros
            if (lanes > 2 && i == n / 2) x[static_cast<std::size_t>(i * stride + 2)] = 40.0f;  // series 2: an outlier
            if (lanes > 3) x[static_cast<std::size_t>(i * stride + 3)] *= 1e-30f;  // series 3: tiny values
            if (lanes > 4) x[static_cast<std::size_t>(i * stride + 4)] *= 1e-32f;  // series 4: too narrow to search
          }
          std::vector<float> lo_ref(static_cast<std::size_t>(lanes)), hi_ref(lo_ref.size());
          fit_ranges_ref(x.data(), n, stride, lanes, qmax, lo_ref.data(), hi_ref.data());
          for (Isa isa : available_isas()) {
            std::vector<float> lo(lo_ref.size(), -7.0f), hi(lo_ref.size(), -7.0f);
            tile_kernels(isa).fit(x.data(), n, stride, lanes, qmax, lo.data(), hi.data());
            ASSERT_EQ(0, std::memcmp(lo.data(), lo_ref.data(), lo.size() * sizeof(float)))
                << isa_name(isa) << " qmax " << qmax << " n " << n << " lanes " << lanes << " stride " << stride;
            ASSERT_EQ(0, std::memcmp(hi.data(), hi_ref.data(), hi.size() * sizeof(float)))
                << isa_name(isa) << " qmax " << qmax << " n " << n << " lanes " << lanes << " stride " << stride;
          }
        }
}

TEST(KvFitIsa, ReferenceKeepsOrBeatsTheFullRange) {
  std::mt19937 rng(43);
  const int n = 32, lanes = 64, qmax = 3;
  auto x = normal(static_cast<std::size_t>(n * lanes), 1.0f, rng);
  for (int s = 0; s < lanes; s += 4) x[static_cast<std::size_t>((s % n) * lanes + s)] = 12.0f;  // outliers to clip
  std::vector<float> lo(lanes), hi(lanes);
  fit_ranges_ref(x.data(), n, lanes, lanes, qmax, lo.data(), hi.data());
  int clipped = 0;
  for (int s = 0; s < lanes; ++s) {
    float l = x[static_cast<std::size_t>(s)], h = l;
    for (int i = 0; i < n; ++i) {
      l = std::min(l, x[static_cast<std::size_t>(i * lanes + s)]);
      h = std::max(h, x[static_cast<std::size_t>(i * lanes + s)]);
    }
    EXPECT_GE(lo[static_cast<std::size_t>(s)], l);
    EXPECT_LE(hi[static_cast<std::size_t>(s)], h);
    EXPECT_LE(coded_error(x, n, lanes, s, lo[static_cast<std::size_t>(s)], hi[static_cast<std::size_t>(s)], qmax),
              coded_error(x, n, lanes, s, l, h, qmax) * (1 + 1e-5))
        << s;
    clipped += lo[static_cast<std::size_t>(s)] != l || hi[static_cast<std::size_t>(s)] != h;
  }
  EXPECT_GT(clipped, lanes / 2);  // at 2 bits most series gain from clipping
}

}  // namespace
}  // namespace qkvshare::kernels::testing
