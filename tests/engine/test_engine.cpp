#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/engine.hpp"
#include "qkvshare/kernels/packed_weights.hpp"
#include "qkvshare/model/synthetic_model.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = Model::load(testing::shared_path("models/stories260K.bin"), testing::shared_path("models/tok512.bin"));
  }
  std::vector<TokenId> prompt(const std::string& text) const {
    std::vector<TokenId> ids{model_->tokenizer().bos_id()};
    const auto body = model_->tokenizer().encode(text);
    ids.insert(ids.end(), body.begin(), body.end());
    return ids;
  }
  std::unique_ptr<Model> model_;
};

TEST_F(EngineTest, BatchedPrefillMatchesTokenByTokenDecode) {
  Engine engine(*model_, EngineOptions{2});
  const auto ids = prompt("Once upon a time there was a cat named Tom who liked milk.");
  const auto vocab = static_cast<std::size_t>(model_->config().vocab_size);
  auto batched = engine.new_session();
  const auto all = engine.forward(*batched, ids, true);
  const std::vector<float> prefill(all.begin(), all.end());
  auto stepwise = engine.new_session();
  for (std::size_t t = 0; t < ids.size(); ++t) {
    const auto l = engine.forward(*stepwise, std::span<const TokenId>(&ids[t], 1));
    for (std::size_t i = 0; i < vocab; ++i) ASSERT_NEAR(l[i], prefill[t * vocab + i], 1e-4f) << "t=" << t;
  }
  EXPECT_EQ(batched->tokens(), stepwise->tokens());
  EXPECT_EQ(batched->cache().size(), static_cast<int>(ids.size()));
}

TEST_F(EngineTest, ChunkedPrefillMatchesOneChunk) {
  const auto ids = prompt("Lily and Ben went to the park to play on the swings and the slide all day long.");
  Engine big(*model_, EngineOptions{1, 256});
  Engine small(*model_, EngineOptions{1, 3});
  auto a = big.new_session();
  auto b = small.new_session();
  const auto la = big.forward(*a, ids, true);
  const std::vector<float> va(la.begin(), la.end());
  const auto lb = small.forward(*b, ids, true);
  ASSERT_EQ(va.size(), lb.size());
  for (std::size_t i = 0; i < va.size(); ++i) ASSERT_NEAR(va[i], lb[i], 1e-4f);
}

TEST_F(EngineTest, ContextLimitIsAClearErrorAndLeavesSessionIntact) {
  Engine engine(*model_, EngineOptions{1});
  auto session = engine.new_session(16);
  const auto ids = prompt("one two three");
  engine.forward(*session, ids);
  const int before = session->n_past();
  std::vector<TokenId> more(20, 5);
  try {
    engine.forward(*session, more);
    FAIL() << "expected context_full";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::context_full);
    EXPECT_NE(std::string(e.what()).find("context length"), std::string::npos) << e.what();
  }
  EXPECT_EQ(session->n_past(), before);
  EXPECT_EQ(session->cache().size(), before);
}

TEST_F(EngineTest, OutOfRangeTokenIsRejected) {
  Engine engine(*model_, EngineOptions{1});
  auto session = engine.new_session();
  const std::vector<TokenId> bad{1, 100000};
  EXPECT_THROW(engine.forward(*session, bad), Error);
  EXPECT_EQ(session->n_past(), 0);
}

TEST_F(EngineTest, LogitsAreFinite) {
  Engine engine(*model_, EngineOptions{1});
  auto session = engine.new_session();
  const auto l = engine.forward(*session, prompt("Hello"));
  for (float v : l) ASSERT_TRUE(std::isfinite(v));
}

// Float activations on the SIMD kernels (weights dequantized once) compute what
// the scalar float reference computes, up to f32 summation order, and far
// closer to it than 8-bit activations do.
TEST(EngineFloatActivations, MatchTheExactReferenceOnQuantizedWeights) {
  for (const auto& [name, type] : {std::pair{"tiny-llama", GgmlType::Q4_0}, std::pair{"tiny-qwen3", GgmlType::Q4_K},
                                   std::pair{"tiny-llama", GgmlType::Q8_0}}) {
    const std::string path = testing::temp_dir() + "/float-acts-" + name + "-" + std::string(type_name(type)) + ".gguf";
    SyntheticOptions opt;
    opt.type = type;
    write_synthetic_model(find_synthetic_shape(name), opt, path);
    auto model = Model::load(path);
    const auto ids = model->tokenizer().encode("The cat sat on the mat, and then the dog came in.");
    EngineOptions exact{2}, fast{2}, int8{2};
    exact.exact_matmul = true;
    fast.float_activations = true;
    const auto logits = [&](const EngineOptions& o) {
      Engine engine(*model, o);
      auto session = engine.new_session(64);
      const auto l = engine.forward(*session, ids, true);
      return std::vector<float>(l.begin(), l.end());
    };
    const auto ref = logits(exact), f = logits(fast), q = logits(int8);
    // The f32 copies are what float activations cost in memory: 4 bytes per quantized weight.
    EXPECT_GT(Engine(*model, fast).float_copy_bytes(), 3 * model->weight_bytes()) << name;
    EXPECT_EQ(Engine(*model, int8).float_copy_bytes(), 0u) << name;
    float scale = 0, df = 0, dq = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      scale = std::max(scale, std::abs(ref[i]));
      df = std::max(df, std::abs(f[i] - ref[i]));
      dq = std::max(dq, std::abs(q[i] - ref[i]));
    }
    EXPECT_LE(df, 1e-4f * scale) << name << " " << type_name(type);
    EXPECT_LT(df * 10.0f, dq) << name << " " << type_name(type) << ": 8-bit activations should be further off";
  }
  auto model = Model::load(testing::shared_path("models/stories260K.bin"), testing::shared_path("models/tok512.bin"));
  EngineOptions both{2};
  both.exact_matmul = both.float_activations = true;
  EXPECT_THROW(Engine(*model, both), Error);
}

// Matrices packed at load (kernels/packed_weights.hpp) change no bit: a
// prompt's logits and the greedy tokens after it equal those of the same file
// loaded with its rows as stored. The file's rows stay readable.
class EnginePackedWeights : public ::testing::TestWithParam<GgmlType> {};

TEST_P(EnginePackedWeights, SameLogitsAndTokensAsTheRowsAsStored) {
  const std::string path = testing::temp_dir() + "/packed-tiny-llama-" + std::string(type_name(GetParam())) + ".gguf";
  SyntheticOptions opt;
  opt.type = GetParam();
  write_synthetic_model(find_synthetic_shape("tiny-llama"), opt, path);
  kernels::set_weight_packing(false);
  auto plain = Model::load(path);
  kernels::set_weight_packing(true);
  auto packed = Model::load(path);
  EXPECT_EQ(plain->packed_bytes(), 0u);
  if (packed->packed_bytes() == 0)
    GTEST_SKIP() << "*** no kernel level on this CPU reads packed tiles (AVX-512 does): nothing to compare ***";
  EXPECT_GT(packed->packed_bytes(), packed->weight_bytes() / 2);
  const auto ids = packed->tokenizer().encode("The cat sat on the mat, and then the dog came in.");
  const auto run = [&](const Model& m) {
    Engine engine(m, EngineOptions{2});
    auto session = engine.new_session(64);
    const auto l = engine.forward(*session, ids, true);
    std::vector<float> out(l.begin(), l.end());
    for (int step = 0; step < 8; ++step) {
      const auto next = static_cast<TokenId>(std::max_element(out.end() - m.config().vocab_size, out.end()) -
                                             (out.end() - m.config().vocab_size));
      const auto d = engine.forward(*session, std::vector<TokenId>{next});
      out.insert(out.end(), d.begin(), d.end());
    }
    return out;
  };
  EXPECT_EQ(run(*plain), run(*packed));
}

INSTANTIATE_TEST_SUITE_P(Types, EnginePackedWeights, ::testing::Values(GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0),
                         [](const auto& p) { return std::string(type_name(p.param)); });

}  // namespace
}  // namespace qkvshare
