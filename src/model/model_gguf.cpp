// Maps a GGUF file's metadata and tensors onto ModelConfig / ModelWeights for
// the `llama` and `qwen2` architectures.
#include <cmath>

#include "qkvshare/core/error.hpp"
#include "qkvshare/model/gguf.hpp"
#include "qkvshare/model/model.hpp"

namespace qkvshare {

namespace {

int get_dim(const GgufFile& f, const std::string& key, std::int64_t lo, std::int64_t hi) {
  const std::int64_t v = f.get_int(key);
  if (v < lo || v > hi)
    fail(ErrorCode::bad_model_file, "{}: {}: value {} is outside [{}, {}]", f.path(), key, v, lo, hi);
  return static_cast<int>(v);
}

}  // namespace

std::unique_ptr<Model> Model::load_gguf(const std::string& path, MappedFile::Mode mode) {
  auto model = std::unique_ptr<Model>(new Model());
  model->path_ = path;
  model->format_ = "gguf";
  model->gguf_ = GgufFile::open(path, mode);
  const GgufFile& f = *model->gguf_;

  ModelConfig& c = model->config_;
  c.architecture = f.get_string("general.architecture");
  if (c.architecture != "llama" && c.architecture != "qwen2")
    fail(ErrorCode::bad_model_file, "{}: general.architecture: '{}' is not supported (llama, qwen2 are)", path,
         c.architecture);
  const std::string a = c.architecture + ".";
  c.name = f.find_string("general.name").value_or(c.architecture);
  c.n_layers = get_dim(f, a + "block_count", 1, 1024);
  c.d_model = get_dim(f, a + "embedding_length", 1, 1 << 16);
  c.d_ff = get_dim(f, a + "feed_forward_length", 1, 1 << 18);
  c.n_heads = get_dim(f, a + "attention.head_count", 1, c.d_model);
  c.n_kv_heads = f.has(a + "attention.head_count_kv") ? get_dim(f, a + "attention.head_count_kv", 1, c.n_heads)
                                                       : c.n_heads;
  c.context_length = get_dim(f, a + "context_length", 1, 1 << 22);
  c.rms_eps = static_cast<float>(f.get_float(a + "attention.layer_norm_rms_epsilon"));
  c.rope_theta = static_cast<float>(f.find_float(a + "rope.freq_base").value_or(10000.0));
  if (!(c.rms_eps > 0.0f && c.rms_eps < 1.0f))
    fail(ErrorCode::bad_model_file, "{}: {}attention.layer_norm_rms_epsilon: {} is not in (0, 1)", path, a, c.rms_eps);
  if (!(c.rope_theta > 1.0f && std::isfinite(c.rope_theta)))
    fail(ErrorCode::bad_model_file, "{}: {}rope.freq_base: {} is not a valid RoPE base", path, a, c.rope_theta);
  if (c.d_model % c.n_heads != 0)
    fail(ErrorCode::bad_model_file, "{}: embedding_length {} is not a multiple of head_count {}", path, c.d_model,
         c.n_heads);
  if (c.n_heads % c.n_kv_heads != 0)
    fail(ErrorCode::bad_model_file, "{}: head_count {} is not a multiple of head_count_kv {}", path, c.n_heads,
         c.n_kv_heads);
  c.head_dim = c.d_model / c.n_heads;
  if (auto rope_dims = f.find_int(a + "rope.dimension_count"); rope_dims && *rope_dims != c.head_dim)
    fail(ErrorCode::unsupported, "{}: {}rope.dimension_count {} != head size {} (partial RoPE is not supported)", path,
         a, *rope_dims, c.head_dim);
  if (c.head_dim % 2 != 0) fail(ErrorCode::bad_model_file, "{}: head size {} must be even for RoPE", path, c.head_dim);
  c.rope_style = c.architecture == "qwen2" ? RopeStyle::neox : RopeStyle::interleaved;
  c.qkv_bias = c.architecture == "qwen2";

  ModelWeights& w = model->weights_;
  w.token_embedding = f.tensor("token_embd.weight");
  if (w.token_embedding.rows() < 1 || w.token_embedding.rows() > (1 << 22))
    fail(ErrorCode::bad_model_file, "{}: tensor 'token_embd.weight': {} rows is not a vocabulary size", path,
         w.token_embedding.rows());
  c.vocab_size = static_cast<int>(w.token_embedding.rows());
  w.output_norm = f.tensor("output_norm.weight");
  const TensorView* out = f.find_tensor("output.weight");
  w.output = out != nullptr ? *out : w.token_embedding;
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    LayerWeights lw;
    lw.attn_norm = f.tensor(p + "attn_norm.weight");
    lw.wq = f.tensor(p + "attn_q.weight");
    lw.wk = f.tensor(p + "attn_k.weight");
    lw.wv = f.tensor(p + "attn_v.weight");
    lw.wo = f.tensor(p + "attn_output.weight");
    lw.ffn_norm = f.tensor(p + "ffn_norm.weight");
    lw.w_gate = f.tensor(p + "ffn_gate.weight");
    lw.w_up = f.tensor(p + "ffn_up.weight");
    lw.w_down = f.tensor(p + "ffn_down.weight");
    if (c.qkv_bias) {
      lw.bq = f.tensor(p + "attn_q.bias");
      lw.bk = f.tensor(p + "attn_k.bias");
      lw.bv = f.tensor(p + "attn_v.bias");
    }
    w.layers.push_back(std::move(lw));
  }
  model->tokenizer_ = load_gguf_tokenizer(f);
  return model;
}

}  // namespace qkvshare
