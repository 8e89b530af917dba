#pragma once
// The narrow interface between the forward pass and KV storage. The engine
// hands over post-RoPE keys and values and asks for attention outputs; how K
// and V are stored (dense f32 here, quantized pool blocks later) and how
// attention reads them stays behind this interface (docs/design.md rule 4: the
// storage computes attention over its own blocks, nothing copies them out).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "qkvshare/core/thread_pool.hpp"

namespace qkvshare {

struct KvRope;  // pooled_kv_cache.hpp

// The attention of one cache and layer for a pass, cut into independent jobs
// but not run: a batched forward pass collects the work of every session and
// runs all jobs in one ThreadPool::parallel_for (run_attend_works), so a
// batch of N sessions costs one thread-pool round per layer, not N.
class AttendWork {
 public:
  virtual ~AttendWork() = default;
  virtual std::size_t jobs() const noexcept = 0;
  // Relative cost of one job (the jobs of one work cost about the same); used
  // to give every thread an equal share of a batch's mixed jobs.
  virtual double job_cost() const noexcept = 0;
  // Runs one job. Distinct jobs may run at the same time on any threads.
  virtual void run(std::size_t job) = 0;
  // After every job ran: combines partial results (split-K), on the caller.
  virtual void finish() = 0;
};

// Runs every job of every work in one parallel_for, threads' shares balanced
// by job cost, then finish() of each work. Which thread runs a job never
// changes what it computes, so results equal running each work alone.
void run_attend_works(std::span<AttendWork* const> works, ThreadPool& pool);

struct KvShape {
  int n_layers = 0;
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // key/value heads (grouped-query attention)
  int head_dim = 0;
  // Sliding-window layers (gemma3's local layers): layer_window[l] > 0 is the
  // number of most recent tokens layer l attends to, 0 a global layer; empty:
  // every layer global. With both kinds, the pool keeps only the global
  // layers of a block that has left every window (KvPool, kBlockWindowFreed).
  std::vector<int> layer_window;

  KvShape() = default;
  KvShape(int layers, int heads, int kv_heads, int dim, std::vector<int> windows = {})
      : n_layers(layers), n_heads(heads), n_kv_heads(kv_heads), head_dim(dim), layer_window(std::move(windows)) {}
  int kv_dim() const noexcept { return n_kv_heads * head_dim; }
  int q_dim() const noexcept { return n_heads * head_dim; }
  int window(int layer) const noexcept {
    return layer_window.empty() ? 0 : layer_window[static_cast<std::size_t>(layer)];
  }
  // The largest window: a token this far behind the context's end is seen by global layers only.
  int max_window() const noexcept {
    int w = 0;
    for (const int x : layer_window) w = std::max(w, x);
    return w;
  }
  int global_layers() const noexcept {
    int n = 0;
    for (int l = 0; l < n_layers; ++l) n += window(l) == 0 ? 1 : 0;
    return n;
  }
  // Windowed layers beside global ones: blocks can leave their windowed layers' tiles behind.
  bool frees_windowed() const noexcept { return max_window() > 0 && global_layers() > 0; }
  // Layers a block stores: all, or (windowed_freed) the global ones alone.
  int stored_layers(bool windowed_freed) const noexcept { return windowed_freed ? global_layers() : n_layers; }
  // Index of `layer` among the tiles of such a block, or -1 when it is not stored.
  int stored_index(int layer, bool windowed_freed) const noexcept {
    if (!windowed_freed) return layer;
    if (window(layer) > 0) return -1;
    int i = 0;
    for (int l = 0; l < layer; ++l) i += window(l) == 0 ? 1 : 0;
    return i;
  }
  // The dimensions and windows alike.
  bool operator==(const KvShape&) const = default;
  // The dimensions alone (layers, heads, KV heads, head size).
  bool same_dims(const KvShape& o) const noexcept {
    return n_layers == o.n_layers && n_heads == o.n_heads && n_kv_heads == o.n_kv_heads && head_dim == o.head_dim;
  }
};

class KvCache {
 public:
  virtual ~KvCache() = default;

  virtual const KvShape& shape() const noexcept = 0;
  // Tokens committed so far (every layer written).
  virtual int size() const noexcept = 0;
  // Most tokens this cache can hold.
  virtual int capacity() const noexcept = 0;
  // The position (RoPE) of the next token: size(), unless tokens were
  // dropped from the context with their positions kept (PooledKvCache::evict).
  virtual int next_position() const noexcept { return size(); }

  // Stores keys and values of `n` new tokens for one layer, at token indices
  // [size(), size() + n). k and v are [n][kv_dim], keys already rotated
  // (RoPE) unless keys_before_rope().
  // Throws Error(context_full / out_of_memory) if they do not fit.
  virtual void write(int layer, int n, const float* k, const float* v) = 0;

  // Causal attention of the `n` tokens just written to `layer`: query t sees
  // tokens [0, size() + t], or with window > 0 (a sliding-window layer) the
  // last `window` of them, itself included: [size() + t + 1 - window, size() + t].
  // q and out are [n][q_dim]; q is rotated. The work belongs to the cache and
  // stays valid until its next write, plan_attend or commit; q and out must
  // stay valid until the work has finished.
  virtual AttendWork& plan_attend(int layer, int n, const float* q, float* out, int window = 0) = 0;

  // plan_attend, then its jobs on `pool`: the attention of one cache alone.
  void attend(int layer, int n, const float* q, float* out, ThreadPool& pool, int window = 0);

  // Makes the `n` tokens written to every layer part of the cache.
  virtual void commit(int n) = 0;

  // Whether write() takes keys before RoPE (a cache that applies RoPE when it
  // reads them: KvFormat::key_rope); the engine then gives it the model's
  // frequencies with set_rope() before each pass.
  virtual bool keys_before_rope() const noexcept { return false; }
  virtual void set_rope(const KvRope&) {}
};

}  // namespace qkvshare
