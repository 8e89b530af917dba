// A context copied into another format (PooledKvCache::recoded, the memory
// tiers' demotion): what the copy reads is the source's rows coded again, the
// change it reports is the change it made, blocks already in the target codec
// are shared, and nothing leaks when it fails.
#include <gtest/gtest.h>

#include <cmath>

#include "kv_test_util.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/thread_pool.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {
namespace {

const KvShape kRecodeShape{2, 6, 3, 16};
constexpr int kRecodeBlock = 8;

std::vector<float> recode_rows(const PooledKvCache& c, int layer, int kind, int head) {
  std::vector<float> out(static_cast<std::size_t>(c.size()) * kRecodeShape.head_dim);
  c.read_rows(layer, kind, head, 0, c.size(), out.data());
  return out;
}

// sqrt(sum (b - a)^2 / sum a^2) over every layer and KV head of one kind.
double recode_rel_rms(const PooledKvCache& a, const PooledKvCache& b, int kind) {
  double err = 0, energy = 0;
  for (int l = 0; l < kRecodeShape.n_layers; ++l)
    for (int h = 0; h < kRecodeShape.n_kv_heads; ++h) {
      const auto x = recode_rows(a, l, kind, h), y = recode_rows(b, l, kind, h);
      for (std::size_t i = 0; i < x.size(); ++i) {
        energy += double(x[i]) * x[i];
        err += (double(y[i]) - x[i]) * (double(y[i]) - x[i]);
      }
    }
  return std::sqrt(err / energy);
}

TEST(PooledKvRecode, CopyReadsTheSourceRowsCodedAgainAndReportsTheChange) {
  ThreadPool threads(2);
  const int n = 61;  // seven full blocks and a partly filled tail
  for (const auto& [from, to] : std::vector<std::pair<const char*, const char*>>{
           {"int8", "int4"}, {"int8", "int2"}, {"f16", "int4"}, {"int4", "int8"}, {"int8:window=16", "int4:window=16"},
           {"k8v4:rot=kv", "int2:rot=kv"}}) {
    SCOPED_TRACE(std::string(from) + " -> " + to);
    const KvFormat ff = KvFormat::parse(from), tf = KvFormat::parse(to);
    auto pool = KvPool::create(PoolConfig{kRecodeShape, kRecodeBlock, KvPool::arena_bytes_for(kRecodeShape, kRecodeBlock, KvFormat::parse("f16"), 128, 4)});
    {
      PooledKvCache src(pool, ff, 128);
      testing::run_pass(src, testing::random_pass(kRecodeShape, n, 7), n, threads);
      const auto used = pool->counters().blocks_used;
      PooledKvCache::RecodeCost cost;
      const auto copy = src.recoded(tf, &cost);
      EXPECT_EQ(copy->size(), n);
      EXPECT_EQ(copy->format(), tf);
      EXPECT_EQ(cost.blocks_recoded + cost.blocks_shared, 8);
      EXPECT_EQ(pool->counters().blocks_used, used + static_cast<std::uint32_t>(cost.blocks_recoded));
      // The change it reports is the change a reader of the copy sees.
      EXPECT_NEAR(cost.k_rel_rms, recode_rel_rms(src, *copy, 0), 1e-6);
      EXPECT_NEAR(cost.v_rel_rms, recode_rel_rms(src, *copy, 1), 1e-6);
      EXPECT_GT(cost.k_rel_rms + cost.v_rel_rms, 0.0);
      EXPECT_LT(cost.k_rel_rms, tf.k.type == KvType::q2 ? 0.6 : 0.2);
      // Every cold block now holds the target's codecs; the tail stays hot.
      for (std::size_t b = 0; b < copy->segments()[0].blocks.size(); ++b) {
        const BlockInfo info = pool->info(copy->segments()[0].blocks[b]);
        const bool hot = static_cast<int>(info.fill) < kRecodeBlock || tf.block_is_hot(static_cast<int>(b), n, kRecodeBlock);
        EXPECT_EQ(info.k, hot ? hot_codec(tf.k) : tf.k) << b;
        EXPECT_EQ(info.v, hot ? hot_codec(tf.v) : tf.v) << b;
      }
      // The copy continues like any context of its format.
      testing::run_pass(*copy, testing::random_pass(kRecodeShape, 5, 8), 5, threads);
      EXPECT_EQ(copy->size(), n + 5);
    }
    EXPECT_EQ(pool->counters().blocks_used, 0u);
  }
}

TEST(PooledKvRecode, BlocksAlreadyInTheTargetCodecAreSharedUnchanged) {
  ThreadPool threads(1);
  auto pool = KvPool::create(PoolConfig{kRecodeShape, kRecodeBlock, 1 << 20});
  PooledKvCache src(pool, KvFormat::parse("int4"), 64);
  testing::run_pass(src, testing::random_pass(kRecodeShape, 20, 3), 20, threads);
  PooledKvCache::RecodeCost cost;
  const auto copy = src.recoded(KvFormat::parse("int4"), &cost);
  EXPECT_EQ(cost.blocks_recoded, 0);
  EXPECT_EQ(cost.blocks_shared, 3);
  EXPECT_EQ(cost.k_rel_rms, 0.0);
  EXPECT_EQ(cost.v_rel_rms, 0.0);
  for (std::size_t b = 0; b < 3; ++b) EXPECT_EQ(copy->segments()[0].blocks[b], src.segments()[0].blocks[b]);
}

TEST(PooledKvRecode, SegmentsOffsetsAndPositionGapAreKept) {
  ThreadPool threads(1);
  const KvFormat f = KvFormat::parse("int8:budget=0.5");
  auto pool = KvPool::create(PoolConfig{kRecodeShape, kRecodeBlock, 1 << 21});
  PooledKvCache src(pool, f, 128);
  testing::run_pass(src, testing::random_pass(kRecodeShape, 64, 11), 64, threads);
  ASSERT_FALSE(src.evict().empty());
  ASSERT_GT(src.segments().size(), 1u);
  const auto copy = src.recoded(KvFormat::parse("int4"));
  ASSERT_EQ(copy->segments().size(), src.segments().size());
  for (std::size_t i = 0; i < src.segments().size(); ++i) {
    EXPECT_EQ(copy->segments()[i].position_offset, src.segments()[i].position_offset);
    EXPECT_EQ(copy->segments()[i].tokens, src.segments()[i].tokens);
    EXPECT_EQ(copy->segments()[i].blocks.size(), src.segments()[i].blocks.size());
  }
  EXPECT_EQ(copy->size(), src.size());
  EXPECT_EQ(copy->position_gap(), src.position_gap());
  EXPECT_LT(recode_rel_rms(src, *copy, 1), 0.2);
}

TEST(PooledKvRecode, FormatsStoredOtherwiseOrOfTwoPrecisionsAreRefused) {
  ThreadPool threads(1);
  auto pool = KvPool::create(PoolConfig{kRecodeShape, kRecodeBlock, 1 << 20});
  PooledKvCache src(pool, KvFormat::parse("int8"), 64);
  testing::run_pass(src, testing::random_pass(kRecodeShape, 20, 3), 20, threads);
  const auto used = pool->counters().blocks_used;
  for (const char* bad : {"int4:rot=k", "int4:keys=pre", "int8:lo=int2:top=0.5", "int4:budget=0.5"}) {
    try {
      src.recoded(KvFormat::parse(bad));
      ADD_FAILURE() << bad << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << bad;
      EXPECT_NE(std::string(e.what()).find(KvFormat::parse(bad).to_string()), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(pool->counters().blocks_used, used);
}

TEST(PooledKvRecode, PoolExhaustionGivesEveryBlockBackAndLeavesTheSourceAsItWas) {
  ThreadPool threads(1);
  auto pool = KvPool::create(PoolConfig{kRecodeShape, kRecodeBlock, 1 << 20});
  PooledKvCache src(pool, KvFormat::parse("int8"), 64);
  testing::run_pass(src, testing::random_pass(kRecodeShape, 4 * kRecodeBlock, 5), 4 * kRecodeBlock, threads);
  const auto before = recode_rows(src, 1, 0, 2);
  // Fill the pool, then leave room for two of the four int4 blocks the copy needs.
  const KvCodec q4 = KvFormat::parse("int4").k;
  std::vector<BlockRef> filler;
  try {
    for (;;) filler.push_back(pool->allocate(q4, q4, 0));
  } catch (const Error& e) {
    ASSERT_EQ(e.code(), ErrorCode::out_of_memory);
  }
  ASSERT_GE(filler.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    pool->release(filler.back());
    filler.pop_back();
  }
  const auto used = pool->counters().blocks_used;
  try {
    src.recoded(KvFormat::parse("int4"));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::out_of_memory) << e.what();
  }
  EXPECT_EQ(pool->counters().blocks_used, used);
  EXPECT_EQ(recode_rows(src, 1, 0, 2), before);
  for (const BlockRef b : filler) pool->release(b);
}

}  // namespace
}  // namespace qkvshare
