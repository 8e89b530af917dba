// llama2.c checkpoints: a header of 7 int32 then float32 tensors in a fixed
// order. Every size is checked against the file before a view is made.
#include <cstring>
#include <limits>

#include "qkvshare/core/error.hpp"
#include "qkvshare/model/model.hpp"

namespace qkvshare {

namespace {

constexpr std::int64_t kMaxDim = 1 << 16;
constexpr std::int64_t kMaxLayers = 1024;
constexpr std::int64_t kMaxVocab = 1 << 22;
constexpr std::int64_t kMaxSeq = 1 << 22;

struct CheckpointCursor {
  const MappedFile& file;
  std::size_t offset = 28;

  // Views the next `rows x cols` floats as an F32 tensor.
  TensorView take(const std::string& name, std::int64_t cols, std::int64_t rows) {
    const auto count = static_cast<std::size_t>(cols) * static_cast<std::size_t>(rows);
    const std::size_t bytes = count * sizeof(float);
    if (offset > file.size() || bytes > file.size() - offset)
      fail(ErrorCode::bad_model_file, "{}: tensor '{}': needs {} bytes at offset {}, file has {} bytes (truncated?)",
           file.path(), name, bytes, offset, file.size());
    TensorView t;
    t.name = name;
    t.type = GgmlType::F32;
    t.n_dims = rows == 1 ? 1 : 2;
    t.ne = {cols, rows, 1, 1};
    t.data = file.data() + offset;
    t.nbytes = bytes;
    offset += bytes;
    return t;
  }
  void skip(const std::string& name, std::size_t bytes) {
    if (offset > file.size() || bytes > file.size() - offset)
      fail(ErrorCode::bad_model_file, "{}: '{}': file truncated at offset {}", file.path(), name, offset);
    offset += bytes;
  }
};

void check_range(const std::string& path, const char* field, std::int64_t v, std::int64_t lo, std::int64_t hi) {
  if (v < lo || v > hi)
    fail(ErrorCode::bad_model_file, "{}: header field {} = {} is outside [{}, {}]", path, field, v, lo, hi);
}

}  // namespace

std::unique_ptr<Model> Model::load_llama2c(const std::string& path, const std::string& tokenizer_path,
                                           MappedFile::Mode mode) {
  auto model = std::unique_ptr<Model>(new Model());
  model->path_ = path;
  model->format_ = "llama2c";
  model->llama2c_file_ = MappedFile(path, mode);
  const MappedFile& file = model->llama2c_file_;
  if (file.size() < 28)
    fail(ErrorCode::bad_model_file, "{}: {} bytes is too short for a llama2.c header (28 bytes) and has no GGUF magic",
         path, file.size());
  std::int32_t h[7];
  std::memcpy(h, file.data(), sizeof(h));
  const bool shared_classifier = h[5] > 0;
  const std::int64_t vocab = h[5] < 0 ? -static_cast<std::int64_t>(h[5]) : h[5];
  check_range(path, "dim", h[0], 1, kMaxDim);
  check_range(path, "hidden_dim", h[1], 1, 4 * kMaxDim);
  check_range(path, "n_layers", h[2], 1, kMaxLayers);
  check_range(path, "n_heads", h[3], 1, h[0]);
  check_range(path, "n_kv_heads", h[4], 1, h[3]);
  check_range(path, "vocab_size", vocab, 1, kMaxVocab);
  check_range(path, "seq_len", h[6], 1, kMaxSeq);
  if (h[0] % h[3] != 0)
    fail(ErrorCode::bad_model_file, "{}: dim {} is not a multiple of n_heads {}", path, h[0], h[3]);
  if (h[3] % h[4] != 0)
    fail(ErrorCode::bad_model_file, "{}: n_heads {} is not a multiple of n_kv_heads {}", path, h[3], h[4]);
  if ((h[0] / h[3]) % 2 != 0)
    fail(ErrorCode::bad_model_file, "{}: head size {} must be even for RoPE", path, h[0] / h[3]);

  ModelConfig& c = model->config_;
  c.architecture = "llama";
  c.name = "llama2.c checkpoint";
  c.d_model = h[0];
  c.d_ff = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.head_dim = c.d_model / c.n_heads;
  c.vocab_size = static_cast<int>(vocab);
  c.context_length = h[6];
  c.rms_eps = 1e-5f;
  c.rope_theta = 10000.0f;
  c.rope_style = RopeStyle::interleaved;

  // Layer-major arrays: each named tensor holds all layers back to back.
  CheckpointCursor cur{file};
  const std::int64_t d = c.d_model, L = c.n_layers, kv = c.kv_dim(), ff = c.d_ff;
  TensorView emb = cur.take("token_embedding", d, vocab);
  TensorView rms_att = cur.take("rms_att_weight", d, L);
  TensorView wq = cur.take("wq", d, L * d);
  TensorView wk = cur.take("wk", d, L * kv);
  TensorView wv = cur.take("wv", d, L * kv);
  TensorView wo = cur.take("wo", d, L * d);
  TensorView rms_ffn = cur.take("rms_ffn_weight", d, L);
  TensorView w1 = cur.take("w1", d, L * ff);
  TensorView w2 = cur.take("w2", ff, L * d);
  TensorView w3 = cur.take("w3", d, L * ff);
  TensorView rms_final = cur.take("rms_final_weight", d, 1);
  cur.skip("freq_cis", static_cast<std::size_t>(c.context_length) * static_cast<std::size_t>(c.head_dim) * sizeof(float));
  TensorView wcls = shared_classifier ? emb : cur.take("wcls", d, vocab);
  if (cur.offset != file.size())
    fail(ErrorCode::bad_model_file, "{}: {} trailing bytes after the last tensor (header does not match the file)",
         path, file.size() - cur.offset);

  auto slice = [](const TensorView& all, std::int64_t layer, std::int64_t rows, const std::string& name) {
    TensorView t = all;
    t.name = name;
    t.ne = {all.cols(), rows, 1, 1};
    t.n_dims = rows == 1 ? 1 : 2;
    t.nbytes = static_cast<std::size_t>(all.cols() * rows) * sizeof(float);
    t.data = all.data + static_cast<std::size_t>(layer) * t.nbytes;
    return t;
  };
  ModelWeights& w = model->weights_;
  w.token_embedding = emb;
  w.output_norm = rms_final;
  w.output = wcls;
  for (std::int64_t l = 0; l < L; ++l) {
    const std::string p = "layer " + std::to_string(l) + " ";
    LayerWeights lw;
    lw.attn_norm = slice(rms_att, l, 1, p + "rms_att_weight");
    lw.wq = slice(wq, l, d, p + "wq");
    lw.wk = slice(wk, l, kv, p + "wk");
    lw.wv = slice(wv, l, kv, p + "wv");
    lw.wo = slice(wo, l, d, p + "wo");
    lw.ffn_norm = slice(rms_ffn, l, 1, p + "rms_ffn_weight");
    lw.w_gate = slice(w1, l, ff, p + "w1");
    lw.w_down = slice(w2, l, d, p + "w2");
    lw.w_up = slice(w3, l, ff, p + "w3");
    w.layers.push_back(std::move(lw));
  }
  if (tokenizer_path.empty())
    fail(ErrorCode::invalid_argument, "{}: llama2.c checkpoints carry no tokenizer: pass one with -t TOKENIZER", path);
  model->tokenizer_ = load_llama2c_tokenizer(tokenizer_path, c.vocab_size);
  return model;
}

}  // namespace qkvshare
