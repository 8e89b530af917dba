// The pool under the real forward pass (stories260K).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/engine.hpp"
#include "qkvshare/kernels/isa.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "kv_test_util.hpp"
#include "synthetic_files.hpp"

namespace qkvshare {
namespace {

class PooledEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = Model::load(testing::shared_path("models/stories260K.bin"), testing::shared_path("models/tok512.bin"));
    ids_ = {model_->tokenizer().bos_id()};
    const auto body = model_->tokenizer().encode(
        "Once upon a time there was a little dog named Max. Max liked to run in the park with his friend, a "
        "small cat. One day they found a big red ball under a tree and played with it until the sun went down. "
        "Then they went home and slept.");
    ids_.insert(ids_.end(), body.begin(), body.end());
  }
  std::unique_ptr<Session> pooled_session(Engine& engine, const std::string& format, int capacity = 512) {
    if (!pool_) pool_ = KvPool::create(PoolConfig{engine.kv_shape(), 32, 64 << 20});
    return std::make_unique<Session>(std::make_unique<PooledKvCache>(pool_, KvFormat::parse(format), capacity));
  }
  std::vector<float> all_logits(Engine& engine, Session& s) {
    const auto l = engine.forward(s, ids_, true);
    return {l.begin(), l.end()};
  }
  std::unique_ptr<Model> model_;
  std::vector<TokenId> ids_;
  std::shared_ptr<KvPool> pool_;
};

// The dense cache stores f32 tiles of the pool's default block size and runs
// the same block attention over them, so an f32 pool gives its logits bit for
// bit, on every ISA.
void expect_same_logits(const std::vector<float>& want, std::span<const float> got, bool bitwise, const char* what,
                        float tolerance = 2e-5f) {
  ASSERT_EQ(want.size(), got.size());
  if (bitwise) {
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float))) << what;
    return;
  }
  float worst = 0.0f;
  for (std::size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(want[i] - got[i]));
  EXPECT_LE(worst, tolerance) << what;
}

TEST_F(PooledEngineTest, F32PoolLogitsMatchTheDenseEngine) {
  testing::IsaGuard guard;
  for (const kernels::Isa isa : {kernels::Isa::portable, kernels::best_isa()}) {
    kernels::set_active_isa(isa);
    for (int batch : {256, 7}) {
      Engine engine(*model_, EngineOptions{2, batch});
      auto dense = engine.new_session();
      const auto want = all_logits(engine, *dense);
      auto pooled = pooled_session(engine, "f32");
      // Keys stored before RoPE, rotated when read: the same keys, to float rounding (one more
      // rotation's worth: 2.05e-5 measured in the unoptimised ASan build).
      auto pre = pooled_session(engine, "f32:keys=pre");
      expect_same_logits(want, engine.forward(*pooled, ids_, true), true, "prefill");
      expect_same_logits(want, engine.forward(*pre, ids_, true), false, "prefill, keys=pre", 1e-4f);
      // Decoding on, token by token.
      for (TokenId t : {5, 77, 300}) {
        const std::vector<TokenId> one{t};
        const auto a = engine.forward(*dense, one);
        const std::vector<float> av(a.begin(), a.end());
        expect_same_logits(av, engine.forward(*pooled, one), true, "decode");
        expect_same_logits(av, engine.forward(*pre, one), false, "decode, keys=pre", 1e-4f);
      }
    }
  }
  EXPECT_EQ(pool_->counters().blocks_used, 0u);  // the sessions are gone
}

// tiny-gemma3 (five layers with an 8-token window, then a global one with
// another RoPE): the pool's windowed attention under the real forward pass
// equals the dense engine's over 40 tokens, prefill and decode, also with keys
// stored before RoPE (each layer's own frequencies when read); int8 tracks it.
TEST(PooledEngineWindow, Gemma3SlidingWindowLayersOnThePool) {
  const auto model = Model::load(testing::synthetic_file("tiny-gemma3", GgmlType::F16));
  std::vector<TokenId> ids;
  for (int i = 0; i < 40; ++i) ids.push_back((i * 37 + 11) % 500);
  testing::IsaGuard guard;
  auto pool = KvPool::create(PoolConfig{KvShape{6, 4, 2, 128}, 16, 32 << 20});
  const auto session = [&](const char* format) {
    return std::make_unique<Session>(std::make_unique<PooledKvCache>(pool, KvFormat::parse(format), 128));
  };
  for (const kernels::Isa isa : {kernels::Isa::portable, kernels::best_isa()}) {
    kernels::set_active_isa(isa);
    Engine engine(*model, EngineOptions{2});
    auto dense = engine.new_session(128);
    const auto l = engine.forward(*dense, ids, true);
    const std::vector<float> want(l.begin(), l.end());
    auto pooled = session("f32");
    auto pre = session("f32:keys=pre");
    expect_same_logits(want, engine.forward(*pooled, ids, true), isa == kernels::Isa::portable, "gemma3 prefill");
    expect_same_logits(want, engine.forward(*pre, ids, true), false, "gemma3 prefill, keys=pre", 1e-4f);
    for (TokenId t : {5, 77, 300}) {
      const std::vector<TokenId> one{t};
      const auto a = engine.forward(*dense, one);
      const std::vector<float> av(a.begin(), a.end());
      expect_same_logits(av, engine.forward(*pooled, one), isa == kernels::Isa::portable, "gemma3 decode");
      expect_same_logits(av, engine.forward(*pre, one), false, "gemma3 decode, keys=pre", 1e-4f);
    }
    auto q8 = session("int8");
    const auto got = engine.forward(*q8, ids, true);
    double err = 0.0, ref = 0.0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      err += (got[i] - want[i]) * (got[i] - want[i]);
      ref += want[i] * want[i];
    }
    EXPECT_LT(std::sqrt(err / ref), 0.02) << "int8 on a windowed model";
    const KvRope rope = engine.rope();
    EXPECT_EQ(rope.local_layers, (std::vector<std::uint8_t>{1, 1, 1, 1, 1, 0}));
    EXPECT_NE(rope.local_inv_freq, rope.inv_freq);
  }
}

TEST_F(PooledEngineTest, QuantizedFormatsTrackF32) {
  Engine engine(*model_, EngineOptions{2});
  auto ref_session = pooled_session(engine, "f32");
  const auto ref = all_logits(engine, *ref_session);
  const std::size_t vocab = static_cast<std::size_t>(model_->config().vocab_size);
  const auto top1 = [&](const std::vector<float>& l, std::size_t t) {
    return std::max_element(l.begin() + static_cast<long>(t * vocab), l.begin() + static_cast<long>((t + 1) * vocab)) - l.begin();
  };
  for (const char* f : {"f16", "int8", "int4", "k8v4", "int2:window=32:sink=4", "int8:keys=pre", "int4:keys=pre",
                        "int8:keys=block", "int4:keys=block"}) {
    auto s = pooled_session(engine, f);
    const auto got = all_logits(engine, *s);
    std::size_t agree = 0;
    float worst = 0.0f;
    for (std::size_t t = 0; t < ids_.size(); ++t) {
      agree += top1(ref, t) == top1(got, t);
      for (std::size_t i = 0; i < vocab; ++i) worst = std::max(worst, std::abs(ref[t * vocab + i] - got[t * vocab + i]));
    }
    const double rate = static_cast<double>(agree) / static_cast<double>(ids_.size());
    EXPECT_GE(rate, std::string(f) == "f16" || std::string(f).starts_with("int8") ? 0.98 : 0.8) << f;
    if (std::string(f) == "f16") {
      EXPECT_LT(worst, 0.05f);
    }
    EXPECT_TRUE(std::isfinite(worst)) << f;
  }
}

TEST_F(PooledEngineTest, OutOfMemoryFailsTheForwardAndTheSessionCarriesOn) {
  Engine engine(*model_, EngineOptions{1});
  const KvFormat f = KvFormat::parse("int4");
  pool_ = KvPool::create(PoolConfig{engine.kv_shape(), 32, KvPool::arena_bytes_for(engine.kv_shape(), 32, f, 96)});
  auto hog = pooled_session(engine, "int4");
  engine.forward(*hog, std::vector<TokenId>(80, 42));
  auto s = pooled_session(engine, "int4");
  engine.forward(*s, std::span<const TokenId>(ids_.data(), 5));
  try {
    engine.forward(*s, std::vector<TokenId>(200, 7));
    FAIL() << "expected out_of_memory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::out_of_memory) << e.what();
  }
  EXPECT_EQ(s->n_past(), 5);
  EXPECT_EQ(s->cache().size(), 5);
  hog.reset();  // room again: the same session continues and matches a fresh run
  const auto got = engine.forward(*s, std::span<const TokenId>(ids_.data() + 5, 20));
  const std::vector<float> gv(got.begin(), got.end());
  auto fresh = pooled_session(engine, "int4");
  engine.forward(*fresh, std::span<const TokenId>(ids_.data(), 5));
  const auto want = engine.forward(*fresh, std::span<const TokenId>(ids_.data() + 5, 20));
  EXPECT_EQ(0, std::memcmp(gv.data(), want.data(), gv.size() * sizeof(float)));
}

}  // namespace
}  // namespace qkvshare
