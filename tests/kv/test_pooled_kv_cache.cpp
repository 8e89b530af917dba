#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kv_test_util.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/dense_kv_cache.hpp"
#include "qkvshare/kv/kv_kernels.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {
namespace {

using testing::random_pass;
using testing::max_abs_diff;
using testing::run_pass;

const char* const kAllFormats[] = {"f32", "f16", "int8", "int8:kaxis=token", "k8v4", "int4", "int3", "int2",
                                   "int2:window=20:sink=3", "int4:rot=kv", "int3:rot=k", "k4v2:vgroup=8",
                                   "int4:kaxis=token:kgroup=8:window=9", "k4v2:outliers=0.02",
                                   "int3:vgroup=16:koutliers=0.01:params=8"};

double rel_rms(const std::vector<float>& a, const std::vector<float>& ref) {
  double e = 0.0, r = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    e += (a[i] - ref[i]) * (a[i] - ref[i]);
    r += ref[i] * ref[i];
  }
  return std::sqrt(e / r);
}

struct Geometry {
  KvShape shape;
  int block_tokens;
};

// SIMD attention against the scalar reference, every format, with pass sizes
// that straddle blocks, query chunks (16) and decode partitions (16 blocks).
TEST(PooledKvCache, SimdAttentionMatchesScalarOnEveryFormat) {
  std::vector<AttendPath> paths;
  if (kernels::isa_available(kernels::Isa::avx2)) paths.push_back(AttendPath::avx2);
  if (kernels::isa_available(kernels::Isa::avx512)) paths.push_back(AttendPath::avx512);
  if (kernels::isa_available(kernels::Isa::neon)) paths.push_back(AttendPath::neon);
  if (kernels::isa_available(kernels::Isa::neon_dot)) paths.push_back(AttendPath::neon_dot);
  if (paths.empty()) GTEST_SKIP() << "no SIMD level on this CPU";
  ThreadPool threads(2);
  const Geometry geos[] = {{{2, 6, 3, 16}, 8}, {{1, 4, 4, 8}, 32}, {{1, 9, 3, 64}, 16}, {{1, 2, 1, 48}, 4}};
  const int sizes[] = {1, 7, 33, 1, 1, 50, 3, 1, 90, 1, 1};
  for (const bool codes : {false, true})
  for (const AttendPath path : paths)
    for (const Geometry& g : geos)
      for (const char* text : kAllFormats) {
        const KvFormat f = KvFormat::parse(text);
        if ((f.rotate_k || f.rotate_v) && (g.shape.head_dim & (g.shape.head_dim - 1)) != 0) continue;  // Hadamard: 2^k only
        const testing::CodesAttentionScope scope(codes);
        auto pool = KvPool::create(PoolConfig{g.shape, g.block_tokens, KvPool::arena_bytes_for(g.shape, g.block_tokens, f, 256, 2)});
        PooledKvCache scalar(pool, f, 256), simd(pool, f, 256);
        scalar.set_attend_path(AttendPath::scalar);
        simd.set_attend_path(path);
        DenseKvCache dense(g.shape, 256);
        unsigned seed = 1;
        for (int n : sizes) {
          const auto pass = random_pass(g.shape, n, seed++);
          const auto a = run_pass(scalar, pass, n, threads);
          const auto b = run_pass(simd, pass, n, threads);
          const auto r = run_pass(dense, pass, n, threads);
          ASSERT_LE(max_abs_diff(a, b), testing::attention_tolerance(f))
              << text << (codes ? " on codes" : " decoded") << " path " << static_cast<int>(path) << " n=" << n
                                               << " size=" << scalar.size() << " head_dim " << g.shape.head_dim;
          // And the format approximates f32 attention to its own precision (relative RMS error).
          // (2 and 3 bits are too coarse for random rows; the eval measures them on real models.)
          const int bits = std::min(f.k.bits(), f.v.bits());
          const double tol = bits >= 16 ? 3e-3 : bits >= 8 ? 0.05 : bits >= 4 ? 0.5 : 10.0;
          ASSERT_LE(rel_rms(a, r), tol) << text << " n=" << n;
        }
        EXPECT_EQ(scalar.size(), simd.size());
      }
}

// Pools of 128-token blocks split decode into partitions of 512 keys (4 blocks),
// not of 16 blocks: at depth 1100 a decode step has 3 partitions to merge.
TEST(PooledKvCache, LargeBlocksSplitDecodeByKeysAndMatchScalar) {
  ThreadPool threads(2);
  const KvShape shape{1, 9, 3, 64};
  const int capacity = 1104;
  for (const char* text : {"f16", "int8", "int4", "int2"}) {
    const KvFormat f = KvFormat::parse(text);
    auto pool = KvPool::create(PoolConfig{shape, 128, KvPool::arena_bytes_for(shape, 128, f, capacity, 2)});
    PooledKvCache scalar(pool, f, capacity), simd(pool, f, capacity);
    scalar.set_attend_path(AttendPath::scalar);
    DenseKvCache dense(shape, capacity);
    unsigned seed = 3;
    for (const int n : {600, 500, 1, 1, 2}) {  // the decode steps read 1100-1104 keys
      const auto pass = random_pass(shape, n, seed++);
      const auto a = run_pass(scalar, pass, n, threads);
      const auto b = run_pass(simd, pass, n, threads);
      const auto r = run_pass(dense, pass, n, threads);
      ASSERT_LE(max_abs_diff(a, b), testing::attention_tolerance(f)) << text << " n=" << n;
      if (f.k.bits() >= 8 && f.v.bits() >= 8) {
        ASSERT_LE(rel_rms(b, r), 0.05) << text << " n=" << n;
      }
    }
  }
}

// Both run the block attention over f32 tiles of 16 rows, on every ISA.
TEST(PooledKvCache, F32PoolIsBitIdenticalToDenseCache) {
  testing::IsaGuard guard;
  for (const kernels::Isa isa : {kernels::Isa::portable, kernels::best_isa()}) {
    kernels::set_active_isa(isa);
    ThreadPool threads(2);
    const KvShape s{3, 8, 4, 8};
    auto pool = KvPool::create(PoolConfig{s, 16, 1 << 22});
    PooledKvCache pooled(pool, KvFormat::parse("f32"), 300);
    DenseKvCache dense(s, 300, 16);
    unsigned seed = 9;
    for (int n : {5, 16, 40, 1, 1, 17}) {
      const auto pass = random_pass(s, n, seed++);
      const auto a = run_pass(pooled, pass, n, threads);
      const auto b = run_pass(dense, pass, n, threads);
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "n=" << n;
    }
    // And with a sliding window (a gemma3 local layer), narrower and wider than a block.
    for (const int window : {1, 7, 23}) {
      PooledKvCache wpooled(pool, KvFormat::parse("f32"), 300);
      DenseKvCache wdense(s, 300, 16);
      for (int n : {5, 16, 40, 1, 1, 17}) {
        const auto pass = random_pass(s, n, seed++);
        const auto a = run_pass(wpooled, pass, n, threads, window);
        const auto b = run_pass(wdense, pass, n, threads, window);
        ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "window " << window << " n=" << n;
        if (window != 1) continue;
        // A query that sees only itself returns its own value row.
        const auto last = static_cast<std::size_t>(s.n_layers - 1);
        const int group = s.n_heads / s.n_kv_heads;
        for (int t = 0; t < n; ++t)
          for (int h = 0; h < s.n_heads; ++h)
            for (int c = 0; c < s.head_dim; ++c)
              ASSERT_EQ(b[(last * n + t) * s.q_dim() + h * s.head_dim + c],
                        pass.v[last][static_cast<std::size_t>(t) * s.kv_dim() + (h / group) * s.head_dim + c]);
      }
    }
  }
}

TEST(PooledKvCache, QuantizesOnWriteAndKeepsHotBlocksF16) {
  ThreadPool threads(1);
  const KvShape s{1, 4, 4, 8};
  const KvFormat f = KvFormat::parse("int4:window=40:sink=1");
  auto pool = KvPool::create(PoolConfig{s, 32, 1 << 20});
  PooledKvCache cache(pool, f, 512);
  run_pass(cache, random_pass(s, 200, 1), 200, threads);
  ASSERT_EQ(cache.segments().size(), 1u);
  const auto& blocks = cache.segments()[0].blocks;
  ASSERT_EQ(blocks.size(), 7u);
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    const BlockInfo info = pool->info(blocks[b]);
    const bool hot = b == 0 || b >= 5;  // sink; the last 40 tokens (160..199)
    EXPECT_EQ(info.k, hot ? KvCodec::f16() : f.k) << b;
    EXPECT_EQ(info.v, hot ? KvCodec::f16() : f.v) << b;
    EXPECT_EQ(info.fill, b == 6 ? 8u : 32u);
  }
  // 40 more tokens: block 5 leaves the window and is requantized.
  run_pass(cache, random_pass(s, 40, 2), 40, threads);
  EXPECT_EQ(pool->info(cache.segments()[0].blocks[5]).k, f.k);
  EXPECT_EQ(pool->info(cache.segments()[0].blocks[6]).k, KvCodec::f16());
  EXPECT_EQ(pool->counters().blocks_used, 8u);  // nothing left over from the conversion
}

// PassPrecision::full: the pass that computes tokens attends to them at the
// hot precision, exactly as a cache of the hot codecs would, while the blocks
// store the same codes as under PassPrecision::stored; the next pass reads
// those codes in either mode.
TEST(PooledKvCache, APassReadsItsOwnTokensHotAndLaterPassesTheirCodes) {
  ThreadPool threads(2);
  const KvShape s{2, 6, 3, 16};
  const int T = 8;
  for (const char* text : kAllFormats) {
    const KvFormat f = KvFormat::parse(text);
    if (!f.k.quantized() && !f.v.quantized()) continue;
    KvFormat hot = f;  // the same window, sinks and rotation, every block hot
    hot.k = hot_codec(f.k);
    hot.v = hot_codec(f.v);
    auto pool = KvPool::create(PoolConfig{s, T, KvPool::arena_bytes_for(s, T, f, 128, 4)});
    {
      PooledKvCache full(pool, f, 128), stored(pool, f, 128), hot_cache(pool, hot, 128);
      full.set_pass_precision(PassPrecision::full);
      stored.set_pass_precision(PassPrecision::stored);
      const auto first = random_pass(s, 37, 3);
      const auto a = run_pass(full, first, 37, threads);
      const auto b = run_pass(stored, first, 37, threads);
      const auto h = run_pass(hot_cache, first, 37, threads);
      ASSERT_EQ(0, std::memcmp(a.data(), h.data(), a.size() * sizeof(float))) << text;
      EXPECT_GT(max_abs_diff(a, b), 1e-4f) << text << ": the stored pass should read its own codes";
      // The same codes stored either way.
      std::vector<float> ra(37 * s.head_dim), rb(ra.size());
      for (int l = 0; l < s.n_layers; ++l)
        for (int kind = 0; kind < 2; ++kind)
          for (int kh = 0; kh < s.n_kv_heads; ++kh) {
            full.read_rows(l, kind, kh, 0, 37, ra.data());
            stored.read_rows(l, kind, kh, 0, 37, rb.data());
            ASSERT_EQ(ra, rb) << text << " layer " << l << " kind " << kind;
          }
      // A decode step into the hot tail reads the stored codes in both modes.
      const auto step = random_pass(s, 1, 4);
      const auto c = run_pass(full, step, 1, threads);
      const auto d = run_pass(stored, step, 1, threads);
      ASSERT_EQ(0, std::memcmp(c.data(), d.data(), c.size() * sizeof(float))) << text;
    }
    EXPECT_EQ(pool->counters().blocks_used, 0u) << text;
  }
}

// Mixed precision: demote() keeps the blocks that the last queries attend to
// most in the high precision and recodes the other cold ones; sinks, window and
// tail stay hot, a fork keeps the blocks it shared, the demoted blocks are
// adopted and never requantized by later passes, and nothing leaks.
TEST(PooledKvCache, DemoteKeepsTheBlocksTheLastQueriesAttendTo) {
  ThreadPool threads(2);
  const KvShape s{2, 6, 3, 16};
  const int T = 8, n = 80;  // 10 full blocks: sink 0, window 9, 8 cold
  const KvFormat f = KvFormat::parse("int8:sink=8:window=8:lo=int2:top=0.25");
  auto pool = KvPool::create(PoolConfig{s, T, KvPool::arena_bytes_for(s, T, f, 128, 4)});
  {
    auto pass = testing::random_pass(s, n, 21);
    // The last 16 queries point along one direction per head; the keys of blocks 3 and 6 along it.
    for (int l = 0; l < s.n_layers; ++l)
      for (int t = 0; t < n; ++t) {
        for (int h = 0; h < s.n_kv_heads; ++h) {
          float* k = &pass.k[static_cast<std::size_t>(l)][(static_cast<std::size_t>(t) * s.n_kv_heads + h) * s.head_dim];
          if (t / T == 3 || t / T == 6)
            for (int c = 0; c < s.head_dim; ++c) k[c] = c == h ? 6.0f : 0.0f;
        }
        if (t >= n - 16)
          for (int qh = 0; qh < s.n_heads; ++qh) {
            float* q = &pass.q[static_cast<std::size_t>(l)][(static_cast<std::size_t>(t) * s.n_heads + qh) * s.head_dim];
            for (int c = 0; c < s.head_dim; ++c) q[c] = c == qh / (s.n_heads / s.n_kv_heads) ? 3.0f : 0.0f;
          }
      }
    PooledKvCache cache(pool, f, 128);
    run_pass(cache, pass, n, threads);
    const auto before = cache.fork();
    const std::vector<BlockRef> shared = before->segments()[0].blocks;
    EXPECT_EQ(cache.demote(), 6);
    const auto& blocks = cache.segments()[0].blocks;
    for (int b = 0; b < 10; ++b) {
      const BlockInfo info = pool->info(blocks[static_cast<std::size_t>(b)]);
      const KvCodec want = b == 0 || b == 9 ? KvCodec::f16() : b == 3 || b == 6 ? f.k : f.lo_k;
      EXPECT_EQ(info.k, want) << "block " << b;
      EXPECT_EQ(pool->info(shared[static_cast<std::size_t>(b)]).k, b == 0 || b == 9 ? KvCodec::f16() : f.k) << b;
    }
    EXPECT_EQ(cache.demote(), 0);  // the same choice again: nothing left to recode
    // The demoted blocks are adopted as they are, and later passes leave them so.
    auto adopted = PooledKvCache::adopt(pool, f, 128, cache.segments(), n);
    run_pass(*adopted, testing::random_pass(s, 20, 22), 20, threads);
    EXPECT_EQ(pool->info(adopted->segments()[0].blocks[1]).k, f.lo_k);
    EXPECT_EQ(pool->info(adopted->segments()[0].blocks[3]).k, f.k);
    // One precision, or no observed queries: nothing to do.
    PooledKvCache plain(pool, KvFormat::parse("int8"), 128);
    run_pass(plain, testing::random_pass(s, 40, 23), 40, threads);
    EXPECT_EQ(plain.demote(), 0);
  }
  EXPECT_EQ(pool->counters().blocks_used, 0u);
}

TEST(PooledKvCache, ThousandsOfContextsLeakNothing) {
  ThreadPool threads(1);
  const KvShape s{2, 4, 2, 8};
  auto pool = KvPool::create(PoolConfig{s, 8, 8 << 20});
  const PoolCounters start = pool->counters();
  std::mt19937 rng(3);
  std::vector<std::unique_ptr<PooledKvCache>> live;
  const char* formats[] = {"f16", "int4", "int2:window=8", "f32", "k8v2:sink=4"};
  for (int i = 0; i < 3000; ++i) {
    if (live.size() > 12 || (rng() % 3 == 0 && !live.empty())) {
      live.erase(live.begin() + static_cast<long>(rng() % live.size()));
      continue;
    }
    if (rng() % 4 == 0 && !live.empty()) {
      live.push_back(live[rng() % live.size()]->fork());
    } else {
      live.push_back(std::make_unique<PooledKvCache>(pool, KvFormat::parse(formats[rng() % 5]), 128));
    }
    PooledKvCache& c = *live.back();
    const int n = 1 + static_cast<int>(rng() % 20);
    if (c.size() + n <= c.capacity()) run_pass(c, random_pass(s, n, static_cast<unsigned>(i)), n, threads);
  }
  live.clear();
  const PoolCounters end = pool->counters();
  EXPECT_EQ(end.blocks_used, 0u);
  EXPECT_EQ(end.pages_free, start.pages_free);
  EXPECT_EQ(end.allocations, end.frees);
  EXPECT_GT(end.allocations, 1000u);
}

TEST(PooledKvCache, ForkSharesBlocksAndCopiesTheTailOnWrite) {
  ThreadPool threads(1);
  const KvShape s{2, 4, 2, 8};
  auto pool = KvPool::create(PoolConfig{s, 8, 1 << 20});
  PooledKvCache a(pool, KvFormat::parse("int4"), 128);
  run_pass(a, random_pass(s, 21, 1), 21, threads);  // blocks 0, 1 full; 2 holds 5 tokens
  const auto blocks_before = a.segments()[0].blocks;
  auto b = a.fork();
  EXPECT_EQ(pool->info(blocks_before[0]).refcount, 2u);
  EXPECT_EQ(pool->counters().blocks_used, 3u);  // nothing copied by the fork itself
  // Both continue with different tokens; each must see its own continuation only.
  const auto pa = random_pass(s, 2, 50), pb = random_pass(s, 2, 60);
  const auto out_a = run_pass(a, pa, 2, threads);
  const auto out_b = run_pass(*b, pb, 2, threads);
  EXPECT_EQ(pool->counters().blocks_used, 4u);  // one copied tail
  EXPECT_EQ(a.segments()[0].blocks[0], b->segments()[0].blocks[0]);
  EXPECT_NE(a.segments()[0].blocks[2], b->segments()[0].blocks[2]);
  // Reference: the same history without any fork.
  PooledKvCache ref(pool, KvFormat::parse("int4"), 128);
  run_pass(ref, random_pass(s, 21, 1), 21, threads);
  EXPECT_EQ(run_pass(ref, pb, 2, threads), out_b);
  b.reset();
  EXPECT_EQ(pool->info(a.segments()[0].blocks[0]).refcount, 1u);  // b's references are gone
}

TEST(PooledKvCache, ExhaustionFailsTheRequestAndKeepsOtherContexts) {
  ThreadPool threads(1);
  const KvShape s{2, 4, 2, 8};
  const KvFormat f = KvFormat::parse("int4");
  auto pool = KvPool::create(PoolConfig{s, 8, KvPool::arena_bytes_for(s, 8, f, 64)});
  PooledKvCache a(pool, f, 1000), b(pool, f, 1000);
  const auto history = random_pass(s, 40, 1);
  run_pass(a, history, 40, threads);
  const PoolCounters before = pool->counters();
  try {
    run_pass(b, random_pass(s, 600, 2), 600, threads);
    FAIL() << "expected out_of_memory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::out_of_memory);
    EXPECT_NE(std::string(e.what()).find("KV pool exhausted"), std::string::npos) << e.what();
  }
  EXPECT_EQ(b.size(), 0);
  EXPECT_EQ(pool->counters().pages_free, before.pages_free);
  // a is intact: continuing it matches a context that never saw the failure.
  const auto next = random_pass(s, 3, 3);
  const auto out = run_pass(a, next, 3, threads);
  auto other = KvPool::create(PoolConfig{s, 8, 1 << 20});
  PooledKvCache ref(other, f, 1000);
  run_pass(ref, history, 40, threads);
  EXPECT_EQ(run_pass(ref, next, 3, threads), out);
  // b still works for a request that fits.
  run_pass(b, random_pass(s, 9, 4), 9, threads);
  EXPECT_EQ(b.size(), 9);
}

}  // namespace
}  // namespace qkvshare

namespace qkvshare {
namespace {

TEST(PooledKvCache, AdoptTakesItsOwnReferencesAndChecksTheBlocks) {
  ThreadPool threads(1);
  const KvShape s{2, 4, 2, 8};
  auto pool = KvPool::create(PoolConfig{s, 8, 1 << 20});
  const KvFormat f = KvFormat::parse("int4");
  auto a = std::make_unique<PooledKvCache>(pool, f, 128);
  const auto history = testing::random_pass(s, 21, 1);
  testing::run_pass(*a, history, 21, threads);
  const auto blocks = a->segments()[0].blocks;
  auto b = PooledKvCache::adopt(pool, f, 128, a->segments(), 21);
  EXPECT_EQ(pool->info(blocks[0]).refcount, 2u);
  // The adopted context continues exactly like the original would.
  const auto next = testing::random_pass(s, 4, 2);
  const auto out_b = testing::run_pass(*b, next, 4, threads);
  EXPECT_EQ(testing::run_pass(*a, next, 4, threads), out_b);
  const auto expect_code = [&](ErrorCode code, const std::vector<KvSegment>& segs, const KvFormat& fmt, int tokens) {
    try {
      PooledKvCache::adopt(pool, fmt, 128, segs, tokens);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
    }
  };
  const std::vector<KvSegment> segs{KvSegment{0, blocks}};
  expect_code(ErrorCode::invalid_argument, segs, f, 40);                       // 3 blocks cannot hold 40 tokens
  expect_code(ErrorCode::invalid_argument, segs, KvFormat::parse("int2"), 21);  // other codecs
  std::vector<KvSegment> stale = segs;
  stale[0].blocks[1].generation += 1;
  expect_code(ErrorCode::bad_descriptor, stale, f, 21);
  const PoolCounters before = pool->counters();
  a.reset();
  b.reset();
  EXPECT_LT(pool->counters().blocks_used, before.blocks_used);
  EXPECT_EQ(pool->counters().blocks_used, 0u);  // failed adopts gave back what they took
}

}  // namespace
}  // namespace qkvshare
