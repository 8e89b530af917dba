// Token dropping at seal (PooledKvCache::evict): which blocks stay, how the
// kept runs are placed, and that attention over them is the splice of the
// same blocks (splice itself is checked against a fresh computation in
// test_kv_splice.cpp).
#include <gtest/gtest.h>

#include <cmath>

#include "kv_test_util.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/thread_pool.hpp"
#include "qkvshare/kv/kv_kernels.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {
namespace {

using testing::random_pass;
using testing::run_pass;

KvRope test_rope(int head_dim) {
  KvRope r;
  for (int i = 0; i < head_dim / 2; ++i) r.inv_freq.push_back(static_cast<float>(std::pow(10000.0, -2.0 * i / head_dim)));
  return r;
}

// Keys of blocks `hot_a` and `hot_b` point along the direction the last 16
// queries of each head point along: those blocks get the attention.
testing::Pass attended_pass(const KvShape& s, int n, int T, int hot_a, int hot_b, unsigned seed) {
  auto pass = random_pass(s, n, seed);
  for (int l = 0; l < s.n_layers; ++l)
    for (int t = 0; t < n; ++t) {
      for (int h = 0; h < s.n_kv_heads; ++h) {
        float* k = &pass.k[static_cast<std::size_t>(l)][(static_cast<std::size_t>(t) * s.n_kv_heads + h) * s.head_dim];
        if (t / T == hot_a || t / T == hot_b)
          for (int c = 0; c < s.head_dim; ++c) k[c] = c == h ? 6.0f : 0.0f;
      }
      if (t >= n - 16)
        for (int qh = 0; qh < s.n_heads; ++qh) {
          float* q = &pass.q[static_cast<std::size_t>(l)][(static_cast<std::size_t>(t) * s.n_heads + qh) * s.head_dim];
          for (int c = 0; c < s.head_dim; ++c) q[c] = c == qh / (s.n_heads / s.n_kv_heads) ? 3.0f : 0.0f;
        }
    }
  return pass;
}

// positions=close: the kept runs move back over the gaps.
TEST(PooledKvSeal, EvictKeepsSinksWindowAndTheMostAttendedBlocks) {
  ThreadPool threads(2);
  const KvShape s{2, 6, 3, 16};
  const int T = 8, n = 80;  // 10 full blocks: sink 0, window 9, 8 cold; a budget of 4 blocks
  for (const char* text : {"int8:sink=8:window=8:budget=0.4:positions=close", "f16:budget=0.4:positions=close",
                           "int4:lo=int2:top=0.5:budget=0.4:positions=close"}) {
    SCOPED_TRACE(text);
    const KvFormat f = KvFormat::parse(text);
    auto pool = KvPool::create(PoolConfig{s, T, KvPool::arena_bytes_for(s, T, f, 128, 6)});
    const auto pass = attended_pass(s, n, T, 3, 6, 31);
    {  // the six dropped blocks go back to the pool
      PooledKvCache alone(pool, f, 128);
      run_pass(alone, pass, n, threads);
      alone.demote();
      const std::uint64_t used = pool->counters().blocks_used;
      EXPECT_EQ(alone.evict().size(), 4u);
      EXPECT_EQ(pool->counters().blocks_used, used - 6);
    }
    {
      PooledKvCache cache(pool, f, 128);
      run_pass(cache, pass, n, threads);
      cache.demote();  // the mixed format: demoted first, as seal does
      const auto whole = cache.fork();  // what splice() reads the kept runs from
      const auto kept = cache.evict();
      const std::vector<std::pair<int, int>> want{{0, 8}, {24, 32}, {48, 56}, {72, 80}};
      EXPECT_EQ(kept, want);
      ASSERT_EQ(cache.size(), 32);
      // Four moved runs and a fresh tail; the first sits where it was computed.
      ASSERT_EQ(cache.segments().size(), 5u);
      const int offsets[] = {0, -16, -32, -48, 0};
      for (std::size_t i = 0; i < 5; ++i) {
        EXPECT_EQ(cache.segments()[i].position_offset, offsets[i]) << i;
        EXPECT_EQ(cache.segments()[i].tokens, i < 4 ? 8 : 0) << i;
      }
      EXPECT_EQ(cache.evict(), (std::vector<std::pair<int, int>>{}));  // several segments: evicted already
      EXPECT_EQ(cache.position_gap(), 0);
      EXPECT_EQ(cache.next_position(), 32);
      // The same runs spliced into an empty context read alike, bit for bit.
      const KvRope rope = test_rope(s.head_dim);
      PooledKvCache spliced(pool, f, 128);
      for (const auto& [b, e] : want) spliced.splice(*whole, b, e, rope);
      cache.set_rope(rope);
      const auto next = random_pass(s, 5, 32);
      EXPECT_EQ(run_pass(cache, next, 5, threads), run_pass(spliced, next, 5, threads));
      EXPECT_EQ(cache.size(), 37);
      // A consumer adopts the evicted context as it is.
      auto adopted = PooledKvCache::adopt(pool, f, 128, cache.segments(), cache.size());
      adopted->set_rope(rope);
      EXPECT_EQ(run_pass(*adopted, next, 5, threads).size(), next.q[0].size() * s.n_layers);
    }
    EXPECT_EQ(pool->counters().blocks_used, 0u);
  }
}

// positions=keep (the default, as H2O and SnapKV): the kept runs stay where
// they were computed, the next token comes at the original length, and
// attention reads exactly the kept rows.
TEST(PooledKvSeal, EvictKeepsPositionsByDefault) {
  ThreadPool threads(2);
  const KvShape s{2, 6, 3, 16};
  const int T = 8, n = 80;
  for (const char* text : {"int8:sink=8:window=8:budget=0.4", "f16:budget=0.4", "int4:budget=0.4"}) {
    SCOPED_TRACE(text);
    const KvFormat f = KvFormat::parse(text);
    auto pool = KvPool::create(PoolConfig{s, T, KvPool::arena_bytes_for(s, T, f, 128, 6)});
    const auto pass = attended_pass(s, n, T, 3, 6, 31);
    {
      PooledKvCache cache(pool, f, 128);
      run_pass(cache, pass, n, threads);
      const auto kept = cache.evict();
      const std::vector<std::pair<int, int>> want{{0, 8}, {24, 32}, {48, 56}, {72, 80}};
      ASSERT_EQ(kept, want);
      EXPECT_EQ(cache.size(), 32);
      EXPECT_EQ(cache.position_gap(), 48);
      EXPECT_EQ(cache.next_position(), 80);
      ASSERT_EQ(cache.segments().size(), 4u);  // the last run stays the writable tail
      for (const KvSegment& seg : cache.segments()) EXPECT_EQ(seg.position_offset, 0);
      // The reference: a context of the kept rows alone (same blocks, same codes).
      testing::Pass rows;
      for (int l = 0; l < s.n_layers; ++l) {
        std::vector<float> k, v, q;
        for (const auto& [b, e] : want) {
          const auto* pk = &pass.k[static_cast<std::size_t>(l)][static_cast<std::size_t>(b) * s.kv_dim()];
          const auto* pv = &pass.v[static_cast<std::size_t>(l)][static_cast<std::size_t>(b) * s.kv_dim()];
          const auto* pq = &pass.q[static_cast<std::size_t>(l)][static_cast<std::size_t>(b) * s.q_dim()];
          k.insert(k.end(), pk, pk + static_cast<std::ptrdiff_t>(e - b) * s.kv_dim());
          v.insert(v.end(), pv, pv + static_cast<std::ptrdiff_t>(e - b) * s.kv_dim());
          q.insert(q.end(), pq, pq + static_cast<std::ptrdiff_t>(e - b) * s.q_dim());
        }
        rows.k.push_back(std::move(k));
        rows.v.push_back(std::move(v));
        rows.q.push_back(std::move(q));
      }
      PooledKvCache ref(pool, f, 128);
      run_pass(ref, rows, 32, threads);
      const auto next = random_pass(s, 5, 32);
      const auto got = run_pass(cache, next, 5, threads), exp = run_pass(ref, next, 5, threads);
      ASSERT_EQ(got.size(), exp.size());
      for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], exp[i], 2e-5f) << i;
      EXPECT_EQ(cache.next_position(), 85);
      // Forks and tail contexts carry the gap; a splice from the context is refused.
      EXPECT_EQ(cache.fork()->next_position(), 85);
      PooledKvCache other(pool, f, 128);
      EXPECT_THROW(other.splice(cache, 0, 8, test_rope(s.head_dim)), Error);
    }
    EXPECT_EQ(pool->counters().blocks_used, 0u);
  }
}

// rank=recent (StreamingLLM): the newest cold blocks stay, whatever the queries attend to.
TEST(PooledKvSeal, RecentRankingKeepsTheNewestBlocks) {
  ThreadPool threads(2);
  const KvShape s{2, 6, 3, 16};
  const int T = 8, n = 80;
  const KvFormat f = KvFormat::parse("int8:sink=8:window=8:budget=0.4:rank=recent");
  auto pool = KvPool::create(PoolConfig{s, T, KvPool::arena_bytes_for(s, T, f, 128, 2)});
  {
    PooledKvCache cache(pool, f, 128);
    run_pass(cache, attended_pass(s, n, T, 3, 6, 31), n, threads);  // blocks 3 and 6 attended: ignored
    EXPECT_EQ(cache.evict(), (std::vector<std::pair<int, int>>{{0, 8}, {56, 80}}));
    const KvFormat m = KvFormat::parse("int8:lo=int2:top=0.25:rank=recent");
    PooledKvCache mixed(pool, m, 128);
    run_pass(mixed, attended_pass(s, n, T, 3, 6, 31), n, threads);
    EXPECT_EQ(mixed.demote(), 7);  // 10 cold blocks: the newest 3 keep int8
    for (int b = 0; b < 10; ++b)
      EXPECT_EQ(pool->info(mixed.segments()[0].blocks[static_cast<std::size_t>(b)]).k, b >= 7 ? m.k : m.lo_k) << b;
  }
  EXPECT_EQ(pool->counters().blocks_used, 0u);
}

TEST(PooledKvSeal, EvictDoesNothingWithoutABudgetOrQueries) {
  ThreadPool threads(1);
  const KvShape s{2, 4, 2, 16};
  auto pool = KvPool::create(PoolConfig{s, 8, 8 << 20});
  PooledKvCache plain(pool, KvFormat::parse("int8"), 128);
  run_pass(plain, random_pass(s, 40, 3), 40, threads);
  EXPECT_TRUE(plain.evict().empty());
  EXPECT_EQ(plain.size(), 40);
  // A budget that every block meets (the first and last block always stay).
  PooledKvCache small(pool, KvFormat::parse("int8:budget=0.5"), 128);
  run_pass(small, random_pass(s, 16, 4), 16, threads);
  EXPECT_TRUE(small.evict().empty());
  EXPECT_EQ(small.size(), 16);
  // A budget so small that only the first and last blocks stay.
  PooledKvCache tiny(pool, KvFormat::parse("int8:budget=0.01"), 128);
  run_pass(tiny, random_pass(s, 45, 5), 45, threads);
  const auto kept = tiny.evict();
  EXPECT_EQ(kept, (std::vector<std::pair<int, int>>{{0, 8}, {40, 45}}));
  EXPECT_EQ(tiny.size(), 13);
}

// tail=cold: the partly filled block ships coded (the codes of its rows with
// the unused ones repeating the last), the producer keeps its hot tail, and a
// consumer continues exactly as a context whose last tokens had the shipped
// rows, whether its write fills that block or not and whether or not it holds
// the coded block alone (then it must still copy, never write codes in place).
TEST(PooledKvSeal, ColdTailShipsThePartlyFilledBlockCoded) {
  ThreadPool threads(2);
  const KvShape s{2, 6, 3, 16};
  const int T = 8, n = 27, tail = 3;  // three full blocks and three rows
  for (const char* text : {"int4:tail=cold", "k8v4:tail=cold", "int3:outliers=0.02:params=8:tail=cold"})
    for (const int more : {5, 2})
      for (const bool alone : {false, true}) {
        SCOPED_TRACE(::testing::Message() << text << " +" << more << (alone ? " alone" : " shared"));
        const KvFormat f = KvFormat::parse(text);
        auto pool = KvPool::create(PoolConfig{s, T, KvPool::arena_bytes_for(s, T, f, 64, 4)});
        const auto pass = random_pass(s, n, 7);
        {
          auto producer = std::make_unique<PooledKvCache>(pool, f, 64);
          run_pass(*producer, pass, n, threads);
          auto shipped = producer->fork();
          ASSERT_TRUE(shipped->code_tail());
          EXPECT_FALSE(shipped->code_tail());  // coded already
          const BlockInfo sent = pool->info(shipped->segments()[0].blocks[3]);
          EXPECT_EQ(sent.k, f.k);
          EXPECT_EQ(sent.v, f.v);
          EXPECT_EQ(sent.fill, static_cast<std::uint32_t>(tail));
          EXPECT_EQ(pool->info(producer->segments()[0].blocks[3]).k, hot_codec(f.k));
          // The shipped rows are the scalar codes of the padded tile; the reference pass carries them.
          testing::Pass ref_pass = pass;
          std::vector<float> hot(static_cast<std::size_t>(T) * s.head_dim), got(hot.size()), want(hot.size());
          std::vector<std::byte> tile;
          for (int l = 0; l < s.n_layers; ++l)
            for (int kind = 0; kind < 2; ++kind)
              for (int h = 0; h < s.n_kv_heads; ++h) {
                const KvCodec& c = kind == 0 ? f.k : f.v;
                const TileLayout layout = tile_layout(c, T, s.head_dim);
                producer->read_rows(l, kind, h, 24, tail, hot.data());
                for (int r = tail; r < T; ++r)
                  std::copy_n(&hot[static_cast<std::size_t>(tail - 1) * s.head_dim], s.head_dim, &hot[static_cast<std::size_t>(r) * s.head_dim]);
                tile.assign(layout.bytes, std::byte{0});
                kv::encode_tile(c, layout, hot.data(), tile.data());
                kv::decode_tile_scalar(c, layout, tile.data(), T, want.data());
                shipped->read_rows(l, kind, h, 24, tail, got.data());
                for (std::size_t i = 0; i < static_cast<std::size_t>(tail) * s.head_dim; ++i) ASSERT_EQ(got[i], want[i]) << i;
                auto& rows = (kind == 0 ? ref_pass.k : ref_pass.v)[static_cast<std::size_t>(l)];
                for (int t = 0; t < tail; ++t)
                  std::copy_n(&got[static_cast<std::size_t>(t) * s.head_dim], s.head_dim,
                              &rows[(static_cast<std::size_t>(24 + t) * s.n_kv_heads + h) * s.head_dim]);
              }
          PooledKvCache ref(pool, f, 64);
          run_pass(ref, ref_pass, n, threads);
          // A consumer adopts the shipped blocks as they are.
          auto adopted = PooledKvCache::adopt(pool, f, 64, shipped->segments(), n);
          if (alone) producer.reset();
          const auto next = random_pass(s, more, 9);
          const auto want_out = run_pass(ref, next, more, threads);
          EXPECT_EQ(run_pass(*adopted, next, more, threads), want_out);
          adopted.reset();
          EXPECT_EQ(run_pass(*shipped, next, more, threads), want_out);
          EXPECT_EQ(pool->info(shipped->segments()[0].blocks[3]).k, more == 5 ? f.k : hot_codec(f.k));
        }
        EXPECT_EQ(pool->counters().blocks_used, 0u);
      }
}

// tail=cold leaves a full last block, a sink's block and formats without it as they are.
TEST(PooledKvSeal, ColdTailCodesOnlyAPartlyFilledColdBlock) {
  ThreadPool threads(1);
  const KvShape s{2, 4, 2, 16};
  auto pool = KvPool::create(PoolConfig{s, 8, 8 << 20});
  const auto codes_tail = [&](const char* format, int n) {
    PooledKvCache cache(pool, KvFormat::parse(format), 64);
    run_pass(cache, random_pass(s, n, 3), n, threads);
    return cache.code_tail();
  };
  EXPECT_TRUE(codes_tail("int8:tail=cold", 13));
  EXPECT_FALSE(codes_tail("int8:tail=cold", 16));        // full
  EXPECT_FALSE(codes_tail("int8:sink=4:tail=cold", 5));  // a sink's block
  EXPECT_FALSE(codes_tail("int8", 5));
  EXPECT_EQ(pool->counters().blocks_used, 0u);
  EXPECT_THROW(KvFormat::parse("f16:tail=cold"), Error);
  EXPECT_THROW(KvFormat::parse("int4:window=64:tail=cold"), Error);
  EXPECT_THROW(KvFormat::parse("int4:tail=warm"), Error);
  EXPECT_EQ(KvFormat::parse("int4:tail=cold:vgroup=64").to_string(), "int4:vgroup=64:tail=cold");
  EXPECT_EQ(KvFormat::parse("int4:tail=hot"), KvFormat::parse("int4"));
}

}  // namespace
}  // namespace qkvshare
