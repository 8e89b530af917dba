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
  std::string architecture;  // general.architecture (model/architecture.hpp lists them)
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
  bool qk_norm = false;  // RMSNorm of each q and k head before RoPE (qwen3, gemma3)
  bool embed_scale = false;  // embeddings times sqrt(d_model) (gemma3)
  bool post_norms = false;   // RMSNorm of attention and FFN outputs before the residual add (gemma3)
  bool gelu = false;         // GeGLU instead of SwiGLU (gemma3)
  // Linear RoPE scaling ({arch}.rope.scaling.type linear): positions divided
  // by this factor in the layers that attend to the whole context.
  float rope_scale = 1.0f;
  // Sliding-window layers: layer_window[l] > 0 is the number of most recent
  // tokens layer l attends to (itself included); 0 is the whole context.
  // Those layers use RoPE base rope_theta_local and scale rope_scale_local
  // (gemma3: 10000, unscaled; otherwise the global ones).
  std::vector<int> layer_window;
  float rope_theta_local = 10000.0f;
  float rope_scale_local = 1.0f;
  // tanh soft-capping of the logits ({arch}.final_logit_softcapping), 0: none.
  float final_softcap = 0.0f;

  int q_dim() const noexcept { return n_heads * head_dim; }
  int kv_dim() const noexcept { return n_kv_heads * head_dim; }
  int window(int layer) const noexcept {
    return layer_window.empty() ? 0 : layer_window[static_cast<std::size_t>(layer)];
  }
  // Whether layers rotate with different frequencies (local and global RoPE).
  bool layered_rope() const noexcept;
};

struct LayerWeights {
  TensorView attn_norm, wq, wk, wv, wo;
  std::optional<TensorView> bq, bk, bv;  // qwen2
  std::optional<TensorView> q_norm, k_norm;  // qwen3, gemma3: [head_dim]
  std::optional<TensorView> attn_post_norm, ffn_post_norm;  // gemma3: [d_model]
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
  // The Jinja source of tokenizer.chat_template ("" when the file has none).
  const std::string& chat_template_source() const noexcept { return chat_template_; }
  // The chat template to use: the family named by `name` when given, else the
  // one recognised in tokenizer.chat_template, else ChatML when the vocabulary
  // has <|im_start|>, else plain lines (llama2.c models). Throws
  // Error(unsupported) naming the file and key when the file's template is not
  // recognised, Error(invalid_argument) for an unknown name.
  ChatTemplate chat_template(std::string_view name = {}, bool thinking = true) const;
  // Bytes of weight data the forward pass reads per token.
  std::size_t weight_bytes() const noexcept;
  // Bytes of the packed copies of matmul weights (kernels/packed_weights.hpp)
  // made at load for the active kernel level; 0 when none.
  std::size_t packed_bytes() const noexcept;

 private:
  Model();
  static std::unique_ptr<Model> load_gguf(const std::string& path, MappedFile::Mode mode);
  static std::unique_ptr<Model> load_llama2c(const std::string& path, const std::string& tokenizer_path,
                                             MappedFile::Mode mode);
  void validate() const;
  void pack_weights();
  void copy_small_tensors();
  const MappedFile& weights_file() const noexcept;  // the file the weight views point into

  std::string path_;
  std::string format_;
  ModelConfig config_;
  ModelWeights weights_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::string chat_template_;
  std::unique_ptr<GgufFile> gguf_;
  MappedFile llama2c_file_;
  struct FreeAligned {
    void operator()(std::uint8_t* p) const noexcept;
  };
  // Copies of weights made at load (packed matrices, small tensors): the views point into them.
  std::vector<std::unique_ptr<std::uint8_t[], FreeAligned>> owned_;
  std::size_t packed_bytes_ = 0;
};

}  // namespace qkvshare
