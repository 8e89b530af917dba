#pragma once
// The forward pass: batched prefill and one-token decode for any number of
// sessions over one shared, read-only Model.
#include <initializer_list>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "qkvshare/core/thread_pool.hpp"
#include "qkvshare/kv/kv_cache.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "qkvshare/model/model.hpp"

namespace qkvshare {

// An agent's live decoding state: the tokens so far and the KV cache holding them.
class Session {
 public:
  explicit Session(std::unique_ptr<KvCache> cache) : cache_(std::move(cache)) {}
  // A session over a cache that already holds `tokens` (a handed-off context,
  // share/handoff.hpp); the caller guarantees tokens.size() == cache->size().
  Session(std::unique_ptr<KvCache> cache, std::vector<TokenId> tokens)
      : cache_(std::move(cache)), tokens_(std::move(tokens)) {}
  KvCache& cache() noexcept { return *cache_; }
  const KvCache& cache() const noexcept { return *cache_; }
  const std::vector<TokenId>& tokens() const noexcept { return tokens_; }
  int n_past() const noexcept { return static_cast<int>(tokens_.size()); }
  // Records tokens that were put into the cache without a forward pass (a
  // splice, engine/splice.hpp); the cache must now hold exactly the tokens.
  void note_placed(std::span<const TokenId> tokens);

 private:
  friend class Engine;
  std::unique_ptr<KvCache> cache_;
  std::vector<TokenId> tokens_;
};

struct EngineOptions {
  int n_threads = 0;     // 0: all hardware threads
  int max_batch = 256;   // tokens per forward chunk (bounds scratch memory)
  // Float activations in every matmul (kernels::matmul_exact) instead of the
  // 8-bit-activation SIMD kernels: slow, for checks against float references.
  bool exact_matmul = false;
};

class Engine {
 public:
  explicit Engine(const Model& model, EngineOptions options = {});

  const Model& model() const noexcept { return model_; }
  ThreadPool& pool() noexcept { return pool_; }
  KvShape kv_shape() const noexcept;
  // The rotary embedding of the forward pass, for caches that move segments.
  KvRope rope() const;

  // A session with a dense f32 cache of `capacity` tokens (0: the model's context length).
  std::unique_ptr<Session> new_session(int capacity = 0) const;

  // Appends `tokens` to the session (one batched pass per max_batch chunk) and
  // returns the logits of the last token, or of every token when all_logits
  // ([n][vocab]). Throws Error(context_full) when the tokens do not fit, before
  // anything is written; Error(invalid_argument) for an out-of-range token id.
  std::span<const float> forward(Session& session, std::span<const TokenId> tokens, bool all_logits = false);

 private:
  void forward_chunk(Session& session, std::span<const TokenId> tokens, bool all_logits, float* logits_out);
  // Weights applied to the same n activation rows: one kernels::matmul_multi
  // call (activations quantized once), or exact matmuls one by one.
  void project(std::initializer_list<std::pair<const TensorView*, float*>> outs, const float* x, int n);
  void ensure_scratch(int n);

  const Model& model_;
  EngineOptions options_;
  ThreadPool pool_;
  std::vector<float> inv_freq_;
  // Scratch, sized for max_batch tokens.
  std::vector<float> x_, xb_, q_, k_, v_, att_, gate_, up_, logits_;
  int scratch_tokens_ = 0;
};

}  // namespace qkvshare
