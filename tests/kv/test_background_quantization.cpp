// Blocks a decode step fills are quantized on a background thread while the
// pass goes on (issue 16 item 2): the pass reads their f16 copies, commit()
// waits for the codes. Everything a reader sees must be what quantizing in the
// pass gives: every attention output and every stored byte, on every format
// whose blocks are quantized when they fill.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kv_test_util.hpp"
#include "qkvshare/kv/kv_pool.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {
namespace {

using testing::kStoriesKvShape;
using testing::random_pass;

struct BackgroundQuantization {
  explicit BackgroundQuantization(bool on) { set_background_quantization(on); }
  ~BackgroundQuantization() { set_background_quantization(true); }
};

// A 40-token prompt, then 60 decode steps (blocks of 16 fill at steps 8, 24, 40, 56);
// every attention output of every pass, in order.
std::vector<float> decode_steps(PooledKvCache& cache, ThreadPool& pool) {
  std::vector<float> all = testing::run_pass(cache, random_pass(cache.shape(), 40, 1), 40, pool);
  for (int step = 0; step < 60; ++step) {
    const std::vector<float> out = testing::run_pass(cache, random_pass(cache.shape(), 1, 100 + step), 1, pool);
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

TEST(KvPool, BlocksQuantizedInTheBackgroundGiveTheBitsOfThePass) {
  ThreadPool threads(2);
  for (const char* format : {"int8", "int4", "int3", "int2", "k8v4:rot=kv", "int4:window=16", "int4:sink=4"}) {
    std::vector<float> outs[2];
    std::vector<std::uint64_t> sums[2];
    for (const bool background : {false, true}) {
      // A fresh pool each: a tile's bytes past its rows are whatever its pages held before.
      auto pool = KvPool::create(PoolConfig{kStoriesKvShape, 16, 8u << 20});
      BackgroundQuantization mode(background);
      auto cache = std::make_unique<PooledKvCache>(pool, KvFormat::parse(format), 256);
      outs[background] = decode_steps(*cache, threads);
      for (const BlockRef b : cache->segments().back().blocks) sums[background].push_back(pool->compute_checksum(b));
      cache.reset();
      EXPECT_EQ(pool->counters().blocks_used, 0u) << format;
    }
    ASSERT_EQ(outs[0].size(), outs[1].size()) << format;
    EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(float))) << format;
    EXPECT_EQ(sums[0], sums[1]) << format << ": the stored blocks differ";
  }
}

TEST(KvPool, APassAbandonedWhileItsBlocksAreQuantizedLeaksNothing) {
  ThreadPool threads(2);
  auto pool = KvPool::create(PoolConfig{kStoriesKvShape, 16, 8u << 20});
  {
    PooledKvCache cache(pool, KvFormat::parse("int4"), 256);
    testing::run_pass(cache, random_pass(cache.shape(), 15, 1), 15, threads);
    // The 16th token fills the block: write every layer (queued for the
    // worker), never commit; the cache goes away mid-pass.
    const testing::Pass p = random_pass(cache.shape(), 1, 2);
    for (int l = 0; l < kStoriesKvShape.n_layers; ++l)
      cache.write(l, 1, p.k[static_cast<std::size_t>(l)].data(), p.v[static_cast<std::size_t>(l)].data());
  }
  EXPECT_EQ(pool->counters().blocks_used, 0u);
}

}  // namespace
}  // namespace qkvshare
