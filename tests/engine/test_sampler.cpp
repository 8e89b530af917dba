#include <gtest/gtest.h>

#include <map>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/generate.hpp"
#include "qkvshare/engine/sampler.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

SamplingParams params(float temp, int top_k = 0, float top_p = 1.0f, float min_p = 0.0f) {
  SamplingParams p;
  p.temperature = temp;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.seed = 7;
  return p;
}

TEST(Sampler, GreedyPicksArgmaxAndLowestIdOnTies) {
  Sampler s(params(0.0f));
  const std::vector<float> logits{0.1f, 3.0f, -1.0f, 3.0f};
  EXPECT_EQ(s.sample(logits, {}), 1);
}

TEST(Sampler, TopKOneIsGreedy) {
  Sampler s(params(1.5f, 1));
  const std::vector<float> logits{0.1f, 0.2f, 5.0f, 0.3f};
  for (int i = 0; i < 50; ++i) EXPECT_EQ(s.sample(logits, {}), 2);
}

TEST(Sampler, TopPKeepsOnlyTheNucleus) {
  Sampler s(params(1.0f, 0, 0.5f));
  // softmax: token 0 holds ~0.84 of the mass, so top-p 0.5 keeps it alone.
  const std::vector<float> logits{3.0f, 1.0f, 0.5f, 0.0f};
  for (int i = 0; i < 100; ++i) EXPECT_EQ(s.sample(logits, {}), 0);
}

TEST(Sampler, MinPDropsUnlikelyTokens) {
  Sampler s(params(1.0f, 0, 1.0f, 0.5f));
  const std::vector<float> logits{2.0f, 2.0f, -5.0f, -5.0f};
  std::map<TokenId, int> seen;
  for (int i = 0; i < 400; ++i) ++seen[s.sample(logits, {})];
  EXPECT_EQ(seen.count(2) + seen.count(3), 0u);
  EXPECT_GT(seen[0], 100);
  EXPECT_GT(seen[1], 100);
}

TEST(Sampler, TemperatureSamplingFollowsTheDistribution) {
  Sampler s(params(1.0f));
  const std::vector<float> logits{std::log(0.7f), std::log(0.2f), std::log(0.1f)};
  std::map<TokenId, int> seen;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++seen[s.sample(logits, {})];
  EXPECT_NEAR(seen[0] / static_cast<double>(n), 0.7, 0.02);
  EXPECT_NEAR(seen[1] / static_cast<double>(n), 0.2, 0.02);
  EXPECT_NEAR(seen[2] / static_cast<double>(n), 0.1, 0.02);
}

TEST(Sampler, SameSeedSameTokens) {
  const std::vector<float> logits{1.0f, 1.1f, 0.9f, 1.05f, 0.7f};
  Sampler a(params(1.0f)), b(params(1.0f));
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.sample(logits, {}), b.sample(logits, {}));
}

TEST(Sampler, RepetitionPenaltyDemotesRecentTokens) {
  SamplingParams p = params(0.0f);
  p.repeat_penalty = 2.0f;
  Sampler s(p);
  const std::vector<float> logits{2.0f, 1.5f, 0.0f};
  const std::vector<TokenId> history{0};
  EXPECT_EQ(s.sample(logits, history), 1);  // 2.0 / 2 = 1.0 < 1.5
}

TEST(Sampler, InvalidParametersNameTheField) {
  SamplingParams p;
  p.top_p = 1.5f;
  try {
    Sampler s(p);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("top-p"), std::string::npos);
  }
  p = SamplingParams{};
  p.temperature = -1.0f;
  EXPECT_THROW(Sampler{p}, Error);
}

class GenerateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = Model::load(testing::shared_path("models/stories260K.bin"), testing::shared_path("models/tok512.bin"));
    engine_ = std::make_unique<Engine>(*model_, EngineOptions{1});
  }
  std::vector<TokenId> prompt(const std::string& text) const {
    std::vector<TokenId> ids{1};
    const auto body = model_->tokenizer().encode(text);
    ids.insert(ids.end(), body.begin(), body.end());
    return ids;
  }
  std::unique_ptr<Model> model_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(GenerateTest, StopStringCutsTheTextAndStreamsTheSame) {
  GenerateOptions opts;
  opts.sampling.temperature = 0.0f;
  opts.max_new_tokens = 200;
  opts.stop_strings = {"Lily."};
  auto session = engine_->new_session();
  std::string streamed;
  const auto r = generate(*engine_, *session, prompt("Once upon a time"), opts,
                          [&](std::string_view s) { streamed += s; });
  EXPECT_EQ(r.stop_reason, StopReason::stop_string);
  EXPECT_EQ(r.text, ", there was a little girl named ");
  EXPECT_EQ(streamed, r.text);
}

TEST_F(GenerateTest, MaxNewTokensIsExact) {
  GenerateOptions opts;
  opts.sampling.temperature = 0.0f;
  opts.max_new_tokens = 17;
  opts.stop_at_end_of_generation = false;
  auto session = engine_->new_session();
  const auto p = prompt("Once upon a time");
  const auto r = generate(*engine_, *session, p, opts);
  EXPECT_EQ(r.tokens.size(), 17u);
  EXPECT_EQ(r.stop_reason, StopReason::max_tokens);
  // The last sampled token is not yet in the cache: one forward per token after the first.
  EXPECT_EQ(session->n_past(), static_cast<int>(p.size()) + 16);
}

TEST_F(GenerateTest, ContextLimitEndsGeneration) {
  GenerateOptions opts;
  opts.sampling.temperature = 0.0f;
  opts.max_new_tokens = 100;
  opts.stop_at_end_of_generation = false;
  auto session = engine_->new_session(20);
  const auto r = generate(*engine_, *session, prompt("Once upon a time"), opts);
  EXPECT_EQ(r.stop_reason, StopReason::context_full);
  EXPECT_EQ(session->n_past(), 20);
}

TEST_F(GenerateTest, PromptLongerThanContextIsAnError) {
  GenerateOptions opts;
  auto session = engine_->new_session(4);
  EXPECT_THROW(generate(*engine_, *session, prompt("Once upon a time there was"), opts), Error);
}

}  // namespace
}  // namespace qkvshare
