// k-means for the PQ codebooks (kv_codebook.hpp): one problem per layer, KV
// head, K/V and sub-space, spread over threads; each is deterministic for the
// seed, whatever the thread count.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <random>
#include <thread>

#include "qkvshare/core/error.hpp"
#include "pq_nearest.hpp"
#include "qkvshare/kv/kv_codebook.hpp"

namespace qkvshare {

namespace {

constexpr int C = KvCodebook::kCentroids;

// Lloyd iterations on points [n][sub]; writes centroids [C][sub].
void kmeans(const std::vector<float>& pts, int n, int sub, const CodebookTraining& how, std::uint32_t seed,
            float* out) {
  std::mt19937 rng(seed);
  std::vector<int> order(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<float> cen(static_cast<std::size_t>(C) * sub), ct(cen.size()), norms(C), d(C), sum(cen.size());
  std::vector<int> count(C);
  for (int c = 0; c < C; ++c)
    for (int e = 0; e < sub; ++e)
      cen[static_cast<std::size_t>(c) * sub + e] = pts[static_cast<std::size_t>(order[static_cast<std::size_t>(c % n)]) * sub + e];
  std::uniform_int_distribution<int> pick(0, n - 1);
  for (int it = 0; it < how.iterations; ++it) {
    for (int c = 0; c < C; ++c)
      for (int e = 0; e < sub; ++e) ct[static_cast<std::size_t>(e) * C + c] = cen[static_cast<std::size_t>(c) * sub + e];
    kv::centroid_norms(ct.data(), sub, norms.data());
    std::fill(sum.begin(), sum.end(), 0.0f);
    std::fill(count.begin(), count.end(), 0);
    for (int i = 0; i < n; ++i) {
      const float* x = &pts[static_cast<std::size_t>(i) * sub];
      const int b = kv::nearest_centroid(x, ct.data(), norms.data(), sub, d.data());
      ++count[static_cast<std::size_t>(b)];
      for (int e = 0; e < sub; ++e) sum[static_cast<std::size_t>(b) * sub + e] += x[e];
    }
    for (int c = 0; c < C; ++c) {
      float* cc = &cen[static_cast<std::size_t>(c) * sub];
      if (count[static_cast<std::size_t>(c)] == 0) {  // an empty cluster restarts at a random point
        const float* x = &pts[static_cast<std::size_t>(pick(rng)) * sub];
        for (int e = 0; e < sub; ++e) cc[e] = x[e];
        continue;
      }
      const float inv = 1.0f / static_cast<float>(count[static_cast<std::size_t>(c)]);
      for (int e = 0; e < sub; ++e) cc[e] = sum[static_cast<std::size_t>(c) * sub + e] * inv;
    }
  }
  std::copy(cen.begin(), cen.end(), out);
}

}  // namespace

KvCodebook train_codebook(const KvCodebook::Header& header, const std::vector<float>& keys,
                          const std::vector<float>& values, int tokens, const CodebookTraining& how) {
  KvCodebook book(header);
  const int L = header.n_layers, H = header.n_kv_heads, D = header.head_dim, sub = header.sub, S = D / sub;
  const std::size_t kvd = static_cast<std::size_t>(H) * D;
  const std::size_t want = static_cast<std::size_t>(L) * static_cast<std::size_t>(tokens) * kvd;
  if (tokens < C || keys.size() != want || values.size() != want)
    fail(ErrorCode::invalid_argument, "PQ calibration: {} tokens of {} / {} floats (need >= {} tokens of {} floats)",
         tokens, keys.size(), values.size(), C, want / static_cast<std::size_t>(std::max(tokens, 1)));
  const int problems = 2 * L * H * S;
  std::atomic<int> next{0};
  const auto worker = [&] {
    std::vector<float> pts(static_cast<std::size_t>(tokens) * sub);
    for (int p; (p = next.fetch_add(1)) < problems;) {
      const int s = p % S, h = (p / S) % H, l = (p / (S * H)) % L, kind = p / (S * H * L);
      const std::vector<float>& src = kind == 0 ? keys : values;
      for (int t = 0; t < tokens; ++t) {
        const float* row = &src[(static_cast<std::size_t>(l) * tokens + static_cast<std::size_t>(t)) * kvd +
                                static_cast<std::size_t>(h) * D + static_cast<std::size_t>(s) * sub];
        std::copy(row, row + sub, &pts[static_cast<std::size_t>(t) * sub]);
      }
      float* out = book.table(kind, l, h) + static_cast<std::size_t>(s) * C * sub;
      kmeans(pts, tokens, sub, how, how.seed * 2654435761u + static_cast<std::uint32_t>(p), out);
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < std::max(1, how.threads); ++i) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  book.finish();
  return book;
}

}  // namespace qkvshare
