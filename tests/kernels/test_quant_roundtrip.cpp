// Quantize -> dequantize round trips of the scalar reference formats, with
// bounds derived from each scheme, and the 8-bit activation quantizer of
// every ISA level against the portable one (they must agree byte for byte).
#include <gtest/gtest.h>

#include <limits>

#include "../../src/kernels/kernel_table.hpp"  // white-box: the activation quantizer
#include "kernel_test_util.hpp"

namespace qkvshare::kernels::testing {
namespace {

// Largest |x - dequant(quant(x))| over one block, derived from the scheme in
// quant_ref.cpp. A scale stored as f16 is off by up to 2^-11 relative, or
// 2^-25 absolute once it is subnormal (below 2^-14), and every code multiplies
// that error; kSlack covers the f32 operations.
constexpr double kF16 = 0x1p-11;
constexpr double kF16Sub = 0x1p-25;
constexpr double kSlack = 1e-6;

double scale_error(double d) { return std::fabs(d) * kF16 + kF16Sub; }

double block_bound(GgmlType type, const float* x, int n) {
  double amax = 0.0, lo = x[0], hi = x[0];
  for (int i = 0; i < n; ++i) {
    amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
    lo = std::min(lo, static_cast<double>(x[i]));
    hi = std::max(hi, static_cast<double>(x[i]));
  }
  switch (type) {
    case GgmlType::Q8_0:  // step amax/127, codes up to 127: step/2 + 127 scale errors
      return (amax / 254.0 + 127.0 * scale_error(amax / 127.0)) * (1 + kSlack);
    case GgmlType::Q4_0:  // step amax/8 from the signed maximum; its opposite may clip to 7 steps: one step
      return (amax / 8.0 + 8.0 * scale_error(amax / 8.0)) * (1 + kSlack);
    case GgmlType::Q4_1:  // step (hi-lo)/15, codes 0..15 above the f16 minimum
      return ((hi - lo) / 30.0 + 15.0 * scale_error((hi - lo) / 15.0) + scale_error(lo)) * (1 + kSlack);
    default: return 0.0;
  }
}

// Q6_K: group scales s_g = amax_g / 31, super-block scale d = max s_g / 127
// stored as dd (f16); a group's step is dd * round(s_g / d) = s_g (1 + e) +-
// dd / 2 with |e| <= 2^-11 + 2^-25 / d. Values within 31 steps round to
// within step / 2; the largest may clip by 31 s_g |e| + 15.5 dd.
double q6k_bound(const float* x) {
  double s = 0.0;
  for (int i = 0; i < kQK_K; ++i) s = std::max(s, std::fabs(static_cast<double>(x[i])) / 31.0);
  if (s == 0.0) return 0.0;
  const double d = s / 127.0;
  const double dd = d + scale_error(d);
  const double e = kF16 + kF16Sub / d;
  return std::max((s * (1 + e) + dd / 2.0) / 2.0, 31.0 * s * e + 15.5 * dd) * (1 + kSlack);
}

TEST(QuantRoundTrip, BlockFormatsStayWithinTheirBounds) {
  std::mt19937 rng(1);
  for (GgmlType type : {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q6_K}) {
    for (float sigma : {1e-3f, 1.0f, 100.0f}) {
      const std::int64_t n = 1024;
      auto x = normal(n, sigma, rng);
      x[17] = 0.0f;
      x[100] = 20.0f * sigma;  // an outlier
      for (int i = 256; i < 288; ++i) x[i] = 0.0f;  // an all-zero block
      const TypeTraits& tt = type_traits(type);
      std::vector<std::uint8_t> q(static_cast<std::size_t>(n / tt.block_size) * tt.type_size);
      std::vector<float> back(n);
      quantize_row_ref(type, x.data(), q.data(), n);
      dequantize_row_ref(type, q.data(), back.data(), n);
      for (std::int64_t b = 0; b < n; b += tt.block_size) {
        const double bound = type == GgmlType::Q6_K ? q6k_bound(&x[b]) : block_bound(type, &x[b], kQK);
        for (std::int64_t i = b; i < b + tt.block_size; ++i)
          ASSERT_LE(std::fabs(static_cast<double>(back[i]) - x[i]), bound)
              << type_name(type) << " sigma " << sigma << " index " << i << " x " << x[i] << " back " << back[i];
      }
    }
  }
}

TEST(QuantRoundTrip, HalfFormatsRoundToNearest) {
  std::mt19937 rng(2);
  auto x = normal(4096, 10.0f, rng);
  x.push_back(65504.0f);  // largest f16
  x.push_back(3e-6f);     // f16 subnormal
  x.push_back(0.0f);
  for (GgmlType type : {GgmlType::F16, GgmlType::BF16}) {
    const auto n = static_cast<std::int64_t>(x.size());
    std::vector<std::uint8_t> q(2 * x.size());
    std::vector<float> back(x.size());
    quantize_row_ref(type, x.data(), q.data(), n);
    dequantize_row_ref(type, q.data(), back.data(), n);
    // Half an ulp: 2^-11 (f16) / 2^-8 (bf16) relative, f16 subnormals 2^-25 absolute.
    const double rel = type == GgmlType::F16 ? 0x1p-11 : 0x1p-8;
    for (std::size_t i = 0; i < x.size(); ++i)
      ASSERT_LE(std::fabs(static_cast<double>(back[i]) - x[i]), rel * std::fabs(x[i]) + 0x1p-25)
          << type_name(type) << " x " << x[i];
  }
}

TEST(ActivationQuantizer, EveryLevelMatchesPortableByteForByte) {
  std::mt19937 rng(3);
  const std::int64_t n = 32 * 40;
  auto x = normal(n, 3.0f, rng);
  for (int i = 0; i < 32; ++i) x[i] = 0.0f;             // zero block
  for (int i = 32; i < 64; ++i) x[i] *= 1e-32f;         // below the flush threshold
  for (int i = 64; i < 96; ++i) x[i] *= 1e-28f;         // tiny but kept
  for (int i = 96; i < 128; ++i) x[i] *= 1e30f;         // huge
  for (int i = 128; i < 160; ++i) x[i] = (i % 2 ? 1.0f : -1.0f) * (0.5f + static_cast<float>(i - 128));  // ties
  x[200] = std::numeric_limits<float>::infinity();
  x[260] = std::numeric_limits<float>::quiet_NaN();
  struct Out {
    std::vector<std::int8_t> qs = std::vector<std::int8_t>(n);
    std::vector<float> d = std::vector<float>(n / 32), dl = std::vector<float>(n / 4), xs = std::vector<float>(n / 4),
                       s = std::vector<float>(n / 32);
    std::vector<std::int32_t> bias = std::vector<std::int32_t>(n / 4), bsum = std::vector<std::int32_t>(n / 32);
  };
  const auto run = [&](Isa isa) {
    const IsaGuard guard(isa);
    Out o;
    const detail::ActQ8Out out{o.qs.data(), o.d.data(), o.dl.data(), o.bias.data(), o.xs.data(), o.bsum.data(), o.s.data()};
    detail::kernels().quantize_act(x.data(), n, -8, out);
    return o;
  };
  const Out ref = run(Isa::portable);
  // The block scales and the codes reproduce x within half a step.
  for (std::int64_t i = 0; i < 192; ++i) {  // the blocks before the inf and NaN
    const double d = ref.d[i / 32];
    ASSERT_LE(std::fabs(d * ref.qs[i] - x[i]), d / 2.0 * (1 + 1e-6) + (d == 0 ? std::fabs(x[i]) : 0.0)) << i;
  }
  for (Isa isa : available_isas()) {
    const Out o = run(isa);
    EXPECT_EQ(o.qs, ref.qs) << isa_name(isa);
    EXPECT_EQ(o.bias, ref.bias) << isa_name(isa);
    EXPECT_EQ(o.bsum, ref.bsum) << isa_name(isa);
    for (std::size_t i = 0; i < ref.d.size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(o.d[i]), std::bit_cast<std::uint32_t>(ref.d[i])) << isa_name(isa) << " block " << i;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(o.s[i]), std::bit_cast<std::uint32_t>(ref.s[i])) << isa_name(isa) << " block " << i;
    }
    for (std::size_t i = 0; i < ref.dl.size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(o.dl[i]), std::bit_cast<std::uint32_t>(ref.dl[i])) << isa_name(isa);
      ASSERT_EQ(std::bit_cast<std::uint32_t>(o.xs[i]), std::bit_cast<std::uint32_t>(ref.xs[i])) << isa_name(isa);
    }
  }
}

// The super-block kind (Q4_K, Q5_K, Q6_K): one scale per 256 values, codes
// rounded half to even (as nearbyint), the sums of every group of 16 and
// block of 32 exact; a block below the flush threshold is zeros, and inf and
// NaN give defined codes instead of undefined conversions.
TEST(ActivationQuantizer, SuperBlockKindRoundsToNearestAndSumsItsGroups) {
  std::mt19937 rng(5);
  const std::int64_t n = 256 * 6;
  auto x = normal(n, 2.0f, rng);
  for (int i = 256; i < 512; ++i) x[i] *= 1e-32f;  // below the flush threshold
  for (int i = 512; i < 768; ++i) x[i] = 0.25f * static_cast<float>(i - 640);  // ties at half steps
  x[512] = -32.0f;                                  // sets that block's scale: 32 / 127
  x[800] *= 40.0f;                                  // an outlier sets its block's scale
  x[1100] = std::numeric_limits<float>::infinity();
  x[1300] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::int8_t> qs(n);
  std::vector<float> dk(n / 256), s(n / 32);
  std::vector<std::int32_t> g16(n / 16), bsum(n / 32);
  detail::ActQ8Out out{qs.data(), nullptr, nullptr, nullptr, nullptr, bsum.data(), s.data()};
  out.dk = dk.data();
  out.g16 = g16.data();
  detail::quantize_act_k(x.data(), n, out);
  for (std::int64_t j = 0; j < n / 256; ++j) {
    float amax = 0.0f;
    for (std::int64_t i = 256 * j; i < 256 * j + 256; ++i)
      if (std::isfinite(x[i])) amax = std::max(amax, std::fabs(x[i]));
    if (j == 4) amax = std::numeric_limits<float>::infinity();
    const float want_dk = amax >= detail::kActFlush ? amax / 127.0f : 0.0f;
    ASSERT_EQ(dk[j], want_dk) << "super-block " << j;
    for (std::int64_t i = 256 * j; i < 256 * j + 256; ++i) {
      // An infinite scale multiplies by 1 / inf = 0: finite values give 0, inf * 0 and NaN give -127.
      int want = 0;
      if (!std::isfinite(x[i]) && (std::isnan(x[i]) || !std::isfinite(want_dk)))
        want = -127;
      else if (want_dk > 0.0f && std::isfinite(want_dk))
        want = static_cast<int>(std::nearbyint(std::clamp(x[i] * (1.0f / want_dk), -127.0f, 127.0f)));
      ASSERT_EQ(qs[i], want) << "value " << i << " = " << x[i];
    }
  }
  for (std::int64_t g = 0; g < n / 16; ++g) {
    int sum = 0;
    for (std::int64_t i = 16 * g; i < 16 * g + 16; ++i) sum += qs[i];
    ASSERT_EQ(g16[g], sum) << "group " << g;
  }
  for (std::int64_t b = 0; b < n / 32; ++b) {
    ASSERT_EQ(bsum[b], g16[2 * b] + g16[2 * b + 1]) << "block " << b;
    const float want_s = dk[b / 8] * static_cast<float>(bsum[b]);  // NaN in the infinite block: compare bits
    ASSERT_EQ(std::bit_cast<std::uint32_t>(s[b]), std::bit_cast<std::uint32_t>(want_s)) << "block " << b;
  }
  for (std::int64_t i = 256; i < 512; ++i) ASSERT_EQ(qs[i], 0);
}

}  // namespace
}  // namespace qkvshare::kernels::testing
