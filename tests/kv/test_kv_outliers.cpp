// Dense-and-sparse tiles (KvCodec::outliers): the encoder's choice, the
// decode, attention on codes and on decoded tiles, and the pool's blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "kv_test_util.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/half.hpp"
#include "qkvshare/kv/dense_kv_cache.hpp"
#include "qkvshare/kv/kv_kernels.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {
namespace {

// Unit-scale rows with `spikes` elements 40x larger at known places.
std::vector<float> spiky_rows(int tokens, int dim, unsigned seed, std::vector<std::size_t>* where = nullptr,
                              int spikes = 5) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(tokens) * dim);
  for (float& v : x) v = n(rng);
  for (int s = 0; s < spikes; ++s) {
    const std::size_t i = (static_cast<std::size_t>(s) * 7919u + 13u) % x.size();
    x[i] = (s % 2 == 0 ? 40.0f : -40.0f) + n(rng);
    if (where) where->push_back(i);
  }
  return x;
}

double squared_error(const KvCodec& c, int tokens, int dim, const std::vector<float>& x, std::vector<float>* out = nullptr) {
  const TileLayout l = tile_layout(c, tokens, dim);
  std::vector<std::byte> tile(l.bytes);
  kv::encode_tile(c, l, x.data(), tile.data());
  std::vector<float> y(x.size());
  kv::decode_tile_scalar(c, l, tile.data(), tokens, y.data());
  double e = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) e += (x[i] - y[i]) * (x[i] - y[i]);
  if (out) *out = y;
  return e;
}

const char* const kOutlierFormats[] = {"int2:outliers=0.01", "int3:vgroup=64:outliers=0.01", "int4:outliers=0.005",
                                       "int8:outliers=0.002", "k4v2:vgroup=8:outliers=0.05", "int2:kaxis=token:kgroup=16:outliers=0.02"};

// The spikes are taken out (decoded to within their f16 residual), and the
// rest of the tile is coded on narrower ranges: far less error than without.
TEST(KvOutliers, SpikesAreKeptApartAndTheRestGetsNarrowerRanges) {
  for (const char* text : kOutlierFormats)
    for (int kind = 0; kind < 2; ++kind)
      for (const auto& [t, d] : {std::pair{32, 64}, std::pair{8, 24}, std::pair{16, 48}, std::pair{64, 128}}) {
        const KvFormat f = KvFormat::parse(text);
        const KvCodec c = kind == 0 ? f.k : f.v;
        KvCodec plain = c;
        plain.outliers = 0;
        const TileLayout l = tile_layout(c, t, d);
        ASSERT_GE(l.n_outliers, 1u) << text;
        const int n_spikes = static_cast<int>(std::min<std::size_t>(3, l.n_outliers));
        std::vector<std::size_t> spikes;
        const auto x = spiky_rows(t, d, 5, &spikes, n_spikes);
        const auto calm = spiky_rows(t, d, 5, nullptr, 0);  // the same rows without the spikes
        std::vector<float> y;
        const double with = squared_error(c, t, d, x, &y), without = squared_error(plain, t, d, x);
        // At most the error of the plain codes on the rows without spikes
        // (a spike costs only its f16 residual's rounding), far below theirs with them.
        EXPECT_LE(with, 1.02 * squared_error(plain, t, d, calm) + 1e-3) << text << " kind " << kind << " " << t << "x" << d;
        EXPECT_LT(with, 0.75 * without) << text << " kind " << kind << " " << t << "x" << d;
        for (const std::size_t i : spikes)
          EXPECT_NEAR(y[i], x[i], 0.02f) << text << " kind " << kind << " element " << i;
        // The indices are ascending and distinct; decoding fewer rows adds only theirs.
        std::vector<std::byte> tile(l.bytes);
        kv::encode_tile(c, l, x.data(), tile.data());
        const kv::TileOutliers o = kv::tile_outliers(l, tile.data());
        ASSERT_EQ(o.n, static_cast<int>(l.n_outliers));
        for (int e = 1; e < o.n; ++e) ASSERT_LT(o.index[e - 1], o.index[e]) << text;
        const int half = t / 2;
        std::vector<float> part(static_cast<std::size_t>(half) * d);
        kv::decode_tile_scalar(c, l, tile.data(), half, part.data());
        for (std::size_t i = 0; i < part.size(); ++i) ASSERT_EQ(part[i], y[i]) << text;
      }
}

// Edge tiles: constant, zeros, a one-row tile, a tile with fewer candidates
// than slots; the same bytes every time for the same rows.
TEST(KvOutliers, EdgeTilesDecodeAndEncodingIsDeterministic) {
  const KvCodec c = KvFormat::parse("int2:outliers=0.1").k;
  for (const auto& [t, d] : {std::pair{32, 64}, std::pair{1, 16}, std::pair{2, 8}}) {
    const TileLayout l = tile_layout(c, t, d);
    for (const float value : {0.0f, 1.5f, -3.0f}) {
      const std::vector<float> x(static_cast<std::size_t>(t) * d, value);
      std::vector<float> y;
      EXPECT_LE(squared_error(c, t, d, x, &y), 1e-6 * x.size()) << t << "x" << d << " value " << value;
    }
    const auto x = spiky_rows(t, d, 9, nullptr, 1);
    std::vector<std::byte> a(l.bytes), b(l.bytes);
    kv::encode_tile(c, l, x.data(), a.data());
    kv::encode_tile(c, l, x.data(), b.data());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), l.bytes), 0);
    const kv::TileOutliers o = kv::tile_outliers(l, a.data());
    EXPECT_EQ(std::set<int>(o.index, o.index + o.n).size(), static_cast<std::size_t>(o.n));  // no element twice
  }
}

TEST(KvOutliers, FormatTextPackingAndSizes) {
  const KvFormat f = KvFormat::parse("int2:vgroup=64:outliers=0.01");
  EXPECT_EQ(f.k.outliers, 10);
  EXPECT_EQ(f.v.outliers, 10);
  EXPECT_EQ(KvCodec::unpack(f.k.pack()), f.k);
  EXPECT_EQ(KvCodec::unpack(KvFormat::parse("int2").k.pack()).outliers, 0);
  EXPECT_THROW(KvCodec::unpack(0x0200), Error);  // f32 with outliers
  // Mixed precision: both precisions keep them; f16 sides never do.
  const KvFormat m = KvFormat::parse("int8:lo=int2:top=0.2:outliers=0.005");
  EXPECT_EQ(m.k.outliers, 5);
  EXPECT_EQ(m.lo_v.outliers, 5);
  EXPECT_EQ(KvFormat::parse("k16v2:outliers=0.003").k.outliers, 0);
  // One side only; the text names what was given.
  const KvFormat ko = KvFormat::parse("int2:koutliers=0.01");
  EXPECT_EQ(ko.k.outliers, 10);
  EXPECT_EQ(ko.v.outliers, 0);
  for (const char* text : {"int2:koutliers=0.01", "int2:voutliers=0.02", "int3:koutliers=0.01:voutliers=0.02",
                           "k16v2:outliers=0.003", "k2v16:outliers=0.004", "int8:lo=int2:top=0.3:voutliers=0.01"}) {
    EXPECT_EQ(KvFormat::parse(text).to_string(), text);
    EXPECT_EQ(KvFormat::parse(KvFormat::parse(text).to_string()), KvFormat::parse(text)) << text;
  }
  EXPECT_EQ(KvFormat::parse("int2:koutliers=0.01:voutliers=0.01").to_string(), "int2:outliers=0.01");
  // 32 x 64 elements at 1%: 21 (index, residual) pairs of 4 bytes each.
  const TileLayout l = tile_layout(f.k, 32, 64), plain = tile_layout(KvFormat::parse("int2").k, 32, 64);
  EXPECT_EQ(l.n_outliers, 21u);
  EXPECT_EQ(l.stored_bytes(), plain.stored_bytes() + 84u);
  EXPECT_EQ(l.outlier_offset, l.param_offset + l.param_bytes);
  EXPECT_LE(l.outlier_offset + 4 * l.n_outliers, l.bytes);
  EXPECT_NEAR(f.cold_bits(32, 64) - KvFormat::parse("int2:vgroup=64").cold_bits(32, 64), 84.0 * 8 / 2048, 1e-9);
  // A 16-bit index reaches 65536 elements.
  EXPECT_THROW(tile_layout(f.k, 128, 1024), Error);
  const auto message = [](const char* text) {
    try {
      KvFormat::parse(text);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message("f16:outliers=0.01").find("outliers needs integer codes"), std::string::npos);
  EXPECT_NE(message("int4:outliers=0.2").find("outliers must be a share from 0.001 to 0.127"), std::string::npos);
  EXPECT_NE(message("int4:outliers=0.0105").find("in steps of 0.001"), std::string::npos);
  EXPECT_NE(message("int4:outliers=0").find("outliers must be"), std::string::npos);
  EXPECT_NE(message("int4:outliers=x").find("outliers must be"), std::string::npos);
  EXPECT_NE(message("k16v4:koutliers=0.01").find("koutliers needs integer keys"), std::string::npos);
  EXPECT_NE(message("k4v16:voutliers=0.01").find("voutliers needs integer values"), std::string::npos);
  EXPECT_NE(message("int4:outliers=0.01:koutliers=0.02").find("give it or koutliers/voutliers"), std::string::npos);
  EXPECT_NE(message("int4:voutliers=0.01:outliers=0.02").find("give it or koutliers/voutliers"), std::string::npos);
}

double relative_rms(const std::vector<float>& a, const std::vector<float>& ref) {
  double e = 0.0, r = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) e += (a[i] - ref[i]) * (a[i] - ref[i]), r += ref[i] * ref[i];
  return std::sqrt(e / r);
}

// Keys and values with a few spikes per tile, as real K/V have.
testing::Pass spiky_pass(const KvShape& s, int n, unsigned seed) {
  testing::Pass p = testing::random_pass(s, n, seed);
  std::mt19937 rng(seed);
  for (int l = 0; l < s.n_layers; ++l)
    for (auto* rows : {&p.k[static_cast<std::size_t>(l)], &p.v[static_cast<std::size_t>(l)]})
      for (std::size_t i = rng() % 97; i < rows->size(); i += 97 + rng() % 61) (*rows)[i] *= 12.0f;
  return p;
}

// Attention over outlier tiles: on codes (the residuals added to scores and
// sums) it agrees with attention over decoded tiles, SIMD with scalar; and
// it is closer to f32 attention than the same codes without outliers.
TEST(KvOutliers, AttentionOnCodesAndDecodedAgreeAndBeatPlainCodes) {
  ThreadPool threads(2);
  const KvShape shape{2, 6, 3, 64};
  for (const char* text : {"int2:outliers=0.02", "k4v2:vgroup=16:outliers=0.01", "int3:outliers=0.03"}) {
    const KvFormat f = KvFormat::parse(text);
    KvFormat plain_f = f;
    plain_f.k.outliers = plain_f.v.outliers = 0;
    auto pool = KvPool::create(PoolConfig{shape, 16, KvPool::arena_bytes_for(shape, 16, f, 256, 4)});
    std::vector<std::vector<float>> outs;
    std::vector<float> ref, plain_out;
    for (const bool codes : {true, false})
      for (const AttendPath path : {AttendPath::scalar, AttendPath::automatic}) {
        const testing::CodesAttentionScope scope(codes);
        PooledKvCache cache(pool, f, 256);
        cache.set_attend_path(path);
        std::vector<float> all;
        unsigned seed = 11;
        for (const int n : {70, 1, 1, 33, 1}) {
          const auto pass = spiky_pass(shape, n, seed++);
          const auto o = testing::run_pass(cache, pass, n, threads);
          all.insert(all.end(), o.begin(), o.end());
        }
        outs.push_back(all);
      }
    {
      DenseKvCache dense(shape, 256);
      PooledKvCache plain(pool, plain_f, 256);
      unsigned seed = 11;
      for (const int n : {70, 1, 1, 33, 1}) {
        const auto pass = spiky_pass(shape, n, seed++);
        const auto r = testing::run_pass(dense, pass, n, threads);
        const auto p = testing::run_pass(plain, pass, n, threads);
        ref.insert(ref.end(), r.begin(), r.end());
        plain_out.insert(plain_out.end(), p.begin(), p.end());
      }
    }
    const testing::CodesAttentionScope on(true);
    const float tol = testing::attention_tolerance(f);
    for (std::size_t i = 1; i < outs.size(); ++i)
      EXPECT_LE(testing::max_abs_diff(outs[0], outs[i]), tol) << text << " variant " << i;
    EXPECT_LT(relative_rms(outs[0], ref), 0.9 * relative_rms(plain_out, ref)) << text;
    EXPECT_EQ(pool->counters().blocks_used, 0u) << text;  // every cache released its blocks
  }
}

}  // namespace
}  // namespace qkvshare
