#include "qkvshare/engine/engine.hpp"

#include <algorithm>
#include <array>
#include <cmath>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/matmul.hpp"
#include "qkvshare/kernels/ops.hpp"
#include "qkvshare/kv/dense_kv_cache.hpp"

namespace qkvshare {

Engine::Engine(const Model& model, EngineOptions options)
    : model_(model), options_(options), pool_(options.n_threads) {
  if (options_.max_batch <= 0) fail(ErrorCode::invalid_argument, "max_batch must be positive");
  const ModelConfig& c = model_.config();
  // Linear scaling divides positions by the factor: the same as dividing the frequencies.
  const auto frequencies = [&c](double theta, double scale) {
    std::vector<float> f(static_cast<std::size_t>(c.head_dim / 2));
    for (int i = 0; i < c.head_dim / 2; ++i)
      f[static_cast<std::size_t>(i)] = static_cast<float>(std::pow(theta, -2.0 * i / c.head_dim) / scale);
    return f;
  };
  inv_freq_ = frequencies(c.rope_theta, c.rope_scale);
  inv_freq_local_ = c.layer_window.empty() ? inv_freq_ : frequencies(c.rope_theta_local, c.rope_scale_local);
  if (options_.float_activations) build_float_weights();
}

void Engine::build_float_weights() {
  if (options_.exact_matmul)
    fail(ErrorCode::invalid_argument, "exact_matmul and float_activations are two float paths: choose one");
  const ModelWeights& w = model_.weights();
  std::vector<const TensorView*> all{&w.output};
  for (const LayerWeights& lw : w.layers)
    for (const TensorView* t : {&lw.wq, &lw.wk, &lw.wv, &lw.wo, &lw.w_gate, &lw.w_up, &lw.w_down}) all.push_back(t);
  for (const TensorView* t : all) {
    // f32 weights need no copy; f16/bf16 ones already multiply f32 activations.
    if (t->type == GgmlType::F32 || t->type == GgmlType::F16 || t->type == GgmlType::BF16) continue;
    if (float_views_.contains(t->data)) continue;
    std::vector<float>& store = float_store_.emplace_back(static_cast<std::size_t>(t->n_elements()));
    const std::int64_t cols = t->cols();
    pool_.parallel_for(static_cast<std::size_t>(t->rows()), 64, [&](std::size_t begin, std::size_t end, int) {
      for (std::size_t r = begin; r < end; ++r)
        kernels::dequantize_row(*t, static_cast<std::int64_t>(r), &store[r * static_cast<std::size_t>(cols)]);
    });
    TensorView f = *t;
    f.type = GgmlType::F32;
    f.data = reinterpret_cast<const std::uint8_t*>(store.data());
    f.nbytes = store.size() * sizeof(float);
    float_views_.emplace(t->data, f);
  }
}

KvShape Engine::kv_shape() const noexcept {
  const ModelConfig& c = model_.config();
  return KvShape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.layer_window};
}

std::size_t Engine::float_copy_bytes() const noexcept {
  std::size_t total = 0;
  for (const auto& store : float_store_) total += store.size() * sizeof(float);
  return total;
}

KvRope Engine::rope() const {
  const ModelConfig& c = model_.config();
  KvRope r{inv_freq_, c.rope_style, {}, {}};
  if (c.layered_rope()) {  // gemma3: the sliding-window layers rotate with their own base
    r.local_inv_freq = inv_freq_local_;
    for (int l = 0; l < c.n_layers; ++l) r.local_layers.push_back(c.window(l) > 0 ? 1 : 0);
  } else if (!c.layer_window.empty()) {
    r.inv_freq = inv_freq_local_;  // every layer windowed: one RoPE, the same as inv_freq_
  }
  return r;
}

void Session::note_placed(std::span<const TokenId> tokens) {
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  QKV_CHECK(static_cast<int>(tokens_.size()) == cache_->size());
}

std::unique_ptr<Session> Engine::new_session(int capacity) const {
  if (capacity <= 0) capacity = model_.config().context_length;
  return std::make_unique<Session>(std::make_unique<DenseKvCache>(kv_shape(), capacity));
}

void Engine::ensure_scratch(int n) {
  if (n <= scratch_tokens_) return;
  const ModelConfig& c = model_.config();
  const auto sz = [n](int width) { return static_cast<std::size_t>(n) * static_cast<std::size_t>(width); };
  x_.resize(sz(c.d_model));
  xb_.resize(sz(std::max(c.d_model, c.q_dim())));
  q_.resize(sz(c.q_dim()));
  k_.resize(sz(c.kv_dim()));
  v_.resize(sz(c.kv_dim()));
  att_.resize(sz(c.q_dim()));
  gate_.resize(sz(c.d_ff));
  up_.resize(sz(c.d_ff));
  scratch_tokens_ = n;
}

void Engine::check_entry(const Session& session, std::span<const TokenId> tokens) const {
  const ModelConfig& c = model_.config();
  if (tokens.empty()) fail(ErrorCode::invalid_argument, "forward: no tokens");
  const std::size_t limit = static_cast<std::size_t>(std::min(c.context_length, session.cache().capacity()));
  if (static_cast<std::size_t>(session.n_past()) + tokens.size() > limit)
    fail(ErrorCode::context_full, "context length exceeded: {} tokens already + {} new > limit of {}",
         session.n_past(), tokens.size(), limit);
  for (TokenId t : tokens)
    if (t < 0 || t >= c.vocab_size)
      fail(ErrorCode::invalid_argument, "token id {} is outside the vocabulary [0, {})", t, c.vocab_size);
}

std::span<const float> Engine::forward(Session& session, std::span<const TokenId> tokens, bool all_logits) {
  check_entry(session, tokens);  // the whole sequence, before any chunk runs
  const std::size_t vocab = static_cast<std::size_t>(model_.config().vocab_size);
  const auto chunk = static_cast<std::size_t>(options_.max_batch);
  if (all_logits) forward_logits_.resize(tokens.size() * vocab);
  std::span<const float> last;
  for (std::size_t begin = 0; begin < tokens.size(); begin += chunk) {
    const std::size_t n = std::min(tokens.size() - begin, chunk);
    const bool final_chunk = begin + n == tokens.size();
    const BatchEntry entry{&session, tokens.subspan(begin, n),
                           all_logits ? LogitsWanted::all : (final_chunk ? LogitsWanted::last : LogitsWanted::none)};
    const BatchOutcome& out = forward_batch(std::span<const BatchEntry>(&entry, 1))[0];
    if (out.error) throw *out.error;
    if (all_logits) std::copy(out.logits.begin(), out.logits.end(), forward_logits_.begin() + static_cast<std::ptrdiff_t>(begin * vocab));
    last = out.logits;
  }
  if (all_logits) return {forward_logits_.data(), forward_logits_.size()};
  return last;
}

std::span<const BatchOutcome> Engine::forward_batch(std::span<const BatchEntry> entries) {
  std::size_t total = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].session == nullptr) fail(ErrorCode::invalid_argument, "forward_batch: entry {} has no session", i);
    for (std::size_t j = 0; j < i; ++j)
      if (entries[j].session == entries[i].session)
        fail(ErrorCode::invalid_argument, "forward_batch: entries {} and {} advance the same session", j, i);
    total += entries[i].tokens.size();
  }
  if (total > static_cast<std::size_t>(options_.max_batch))
    fail(ErrorCode::invalid_argument, "forward_batch: {} tokens in one pass exceed max_batch {}", total,
         options_.max_batch);
  outcomes_.assign(entries.size(), BatchOutcome{});
  alive_.assign(entries.size(), 0);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    try {
      check_entry(*entries[i].session, entries[i].tokens);
      alive_[i] = 1;
    } catch (const Error& e) {
      outcomes_[i].error = e;
    }
  }
  run_batch(entries);
  return outcomes_;
}

// One pass over the rows of every live entry, entry i at rows [row0_[i], row0_[i] + n_i).
void Engine::run_batch(std::span<const BatchEntry> entries) {
  const ModelConfig& c = model_.config();
  const ModelWeights& w = model_.weights();
  const std::size_t E = entries.size();
  row0_.assign(E + 1, 0);
  int n = 0;
  for (std::size_t i = 0; i < E; ++i) {
    row0_[i] = n;
    if (alive_[i]) n += static_cast<int>(entries[i].tokens.size());
  }
  row0_[E] = n;
  if (n == 0) return;
  ensure_scratch(n);
  const std::int64_t d = c.d_model, qd = c.q_dim(), kvd = c.kv_dim(), ff = c.d_ff;
  const auto rows = [&](std::size_t i) { return static_cast<int>(entries[i].tokens.size()); };

  for (std::size_t i = 0; i < E; ++i) {
    if (!alive_[i]) continue;
    for (int t = 0; t < rows(i); ++t)
      kernels::dequantize_row(w.token_embedding, entries[i].tokens[static_cast<std::size_t>(t)], &x_[(row0_[i] + t) * d]);
  }
  if (c.embed_scale) {
    const float s = std::sqrt(static_cast<float>(d));
    for (std::int64_t j = 0; j < n * d; ++j) x_[static_cast<std::size_t>(j)] *= s;
  }

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& lw = w.layers[static_cast<std::size_t>(l)];
    const int window = c.window(l);
    const float* inv_freq = window > 0 ? inv_freq_local_.data() : inv_freq_.data();
    const auto* attn_norm = reinterpret_cast<const float*>(lw.attn_norm.data);
    for (int t = 0; t < n; ++t) kernels::rmsnorm(&xb_[t * d], &x_[t * d], attn_norm, d, c.rms_eps);
    project({{&lw.wq, q_.data()}, {&lw.wk, k_.data()}, {&lw.wv, v_.data()}}, xb_.data(), n);
    works_.clear();
    for (std::size_t i = 0; i < E; ++i) {
      if (!alive_[i]) continue;
      KvCache& cache = entries[i].session->cache();
      const int p0 = cache.next_position(), r0 = row0_[i];
      // A cache that stores keys before RoPE rotates them when it reads them.
      const bool keys_as_projected = cache.keys_before_rope();
      if (keys_as_projected && l == 0) cache.set_rope(rope());
      for (int t = 0; t < rows(i); ++t) {
        const std::int64_t r = r0 + t;
        if (lw.bq) {
          kernels::add_inplace(&q_[r * qd], reinterpret_cast<const float*>(lw.bq->data), qd);
          kernels::add_inplace(&k_[r * kvd], reinterpret_cast<const float*>(lw.bk->data), kvd);
          kernels::add_inplace(&v_[r * kvd], reinterpret_cast<const float*>(lw.bv->data), kvd);
        }
        if (lw.q_norm) {  // qwen3: each head RMS-normalised with its own weights, before RoPE
          const auto* qn = reinterpret_cast<const float*>(lw.q_norm->data);
          const auto* kn = reinterpret_cast<const float*>(lw.k_norm->data);
          for (int h = 0; h < c.n_heads; ++h) {
            float* qh = &q_[r * qd + h * c.head_dim];
            kernels::rmsnorm(qh, qh, qn, c.head_dim, c.rms_eps);
          }
          for (int h = 0; h < c.n_kv_heads; ++h) {
            float* kh = &k_[r * kvd + h * c.head_dim];
            kernels::rmsnorm(kh, kh, kn, c.head_dim, c.rms_eps);
          }
        }
        const auto pos = static_cast<float>(p0 + t);
        kernels::rope(&q_[r * qd], c.n_heads, c.head_dim, pos, inv_freq, c.rope_style);
        if (!keys_as_projected) kernels::rope(&k_[r * kvd], c.n_kv_heads, c.head_dim, pos, inv_freq, c.rope_style);
      }
      try {
        cache.write(l, rows(i), &k_[r0 * kvd], &v_[r0 * kvd]);
      } catch (const Error& e) {
        // This session alone fails (its pool is full); its rows ride along
        // as zeros to the end of the pass and nothing of it is committed.
        outcomes_[i].error = e;
        alive_[i] = 0;
        std::fill(att_.begin() + r0 * qd, att_.begin() + (r0 + rows(i)) * qd, 0.0f);
        continue;
      }
      works_.push_back(&cache.plan_attend(l, rows(i), &q_[r0 * qd], &att_[r0 * qd], window));
    }
    shared_reads_.share(works_);
    run_attend_works(works_, pool_);
    project({{&lw.wo, xb_.data()}}, att_.data(), n);
    add_residual(lw.attn_post_norm, n);

    const auto* ffn_norm = reinterpret_cast<const float*>(lw.ffn_norm.data);
    for (int t = 0; t < n; ++t) kernels::rmsnorm(&xb_[t * d], &x_[t * d], ffn_norm, d, c.rms_eps);
    project({{&lw.w_gate, gate_.data()}, {&lw.w_up, up_.data()}}, xb_.data(), n);
    for (int t = 0; t < n; ++t)
      (c.gelu ? kernels::gelu_mul : kernels::silu_mul)(&gate_[t * ff], &up_[t * ff], ff);
    project({{&lw.w_down, xb_.data()}}, gate_.data(), n);
    add_residual(lw.ffn_post_norm, n);
  }

  // Commit, then the logits of the rows that want them, gathered into one matmul.
  const auto* out_norm = reinterpret_cast<const float*>(w.output_norm.data);
  int gathered = 0;
  for (std::size_t i = 0; i < E; ++i) {
    if (!alive_[i]) continue;
    Session& session = *entries[i].session;
    session.cache().commit(rows(i));
    session.tokens_.insert(session.tokens_.end(), entries[i].tokens.begin(), entries[i].tokens.end());
    if (entries[i].logits == LogitsWanted::none) continue;
    const int first = entries[i].logits == LogitsWanted::all ? 0 : rows(i) - 1;
    for (int t = first; t < rows(i); ++t, ++gathered)
      kernels::rmsnorm(&xb_[gathered * d], &x_[(row0_[i] + t) * d], out_norm, d, c.rms_eps);
  }
  if (gathered == 0) return;
  const std::size_t vocab = static_cast<std::size_t>(c.vocab_size);
  logits_.resize(static_cast<std::size_t>(gathered) * vocab);
  project({{&w.output, logits_.data()}}, xb_.data(), gathered);
  if (c.final_softcap > 0.0f) {
    const float cap = c.final_softcap;
    for (float& z : logits_) z = cap * std::tanh(z / cap);
  }
  std::size_t at = 0;
  for (std::size_t i = 0; i < E; ++i) {
    if (!alive_[i] || entries[i].logits == LogitsWanted::none) continue;
    const std::size_t k = entries[i].logits == LogitsWanted::all ? static_cast<std::size_t>(rows(i)) : 1;
    outcomes_[i].logits = std::span<const float>(logits_.data() + at * vocab, k * vocab);
    at += k;
  }
}

// x += xb for the n rows, xb first RMS-normalised when the block has a post-norm (gemma3).
void Engine::add_residual(const std::optional<TensorView>& post_norm, int n) {
  const ModelConfig& c = model_.config();
  const std::int64_t d = c.d_model;
  if (post_norm) {
    const auto* wn = reinterpret_cast<const float*>(post_norm->data);
    for (int t = 0; t < n; ++t) kernels::rmsnorm(&xb_[t * d], &xb_[t * d], wn, d, c.rms_eps);
  }
  for (int t = 0; t < n; ++t) kernels::add_inplace(&x_[t * d], &xb_[t * d], d);
}

void Engine::project(std::initializer_list<std::pair<const TensorView*, float*>> outs, const float* x, int n) {
  if (options_.exact_matmul) {
    for (const auto& [w, y] : outs) kernels::matmul_exact(pool_, *w, x, n, y);
    return;
  }
  std::array<kernels::MatmulOut, kernels::kMaxMatmulOuts> mo{};
  std::size_t k = 0;
  for (const auto& [w, y] : outs) {
    const auto f = float_views_.empty() ? float_views_.end() : float_views_.find(w->data);
    mo[k++] = kernels::MatmulOut{f == float_views_.end() ? w : &f->second, y};
  }
  kernels::matmul_multi(pool_, std::span<const kernels::MatmulOut>(mo.data(), k), x, n);
}

}  // namespace qkvshare
