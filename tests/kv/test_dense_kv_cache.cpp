// DenseKvCache against attention computed here in double precision from the
// rows it was given: every ISA's tile kernels, tiles of 16 and 32 rows, a
// head size the tile kernels do not take (the exact path), sliding windows,
// and passes of many tokens, one token and a chunk that ends inside a tile.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kv_test_util.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/isa.hpp"
#include "qkvshare/kv/dense_kv_cache.hpp"

namespace qkvshare {
namespace {

using testing::random_pass;
using testing::run_pass;

// Outputs of every layer for a pass of n tokens after `before` tokens, from
// all passes' rows so far (rows[l] holds [token][kv_dim]).
std::vector<float> attention_in_double(const KvShape& s, const std::vector<std::vector<float>>& k_rows,
                                       const std::vector<std::vector<float>>& v_rows,
                                       const testing::Pass& p, int before, int n, int window) {
  const int D = s.head_dim, group = s.n_heads / s.n_kv_heads;
  std::vector<float> all;
  for (int l = 0; l < s.n_layers; ++l) {
    const auto& K = k_rows[static_cast<std::size_t>(l)];
    const auto& V = v_rows[static_cast<std::size_t>(l)];
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < s.n_heads; ++h) {
        const float* q = &p.q[static_cast<std::size_t>(l)][static_cast<std::size_t>(t) * s.q_dim() + h * D];
        const int end = before + t + 1, first = window > 0 ? std::max(0, end - window) : 0;
        const int kvh = h / group;
        std::vector<double> w;
        double m = -1e300;
        for (int j = first; j < end; ++j) {
          double dot = 0;
          const float* k = &K[static_cast<std::size_t>(j) * s.kv_dim() + kvh * D];
          for (int c = 0; c < D; ++c) dot += static_cast<double>(q[c]) * k[c];
          w.push_back(dot / std::sqrt(static_cast<double>(D)));
          m = std::max(m, w.back());
        }
        double sum = 0;
        for (double& x : w) sum += (x = std::exp(x - m));
        for (int c = 0; c < D; ++c) {
          double o = 0;
          for (int j = first; j < end; ++j) {
            const double v = V[static_cast<std::size_t>(j) * s.kv_dim() + kvh * D + c];
            o += w[static_cast<std::size_t>(j - first)] * v;
          }
          all.push_back(static_cast<float>(o / sum));
        }
      }
  }
  return all;
}

TEST(DenseKvCache, AttentionMatchesDoublePrecisionOnEveryIsa) {
  testing::IsaGuard guard;
  ThreadPool threads(2);
  const KvShape shapes[] = {{2, 8, 4, 8}, {1, 6, 2, 64}, {2, 4, 2, 12}};
  for (const kernels::Isa isa : kernels::kAllIsas) {
    if (!kernels::isa_available(isa)) continue;
    kernels::set_active_isa(isa);
    for (const KvShape& s : shapes)
      for (const int tile : {16, 32})
        for (const int window : {0, 5, 40}) {
          DenseKvCache cache(s, 200, tile);
          std::vector<std::vector<float>> k_rows(static_cast<std::size_t>(s.n_layers)), v_rows(k_rows.size());
          unsigned seed = 3;
          for (const int n : {40, 1, 1, 17, 33}) {
            const int before = cache.size();
            const auto pass = random_pass(s, n, seed++);
            for (std::size_t l = 0; l < k_rows.size(); ++l) {
              k_rows[l].insert(k_rows[l].end(), pass.k[l].begin(), pass.k[l].end());
              v_rows[l].insert(v_rows[l].end(), pass.v[l].begin(), pass.v[l].end());
            }
            const auto got = run_pass(cache, pass, n, threads, window);
            const auto want = attention_in_double(s, k_rows, v_rows, pass, before, n, window);
            ASSERT_LE(testing::max_abs_diff(got, want), 2e-5f) << kernels::isa_name(isa) << " head_dim " << s.head_dim << " tile "
                                    << tile << " window " << window << " n " << n;
          }
          // The rows read back are the rows written.
          std::vector<float> k(static_cast<std::size_t>(s.kv_dim())), v(k.size());
          for (const int t : {0, 57, cache.size() - 1}) {
            cache.read_row(s.n_layers - 1, t, k.data(), v.data());
            const auto at = k_rows.back().begin() + static_cast<std::ptrdiff_t>(t) * s.kv_dim();
            ASSERT_TRUE(std::equal(k.begin(), k.end(), at)) << "token " << t;
            ASSERT_TRUE(std::equal(v.begin(), v.end(), v_rows.back().begin() + (at - k_rows.back().begin())));
          }
        }
  }
}

TEST(DenseKvCache, RejectsWhatDoesNotFit) {
  const KvShape s{1, 2, 1, 8};
  EXPECT_THROW(DenseKvCache(s, 0), Error);
  EXPECT_THROW(DenseKvCache(s, 10, 0), Error);
  DenseKvCache cache(s, 10);
  std::vector<float> rows(11 * 8);
  EXPECT_THROW(cache.write(0, 11, rows.data(), rows.data()), Error);
}

}  // namespace
}  // namespace qkvshare
