#pragma once
// A loaded model: architecture, weights (views into the mapped file) and
// tokenizer. Loaded once and shared read-only by every session and agent.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qkvshare/core/mapped_file.hpp"
#include "qkvshare/tensor/tensor.hpp"
#include "qkvshare/model/tokenizer.hpp"

namespace qkvshare {

class GgufFile;

struct ModelConfig {
  std::string architecture;  // "llama", "qwen2"
  std::string name;
  int n_layers = 0;
  int d_model = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int d_ff = 0;
  int vocab_size = 0;
  int context_length = 0;
  float rms_eps = 1e-5f;
  float rope_theta = 10000.0f;
  RopeStyle rope_style = RopeStyle::interleaved;
  bool qkv_bias = false;

  int q_dim() const noexcept { return n_heads * head_dim; }
  int kv_dim() const noexcept { return n_kv_heads * head_dim; }
};

struct LayerWeights {
  TensorView attn_norm, wq, wk, wv, wo;
  std::optional<TensorView> bq, bk, bv;  // qwen2
  TensorView ffn_norm, w_gate, w_up, w_down;
};

struct ModelWeights {
  TensorView token_embedding;  // [vocab rows, d_model cols]
  std::vector<LayerWeights> layers;
  TensorView output_norm;
  TensorView output;  // [vocab rows, d_model cols]; the embedding when tied
};

class Model {
 public:
  // Detects the format from the file's magic ("GGUF", else llama2.c).
  // llama2.c checkpoints need `tokenizer_path`; GGUF files carry their own.
  // Throws Error(bad_model_file / bad_tokenizer / io) naming file, item, reason.
  static std::unique_ptr<Model> load(const std::string& path, const std::string& tokenizer_path = {},
                                     MappedFile::Mode mode = MappedFile::Mode::shared);
  ~Model();

  const ModelConfig& config() const noexcept { return config_; }
  const ModelWeights& weights() const noexcept { return weights_; }
  const Tokenizer& tokenizer() const noexcept { return *tokenizer_; }
  const std::string& path() const noexcept { return path_; }
  const std::string& format() const noexcept { return format_; }  // "gguf" or "llama2c"
  // Bytes of weight data the forward pass reads per token.
  std::size_t weight_bytes() const noexcept;

 private:
  Model();
  static std::unique_ptr<Model> load_gguf(const std::string& path, MappedFile::Mode mode);
  static std::unique_ptr<Model> load_llama2c(const std::string& path, const std::string& tokenizer_path,
                                             MappedFile::Mode mode);
  void validate() const;

  std::string path_;
  std::string format_;
  ModelConfig config_;
  ModelWeights weights_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<GgufFile> gguf_;
  MappedFile llama2c_file_;
};

}  // namespace qkvshare
