// The KV quality evaluation (engine/eval.cpp, qkvshare eval) on stories260K.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/eval.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(KvEval, ReferenceRowIsExactAndFormatsAreOrdered) {
  auto model = Model::load(testing::shared_path("models/stories260K.bin"), testing::shared_path("models/tok512.bin"));
  const auto tokens = model->tokenizer().encode(slurp(testing::shared_path("data/tinystories-valid-sample.txt")));
  Engine engine(*model, EngineOptions{2});
  const std::vector<KvFormat> formats{KvFormat::parse("f16"), KvFormat::parse("int8"), KvFormat::parse("int2")};
  EvalOptions o;
  o.ctx = 128;
  o.max_scored = 300;
  o.decode_tokens = 4;
  int progress_lines = 0;
  o.progress = [&](const std::string&) { ++progress_lines; };
  const EvalReport r = evaluate_kv(engine, tokens, formats, o);
  EXPECT_EQ(r.windows, 5);  // 64 scored per window (the second half): 5 windows reach 300
  EXPECT_EQ(r.scored, 320);
  ASSERT_EQ(r.results.size(), 4u);
  EXPECT_EQ(r.results[0].format, "f32");
  EXPECT_EQ(r.results[0].mean_kl, 0.0);
  EXPECT_EQ(r.results[0].top1, 1.0);
  EXPECT_EQ(r.results[0].ppl_delta_pct, 0.0);
  EXPECT_GT(r.results[0].ppl, 1.0);
  EXPECT_LT(r.results[0].ppl, 50.0);
  EXPECT_LT(r.results[1].mean_kl, 1e-4);  // f16: no activation rounding in this f32 model
  EXPECT_LT(r.results[1].mean_kl, r.results[2].mean_kl);
  EXPECT_LT(r.results[2].mean_kl, r.results[3].mean_kl);
  EXPECT_GT(r.results[3].p99_kl, r.results[3].mean_kl);
  EXPECT_DOUBLE_EQ(r.results[1].bits_per_element, 16.0);
  EXPECT_LT(r.results[3].bits_per_element, r.results[2].bits_per_element);
  for (const EvalFormatResult& f : r.results) {
    EXPECT_EQ(f.scored, 320);
    EXPECT_GT(f.decode_tokens_per_s, 0.0);
    EXPECT_TRUE(std::isfinite(f.ppl));
  }
  EXPECT_EQ(progress_lines, 5 * 4 + 4);
  // Bad requests name what is wrong.
  o.ctx = 100000;
  EXPECT_THROW(evaluate_kv(engine, tokens, formats, o), Error);
  o.ctx = 128;
  EXPECT_THROW(evaluate_kv(engine, std::span<const TokenId>(tokens.data(), 50), formats, o), Error);
}

TEST(KvEval, CliWritesJsonAndRejectsBadFormats) {
  const std::string dir = testing::temp_dir();
  const std::string json = dir + "/eval.json";
  const std::string base = testing::cli_path() + " eval -m " + testing::shared_path("models/stories260K.bin") + " -t " +
                           testing::shared_path("models/tok512.bin") + " --text " +
                           testing::shared_path("data/tinystories-valid-sample.txt") + " --ctx 64 --max-tokens 64";
  ASSERT_EQ(std::system((base + " --kv f16,int4:window=32 --json " + json + " > " + dir + "/out.txt 2>&1").c_str()), 0);
  const auto j = nlohmann::json::parse(slurp(json));
  ASSERT_EQ(j["formats"].size(), 3u);
  EXPECT_EQ(j["formats"][2]["format"], "int4:window=32");
  EXPECT_NE(slurp(dir + "/out.txt").find("mean KL"), std::string::npos);
  const int rc = std::system((base + " --kv int5 > " + dir + "/bad.txt 2>&1").c_str());
  EXPECT_NE(rc, 0);
  EXPECT_NE(slurp(dir + "/bad.txt").find("'int5'"), std::string::npos) << slurp(dir + "/bad.txt");
}

// The handoff protocol: a consumer that continues the producer's sealed half in
// one pass computes exactly what the prefill protocol does (the same blocks,
// shared); in smaller passes it reads more of its own tokens hot, so a
// quantized format then scores differently.
TEST(KvEval, HandoffProtocolContinuesTheProducersBlocks) {
  auto model = Model::load(testing::shared_path("models/stories260K.bin"), testing::shared_path("models/tok512.bin"));
  const auto tokens = model->tokenizer().encode(slurp(testing::shared_path("data/tinystories-valid-sample.txt")));
  Engine engine(*model, EngineOptions{2});
  const std::vector<KvFormat> formats{KvFormat::parse("f16"), KvFormat::parse("int4"), KvFormat::parse("int2")};
  EvalOptions o;
  o.ctx = 128;
  o.max_scored = 192;
  const EvalReport prefill = evaluate_kv(engine, tokens, formats, o);
  o.protocol = EvalProtocol::handoff;
  o.chunk = 64;  // the consumer's whole half in one pass
  const EvalReport whole = evaluate_kv(engine, tokens, formats, o);
  o.chunk = 8;
  const EvalReport chunked = evaluate_kv(engine, tokens, formats, o);
  ASSERT_EQ(whole.results.size(), prefill.results.size());
  for (std::size_t i = 0; i < prefill.results.size(); ++i) {
    EXPECT_EQ(whole.results[i].scored, prefill.results[i].scored);
    EXPECT_DOUBLE_EQ(whole.results[i].ppl, prefill.results[i].ppl) << prefill.results[i].format;
    EXPECT_DOUBLE_EQ(whole.results[i].mean_kl, prefill.results[i].mean_kl) << prefill.results[i].format;
    EXPECT_EQ(chunked.results[i].scored, prefill.results[i].scored);
    EXPECT_TRUE(std::isfinite(chunked.results[i].ppl));
  }
  EXPECT_NEAR(chunked.results[0].ppl, prefill.results[0].ppl, 1e-4 * prefill.results[0].ppl);  // f32: rounding only
  EXPECT_NE(chunked.results[2].ppl, prefill.results[2].ppl);  // int4
  // A mixed format is demoted when the producer hands its half off: what ships
  // lies between its two precisions; the scored window (the consumer's own
  // blocks at the high precision) is larger.
  const std::vector<KvFormat> mixed{KvFormat::parse("int2"), KvFormat::parse("int8:lo=int2:top=0.25")};
  o.block_tokens = 8;
  const EvalReport m = evaluate_kv(engine, tokens, mixed, o);
  ASSERT_EQ(m.results.size(), 3u);
  const EvalFormatResult &lo = m.results[1], &mix = m.results[2];
  EXPECT_GT(mix.handoff_bits_per_element, lo.bits_per_element);
  EXPECT_LT(mix.handoff_bits_per_element, mix.bits_per_element);
  EXPECT_LT(mix.mean_kl, lo.mean_kl);
  o.protocol = EvalProtocol::prefill;
  EXPECT_THROW(evaluate_kv(engine, tokens, mixed, o), Error);  // demotion happens at handoff
  o.protocol = EvalProtocol::handoff;
  o.block_tokens = 32;
  // The consumer's half needs a producer's half.
  o.score_all = true;
  EXPECT_THROW(evaluate_kv(engine, tokens, formats, o), Error);
  o.score_all = false;
  o.chunk = 0;
  EXPECT_THROW(evaluate_kv(engine, tokens, formats, o), Error);
}

// Two formats on stories260K under the handoff protocol (ctx 256, 512 scored
// positions): the f32 reference, then the two.
EvalReport handoff_eval_on_stories(const char* a, const char* b) {
  auto model = Model::load(testing::shared_path("models/stories260K.bin"), testing::shared_path("models/tok512.bin"));
  const auto tokens = model->tokenizer().encode(slurp(testing::shared_path("data/tinystories-valid-sample.txt")));
  Engine engine(*model, EngineOptions{2});
  EvalOptions o;
  o.ctx = 256;
  o.max_scored = 512;
  o.protocol = EvalProtocol::handoff;
  o.chunk = 32;
  const std::vector<KvFormat> formats{KvFormat::parse(a), KvFormat::parse(b)};
  return evaluate_kv(engine, tokens, formats, o);
}

// Dense-and-sparse tiles on a real model: the same int2 codes with 2% of each
// tile's elements kept apart cost less KL, and the bits count the outliers.
TEST(KvEval, OutliersLowerInt2KlOnStories) {
  const EvalReport r = handoff_eval_on_stories("int2", "int2:outliers=0.02");
  ASSERT_EQ(r.results.size(), 3u);
  const EvalFormatResult &plain = r.results[1], &sparse = r.results[2];
  EXPECT_LT(sparse.mean_kl, 0.8 * plain.mean_kl);
  // 2% of a 32 x 8 tile: 6 (index, residual) pairs of 32 bits over 256 elements.
  EXPECT_NEAR(sparse.bits_per_element - plain.bits_per_element, 6.0 * 32 / 256, 1e-9);
}

// One-byte (scale, min) pairs on a real model: fewer bits than the f16 pairs,
// counted exactly, for a small share of extra KL (the grid is coarser).
TEST(KvEval, ByteParamsCostLittleKlOnStories) {
  const EvalReport r = handoff_eval_on_stories("int4", "int4:params=8");
  ASSERT_EQ(r.results.size(), 3u);
  const EvalFormatResult &f16_pairs = r.results[1], &byte_pairs = r.results[2];
  // head_dim 8, 32-token blocks: keys 8 pairs (32 -> 12 + 16 bytes), values one
  // pair per row (128 -> 12 + 64 bytes), over 2 x 256 elements.
  EXPECT_NEAR(f16_pairs.bits_per_element - byte_pairs.bits_per_element, (160.0 - 104.0) * 8 / 512, 1e-9);
  EXPECT_GT(byte_pairs.mean_kl, 0.0);
  EXPECT_LT(byte_pairs.mean_kl, 1.5 * f16_pairs.mean_kl);
}

}  // namespace
}  // namespace qkvshare
