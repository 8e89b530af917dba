// Engine::forward_batch: a batch of sessions gives what each session gives alone
// (bit for bit with exact matmuls, to rounding with the 8-bit-activation
// kernels), for mixed prefill/decode batches and every KV format, and a
// session that fails leaves the others' results and its own state untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/engine.hpp"
#include "qkvshare/kv/dense_kv_cache.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "qkvshare/kv/shared_block_reads.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

const char* const kFormats[] = {"dense", "f32", "f16", "int8", "int4", "int3", "int2", "k8v4:rot=kv", "int4:window=16",
                                "k8v4:keys=pre"};

class BatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = Model::load(testing::shared_path("models/stories260K.bin"), testing::shared_path("models/tok512.bin"));
    const char* texts[] = {
        "Once upon a time there was a little dog named Max who liked to run in the park.",
        "Lily and Ben went to the beach. They built a big sand castle with a tall tower and a moat around it.",
        "The sun was hot.",
        "One day a bird flew into the garden and sang a happy song for the old man who lived there alone."};
    for (const char* t : texts) {
      std::vector<TokenId> ids{model_->tokenizer().bos_id()};
      const auto body = model_->tokenizer().encode(t);
      ids.insert(ids.end(), body.begin(), body.end());
      prompts_.push_back(ids);
    }
  }
  std::unique_ptr<Session> session(Engine& engine, const std::string& format, int capacity = 512) {
    if (format == "dense") return engine.new_session(capacity);
    if (!pool_) pool_ = KvPool::create(PoolConfig{engine.kv_shape(), 32, 64 << 20});
    return std::make_unique<Session>(std::make_unique<PooledKvCache>(pool_, KvFormat::parse(format), capacity));
  }

  // Runs the same schedule batched and one session at a time and compares
  // every logit: step 0 prefills sessions 0-2 (different lengths) while 3
  // waits; then decodes of 0-2 share passes with 3's prompt, in two chunks.
  void compare_schedule(const EngineOptions& eo, const std::string& format, float tolerance) {
    Engine batched(*model_, eo), alone(*model_, eo);
    struct Plan {
      std::vector<std::vector<TokenId>> feed;  // per session, tokens of this step (empty: idle)
    };
    std::vector<Plan> plan(5);
    for (int s = 0; s < 3; ++s) plan[0].feed.push_back(prompts_[static_cast<std::size_t>(s)]);
    plan[0].feed.emplace_back();
    const auto& p3 = prompts_[3];
    const std::size_t half = p3.size() / 2;
    for (int step = 1; step < 5; ++step) {
      for (int s = 0; s < 3; ++s) plan[static_cast<std::size_t>(step)].feed.push_back({static_cast<TokenId>(20 + 7 * s + step)});
      if (step == 1) plan[1].feed.emplace_back(p3.begin(), p3.begin() + static_cast<std::ptrdiff_t>(half));
      else if (step == 2) plan[2].feed.emplace_back(p3.begin() + static_cast<std::ptrdiff_t>(half), p3.end());
      else plan[static_cast<std::size_t>(step)].feed.push_back({static_cast<TokenId>(30 + step)});
    }
    std::vector<std::unique_ptr<Session>> a, b;
    for (int s = 0; s < 4; ++s) {
      a.push_back(session(batched, format));
      b.push_back(session(alone, format));
    }
    for (std::size_t step = 0; step < plan.size(); ++step) {
      std::vector<BatchEntry> entries;
      std::vector<int> who;
      for (int s = 0; s < 4; ++s) {
        const auto& f = plan[step].feed[static_cast<std::size_t>(s)];
        if (f.empty()) continue;
        entries.push_back({a[static_cast<std::size_t>(s)].get(), f, LogitsWanted::all});
        who.push_back(s);
      }
      const auto out = batched.forward_batch(entries);
      ASSERT_EQ(out.size(), entries.size());
      std::vector<std::vector<float>> got;
      for (const auto& o : out) {
        ASSERT_TRUE(o.ok()) << o.error->what();
        got.emplace_back(o.logits.begin(), o.logits.end());
      }
      for (std::size_t e = 0; e < who.size(); ++e) {
        const int s = who[e];
        const auto want = alone.forward(*b[static_cast<std::size_t>(s)], plan[step].feed[static_cast<std::size_t>(s)], true);
        ASSERT_EQ(want.size(), got[e].size());
        if (tolerance == 0.0f) {
          EXPECT_EQ(0, std::memcmp(want.data(), got[e].data(), want.size() * sizeof(float)))
              << format << " step " << step << " session " << s;
        } else {
          float worst = 0.0f, scale = 0.0f;
          for (std::size_t i = 0; i < want.size(); ++i) {
            worst = std::max(worst, std::abs(want[i] - got[e][i]));
            scale = std::max(scale, std::abs(want[i]));
          }
          EXPECT_LE(worst, tolerance * scale) << format << " step " << step << " session " << s;
        }
      }
    }
    for (int s = 0; s < 4; ++s) {
      EXPECT_EQ(a[static_cast<std::size_t>(s)]->tokens(), b[static_cast<std::size_t>(s)]->tokens());
      EXPECT_EQ(a[static_cast<std::size_t>(s)]->cache().size(), b[static_cast<std::size_t>(s)]->cache().size());
    }
  }

  std::unique_ptr<Model> model_;
  std::vector<std::vector<TokenId>> prompts_;
  std::shared_ptr<KvPool> pool_;
};

TEST_F(BatchTest, MixedBatchIsBitIdenticalToEachAloneWithExactMatmul) {
  EngineOptions eo;
  eo.n_threads = 2;
  eo.exact_matmul = true;
  for (const char* f : kFormats) compare_schedule(eo, f, 0.0f);
}

TEST_F(BatchTest, MixedBatchMatchesEachAloneToRoundingWithDefaultKernels) {
  EngineOptions eo;
  eo.n_threads = 2;
  for (const char* f : {"dense", "f16", "int8", "int4"}) compare_schedule(eo, f, 1e-4f);
}

// Forks of one 200-token context decode together, in a pool of 8-token
// blocks (a split-K partition is 128 tokens): the batch reads their common
// blocks once per layer (kv::SharedBlockReads), and every session's logits
// keep the bits it gets alone, with the reads shared and without.
TEST_F(BatchTest, ForksDecodingTogetherKeepTheirBitsWithSharedBlockReads) {
  EngineOptions eo;
  eo.n_threads = 2;
  eo.exact_matmul = true;  // batch-invariant matmuls: attention is what differs
  std::vector<TokenId> prompt;
  while (prompt.size() < 200)
    for (const auto& p : prompts_) prompt.insert(prompt.end(), p.begin(), p.end());
  prompt.resize(200);
  for (const char* format : {"f16", "int8", "int4", "k8v4:rot=kv"}) {
    for (const bool shared : {true, false}) {
      kv::set_shared_block_reads(shared);
      Engine batched(*model_, eo), alone(*model_, eo);
      auto pool = KvPool::create(PoolConfig{batched.kv_shape(), 8, 64 << 20});
      Session parent(std::make_unique<PooledKvCache>(pool, KvFormat::parse(format), 512));
      batched.forward(parent, prompt);
      const auto& parent_cache = dynamic_cast<const PooledKvCache&>(parent.cache());
      std::vector<std::unique_ptr<Session>> a, b;
      for (int s = 0; s < 4; ++s) {
        a.push_back(std::make_unique<Session>(parent_cache.fork(), parent.tokens()));
        b.push_back(std::make_unique<Session>(parent_cache.fork(), parent.tokens()));
      }
      for (int step = 0; step < 3; ++step) {
        std::vector<TokenId> next;
        std::vector<BatchEntry> entries;
        for (int s = 0; s < 4; ++s) next.push_back(static_cast<TokenId>(40 + 11 * s + step));
        for (int s = 0; s < 4; ++s) entries.push_back({a[static_cast<std::size_t>(s)].get(), std::span<const TokenId>(&next[static_cast<std::size_t>(s)], 1), LogitsWanted::last});
        const auto out = batched.forward_batch(entries);
        for (int s = 0; s < 4; ++s) {
          ASSERT_TRUE(out[static_cast<std::size_t>(s)].ok());
          const auto want = alone.forward(*b[static_cast<std::size_t>(s)], std::span<const TokenId>(&next[static_cast<std::size_t>(s)], 1));
          const auto& got = out[static_cast<std::size_t>(s)].logits;
          ASSERT_EQ(want.size(), got.size());
          EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)))
              << format << (shared ? " shared" : " private") << " step " << step << " session " << s;
        }
      }
    }
  }
  kv::set_shared_block_reads(true);
}

TEST_F(BatchTest, LogitsWantedNoneLastAll) {
  Engine engine(*model_, EngineOptions{1});
  auto s0 = engine.new_session(), s1 = engine.new_session(), s2 = engine.new_session();
  const std::vector<BatchEntry> entries{{s0.get(), prompts_[0], LogitsWanted::none},
                                        {s1.get(), prompts_[1], LogitsWanted::last},
                                        {s2.get(), prompts_[2], LogitsWanted::all}};
  const auto out = engine.forward_batch(entries);
  const auto vocab = static_cast<std::size_t>(model_->config().vocab_size);
  EXPECT_TRUE(out[0].logits.empty());
  EXPECT_EQ(out[1].logits.size(), vocab);
  EXPECT_EQ(out[2].logits.size(), vocab * prompts_[2].size());
  EXPECT_EQ(s0->n_past(), static_cast<int>(prompts_[0].size()));
}

TEST_F(BatchTest, ASessionAtItsContextLimitFailsAloneAndIsUntouched) {
  Engine engine(*model_, EngineOptions{2});
  auto small = engine.new_session(20), big = engine.new_session(), ref = engine.new_session();
  engine.forward(*small, std::span<const TokenId>(prompts_[0].data(), 15));
  const std::vector<TokenId> bad{1, 100000};
  auto third = engine.new_session();
  const std::vector<BatchEntry> entries{{small.get(), prompts_[1], LogitsWanted::last},
                                        {big.get(), prompts_[1], LogitsWanted::last},
                                        {third.get(), bad, LogitsWanted::last}};
  const auto out = engine.forward_batch(entries);
  ASSERT_FALSE(out[0].ok());
  EXPECT_EQ(out[0].error->code(), ErrorCode::context_full);
  EXPECT_NE(std::string(out[0].error->what()).find("context length"), std::string::npos) << out[0].error->what();
  ASSERT_FALSE(out[2].ok());
  EXPECT_EQ(out[2].error->code(), ErrorCode::invalid_argument);
  ASSERT_TRUE(out[1].ok());
  const std::vector<float> got(out[1].logits.begin(), out[1].logits.end());
  const auto want = engine.forward(*ref, prompts_[1]);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4f);
  EXPECT_EQ(small->n_past(), 15);
  EXPECT_EQ(small->cache().size(), 15);
  EXPECT_EQ(third->n_past(), 0);
}

TEST_F(BatchTest, PoolExhaustionFailsOneSessionAndLeaksNothing) {
  Engine engine(*model_, EngineOptions{2});
  const KvShape shape = engine.kv_shape();
  const KvFormat f = KvFormat::parse("int4");
  auto tiny = KvPool::create(PoolConfig{shape, 32, KvPool::arena_bytes_for(shape, 32, f, 64)});
  auto roomy = KvPool::create(PoolConfig{shape, 32, 16 << 20});
  auto starving = std::make_unique<Session>(std::make_unique<PooledKvCache>(tiny, f, 512));
  auto fine = std::make_unique<Session>(std::make_unique<PooledKvCache>(roomy, f, 512));
  auto ref = std::make_unique<Session>(std::make_unique<PooledKvCache>(roomy, f, 512));
  engine.forward(*starving, std::span<const TokenId>(prompts_[0].data(), 8));
  const auto used_before = tiny->counters().blocks_used;
  const std::vector<TokenId> long_prompt(200, 9);
  const std::vector<BatchEntry> entries{{fine.get(), prompts_[3], LogitsWanted::last},
                                        {starving.get(), long_prompt, LogitsWanted::last}};
  const auto out = engine.forward_batch(entries);
  ASSERT_FALSE(out[1].ok());
  EXPECT_EQ(out[1].error->code(), ErrorCode::out_of_memory) << out[1].error->what();
  ASSERT_TRUE(out[0].ok());
  const std::vector<float> got(out[0].logits.begin(), out[0].logits.end());
  const auto want = engine.forward(*ref, prompts_[3]);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4f);
  EXPECT_EQ(starving->n_past(), 8);
  EXPECT_EQ(tiny->counters().blocks_used, used_before);
  // The failed session carries on once its request fits.
  const TokenId next = 11;
  const BatchEntry again{starving.get(), std::span<const TokenId>(&next, 1), LogitsWanted::last};
  EXPECT_TRUE(engine.forward_batch(std::span<const BatchEntry>(&again, 1))[0].ok());
  EXPECT_EQ(starving->n_past(), 9);
}

TEST_F(BatchTest, MisuseOfTheWholeCallIsRejectedBeforeAnythingRuns) {
  Engine engine(*model_, EngineOptions{1, 32});
  auto s = engine.new_session();
  const std::vector<TokenId> two{1, 2};
  const std::vector<BatchEntry> dup{{s.get(), two, LogitsWanted::last}, {s.get(), two, LogitsWanted::last}};
  EXPECT_THROW(engine.forward_batch(dup), Error);
  const std::vector<BatchEntry> null{{nullptr, two, LogitsWanted::last}};
  EXPECT_THROW(engine.forward_batch(null), Error);
  const std::vector<TokenId> many(40, 3);
  const std::vector<BatchEntry> big{{s.get(), many, LogitsWanted::last}};
  try {
    engine.forward_batch(big);
    FAIL() << "expected invalid_argument";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("max_batch"), std::string::npos) << e.what();
  }
  EXPECT_EQ(s->n_past(), 0);
  const std::vector<BatchEntry> empty_tokens{{s.get(), {}, LogitsWanted::last}};
  const auto out = engine.forward_batch(empty_tokens);
  ASSERT_FALSE(out[0].ok());
  EXPECT_EQ(out[0].error->code(), ErrorCode::invalid_argument);
  EXPECT_TRUE(engine.forward_batch({}).empty());
}

}  // namespace
}  // namespace qkvshare
