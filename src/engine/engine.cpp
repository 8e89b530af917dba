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
  inv_freq_.resize(static_cast<std::size_t>(c.head_dim / 2));
  for (int i = 0; i < c.head_dim / 2; ++i)
    inv_freq_[static_cast<std::size_t>(i)] =
        static_cast<float>(1.0 / std::pow(static_cast<double>(c.rope_theta), 2.0 * i / c.head_dim));
}

KvShape Engine::kv_shape() const noexcept {
  const ModelConfig& c = model_.config();
  return KvShape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim};
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

std::span<const float> Engine::forward(Session& session, std::span<const TokenId> tokens, bool all_logits) {
  const ModelConfig& c = model_.config();
  if (tokens.empty()) fail(ErrorCode::invalid_argument, "forward: no tokens");
  const std::size_t limit = static_cast<std::size_t>(std::min(c.context_length, session.cache().capacity()));
  if (static_cast<std::size_t>(session.n_past()) + tokens.size() > limit)
    fail(ErrorCode::context_full, "context length exceeded: {} tokens already + {} new > limit of {}",
         session.n_past(), tokens.size(), limit);
  for (TokenId t : tokens)
    if (t < 0 || t >= c.vocab_size)
      fail(ErrorCode::invalid_argument, "token id {} is outside the vocabulary [0, {})", t, c.vocab_size);

  const std::size_t vocab = static_cast<std::size_t>(c.vocab_size);
  logits_.resize(all_logits ? tokens.size() * vocab : vocab);
  for (std::size_t begin = 0; begin < tokens.size(); begin += static_cast<std::size_t>(options_.max_batch)) {
    const std::size_t n = std::min(tokens.size() - begin, static_cast<std::size_t>(options_.max_batch));
    const bool last = begin + n == tokens.size();
    float* out = all_logits ? logits_.data() + begin * vocab : (last ? logits_.data() : nullptr);
    forward_chunk(session, tokens.subspan(begin, n), all_logits, out);
  }
  return {logits_.data(), logits_.size()};
}

void Engine::forward_chunk(Session& session, std::span<const TokenId> tokens, bool all_logits, float* logits_out) {
  const ModelConfig& c = model_.config();
  const ModelWeights& w = model_.weights();
  KvCache& cache = session.cache();
  const int n = static_cast<int>(tokens.size());
  const int p0 = cache.size();
  ensure_scratch(n);
  const std::int64_t d = c.d_model, qd = c.q_dim(), kvd = c.kv_dim(), ff = c.d_ff;

  for (int t = 0; t < n; ++t) kernels::dequantize_row(w.token_embedding, tokens[static_cast<std::size_t>(t)], &x_[t * d]);

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& lw = w.layers[static_cast<std::size_t>(l)];
    const auto* attn_norm = reinterpret_cast<const float*>(lw.attn_norm.data);
    for (int t = 0; t < n; ++t) kernels::rmsnorm(&xb_[t * d], &x_[t * d], attn_norm, d, c.rms_eps);
    project({{&lw.wq, q_.data()}, {&lw.wk, k_.data()}, {&lw.wv, v_.data()}}, xb_.data(), n);
    for (int t = 0; t < n; ++t) {
      if (lw.bq) {
        kernels::add_inplace(&q_[t * qd], reinterpret_cast<const float*>(lw.bq->data), qd);
        kernels::add_inplace(&k_[t * kvd], reinterpret_cast<const float*>(lw.bk->data), kvd);
        kernels::add_inplace(&v_[t * kvd], reinterpret_cast<const float*>(lw.bv->data), kvd);
      }
      if (lw.q_norm) {  // qwen3: each head RMS-normalised with its own weights, before RoPE
        const auto* qn = reinterpret_cast<const float*>(lw.q_norm->data);
        const auto* kn = reinterpret_cast<const float*>(lw.k_norm->data);
        for (int h = 0; h < c.n_heads; ++h) {
          float* qh = &q_[t * qd + h * c.head_dim];
          kernels::rmsnorm(qh, qh, qn, c.head_dim, c.rms_eps);
        }
        for (int h = 0; h < c.n_kv_heads; ++h) {
          float* kh = &k_[t * kvd + h * c.head_dim];
          kernels::rmsnorm(kh, kh, kn, c.head_dim, c.rms_eps);
        }
      }
      const auto pos = static_cast<float>(p0 + t);
      kernels::rope(&q_[t * qd], c.n_heads, c.head_dim, pos, inv_freq_.data(), c.rope_style);
      kernels::rope(&k_[t * kvd], c.n_kv_heads, c.head_dim, pos, inv_freq_.data(), c.rope_style);
    }
    cache.write(l, n, k_.data(), v_.data());
    cache.attend(l, n, q_.data(), att_.data(), pool_);
    project({{&lw.wo, xb_.data()}}, att_.data(), n);
    for (int t = 0; t < n; ++t) kernels::add_inplace(&x_[t * d], &xb_[t * d], d);

    const auto* ffn_norm = reinterpret_cast<const float*>(lw.ffn_norm.data);
    for (int t = 0; t < n; ++t) kernels::rmsnorm(&xb_[t * d], &x_[t * d], ffn_norm, d, c.rms_eps);
    project({{&lw.w_gate, gate_.data()}, {&lw.w_up, up_.data()}}, xb_.data(), n);
    for (int t = 0; t < n; ++t) kernels::silu_mul(&gate_[t * ff], &up_[t * ff], ff);
    project({{&lw.w_down, xb_.data()}}, gate_.data(), n);
    for (int t = 0; t < n; ++t) kernels::add_inplace(&x_[t * d], &xb_[t * d], d);
  }
  cache.commit(n);
  session.tokens_.insert(session.tokens_.end(), tokens.begin(), tokens.end());

  if (logits_out == nullptr) return;
  const auto* out_norm = reinterpret_cast<const float*>(w.output_norm.data);
  const int first = all_logits ? 0 : n - 1;
  for (int t = first; t < n; ++t) kernels::rmsnorm(&xb_[t * d], &x_[t * d], out_norm, d, c.rms_eps);
  project({{&w.output, logits_out}}, &xb_[first * d], n - first);
}

void Engine::project(std::initializer_list<std::pair<const TensorView*, float*>> outs, const float* x, int n) {
  if (options_.exact_matmul) {
    for (const auto& [w, y] : outs) kernels::matmul_exact(pool_, *w, x, n, y);
    return;
  }
  std::array<kernels::MatmulOut, kernels::kMaxMatmulOuts> mo{};
  std::size_t k = 0;
  for (const auto& [w, y] : outs) mo[k++] = kernels::MatmulOut{w, y};
  kernels::matmul_multi(pool_, std::span<const kernels::MatmulOut>(mo.data(), k), x, n);
}

}  // namespace qkvshare
