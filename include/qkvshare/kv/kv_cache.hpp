#pragma once
// The narrow interface between the forward pass and KV storage. The engine
// hands over post-RoPE keys and values and asks for attention outputs; how K
// and V are stored (dense f32 here, quantized pool blocks later) and how
// attention reads them stays behind this interface (docs/design.md rule 4: the
// storage computes attention over its own blocks, nothing copies them out).
#include <cstdint>

#include "qkvshare/core/thread_pool.hpp"

namespace qkvshare {

struct KvShape {
  int n_layers = 0;
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // key/value heads (grouped-query attention)
  int head_dim = 0;
  int kv_dim() const noexcept { return n_kv_heads * head_dim; }
  int q_dim() const noexcept { return n_heads * head_dim; }
};

class KvCache {
 public:
  virtual ~KvCache() = default;

  virtual const KvShape& shape() const noexcept = 0;
  // Tokens committed so far (every layer written).
  virtual int size() const noexcept = 0;
  // Most tokens this cache can hold.
  virtual int capacity() const noexcept = 0;

  // Stores keys and values of `n` new tokens for one layer, at token indices
  // [size(), size() + n). k and v are [n][kv_dim], keys already rotated.
  // Throws Error(context_full / out_of_memory) if they do not fit.
  virtual void write(int layer, int n, const float* k, const float* v) = 0;

  // Causal attention of the `n` tokens just written to `layer`: query t sees
  // tokens [0, size() + t]. q and out are [n][q_dim]; q is rotated.
  virtual void attend(int layer, int n, const float* q, float* out, ThreadPool& pool) = 0;

  // Makes the `n` tokens written to every layer part of the cache.
  virtual void commit(int n) = 0;
};

}  // namespace qkvshare
