#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "qkvshare/core/half.hpp"
#include "qkvshare/kv/kv_kernels.hpp"

namespace qkvshare {
namespace {

const char* const kFormats[] = {"f32", "f16", "int8", "int8:kaxis=token", "int4", "int3", "int2",
                                "int4:kaxis=token:kgroup=8", "int2:vgroup=16", "int4:vgroup=64", "int3:vgroup=24",
                                "int2:vgroup=8", "int8:params=8", "int4:params=8", "int3:vgroup=24:params=8",
                                "int2:vgroup=16:params=8", "int4:kaxis=token:kgroup=8:params=8"};

// Rows like real keys: mostly small, one outlier channel (docs/design.md).
std::vector<float> sample_rows(int tokens, int dim, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(tokens) * dim);
  for (int j = 0; j < tokens; ++j)
    for (int c = 0; c < dim; ++c) x[static_cast<std::size_t>(j) * dim + c] = n(rng) * (c == 3 ? 8.0f : 1.0f) + (c == 5 ? 2.0f : 0.0f);
  return x;
}

struct Case {
  KvCodec codec;
  int tokens, dim;
};

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const char* f : kFormats)
    for (int kind = 0; kind < 2; ++kind)
      for (const auto& [t, d] : {std::pair{32, 64}, std::pair{32, 8}, std::pair{8, 24}, std::pair{64, 128}, std::pair{1, 16}, std::pair{16, 48}}) {
        const KvFormat fmt = KvFormat::parse(f);
        const KvCodec c = kind == 0 ? fmt.k : fmt.v;
        cases.push_back({c, t, d});
      }
  return cases;
}

// Every decoded value is the grid point (code * scale + min, code in
// [0, 2^bits)) nearest to the original, for the parameters stored with the
// tile; float types round to nearest. And the overall error shrinks with the bits.
TEST(KvQuant, RoundTripIsTheNearestGridPoint) {
  for (const Case& cs : all_cases()) {
    const TileLayout l = tile_layout(cs.codec, cs.tokens, cs.dim);
    std::vector<std::byte> tile(l.bytes);
    const auto x = sample_rows(cs.tokens, cs.dim, 7);
    kv::encode_tile(cs.codec, l, x.data(), tile.data());
    std::vector<float> y(x.size());
    kv::decode_tile_scalar(cs.codec, l, tile.data(), cs.tokens, y.data());
    const kernels::TileCodes codes = kv::tile_codes(cs.codec, l);
    const int qmax = cs.codec.quantized() ? (1 << cs.codec.bits()) - 1 : 0;
    double sq = 0.0, ref = 0.0;
    for (int j = 0; j < cs.tokens; ++j)
      for (int c = 0; c < cs.dim; ++c) {
        const std::size_t i = static_cast<std::size_t>(j) * cs.dim + c;
        sq += (x[i] - y[i]) * (x[i] - y[i]);
        ref += x[i] * x[i];
        const std::string where = fmt::format("{} bits axis {} byte params {} t={} d={} j={} c={}", cs.codec.bits(),
                                              static_cast<int>(cs.codec.axis), cs.codec.byte_params, cs.tokens, cs.dim, j, c);
        if (cs.codec.type == KvType::f32) {
          ASSERT_EQ(x[i], y[i]) << where;
          continue;
        }
        if (cs.codec.type == KvType::f16) {
          ASSERT_EQ(y[i], fp16_to_fp32(fp32_to_fp16(x[i]))) << where;
          continue;
        }
        const int g = effective_group(cs.codec, cs.dim);
        const std::size_t p = cs.codec.axis == KvAxis::channel ? static_cast<std::size_t>(c)
                                                               : static_cast<std::size_t>(j * (cs.dim / g) + c / g);
        float s = 0.0f, m = 0.0f;
        kernels::tile_param_ref(codes, tile.data(), static_cast<int>(p), s, m);
        float nearest = 1e30f;
        for (int k = 0; k <= qmax; ++k) nearest = std::min(nearest, std::abs(x[i] - std::fma(static_cast<float>(k), s, m)));
        ASSERT_LE(std::abs(x[i] - y[i]), nearest + 1e-5f * (std::abs(x[i]) + s)) << where;
      }
    if (cs.codec.quantized()) {  // about the uniform-noise value of the grid, with room
      const double rel = std::sqrt(sq / ref);
      EXPECT_LT(rel, 4.0 / qmax) << cs.codec.bits() << " bits t=" << cs.tokens << " d=" << cs.dim;
    }
  }
}

// Clipping the range is only kept when it lowers the error: never worse than min/max.
TEST(KvQuant, ClippedRangesNeverLoseToMinMax) {
  const auto x = sample_rows(32, 64, 21);
  for (KvType t : {KvType::q4, KvType::q3, KvType::q2}) {
    const KvCodec c{t, KvAxis::token, 64};
    const TileLayout l = tile_layout(c, 32, 64);
    std::vector<std::byte> tile(l.bytes);
    kv::encode_tile(c, l, x.data(), tile.data());
    std::vector<float> y(x.size());
    kv::decode_tile_scalar(c, l, tile.data(), 32, y.data());
    const int qmax = (1 << c.bits()) - 1;
    for (int j = 0; j < 32; ++j) {
      const float* r = &x[static_cast<std::size_t>(j) * 64];
      const auto [lo, hi] = std::minmax_element(r, r + 64);
      const float m = fp16_to_fp32(fp32_to_fp16(*lo));
      const float s = fp16_to_fp32(fp32_to_fp16((*hi - m) / qmax));
      double plain = 0.0, got = 0.0;
      for (int i = 0; i < 64; ++i) {
        const float q = std::clamp(std::nearbyint((r[i] - m) / s), 0.0f, static_cast<float>(qmax));
        plain += std::pow(r[i] - std::fma(q, s, m), 2);
        got += std::pow(r[i] - y[static_cast<std::size_t>(j) * 64 + i], 2);
      }
      EXPECT_LE(got, plain * (1 + 1e-5) + 1e-9) << c.bits() << " bits row " << j;
    }
  }
}

TEST(KvQuant, PerChannelKeysBeatPerTokenOnOutlierChannels) {
  const auto x = sample_rows(32, 64, 11);
  const auto error = [&](const KvCodec& c) {
    const TileLayout l = tile_layout(c, 32, 64);
    std::vector<std::byte> tile(l.bytes);
    kv::encode_tile(c, l, x.data(), tile.data());
    std::vector<float> y(x.size());
    kv::decode_tile_scalar(c, l, tile.data(), 32, y.data());
    double e = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) e += (x[i] - y[i]) * (x[i] - y[i]);
    return e;
  };
  for (KvType t : {KvType::q8, KvType::q4, KvType::q2})
    EXPECT_LT(error({t, KvAxis::channel, 0}), error({t, KvAxis::token, 0}));
}

// The SIMD levels this CPU runs (the scalar reference is compared with each).
std::vector<kernels::Isa> simd_isas() {
  std::vector<kernels::Isa> out;
  for (kernels::Isa isa : kernels::kAllIsas)
    if (isa != kernels::Isa::portable && kernels::isa_available(isa)) out.push_back(isa);
  return out;
}

TEST(KvQuant, SimdDecodeMatchesScalarBitForBit) {
  if (simd_isas().empty()) GTEST_SKIP() << "no SIMD level on this CPU";
  const kernels::TileKernels& ref = kernels::tile_kernels(kernels::Isa::portable);
  for (kernels::Isa isa : simd_isas())
    for (const Case& cs : all_cases()) {
      const TileLayout l = tile_layout(cs.codec, cs.tokens, cs.dim);
      std::vector<std::byte> tile(l.bytes);
      const auto x = sample_rows(cs.tokens, cs.dim, 3);
      kv::encode_tile(cs.codec, l, x.data(), tile.data());
      for (int rows : {cs.tokens, std::max(1, cs.tokens / 2 + 1), 1}) {
        std::vector<float> a(x.size(), -1.0f), b(x.size(), -1.0f);
        ref.decode(kv::tile_codes(cs.codec, l), tile.data(), rows, a.data());
        kernels::tile_kernels(isa).decode(kv::tile_codes(cs.codec, l), tile.data(), rows, b.data());
        ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
            << "isa " << kernels::isa_name(isa) << " bits " << cs.codec.bits() << " axis "
            << static_cast<int>(cs.codec.axis) << " group " << cs.codec.group << " t=" << cs.tokens << " d=" << cs.dim
            << " rows=" << rows;
      }
    }
}

TEST(KvQuant, SimdScoresSumsExpMatchScalar) {
  if (simd_isas().empty()) GTEST_SKIP() << "no SIMD level on this CPU";
  const kernels::TileKernels& ref = kernels::tile_kernels(kernels::Isa::portable);
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (kernels::Isa isa : simd_isas()) {
    const kernels::TileKernels& k2 = kernels::tile_kernels(isa);
    for (int dim : {8, 16, 24, 64, 136, 256}) {
      for (int rows : {1, 7, 8, 9, 32, 45}) {
        std::vector<float> q(static_cast<std::size_t>(dim)), k(static_cast<std::size_t>(rows * dim)), p(static_cast<std::size_t>(rows));
        for (auto& v : q) v = n(rng);
        for (auto& v : k) v = n(rng);
        for (auto& v : p) v = std::abs(n(rng));
        std::vector<float> s1(p.size()), s2(p.size());
        const float m1 = ref.scores(q.data(), k.data(), rows, dim, 0.125f, s1.data());
        const float m2 = k2.scores(q.data(), k.data(), rows, dim, 0.125f, s2.data());
        for (int j = 0; j < rows; ++j)
          ASSERT_NEAR(s1[static_cast<std::size_t>(j)], s2[static_cast<std::size_t>(j)], 1e-5f * dim) << dim << " " << j;
        EXPECT_EQ(m2, *std::max_element(s2.begin(), s2.end()));
        EXPECT_NEAR(m1, m2, 1e-5f * dim);
        std::vector<float> o1(q), o2(q);
        ref.weighted_sum(o1.data(), p.data(), k.data(), rows, dim);
        k2.weighted_sum(o2.data(), p.data(), k.data(), rows, dim);
        for (int c = 0; c < dim; ++c)
          ASSERT_NEAR(o1[static_cast<std::size_t>(c)], o2[static_cast<std::size_t>(c)], 1e-5f * rows) << dim << " " << c;
      }
    }
    for (int len : {1, 7, 8, 33, 200}) {
      std::vector<float> s(static_cast<std::size_t>(len));
      for (auto& v : s) v = n(rng) * 10.0f - 5.0f;
      s[0] = -200.0f;  // far below the max: underflows to ~0
      float m = s[0];
      for (float v : s) m = std::max(m, v);
      std::vector<float> e1 = s, e2 = s;
      const float s1 = ref.exp_sum(e1.data(), len, m), s2 = k2.exp_sum(e2.data(), len, m);
      EXPECT_NEAR(s1, s2, 1e-6f * s1);
      for (int i = 0; i < len; ++i) EXPECT_NEAR(e1[static_cast<std::size_t>(i)], e2[static_cast<std::size_t>(i)], 1e-6f) << i;
    }
  }
}

// The softmax maximum: exact, and std::max's rule for NaNs, on every level
// and length (the vector body, its chains and the scalar tail).
TEST(KvQuant, MaxEqualsTheReferenceOnEveryLevel) {
  std::mt19937 rng(29);
  std::normal_distribution<float> n(0.0f, 3.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (kernels::Isa isa : simd_isas()) {
    const kernels::TileKernels& k = kernels::tile_kernels(isa);
    for (int len : {0, 1, 15, 16, 63, 64, 65, 127, 200, 2048})
      for (int kind = 0; kind < 5; ++kind) {
        std::vector<float> x(static_cast<std::size_t>(len) + 1);
        for (auto& v : x) v = n(rng);
        float m = -inf;
        if (kind == 1 && len > 0) x[static_cast<std::size_t>(len) - 1] = 1e30f;  // the largest in the scalar tail
        if (kind == 2 && len > 0) x[static_cast<std::size_t>(len / 2)] = nan;    // passed over
        if (kind == 3) m = 1e6f;                                                // above every x
        if (kind == 4) m = nan;                                                 // kept
        x[static_cast<std::size_t>(len)] = 1e38f;  // past n: never read
        const float want = kernels::max_ref(x.data(), len, m), got = k.max(x.data(), len, m);
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(got)) << kernels::isa_name(isa) << " len " << len << " kind " << kind;
        } else {
          EXPECT_EQ(got, want) << kernels::isa_name(isa) << " len " << len << " kind " << kind;
          EXPECT_FALSE(std::isnan(got));
        }
      }
  }
}

TEST(KvQuant, RotationIsOrthonormalAndInvertible) {
  for (int n : {8, 64, 128}) {
    std::vector<float> x(static_cast<std::size_t>(n)), q(x.size());
    for (int i = 0; i < n; ++i) x[static_cast<std::size_t>(i)] = std::sin(i * 1.3f) + (i == 3 ? 9.0f : 0.0f);
    for (int i = 0; i < n; ++i) q[static_cast<std::size_t>(i)] = std::cos(i * 0.7f);
    float dot = 0.0f, rdot = 0.0f;
    kernels::scores_ref(x.data(), q.data(), 1, n, 1.0f, &dot);
    std::vector<float> rx = x, rq = q;
    kv::rotate(rx.data(), n);
    kv::rotate(rq.data(), n);
    kernels::scores_ref(rx.data(), rq.data(), 1, n, 1.0f, &rdot);
    EXPECT_NEAR(rdot, dot, 1e-4f);
    float peak = 0.0f;
    for (float v : rx) peak = std::max(peak, std::abs(v));
    EXPECT_LT(peak, 9.0f * 0.6f);  // the outlier is spread over the head
    kv::unrotate(rx.data(), n);
    for (int i = 0; i < n; ++i) EXPECT_NEAR(rx[static_cast<std::size_t>(i)], x[static_cast<std::size_t>(i)], 1e-5f);
  }
}

}  // namespace
}  // namespace qkvshare
