// Model-level validation: llama2.c checkpoints and GGUF architectures whose
// header, tensors or shapes are wrong get a clear error naming file and item.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <random>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/engine.hpp"
#include "qkvshare/kernels/quant.hpp"
#include "qkvshare/model/gguf.hpp"
#include "qkvshare/model/model.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string write_bytes(const std::vector<std::uint8_t>& bytes, const std::string& name) {
  const std::string path = testing::temp_dir() + "/" + name;
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                              static_cast<std::streamsize>(bytes.size()));
  return path;
}

// Expects Model::load to throw `code` with every `parts` in the message.
void expect_load_error(const std::string& path, const std::string& tok, ErrorCode code,
                       const std::vector<std::string>& parts) {
  try {
    Model::load(path, tok);
    FAIL() << "loaded " << path;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

class Llama2cFile : public ::testing::Test {
 protected:
  std::string tok_ = testing::shared_path("models/tok512.bin");
  std::vector<std::uint8_t> good_ = read_bytes(testing::shared_path("models/stories260K.bin"));
  std::string with_header_field(int index, std::int32_t value, const std::string& name) {
    auto bytes = good_;
    std::memcpy(bytes.data() + 4 * index, &value, 4);
    return write_bytes(bytes, name);
  }
};

TEST_F(Llama2cFile, LoadsStories260K) {
  auto m = Model::load(testing::shared_path("models/stories260K.bin"), tok_);
  const auto& c = m->config();
  EXPECT_EQ(c.d_model, 64);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.context_length, 512);
  EXPECT_EQ(m->format(), "llama2c");
  EXPECT_EQ(m->weights().output.data, m->weights().token_embedding.data);  // shared classifier
}

TEST_F(Llama2cFile, TruncatedNamesTheTensor) {
  auto bytes = good_;
  bytes.resize(bytes.size() / 2);
  expect_load_error(write_bytes(bytes, "half.bin"), tok_, ErrorCode::bad_model_file, {"half.bin", "truncated"});
  bytes.resize(20);
  expect_load_error(write_bytes(bytes, "tiny.bin"), tok_, ErrorCode::bad_model_file, {"tiny.bin", "too short"});
}

TEST_F(Llama2cFile, TrailingBytesAreRejected) {
  auto bytes = good_;
  bytes.resize(bytes.size() + 8);
  expect_load_error(write_bytes(bytes, "long.bin"), tok_, ErrorCode::bad_model_file, {"long.bin", "trailing"});
}

TEST_F(Llama2cFile, AbsurdHeaderFields) {
  expect_load_error(with_header_field(0, 0, "dim0.bin"), tok_, ErrorCode::bad_model_file, {"dim0.bin", "dim"});
  expect_load_error(with_header_field(0, -64, "dimneg.bin"), tok_, ErrorCode::bad_model_file, {"dim"});
  expect_load_error(with_header_field(2, 1 << 30, "layers.bin"), tok_, ErrorCode::bad_model_file, {"n_layers"});
  expect_load_error(with_header_field(3, 7, "heads.bin"), tok_, ErrorCode::bad_model_file, {"n_heads"});
  expect_load_error(with_header_field(4, 3, "kv.bin"), tok_, ErrorCode::bad_model_file, {"n_kv_heads"});
  expect_load_error(with_header_field(5, 1 << 30, "vocab.bin"), tok_, ErrorCode::bad_model_file, {"vocab_size"});
  expect_load_error(with_header_field(6, 0, "seq.bin"), tok_, ErrorCode::bad_model_file, {"seq_len"});
  // Consistent-looking but wrong sizes: the file no longer matches the header.
  expect_load_error(with_header_field(1, 180, "hidden.bin"), tok_, ErrorCode::bad_model_file, {"hidden.bin"});
}

// Not GGUF, so read as llama2.c (which has no magic): a file that starts with
// another format's magic, or a damaged GGUF magic, is named by it.
TEST_F(Llama2cFile, AnotherFormatsMagicIsNamed) {
  for (const char* magic : {"GGUX", "ggjt", "GGML"}) {
    auto bytes = good_;
    std::memcpy(bytes.data(), magic, 4);
    expect_load_error(write_bytes(bytes, "magic.bin"), tok_, ErrorCode::bad_model_file,
                      {"magic.bin", std::string("starts with '") + magic + "'", "neither GGUF"});
  }
}

TEST_F(Llama2cFile, MissingTokenizerIsNamed) {
  expect_load_error(testing::shared_path("models/stories260K.bin"), "", ErrorCode::invalid_argument, {"-t"});
  expect_load_error(testing::shared_path("models/stories260K.bin"), "/nonexistent/tok.bin", ErrorCode::io,
                    {"/nonexistent/tok.bin"});
}

TEST_F(Llama2cFile, RandomHeaderCorruptionNeverCrashes) {
  std::mt19937 rng(1234);
  for (int i = 0; i < 100; ++i) {
    auto bytes = good_;
    const int field = static_cast<int>(rng() % 7);
    const auto value = static_cast<std::int32_t>(rng());
    std::memcpy(bytes.data() + 4 * field, &value, 4);
    const std::string path = write_bytes(bytes, "fuzz.bin");
    try {
      Model::load(path, tok_);
    } catch (const Error&) {
    }
  }
}

// A tiny GGUF `llama` model with a SentencePiece vocabulary, built with the writer.
struct TinyGguf {
  int d = 32, ff = 64, heads = 4, kv_heads = 2, layers = 2;
  std::string arch = "llama";
  GgmlType matrix_type = GgmlType::Q8_0;
  std::map<std::string, double> overrides;  // replaces the value of a numeric key
  std::map<std::string, double> extra_f32;  // more float keys (caps, scaling factor)
  std::map<std::string, std::uint32_t> extra_u32;  // more integer keys (sliding window)
  std::map<std::string, std::string> extra_strings;
  std::string skip_tensor;
  std::string bad_shape_tensor;
  std::string chat_template;  // tokenizer.chat_template when set

  std::string write(const std::string& name) const {
    GgufWriter w;
    auto u32 = [&](const std::string& key, double v) {
      w.set_u32(key, static_cast<std::uint32_t>(overrides.count(key) ? overrides.at(key) : v));
    };
    auto f32 = [&](const std::string& key, double v) {
      w.set_f32(key, static_cast<float>(overrides.count(key) ? overrides.at(key) : v));
    };
    w.set_string("general.architecture", arch);
    u32(arch + ".block_count", layers);
    u32(arch + ".embedding_length", d);
    u32(arch + ".feed_forward_length", ff);
    u32(arch + ".attention.head_count", heads);
    u32(arch + ".attention.head_count_kv", kv_heads);
    u32(arch + ".context_length", 128);
    f32(arch + ".attention.layer_norm_rms_epsilon", 1e-5);
    f32(arch + ".rope.freq_base", 10000.0);
    for (const auto& [key, v] : extra_f32) w.set_f32(key, static_cast<float>(v));
    for (const auto& [key, v] : extra_u32) w.set_u32(key, v);
    for (const auto& [key, v] : extra_strings) w.set_string(key, v);
    std::vector<std::string> tokens{"<unk>", "<s>", "</s>"};
    std::vector<float> scores{0, 0, 0};
    std::vector<std::int32_t> types{2, 3, 3};
    for (int b = 0; b < 256; ++b) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "<0x%02X>", b);
      tokens.emplace_back(buf);
      scores.push_back(0);
      types.push_back(6);
    }
    for (const char* piece : {"\xe2\x96\x81", "a", "b", "\xe2\x96\x81" "a"}) {
      tokens.emplace_back(piece);
      scores.push_back(-1.0f);
      types.push_back(1);
    }
    const int vocab = static_cast<int>(tokens.size());
    w.set_string("tokenizer.ggml.model", "llama");
    w.set_string_array("tokenizer.ggml.tokens", tokens);
    w.set_f32_array("tokenizer.ggml.scores", scores);
    w.set_i32_array("tokenizer.ggml.token_type", types);
    w.set_u32("tokenizer.ggml.bos_token_id", 1);
    w.set_u32("tokenizer.ggml.eos_token_id", 2);
    if (!chat_template.empty()) w.set_string("tokenizer.chat_template", chat_template);

    std::mt19937 rng(7);
    std::normal_distribution<float> dist(0.0f, 0.1f);
    auto add = [&](const std::string& tname, GgmlType type, std::int64_t cols, std::int64_t rows) {
      if (tname == skip_tensor) return;
      if (tname == bad_shape_tensor) cols += 32;
      std::vector<float> v(static_cast<std::size_t>(cols * rows));
      for (auto& x : v) x = type == GgmlType::F32 ? 1.0f : dist(rng);
      const std::size_t row_bytes =
          static_cast<std::size_t>(cols / type_traits(type).block_size) * type_traits(type).type_size;
      std::vector<std::uint8_t> bytes(row_bytes * static_cast<std::size_t>(rows));
      for (std::int64_t r = 0; r < rows; ++r)
        kernels::quantize_row_ref(type, &v[static_cast<std::size_t>(r * cols)], &bytes[static_cast<std::size_t>(r) * row_bytes], cols);
      std::vector<std::int64_t> shape{cols};
      if (rows > 1 || type != GgmlType::F32) shape.push_back(rows);
      w.add_tensor(tname, type, shape, std::move(bytes));
    };
    const int hd = d / heads;
    add("token_embd.weight", matrix_type, d, vocab);
    add("output_norm.weight", GgmlType::F32, d, 1);
    for (int l = 0; l < layers; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      add(p + "attn_norm.weight", GgmlType::F32, d, 1);
      add(p + "attn_q.weight", matrix_type, d, heads * hd);
      add(p + "attn_k.weight", matrix_type, d, kv_heads * hd);
      add(p + "attn_v.weight", matrix_type, d, kv_heads * hd);
      add(p + "attn_output.weight", matrix_type, heads * hd, d);
      add(p + "ffn_norm.weight", GgmlType::F32, d, 1);
      add(p + "ffn_gate.weight", matrix_type, d, ff);
      add(p + "ffn_up.weight", matrix_type, d, ff);
      add(p + "ffn_down.weight", matrix_type, ff, d);
      if (arch == "gemma3") {
        add(p + "attn_q_norm.weight", GgmlType::F32, hd, 1);
        add(p + "attn_k_norm.weight", GgmlType::F32, hd, 1);
        add(p + "post_attention_norm.weight", GgmlType::F32, d, 1);
        add(p + "post_ffw_norm.weight", GgmlType::F32, d, 1);
      }
    }
    const std::string path = testing::temp_dir() + "/" + name;
    w.write(path);
    return path;
  }
};

TEST(GgufModel, TinyModelLoadsForEveryWeightType) {
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1}) {
    TinyGguf g;
    g.matrix_type = t;
    auto m = Model::load(g.write("tiny.gguf"));
    EXPECT_EQ(m->config().vocab_size, 263);
    EXPECT_EQ(m->config().head_dim, 8);
    EXPECT_EQ(m->weights().output.name, "token_embd.weight");  // tied
  }
  for (GgmlType t : {GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::IQ4_NL}) {
    TinyGguf g;
    g.matrix_type = t;
    EXPECT_NO_THROW(Model::load(g.write("tiny32.gguf"))) << type_name(t);
  }
  for (GgmlType t : {GgmlType::Q6_K, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::IQ4_XS}) {
    TinyGguf k;  // k-quants need rows of 256
    k.d = 256;
    k.ff = 512;
    k.matrix_type = t;
    EXPECT_NO_THROW(Model::load(k.write("tiny256.gguf"))) << type_name(t);
  }
}

TEST(GgufModel, ChatTemplateFromTheFileOrAFlag) {
  TinyGguf none;
  EXPECT_EQ(Model::load(none.write("none.gguf"))->chat_template().family(), ChatFamily::plain);  // no template, no ChatML tokens
  TinyGguf llama3;
  llama3.chat_template = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}";
  const auto m = Model::load(llama3.write("llama3.gguf"));
  EXPECT_EQ(m->chat_template().family(), ChatFamily::llama3);
  EXPECT_EQ(m->chat_template("gemma").family(), ChatFamily::gemma);  // the flag wins
  TinyGguf odd;
  odd.chat_template = "{{ message.content }}### Response:";
  const auto o = Model::load(odd.write("odd.gguf"));
  EXPECT_EQ(o->chat_template("chatml").family(), ChatFamily::chatml);
  try {
    (void)o->chat_template();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    for (const char* part : {"odd.gguf", "tokenizer.chat_template", "--chat-template"})
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(GgufModel, UnsupportedArchitectureIsNamed) {
  TinyGguf g;
  g.arch = "mamba";
  expect_load_error(g.write("mamba.gguf"), "", ErrorCode::bad_model_file, {"mamba.gguf", "general.architecture", "mamba"});
}

TEST(GgufModel, MissingTensorIsNamed) {
  TinyGguf g;
  g.skip_tensor = "blk.1.ffn_up.weight";
  expect_load_error(g.write("missing.gguf"), "", ErrorCode::bad_model_file, {"missing.gguf", "blk.1.ffn_up.weight"});
}

TEST(GgufModel, WrongShapeIsNamed) {
  TinyGguf g;
  g.bad_shape_tensor = "blk.0.attn_k.weight";
  expect_load_error(g.write("shape.gguf"), "", ErrorCode::bad_model_file, {"shape.gguf", "blk.0.attn_k.weight", "shape"});
}

TEST(GgufModel, MissingOrAbsurdHyperparameters) {
  TinyGguf g;
  g.overrides["llama.attention.head_count"] = 5;
  expect_load_error(g.write("heads.gguf"), "", ErrorCode::bad_model_file, {"heads.gguf", "head_count"});
  TinyGguf h;
  h.overrides["llama.block_count"] = 0;
  expect_load_error(h.write("blocks.gguf"), "", ErrorCode::bad_model_file, {"blocks.gguf", "llama.block_count"});
  TinyGguf e;
  e.overrides["llama.attention.layer_norm_rms_epsilon"] = -1.0;
  expect_load_error(e.write("eps.gguf"), "", ErrorCode::bad_model_file, {"eps.gguf", "epsilon"});
}

TEST(GgufModel, Gemma3InterleavesSlidingWindowLayers) {
  TinyGguf g;
  g.arch = "gemma3";
  g.layers = 7;
  g.extra_u32["gemma3.attention.sliding_window"] = 16;
  g.overrides["gemma3.rope.freq_base"] = 1e6;
  g.extra_strings["gemma3.rope.scaling.type"] = "linear";
  g.extra_f32["gemma3.rope.scaling.factor"] = 8;
  const auto m = Model::load(g.write("gemma3.gguf"));
  const ModelConfig& c = m->config();
  EXPECT_TRUE(c.embed_scale && c.post_norms && c.gelu && c.qk_norm);
  EXPECT_EQ(c.layer_window, (std::vector<int>{16, 16, 16, 16, 16, 0, 16}));  // the 6th layer of each run is global
  EXPECT_EQ(c.rope_theta_local, 10000.0f);
  EXPECT_EQ(c.rope_scale_local, 1.0f);
  EXPECT_EQ(c.rope_scale, 8.0f);
  EXPECT_TRUE(c.layered_rope());
  EXPECT_TRUE(m->weights().layers[3].ffn_post_norm.has_value());
}

TEST(GgufModel, Gemma3NeedsItsWindowAndPostNorms) {
  TinyGguf g;
  g.arch = "gemma3";
  expect_load_error(g.write("nowindow.gguf"), "", ErrorCode::bad_model_file,
                    {"nowindow.gguf", "gemma3.attention.sliding_window", "missing"});
  TinyGguf n;
  n.arch = "gemma3";
  n.extra_u32["gemma3.attention.sliding_window"] = 16;
  n.skip_tensor = "blk.1.post_ffw_norm.weight";
  expect_load_error(n.write("nonorm.gguf"), "", ErrorCode::bad_model_file, {"nonorm.gguf", "blk.1.post_ffw_norm.weight"});
}

TEST(GgufModel, RopeScalingSlidingWindowAndSoftCapsOfOtherFiles) {
  TinyGguf yarn;
  yarn.extra_strings["llama.rope.scaling.type"] = "yarn";
  expect_load_error(yarn.write("yarn.gguf"), "", ErrorCode::unsupported, {"yarn.gguf", "llama.rope.scaling.type", "yarn"});
  TinyGguf cap;
  cap.extra_f32["llama.attn_logit_softcapping"] = 50;
  expect_load_error(cap.write("cap.gguf"), "", ErrorCode::unsupported, {"cap.gguf", "attn_logit_softcapping"});
  TinyGguf bad;
  bad.extra_strings["llama.rope.scaling.type"] = "linear";
  bad.extra_f32["llama.rope.scaling.factor"] = 0.5;
  expect_load_error(bad.write("factor.gguf"), "", ErrorCode::bad_model_file, {"factor.gguf", "rope.scaling.factor"});
  TinyGguf ok;
  ok.extra_strings["llama.rope.scaling.type"] = "linear";
  ok.extra_f32["llama.rope.scaling.factor"] = 4;
  ok.extra_f32["llama.final_logit_softcapping"] = 30;
  ok.extra_u32["llama.attention.sliding_window"] = 8;  // a Mistral-style window: every layer
  ok.extra_f32["llama.rope.freq_base_swa"] = 5000;       // the windowed layers' own base, when written
  const auto m = Model::load(ok.write("scaled.gguf"));
  EXPECT_EQ(m->config().rope_scale, 4.0f);
  EXPECT_EQ(m->config().rope_scale_local, 4.0f);
  EXPECT_EQ(m->config().final_softcap, 30.0f);
  EXPECT_EQ(m->config().layer_window, (std::vector<int>{8, 8}));
  EXPECT_EQ(m->config().rope_theta_local, 5000.0f);
  EXPECT_FALSE(m->config().layered_rope());  // every layer windowed: one RoPE
}

// final_logit_softcapping: the logits of a file that has it are cap * tanh(z / cap)
// of the same file's without it (the rest of the pass is the same).
TEST(GgufModel, FinalSoftCapBoundsTheLogits) {
  TinyGguf plain, capped;
  plain.matrix_type = capped.matrix_type = GgmlType::F32;
  capped.extra_f32["llama.final_logit_softcapping"] = 0.5;  // small, so that it bends these logits
  const auto a = Model::load(plain.write("plain.gguf")), b = Model::load(capped.write("capped.gguf"));
  Engine ea(*a, EngineOptions{1}), eb(*b, EngineOptions{1});
  auto sa = ea.new_session(16), sb = eb.new_session(16);
  const std::vector<TokenId> ids{1, 70, 200, 262};
  const auto la = ea.forward(*sa, ids, true);
  const auto lb = eb.forward(*sb, ids, true);
  ASSERT_EQ(la.size(), lb.size());
  float widest = 0.0f;
  for (std::size_t i = 0; i < la.size(); ++i) {
    widest = std::max(widest, std::abs(la[i]));
    ASSERT_LE(std::abs(lb[i]), 0.5f);  // tanh reaches 1 in float for large logits
    EXPECT_NEAR(lb[i], 0.5f * std::tanh(la[i] / 0.5f), 1e-6f) << i;
  }
  EXPECT_GT(widest, 0.5f) << "the cap never bent a logit: the test checks nothing";
}

}  // namespace
}  // namespace qkvshare
