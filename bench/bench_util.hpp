#pragma once
// Helpers shared by the benchmark programs (bench_handoff, bench_tiers):
// a median of samples, and a context filled with random K/V the way a
// forward pass writes it.
#include <algorithm>
#include <random>
#include <vector>

#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Fills `n` tokens of random K/V, layer by layer in chunks of 256, as prefill does.
inline void fill_random_kv(PooledKvCache& cache, int n) {
  const KvShape& s = cache.shape();
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const int chunk = 256;
  std::vector<float> k(static_cast<std::size_t>(chunk) * s.kv_dim()), v(k.size());
  for (auto& x : k) x = g(rng);
  for (auto& x : v) x = g(rng);
  for (int done = 0; done < n; done += chunk) {
    const int m = std::min(chunk, n - done);
    for (int l = 0; l < s.n_layers; ++l) cache.write(l, m, k.data(), v.data());
    cache.commit(m);
  }
}

}  // namespace qkvshare::bench
