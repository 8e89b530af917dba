#include "qkvshare/model/model.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/packed_weights.hpp"
#include "qkvshare/model/gguf.hpp"

namespace qkvshare {

Model::Model() = default;
Model::~Model() = default;

std::unique_ptr<Model> Model::load(const std::string& path, const std::string& tokenizer_path, MappedFile::Mode mode) {
  MappedFile probe(path);
  const bool is_gguf = probe.size() >= 4 && std::memcmp(probe.data(), "GGUF", 4) == 0;
  // llama2.c checkpoints have no magic: anything not GGUF is read as one. A
  // file that starts with a magic of letters (GGML, ggjt, a GGUF with a
  // damaged magic) fails there with a header value; say what it starts with.
  std::string magic;
  if (probe.size() >= 4 && std::all_of(probe.data(), probe.data() + 4, [](std::uint8_t b) { return std::isalpha(b); }))
    magic.assign(reinterpret_cast<const char*>(probe.data()), 4);
  probe = MappedFile();
  std::unique_ptr<Model> model;
  try {
    model = is_gguf ? load_gguf(path, mode) : load_llama2c(path, tokenizer_path, mode);
  } catch (const Error& e) {
    if (is_gguf || magic.empty() || e.code() != ErrorCode::bad_model_file) throw;
    fail(ErrorCode::bad_model_file, "{} (the file starts with '{}': it is neither GGUF, whose magic is 'GGUF', nor a "
         "llama2.c checkpoint)", e.what(), magic);
  }
  model->validate();
  model->pack_weights();
  return model;
}

void Model::FreeAligned::operator()(std::uint8_t* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }

std::size_t Model::packed_bytes() const noexcept { return packed_bytes_; }

const MappedFile& Model::weights_file() const noexcept { return gguf_ ? gguf_->file() : llama2c_file_; }

// Each matmul weight the active kernels read faster packed gets a packed copy
// (built on all cores), and its view points there. The file's pages of it are
// released as they are packed (MappedFile::release: they read the same if
// anything still reads the rows as stored, such as another kernel level or
// --float-activations): the copy replaces them, and at most a few chunks of
// both are resident at once, in either mapping mode.
void Model::pack_weights() {
  std::vector<TensorView*> all{&weights_.output};
  for (LayerWeights& l : weights_.layers)
    for (TensorView* t : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) all.push_back(t);
  const MappedFile& file = weights_file();
  constexpr std::int64_t kChunkTiles = 64;
  const unsigned n_threads = std::max(1u, std::thread::hardware_concurrency());
  if (std::none_of(all.begin(), all.end(), [](const TensorView* t) { return kernels::packs(*t); })) return;
  copy_small_tensors();  // first: reading them later would map their neighbours' pages again
  // A fault maps the whole page-cache folio around it (up to 2 MiB, across
  // tensor boundaries), so packing one matrix maps pages of the neighbours
  // already packed and released: those are released again after each matrix.
  constexpr std::ptrdiff_t kFolioReach = 4 << 20;
  std::vector<const TensorView*> done;
  for (TensorView* t : all) {
    if (!kernels::packs(*t)) continue;
    std::unique_ptr<std::uint8_t[], FreeAligned> buf(
        static_cast<std::uint8_t*>(::operator new[](t->nbytes, std::align_val_t{64})));
    const std::int64_t tiles = t->rows() / kernels::kPackedTileRows;
    const std::size_t tile_bytes = static_cast<std::size_t>(kernels::kPackedTileRows) * t->row_bytes();
    std::vector<std::thread> threads;
    for (unsigned i = 0; i < n_threads; ++i)
      threads.emplace_back([&, i] {
        const std::int64_t end = tiles * (i + 1) / n_threads;
        for (std::int64_t a = tiles * i / n_threads; a < end; a += kChunkTiles) {
          const std::int64_t b = std::min(end, a + kChunkTiles);
          kernels::pack_tiles(*t, a, b, buf.get());
          file.release(t->data + static_cast<std::size_t>(a) * tile_bytes, t->data + static_cast<std::size_t>(b) * tile_bytes);
        }
      });
    for (std::thread& th : threads) th.join();
    file.release(t->data, t->data + t->nbytes);  // the pages the chunks' edges shared
    for (const TensorView* d : done)
      if (d->data + d->nbytes + kFolioReach > t->data && t->data + t->nbytes + kFolioReach > d->data)
        file.release(d->data, d->data + d->nbytes);
    done.push_back(t);
    t->packed = buf.get();
    packed_bytes_ += t->nbytes;
    owned_.push_back(std::move(buf));
  }
  // The tied output is the embedding's view: let both see the packed rows.
  if (weights_.token_embedding.data == weights_.output.data) weights_.token_embedding.packed = weights_.output.packed;
}

// Once the matrices are packed, the forward pass reads the file only for the
// small tensors (norms, biases). Those sit between the matrices in the file,
// and a fault on one maps the whole page-cache folio around it: the released
// rows of its neighbours would come back into the process's RSS. Copied, the
// file is not touched after load (but for rows of an untied embedding).
void Model::copy_small_tensors() {
  constexpr std::size_t kSmall = 1 << 20;
  const MappedFile& file = weights_file();
  const auto own = [&](TensorView& t) {
    if (t.packed != nullptr || t.data == nullptr || t.nbytes == 0 || t.nbytes > kSmall) return;
    std::unique_ptr<std::uint8_t[], FreeAligned> buf(
        static_cast<std::uint8_t*>(::operator new[](t.nbytes, std::align_val_t{64})));
    std::memcpy(buf.get(), t.data, t.nbytes);
    file.release(t.data, t.data + t.nbytes);
    t.data = buf.get();
    owned_.push_back(std::move(buf));
  };
  own(weights_.output_norm);
  for (LayerWeights& l : weights_.layers) {
    own(l.attn_norm);
    own(l.ffn_norm);
    for (std::optional<TensorView>* t : {&l.bq, &l.bk, &l.bv, &l.q_norm, &l.k_norm, &l.attn_post_norm, &l.ffn_post_norm})
      if (t->has_value()) own(**t);
  }
}

ChatTemplate Model::chat_template(std::string_view name, bool thinking) const {
  if (!name.empty()) return ChatTemplate(parse_chat_family(name), thinking);
  if (!chat_template_.empty()) {
    if (auto f = detect_chat_family(chat_template_)) return ChatTemplate(*f, thinking);
    fail(ErrorCode::unsupported,
         "{}: tokenizer.chat_template: not a recognised family (chatml, qwen3, llama3, gemma, phi3, mistral); "
         "choose one with --chat-template NAME",
         path_);
  }
  if (tokenizer_->find("<|im_start|>") && tokenizer_->find("<|im_end|>")) return ChatTemplate(ChatFamily::chatml, thinking);
  return ChatTemplate(ChatFamily::plain, thinking);
}

std::size_t Model::weight_bytes() const noexcept {
  std::size_t total = weights_.output.nbytes + weights_.output_norm.nbytes;
  for (const auto& l : weights_.layers)
    total += l.attn_norm.nbytes + l.wq.nbytes + l.wk.nbytes + l.wv.nbytes + l.wo.nbytes + l.ffn_norm.nbytes +
             l.w_gate.nbytes + l.w_up.nbytes + l.w_down.nbytes;
  return total;
}

bool ModelConfig::layered_rope() const noexcept {
  bool local = false, global = false;
  for (int w : layer_window) (w > 0 ? local : global) = true;
  if (layer_window.empty()) global = true;
  return local && global && (rope_theta_local != rope_theta || rope_scale_local != rope_scale);
}

namespace {

void expect_shape(const std::string& path, const TensorView& t, std::int64_t cols, std::int64_t rows) {
  if (t.cols() != cols || t.rows() != rows)
    fail(ErrorCode::bad_model_file, "{}: tensor '{}': shape [{} x {}] does not fit the architecture (want [{} x {}])",
         path, t.name, t.cols(), t.rows(), cols, rows);
}

void expect_matrix(const std::string& path, const TensorView& t, std::int64_t cols, std::int64_t rows) {
  expect_shape(path, t, cols, rows);
  if (!is_supported_weight_type(t.type))
    fail(ErrorCode::bad_model_file, "{}: tensor '{}': weight type {} is not supported", path, t.name,
         type_name(t.type));
}

void expect_vector(const std::string& path, const TensorView& t, std::int64_t n) {
  expect_shape(path, t, n, 1);
  if (t.type != GgmlType::F32)
    fail(ErrorCode::bad_model_file, "{}: tensor '{}': must be F32, is {}", path, t.name, type_name(t.type));
}

}  // namespace

void Model::validate() const {
  const ModelConfig& c = config_;
  const auto& w = weights_;
  if (static_cast<int>(w.layers.size()) != c.n_layers)
    fail(ErrorCode::bad_model_file, "{}: has {} layers of weights, header says {}", path_, w.layers.size(), c.n_layers);
  expect_matrix(path_, w.token_embedding, c.d_model, c.vocab_size);
  expect_vector(path_, w.output_norm, c.d_model);
  expect_matrix(path_, w.output, c.d_model, c.vocab_size);
  for (const LayerWeights& l : w.layers) {
    expect_vector(path_, l.attn_norm, c.d_model);
    expect_matrix(path_, l.wq, c.d_model, c.q_dim());
    expect_matrix(path_, l.wk, c.d_model, c.kv_dim());
    expect_matrix(path_, l.wv, c.d_model, c.kv_dim());
    expect_matrix(path_, l.wo, c.q_dim(), c.d_model);
    expect_vector(path_, l.ffn_norm, c.d_model);
    expect_matrix(path_, l.w_gate, c.d_model, c.d_ff);
    expect_matrix(path_, l.w_up, c.d_model, c.d_ff);
    expect_matrix(path_, l.w_down, c.d_ff, c.d_model);
    if (c.qkv_bias) {
      if (!l.bq || !l.bk || !l.bv) fail(ErrorCode::bad_model_file, "{}: {} needs Q/K/V biases", path_, c.architecture);
      expect_vector(path_, *l.bq, c.q_dim());
      expect_vector(path_, *l.bk, c.kv_dim());
      expect_vector(path_, *l.bv, c.kv_dim());
    }
    if (c.qk_norm) {
      if (!l.q_norm || !l.k_norm) fail(ErrorCode::bad_model_file, "{}: {} needs q/k norm weights", path_, c.architecture);
      expect_vector(path_, *l.q_norm, c.head_dim);
      expect_vector(path_, *l.k_norm, c.head_dim);
    }
    if (c.post_norms) {
      if (!l.attn_post_norm || !l.ffn_post_norm)
        fail(ErrorCode::bad_model_file, "{}: {} needs post-attention and post-FFN norm weights", path_, c.architecture);
      expect_vector(path_, *l.attn_post_norm, c.d_model);
      expect_vector(path_, *l.ffn_post_norm, c.d_model);
    }
  }
  if (tokenizer_->vocab_size() != c.vocab_size)
    fail(ErrorCode::bad_model_file, "{}: tokenizer has {} tokens, model vocabulary is {}", path_,
         tokenizer_->vocab_size(), c.vocab_size);
}

}  // namespace qkvshare
