// stories260K must reproduce llama2.c's run.c output token for token
// (greedy, BOS, prompt "Once upon a time", 256 steps counting the prompt).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "qkvshare/engine/generate.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::unique_ptr<Model> load_stories() {
  return Model::load(testing::shared_path("models/stories260K.bin"), testing::shared_path("models/tok512.bin"));
}

TEST(Llama2cReference, GreedyOnceUponATimeMatchesRunC) {
  auto model = load_stories();
  Engine engine(*model, EngineOptions{1});
  auto session = engine.new_session();
  std::vector<TokenId> prompt{model->tokenizer().bos_id()};
  const auto body = model->tokenizer().encode("Once upon a time");
  prompt.insert(prompt.end(), body.begin(), body.end());

  GenerateOptions opts;
  opts.sampling.temperature = 0.0f;
  // run.c makes 256 forward passes and prints the token after each one: the
  // prompt tokens after BOS, then 257 - len(prompt) sampled tokens.
  opts.max_new_tokens = 257 - static_cast<int>(prompt.size());
  const GenerateResult r = generate(engine, *session, prompt, opts);

  const std::string expected = read_file(testing::source_path("tests/data/llama2c_reference_once_upon_a_time.txt"));
  ASSERT_FALSE(expected.empty());
  // run.c prints a final newline after the text.
  EXPECT_EQ("Once upon a time" + r.text + "\n", expected);
  EXPECT_EQ(r.stop_reason, StopReason::max_tokens);
}

TEST(Llama2cReference, SameResultWithSeveralThreads) {
  auto model = load_stories();
  std::vector<TokenId> prompt{1};
  const auto body = model->tokenizer().encode("The little dog");
  prompt.insert(prompt.end(), body.begin(), body.end());
  GenerateOptions opts;
  opts.sampling.temperature = 0.0f;
  opts.max_new_tokens = 100;
  Engine one(*model, EngineOptions{1});
  Engine two(*model, EngineOptions{2});
  auto s1 = one.new_session();
  auto s2 = two.new_session();
  EXPECT_EQ(generate(one, *s1, prompt, opts).tokens, generate(two, *s2, prompt, opts).tokens);
}

}  // namespace
}  // namespace qkvshare
