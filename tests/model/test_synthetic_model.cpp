// make-model's synthetic GGUF files: the vocabulary is a consistent BPE, the
// files load in this engine and generate, the output is deterministic, and bad
// shapes or types are clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <unordered_set>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/engine.hpp"
#include "qkvshare/engine/generate.hpp"
#include "qkvshare/kernels/quant.hpp"
#include "qkvshare/model/synthetic_model.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

std::string file_contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

template <typename F>
void expect_model_error(F&& f, ErrorCode code, const std::string& substring) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing '" << substring << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(substring), std::string::npos) << e.what();
  }
}

TEST(SyntheticVocab, IsAConsistentByteLevelBpe) {
  for (const int size : {259, 512, 49152, 70000}) {
    SCOPED_TRACE(size);
    const SyntheticVocab v = make_synthetic_vocab(size);
    ASSERT_EQ(v.tokens.size(), static_cast<std::size_t>(size));
    ASSERT_EQ(v.types.size(), v.tokens.size());
    EXPECT_EQ(v.merges.size(), static_cast<std::size_t>(size - 259));
    const std::unordered_set<std::string> tokens(v.tokens.begin(), v.tokens.end());
    EXPECT_EQ(tokens.size(), v.tokens.size()) << "duplicate tokens";
    for (const std::string& m : v.merges) {
      const auto space = m.find(' ', 1);
      ASSERT_NE(space, std::string::npos) << m;
      const std::string left = m.substr(0, space), right = m.substr(space + 1);
      ASSERT_TRUE(tokens.contains(left) && tokens.contains(right) && tokens.contains(left + right)) << m;
    }
    EXPECT_EQ(v.tokens[v.bos_id], "<|endoftext|>");
    EXPECT_EQ(v.tokens[v.eos_id], "<|im_end|>");
    EXPECT_EQ(v.types[v.eos_id], 3);
    EXPECT_EQ(v.tokens['A'], "A");
    EXPECT_EQ(v.tokens[' '], "\xC4\xA0");  // GPT-2's byte-to-unicode: space is U+0120
  }
  expect_model_error([] { make_synthetic_vocab(258); }, ErrorCode::invalid_argument, "258");
}

TEST(SyntheticShapes, NamedShapesHaveTheRealModelsDimensions) {
  const SyntheticShape& s = find_synthetic_shape("smollm2-135m");
  EXPECT_EQ(s.n_layers, 30);
  EXPECT_EQ(s.vocab_size, 49152);
  const SyntheticShape& q = find_synthetic_shape("qwen2.5-0.5b");
  EXPECT_EQ(q.architecture, "qwen2");
  EXPECT_NEAR(static_cast<double>(q.n_params()), 494e6, 1e6);
  const SyntheticShape& l = find_synthetic_shape("llama3.2-1b");
  EXPECT_EQ(l.n_kv_heads, 8);
  EXPECT_EQ(l.rope_theta, 500000.0f);
  EXPECT_NEAR(static_cast<double>(l.n_params()), 1.236e9, 1e7);
  const SyntheticShape& q3 = find_synthetic_shape("qwen3-0.6b");  // 596M parameters with the tied embedding
  EXPECT_EQ(q3.head_dim(), 128);
  EXPECT_NEAR(static_cast<double>(q3.n_params()), 596e6, 2e6);
  const SyntheticShape& g3 = find_synthetic_shape("gemma3-1b");  // 999.9M parameters (tied)
  EXPECT_EQ(g3.head_dim(), 256);
  EXPECT_EQ(g3.sliding_window, 512);
  EXPECT_NEAR(static_cast<double>(g3.n_params()), 999.9e6, 2e6);
  for (const SyntheticShape& shape : synthetic_shapes())
    for (const GgmlType t : {GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0}) EXPECT_NO_THROW(validate_shape(shape, t));
}

TEST(SyntheticShapes, BadNamesTypesAndShapesAreClearErrors) {
  expect_model_error([] { find_synthetic_shape("gpt-5"); }, ErrorCode::invalid_argument, "known: smollm2-135m");
  expect_model_error([] { parse_synthetic_type("Q8_K"); }, ErrorCode::invalid_argument, "F16, BF16, Q8_0, Q4_0");
  EXPECT_EQ(parse_synthetic_type("q4_k"), GgmlType::Q4_K);
  EXPECT_EQ(parse_synthetic_type("IQ4_XS"), GgmlType::IQ4_XS);
  EXPECT_EQ(parse_synthetic_type("q4_0"), GgmlType::Q4_0);
  SyntheticShape s = find_synthetic_shape("tiny-llama");
  s.d_model = 48;  // 4 heads of 12: fine for F16, not a multiple of the 32-wide Q8_0 block
  EXPECT_NO_THROW(validate_shape(s, GgmlType::F16));
  expect_model_error([&] { validate_shape(s, GgmlType::Q8_0); }, ErrorCode::invalid_argument, "block size");
  s = find_synthetic_shape("tiny-llama");
  s.n_kv_heads = 3;
  expect_model_error([&] { validate_shape(s, GgmlType::F16); }, ErrorCode::invalid_argument, "KV heads");
  const std::string path = testing::temp_dir() + "/never.gguf";
  SyntheticOptions q8k;
  q8k.type = GgmlType::Q8_K;  // a known type make-model does not write
  expect_model_error([&] { write_synthetic_model(find_synthetic_shape("tiny-llama"), q8k, path); },
               ErrorCode::invalid_argument, "--type");
}

class SyntheticModelLoad : public ::testing::TestWithParam<std::tuple<const char*, GgmlType>> {};

TEST_P(SyntheticModelLoad, LoadsAndGenerates) {
  const auto [name, type] = GetParam();
  const SyntheticShape& shape = find_synthetic_shape(name);
  const std::string path = testing::temp_dir() + "/" + name + "-" + std::string(type_name(type)) + ".gguf";
  SyntheticOptions opt;
  opt.type = type;
  opt.n_threads = 2;
  const std::uint64_t bytes = write_synthetic_model(shape, opt, path);
  EXPECT_GT(bytes, 0u);

  auto model = Model::load(path);
  const ModelConfig& c = model->config();
  EXPECT_EQ(c.architecture, shape.architecture);
  EXPECT_EQ(c.n_layers, shape.n_layers);
  EXPECT_EQ(c.d_model, shape.d_model);
  EXPECT_EQ(c.n_kv_heads, shape.n_kv_heads);
  EXPECT_EQ(c.vocab_size, shape.vocab_size);
  EXPECT_EQ(c.qkv_bias, shape.architecture == "qwen2");
  EXPECT_EQ(model->weights().layers[0].wq.type, type);
  EXPECT_EQ(model->weights().token_embedding.type, type);
  EXPECT_EQ(model->weights().layers[0].attn_norm.type, GgmlType::F32);

  const Tokenizer& tok = model->tokenizer();
  const std::string text = "Hello world, the cat sat on the mat.\n";
  const auto ids = tok.encode(text);
  EXPECT_LT(ids.size(), text.size()) << "merges should join some bytes";
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_TRUE(tok.is_end_of_generation(*tok.find("<|im_end|>")));

  Engine engine(*model, EngineOptions{2});
  auto session = engine.new_session(64);
  const auto logits = engine.forward(*session, ids);
  for (const float x : logits) ASSERT_TRUE(std::isfinite(x));
  GenerateOptions g;
  g.max_new_tokens = 8;
  g.stop_at_end_of_generation = false;
  const GenerateResult r = generate(engine, *session, std::span<const TokenId>(&ids.back(), 1), g);
  EXPECT_EQ(r.tokens.size(), 8u);
}

INSTANTIATE_TEST_SUITE_P(SyntheticTypes, SyntheticModelLoad,
                         ::testing::Values(std::tuple{"tiny-llama", GgmlType::Q8_0},
                                           std::tuple{"tiny-llama", GgmlType::Q4_0},
                                           std::tuple{"tiny-llama", GgmlType::F16},
                                           std::tuple{"tiny-qwen2", GgmlType::Q8_0},
                                           std::tuple{"tiny-qwen2", GgmlType::Q4_0},
                                           std::tuple{"tiny-qwen3", GgmlType::Q4_K},
                                           std::tuple{"tiny-phi3", GgmlType::Q5_K},
                                           std::tuple{"tiny-gemma3", GgmlType::Q8_0}));

TEST(SyntheticModel, SameSeedSameBytesAtAnyThreadCount) {
  const std::string dir = testing::temp_dir();
  SyntheticShape shape = find_synthetic_shape("tiny-qwen2");
  SyntheticOptions opt;
  opt.type = GgmlType::Q4_0;
  opt.seed = 7;
  opt.n_threads = 1;
  write_synthetic_model(shape, opt, dir + "/a.gguf");
  opt.n_threads = 2;
  write_synthetic_model(shape, opt, dir + "/b.gguf");
  opt.seed = 8;
  write_synthetic_model(shape, opt, dir + "/c.gguf");
  const std::string a = file_contents(dir + "/a.gguf");
  EXPECT_EQ(a, file_contents(dir + "/b.gguf"));
  EXPECT_NE(a, file_contents(dir + "/c.gguf"));
}

TEST(SyntheticModel, WeightsLookLikeARealInit) {
  const std::string path = testing::temp_dir() + "/f16.gguf";
  SyntheticOptions opt;
  opt.type = GgmlType::F16;
  write_synthetic_model(find_synthetic_shape("tiny-llama"), opt, path);
  auto model = Model::load(path);
  const TensorView& w = model->weights().layers[0].w_up;
  std::vector<float> row(static_cast<std::size_t>(w.cols()));
  double sum = 0, sq = 0;
  for (std::int64_t r = 0; r < w.rows(); ++r) {
    kernels::dequantize_row_ref(w.type, w.row(r), row.data(), w.cols());
    for (const float x : row) {
      sum += x;
      sq += static_cast<double>(x) * x;
    }
  }
  const double n = static_cast<double>(w.n_elements());
  EXPECT_NEAR(sum / n, 0.0, 0.002);
  EXPECT_NEAR(std::sqrt(sq / n), 0.02, 0.002);
  const TensorView& norm = model->weights().layers[0].attn_norm;
  EXPECT_EQ(reinterpret_cast<const float*>(norm.data)[0], 1.0f);
}

}  // namespace
}  // namespace qkvshare
