// Maps a GGUF file's metadata and tensors onto ModelConfig / ModelWeights for
// the architectures of model/architecture.hpp.
#include <cmath>

#include "qkvshare/core/error.hpp"
#include "qkvshare/model/architecture.hpp"
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

// Rows [r0, r0 + n) of a matrix, as a view of their own (the parts of phi3's fused tensors).
TensorView row_range(const std::string& path, const TensorView& t, std::int64_t r0, std::int64_t n,
                     const std::string& name) {
  if (t.n_dims != 2 || r0 + n > t.rows())
    fail(ErrorCode::bad_model_file, "{}: tensor '{}': {} rows, need {} for the fused parts", path, t.name, t.rows(),
         r0 + n);
  TensorView v = t;
  v.name = name;
  v.ne = {t.ne[0], n, 1, 1};
  v.data = t.data + static_cast<std::size_t>(r0) * t.row_bytes();
  v.nbytes = static_cast<std::size_t>(n) * t.row_bytes();
  return v;
}

// {arch}.rope.scaling.type: "linear" divides positions by the factor (the
// global layers of Gemma 3 4B and larger); YaRN and the like are refused.
void read_rope_scaling(const GgufFile& f, const std::string& a, ModelConfig& c) {
  const auto type = f.find_string(a + "rope.scaling.type");
  if (!type || *type == "none") return;
  if (*type != "linear")
    fail(ErrorCode::unsupported, "{}: {}rope.scaling.type '{}' is not supported (none and linear are)", f.path(), a,
         *type);
  const double factor = f.find_float(a + "rope.scaling.factor").value_or(1.0);
  if (!(factor >= 1.0 && factor <= 1024.0))
    fail(ErrorCode::bad_model_file, "{}: {}rope.scaling.factor: {} is outside [1, 1024]", f.path(), a, factor);
  c.rope_scale = static_cast<float>(factor);
}

// {arch}.attention.sliding_window: every layer of a llama/mistral file that
// has it, the local layers of an interleaved architecture (ArchTraits).
void read_sliding_window(const GgufFile& f, const std::string& a, const ArchTraits& arch, ModelConfig& c) {
  const std::string key = a + "attention.sliding_window";
  if (!f.has(key)) {
    if (arch.swa_pattern > 0)
      fail(ErrorCode::bad_model_file, "{}: {}: missing ({} interleaves sliding-window layers)", f.path(), key, arch.name);
    return;
  }
  const int window = get_dim(f, key, 0, 1 << 22);
  if (window == 0) return;
  c.layer_window.assign(static_cast<std::size_t>(c.n_layers), window);
  c.rope_theta_local = c.rope_theta;
  c.rope_scale_local = c.rope_scale;
  if (arch.swa_pattern > 0) {
    c.rope_scale_local = 1.0f;
    for (int l = 0; l < c.n_layers; ++l)
      if (l % arch.swa_pattern == arch.swa_pattern - 1) c.layer_window[static_cast<std::size_t>(l)] = 0;
    c.rope_theta_local = arch.swa_rope_base;
  }
  // Newer converters write the local base explicitly.
  if (auto base = f.find_float(a + "rope.freq_base_swa")) {
    if (!(*base > 1.0 && std::isfinite(*base)))
      fail(ErrorCode::bad_model_file, "{}: {}rope.freq_base_swa: {} is not a valid RoPE base", f.path(), a, *base);
    c.rope_theta_local = static_cast<float>(*base);
  }
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
  const ArchTraits* arch = find_architecture(c.architecture);
  if (arch == nullptr)
    fail(ErrorCode::bad_model_file, "{}: general.architecture: '{}' is not supported ({} are)", path, c.architecture,
         supported_architectures());
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
  // Qwen3 and Gemma heads are wider than d_model / n_heads: the file says so.
  c.head_dim = f.has(a + "attention.key_length") ? get_dim(f, a + "attention.key_length", 2, 1024) : c.d_model / c.n_heads;
  if (f.has(a + "attention.value_length") && f.get_int(a + "attention.value_length") != c.head_dim)
    fail(ErrorCode::unsupported, "{}: {}attention.value_length {} != key_length {}", path, a,
         f.get_int(a + "attention.value_length"), c.head_dim);
  if (auto rope_dims = f.find_int(a + "rope.dimension_count"); rope_dims && *rope_dims != c.head_dim)
    fail(ErrorCode::unsupported, "{}: {}rope.dimension_count {} != head size {} (partial RoPE is not supported)", path,
         a, *rope_dims, c.head_dim);
  if (c.head_dim % 2 != 0) fail(ErrorCode::bad_model_file, "{}: head size {} must be even for RoPE", path, c.head_dim);
  c.rope_style = arch->rope;
  c.qkv_bias = arch->qkv_bias;
  c.qk_norm = arch->qk_norm;
  c.embed_scale = arch->embed_scale;
  c.post_norms = arch->post_norms;
  c.gelu = arch->gelu;
  read_rope_scaling(f, a, c);
  read_sliding_window(f, a, *arch, c);
  // Gemma 3 27B scales queries by 1/sqrt(d_model / n_heads) rather than by
  // 1/sqrt(head_dim); llama.cpp tells it by its 62 layers. The smaller ones
  // (the on-device sizes) use head_dim, as every other architecture here.
  if (arch->name == "gemma3" && c.n_layers == 62)
    fail(ErrorCode::unsupported, "{}: Gemma 3 27B (62 layers) scales attention by d_model / n_heads; not supported",
         path);
  if (auto cap = f.find_float(a + "final_logit_softcapping"); cap && *cap != 0.0) {
    if (!(*cap > 0.0 && std::isfinite(*cap)))
      fail(ErrorCode::bad_model_file, "{}: {}final_logit_softcapping: {} is not a positive number", path, a, *cap);
    c.final_softcap = static_cast<float>(*cap);
  }
  if (auto cap = f.find_float(a + "attn_logit_softcapping"); cap && *cap != 0.0)
    fail(ErrorCode::unsupported, "{}: {}attn_logit_softcapping: soft-capped attention scores (Gemma 2) are not supported",
         path, a);
  if (f.find_tensor("rope_freqs.weight") != nullptr || f.find_tensor("rope_factors_long.weight") != nullptr)
    fail(ErrorCode::unsupported, "{}: RoPE frequency factors (rope_freqs / rope_factors_*: Llama-3.1 or LongRoPE "
         "scaling) are not supported", path);

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
    if (arch->fused_qkv) {
      const TensorView& qkv = f.tensor(p + "attn_qkv.weight");
      lw.wq = row_range(path, qkv, 0, c.q_dim(), p + "attn_qkv.weight[q]");
      lw.wk = row_range(path, qkv, c.q_dim(), c.kv_dim(), p + "attn_qkv.weight[k]");
      lw.wv = row_range(path, qkv, c.q_dim() + c.kv_dim(), c.kv_dim(), p + "attn_qkv.weight[v]");
      const TensorView& gate_up = f.tensor(p + "ffn_up.weight");
      lw.w_gate = row_range(path, gate_up, 0, c.d_ff, p + "ffn_up.weight[gate]");
      lw.w_up = row_range(path, gate_up, c.d_ff, c.d_ff, p + "ffn_up.weight[up]");
    } else {
      lw.wq = f.tensor(p + "attn_q.weight");
      lw.wk = f.tensor(p + "attn_k.weight");
      lw.wv = f.tensor(p + "attn_v.weight");
      lw.w_gate = f.tensor(p + "ffn_gate.weight");
      lw.w_up = f.tensor(p + "ffn_up.weight");
    }
    lw.wo = f.tensor(p + "attn_output.weight");
    lw.ffn_norm = f.tensor(p + "ffn_norm.weight");
    lw.w_down = f.tensor(p + "ffn_down.weight");
    if (c.qkv_bias) {
      lw.bq = f.tensor(p + "attn_q.bias");
      lw.bk = f.tensor(p + "attn_k.bias");
      lw.bv = f.tensor(p + "attn_v.bias");
    }
    if (c.qk_norm) {
      lw.q_norm = f.tensor(p + "attn_q_norm.weight");
      lw.k_norm = f.tensor(p + "attn_k_norm.weight");
    }
    if (c.post_norms) {
      lw.attn_post_norm = f.tensor(p + "post_attention_norm.weight");
      lw.ffn_post_norm = f.tensor(p + "post_ffw_norm.weight");
    }
    w.layers.push_back(std::move(lw));
  }
  model->tokenizer_ = load_gguf_tokenizer(f);
  model->chat_template_ = f.find_string("tokenizer.chat_template").value_or("");
  return model;
}

}  // namespace qkvshare
