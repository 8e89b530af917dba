#pragma once
// Drives a KvCache the way the forward pass does (write, attend per layer,
// then commit) with synthetic rows, so pool behaviour is tested without a model.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "qkvshare/kernels/isa.hpp"
#include "qkvshare/kv/kv_cache.hpp"
#include "qkvshare/kv/kv_kernels.hpp"

namespace qkvshare::testing {

// stories260K's KV shape: 5 layers, 8 query heads, 4 KV heads of 8.
inline const KvShape kStoriesKvShape{5, 8, 4, 8};

struct Pass {
  std::vector<std::vector<float>> k, v, q;  // per layer
};

// Restores the kernels' ISA when a test that forced one ends.
struct IsaGuard {
  kernels::Isa saved = kernels::active_isa();
  ~IsaGuard() { kernels::set_active_isa(saved); }
};

inline Pass random_pass(const KvShape& s, int n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  Pass p;
  for (int l = 0; l < s.n_layers; ++l) {
    std::vector<float> k(static_cast<std::size_t>(n) * s.kv_dim()), v(k.size()), q(static_cast<std::size_t>(n) * s.q_dim());
    for (std::size_t i = 0; i < k.size(); ++i) {
      const int c = static_cast<int>(i % static_cast<std::size_t>(s.head_dim));
      k[i] = g(rng) * (c == 1 ? 6.0f : 1.0f);  // an outlier key channel
      v[i] = g(rng);
    }
    for (auto& x : q) x = g(rng);
    p.k.push_back(std::move(k));
    p.v.push_back(std::move(v));
    p.q.push_back(std::move(q));
  }
  return p;
}

// Runs one pass (every layer with the same sliding window, 0: none); returns
// the attention outputs of every layer, concatenated.
inline std::vector<float> run_pass(KvCache& cache, const Pass& p, int n, ThreadPool& pool, int window = 0) {
  const KvShape& s = cache.shape();
  std::vector<float> all;
  std::vector<float> out(static_cast<std::size_t>(n) * s.q_dim());
  for (int l = 0; l < s.n_layers; ++l) {
    cache.write(l, n, p.k[static_cast<std::size_t>(l)].data(), p.v[static_cast<std::size_t>(l)].data());
    cache.attend(l, n, p.q[static_cast<std::size_t>(l)].data(), out.data(), pool, window);
    all.insert(all.end(), out.begin(), out.end());
  }
  cache.commit(n);
  return all;
}

// Largest |a[i] - b[i]|; infinity when the sizes differ.
inline float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::numeric_limits<float>::infinity();
  float m = 0.0f;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// Attention on codes on or off (kv::set_codes_attention) for a scope.
class CodesAttentionScope {
 public:
  explicit CodesAttentionScope(bool on) : saved_(kv::codes_attention()) { kv::set_codes_attention(on); }
  ~CodesAttentionScope() { kv::set_codes_attention(saved_); }
  CodesAttentionScope(const CodesAttentionScope&) = delete;
  CodesAttentionScope& operator=(const CodesAttentionScope&) = delete;

 private:
  bool saved_;
};

// How far an attention output may be from float math over the same stored
// rows (random rows and queries of unit scale): float rounding alone when
// tiles are decoded; on codes, also the rounding of queries and weights
// (kernels/kv_tiles.hpp): 15 bits (a flip moves an output by 1/32767 of the
// largest weight's share), or 8 bits for queries against 4- and 2-bit keys,
// whose score error is then a fraction of those keys' own.
inline float attention_tolerance(const KvFormat& f) {
  if (!kv::codes_attention()) return 2e-5f;
  const bool byte_queries = (f.k.type == KvType::q4 || f.k.type == KvType::q2) && f.k.axis == KvAxis::channel;
  // 4- and 2-bit values sum under 7-bit weights (kernels::value_weight_max).
  const bool byte_weights = (f.v.type == KvType::q4 || f.v.type == KvType::q2) && f.v.axis == KvAxis::token;
  return byte_queries ? 0.15f : byte_weights ? 0.03f : 2e-3f;
}

}  // namespace qkvshare::testing
