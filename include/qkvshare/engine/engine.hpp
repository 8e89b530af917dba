#pragma once
// The forward pass: batched prefill and one-token decode for any number of
// sessions over one shared, read-only Model.
//
// Thread-safety rules:
//  - A Model is read-only after load: any number of engines and threads may
//    read it at once.
//  - An Engine is driven by one thread at a time: forward() and
//    forward_batch() use the engine's scratch and thread pool and must not
//    overlap (the Scheduler, scheduler.hpp, is the one driver a server or the
//    orchestrator shares; its submit()/cancel() are the calls other threads
//    make).
//  - A Session belongs to whoever drives it. While a call that includes it
//    runs, no other thread may read or write it (tokens(), its cache); between
//    calls it may be handed to another thread.
//  - The KV pool behind pooled sessions is thread- and process-safe; sessions
//    of one pool can be advanced by different engines at the same time.
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "qkvshare/core/error.hpp"

#include "qkvshare/core/thread_pool.hpp"
#include "qkvshare/kv/kv_cache.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "qkvshare/kv/shared_block_reads.hpp"
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

// Which logits an entry of a batch wants back.
enum class LogitsWanted { none, last, all };

// One entry of a batched forward pass: `tokens` appended to `session` (one
// token for a decoding session, a chunk of a prompt for a prefilling one).
struct BatchEntry {
  Session* session = nullptr;
  std::span<const TokenId> tokens;
  LogitsWanted logits = LogitsWanted::last;
};

// What one entry got. A failed entry (error set) left its session exactly as
// it was before the call; the other entries are unaffected by its failure.
struct BatchOutcome {
  std::optional<Error> error;
  // [1][vocab] (last) or [tokens][vocab] (all); empty for none or on error.
  // Valid until the next forward/forward_batch call on this engine.
  std::span<const float> logits;
  bool ok() const noexcept { return !error.has_value(); }
};

struct EngineOptions {
  int n_threads = 0;     // 0: all hardware threads
  int max_batch = 256;   // tokens per forward chunk (bounds scratch memory)
  // Float activations in every matmul (kernels::matmul_exact) instead of the
  // 8-bit-activation SIMD kernels: slow, for checks against float references.
  bool exact_matmul = false;
  // Float activations on the SIMD kernels: every block-quantized weight is
  // dequantized to f32 once, when the engine is built (4 bytes per weight),
  // and multiplied by the f32 GEMM tiles. The same weights as the 8-bit path,
  // without its activation rounding; what quality measurements below that
  // rounding's noise need (eval --float-activations).
  bool float_activations = false;
};

class Engine {
 public:
  explicit Engine(const Model& model, EngineOptions options = {});

  const Model& model() const noexcept { return model_; }
  // Bytes of the f32 weight copies that float_activations made (0 otherwise).
  std::size_t float_copy_bytes() const noexcept;
  const EngineOptions& options() const noexcept { return options_; }
  ThreadPool& pool() noexcept { return pool_; }
  KvShape kv_shape() const noexcept;
  // The rotary embedding of the forward pass, for caches that move segments
  // (per layer where the model's layers rotate differently: gemma3).
  KvRope rope() const;

  // A session with a dense f32 cache of `capacity` tokens (0: the model's context length).
  std::unique_ptr<Session> new_session(int capacity = 0) const;

  // Appends `tokens` to the session (one batched pass per max_batch chunk) and
  // returns the logits of the last token, or of every token when all_logits
  // ([n][vocab]). Throws Error(context_full) when the tokens do not fit, before
  // anything is written; Error(invalid_argument) for an out-of-range token id.
  std::span<const float> forward(Session& session, std::span<const TokenId> tokens, bool all_logits = false);

  // The step API: advances every entry's session by its tokens in ONE forward
  // pass. Every matmul runs over the rows of all entries (the weights are
  // read once for the whole batch); RoPE uses each session's own positions;
  // attention runs per session over its own KV, all sessions' jobs in one
  // thread-pool round per layer. A row's result does not depend on the other
  // rows of the batch beyond the matmul kernels' rounding (bit-identical with
  // exact_matmul).
  // Per entry, not thrown: a session that would exceed its context
  // (context_full), an out-of-range token id or no tokens (invalid_argument),
  // pool exhaustion while storing its KV (out_of_memory). Thrown before
  // anything runs (Error(invalid_argument)): a null session, one session in two
  // entries, more than max_batch tokens in all. Any other exception (a bug)
  // fails the whole call; sessions keep their committed tokens either way.
  std::span<const BatchOutcome> forward_batch(std::span<const BatchEntry> entries);

 private:
  void run_batch(std::span<const BatchEntry> entries);
  void check_entry(const Session& session, std::span<const TokenId> tokens) const;
  // Weights applied to the same n activation rows: one kernels::matmul_multi
  // call (activations quantized once), or exact matmuls one by one.
  void project(std::initializer_list<std::pair<const TensorView*, float*>> outs, const float* x, int n);
  void ensure_scratch(int n);
  void add_residual(const std::optional<TensorView>& post_norm, int n);
  void build_float_weights();

  const Model& model_;
  EngineOptions options_;
  ThreadPool pool_;
  // RoPE frequencies of the whole-context layers and of the sliding-window
  // ones (ModelConfig::rope_theta_local): one list when they agree.
  std::vector<float> inv_freq_, inv_freq_local_;
  // Scratch, sized for max_batch tokens.
  std::vector<float> x_, xb_, q_, k_, v_, att_, gate_, up_, logits_, forward_logits_;
  int scratch_tokens_ = 0;
  // Per batch: outcomes, the first row of each entry, whether it still runs.
  std::vector<BatchOutcome> outcomes_;
  std::vector<int> row0_;
  std::vector<char> alive_;
  std::vector<AttendWork*> works_;
  kv::SharedBlockReads shared_reads_;  // sessions' common prefix blocks read once per layer
  // float_activations: the f32 copy of each block-quantized weight, by the
  // address of its data (a tied output shares the embedding's copy).
  std::unordered_map<const std::uint8_t*, TensorView> float_views_;
  std::vector<std::vector<float>> float_store_;
};

}  // namespace qkvshare
