// Sliding-window layers in the pool, under the real forward pass (tiny-gemma3:
// five layers with an 8-token window, then a global one): blocks whose tokens
// left every window keep only the global layer's tiles, and nothing that reads
// the context notices. Every check runs the same work twice, in a pool of the
// model's shape (windows: blocks are freed) and in one of its dimensions alone
// (nothing is freed), and wants the same logits bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/engine.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "synthetic_files.hpp"

namespace qkvshare {
namespace {

constexpr int kBlock = 8;  // tokens per block: the model's window is 8 too

class WindowedPool : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { path_ = new std::string(testing::synthetic_file("tiny-gemma3", GgmlType::F16)); }
  static void TearDownTestSuite() {
    delete path_;
    path_ = nullptr;
  }
  void SetUp() override {
    model_ = Model::load(*path_);
    engine_ = std::make_unique<Engine>(*model_, EngineOptions{2});
    for (int i = 0; i < 96; ++i) ids_.push_back((i * 37 + 11) % 500);
    ASSERT_TRUE(engine_->kv_shape().frees_windowed());
    freeing_ = KvPool::create(PoolConfig{engine_->kv_shape(), kBlock, 16 << 20});
    KvShape dims = engine_->kv_shape();
    dims.layer_window.clear();
    keeping_ = KvPool::create(PoolConfig{dims, kBlock, 16 << 20});
  }
  std::unique_ptr<Session> session(const std::shared_ptr<KvPool>& pool, const std::string& format) const {
    return std::make_unique<Session>(std::make_unique<PooledKvCache>(pool, KvFormat::parse(format), 256));
  }
  // Feeds ids [from, to): a chunk of `chunk` tokens, then the rest token by token.
  std::vector<float> feed(Session& s, int from, int to, int chunk) const {
    const auto l = engine_->forward(s, std::span<const TokenId>(ids_.data() + from, static_cast<std::size_t>(chunk)), true);
    std::vector<float> out(l.begin(), l.end());
    for (int i = from + chunk; i < to; ++i) {
      const auto d = engine_->forward(s, std::span<const TokenId>(ids_.data() + i, 1));
      out.insert(out.end(), d.begin(), d.end());
    }
    return out;
  }
  static PooledKvCache& pooled(Session& s) { return dynamic_cast<PooledKvCache&>(s.cache()); }
  static int freed_blocks(const PooledKvCache& c) {
    int n = 0;
    for (const KvSegment& seg : c.segments())
      for (const BlockRef b : seg.blocks) n += (c.pool().info(b).flags & kBlockWindowFreed) != 0 ? 1 : 0;
    return n;
  }
  // Freed blocks in the lo codecs of a mixed format.
  static int count_lo(const PooledKvCache& c) {
    int n = 0;
    for (const BlockRef b : c.segments()[0].blocks) {
      const BlockInfo i = c.pool().info(b);
      n += (i.flags & kBlockWindowFreed) != 0 && i.k == c.format().lo_k ? 1 : 0;
    }
    return n;
  }
  static bool same(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  }

  static std::string* path_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Engine> engine_;
  std::vector<TokenId> ids_;
  std::shared_ptr<KvPool> freeing_, keeping_;
};
std::string* WindowedPool::path_ = nullptr;

// Prefill, decode across many block boundaries (each commit may free a
// block), then another chunk: every format reads the same logits, and the
// freed blocks are exactly those 8 or more tokens behind the end.
TEST_F(WindowedPool, FreeingTheWindowedLayersChangesNoLogit) {
  for (const char* format : {"f32", "f16", "int8", "int4", "int4:window=16", "k8v4:keys=pre", "int4:keys=block",
                             "int8:lo=int4:top=0.5"}) {
    auto a = session(freeing_, format), b = session(keeping_, format);
    const auto want = feed(*b, 0, 60, 30);
    ASSERT_TRUE(same(want, feed(*a, 0, 60, 30))) << format;
    ASSERT_TRUE(same(feed(*b, 60, 90, 20), feed(*a, 60, 90, 20))) << format;
    // 90 tokens: blocks ending at token 83 or before (+1 - 8) left every window.
    const PooledKvCache& c = pooled(*a);
    EXPECT_EQ(freed_blocks(c), 10) << format;
    EXPECT_EQ(c.windowed_kept_from(), 80) << format;
    EXPECT_EQ(freed_blocks(pooled(*b)), 0) << format;
    EXPECT_LT(c.kv_bytes() * 2, pooled(*b).kv_bytes()) << format;  // 10 of 12 blocks keep 1 of 6 layers
    if (!KvFormat::parse(format).mixed()) continue;
    // Mixed precision recodes blocks as they are, freed or not. (Which blocks
    // differs: the other pool's shape names no windows, so its ranking counts
    // the windowed layers' attention to every token.)
    const int freed = freed_blocks(c);
    EXPECT_GT(pooled(*a).demote(), 0) << format;
    EXPECT_EQ(freed_blocks(pooled(*a)), freed) << format;
    EXPECT_GT(count_lo(pooled(*a)), 0) << format;
    const auto more = feed(*a, 90, 96, 1);
    EXPECT_TRUE(std::all_of(more.begin(), more.end(), [](float x) { return std::isfinite(x); })) << format;
  }
  EXPECT_EQ(freeing_->counters().blocks_used, 0u);
}

// A fork shares its blocks: neither context frees a shared block (the other
// may still be inside its window) until it is theirs alone again, and both
// go on exactly as in a pool that frees nothing.
TEST_F(WindowedPool, ForksKeepSharedBlocksWholeAndStayExact) {
  auto a = session(freeing_, "int8"), b = session(keeping_, "int8");
  ASSERT_TRUE(same(feed(*b, 0, 40, 40), feed(*a, 0, 40, 40)));
  EXPECT_EQ(freed_blocks(pooled(*a)), 4);  // blocks ending at 8..32 <= 41 - 8
  auto fa = std::make_unique<Session>(pooled(*a).fork(), a->tokens());
  auto fb = std::make_unique<Session>(pooled(*b).fork(), b->tokens());
  ASSERT_TRUE(same(feed(*fb, 40, 70, 1), feed(*fa, 40, 70, 1)));
  ASSERT_TRUE(same(feed(*b, 50, 66, 4), feed(*a, 50, 66, 4)));
  // 56 tokens: blocks 0-5 left every window, but block 4 is still the fork's too.
  EXPECT_EQ(freed_blocks(pooled(*a)), 5);
  EXPECT_EQ(freed_blocks(pooled(*fa)), 6);  // 70 tokens: blocks 0-6 but the shared block 4
  fa.reset();
  fb.reset();
  ASSERT_TRUE(same(feed(*b, 66, 80, 1), feed(*a, 66, 80, 1)));
  EXPECT_EQ(freed_blocks(pooled(*a)), 7);  // block 4 its own again: freed at a later commit
}

// Contexts that end before the blocks they reuse allow (a prefix of a
// context whose early blocks were freed, a splice of a range that ends long
// before the source's end) are refused with the reason; whole ones work.
TEST_F(WindowedPool, PrefixesThatNeedFreedLayersAreRefused) {
  auto a = session(freeing_, "f16"), b = session(keeping_, "f16");
  feed(*a, 0, 40, 40);
  feed(*b, 0, 40, 40);
  const PooledKvCache& src = pooled(*a);
  ASSERT_EQ(src.windowed_kept_from(), 32);
  const KvFormat f16 = KvFormat::parse("f16");
  std::vector<BlockRef> first3(src.segments()[0].blocks.begin(), src.segments()[0].blocks.begin() + 3);
  try {
    PooledKvCache::adopt(freeing_, f16, 256, {KvSegment{0, first3, 0, 24}}, 24);
    FAIL() << "adopted a prefix whose window was freed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("sliding window"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(PooledKvCache::adopt(freeing_, f16, 256, {KvSegment{0, src.segments()[0].blocks, 0, 40}}, 40));

  // Splice: the writer's own prefix, then the source's tokens [3, 40) at another position.
  auto wa = session(freeing_, "f16"), wb = session(keeping_, "f16");
  feed(*wa, 60, 70, 10);
  feed(*wb, 60, 70, 10);
  EXPECT_THROW(pooled(*wa).splice(src, 3, 30, engine_->rope()), Error);
  pooled(*wa).splice(src, 3, 40, engine_->rope());
  pooled(*wb).splice(pooled(*b), 3, 40, engine_->rope());
  wa->note_placed(std::span<const TokenId>(ids_.data() + 3, 37));
  wb->note_placed(std::span<const TokenId>(ids_.data() + 3, 37));
  ASSERT_TRUE(same(feed(*wb, 70, 90, 3), feed(*wa, 70, 90, 3)));
  // Rows of a freed layer are not there to read; the global layer's are.
  std::vector<float> rows(8 * 128);
  EXPECT_THROW(src.read_rows(0, 0, 0, 0, 8, rows.data()), Error);
  EXPECT_NO_THROW(src.read_rows(5, 0, 0, 0, 8, rows.data()));
}

// The memory tiers' recode copies a context block by block into another
// format: freed blocks stay freed, and the copy reads what the copy of an
// unfreed context reads.
TEST_F(WindowedPool, RecodingKeepsTheLayersEachBlockHas) {
  auto a = session(freeing_, "f16"), b = session(keeping_, "f16");
  feed(*a, 0, 50, 50);
  feed(*b, 0, 50, 50);
  const KvFormat int4 = KvFormat::parse("int4");
  auto ca = std::make_unique<Session>(pooled(*a).recoded(int4), a->tokens());
  auto cb = std::make_unique<Session>(pooled(*b).recoded(int4), b->tokens());
  EXPECT_EQ(freed_blocks(pooled(*ca)), freed_blocks(pooled(*a)));
  ASSERT_TRUE(same(feed(*cb, 50, 70, 5), feed(*ca, 50, 70, 5)));
}

}  // namespace
}  // namespace qkvshare
