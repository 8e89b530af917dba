// attend_head_f32 at every ISA level against the scalar reference, for head
// sizes that are and are not multiples of the vector width.
#include <gtest/gtest.h>

#include "kernel_test_util.hpp"
#include "qkvshare/kernels/attention.hpp"

namespace qkvshare::kernels::testing {
namespace {

// Both sides compute scores s_j = scale * q.k_j with f32 dot products (error
// <= (hd + 8) u scale sum|q k_j| each), so they differ by at most twice that,
// ds. Softmax turns score errors into dp_j = p_j (ds_j - sum_k p_k ds_k), so
// |dp_j| <= 2 p_j max ds; the weighted sums of v add (n + 8) u sum_j p_j |v_j|
// on each side, and exp/normalisation a few u more.
double output_bound(const std::vector<float>& q, const std::vector<float>& kv, std::int64_t stride, int n, int hd,
                    float scale, const std::vector<float>& p, int i) {
  double max_ds = 0.0;
  for (int j = 0; j < n; ++j) {
    double s = 0.0;
    for (int c = 0; c < hd; ++c) s += std::fabs(static_cast<double>(q[c]) * kv[j * stride + c]);
    max_ds = std::max(max_ds, 2.0 * (hd + 8) * kU * scale * s);
  }
  double pv = 0.0;
  for (int j = 0; j < n; ++j) pv += p[j] * std::fabs(static_cast<double>(kv[j * stride + i]));
  return (2.0 * max_ds + 2.0 * (n + 8) * kU + 16.0 * kU) * pv * 1.01 + 1e-30;
}

TEST(AttentionIsa, EveryLevelMatchesTheReference) {
  std::mt19937 rng(17);
  for (int hd : {8, 16, 17, 64, 80, 128, 256})
    for (int n : {1, 2, 33, 300}) {
      const std::int64_t stride = hd + 5;  // keys of other heads in between
      const auto q = normal(static_cast<std::size_t>(hd), 1.0f, rng);
      const auto kv = normal(static_cast<std::size_t>(n * stride), 2.0f, rng);  // keys and values share data
      const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
      std::vector<float> ref(static_cast<std::size_t>(hd)), p(static_cast<std::size_t>(n));
      attend_head_f32_ref(q.data(), kv.data(), kv.data(), stride, n, hd, scale, p.data(), ref.data());
      for (Isa isa : available_isas()) {
        const IsaGuard guard(isa);
        std::vector<float> out(static_cast<std::size_t>(hd) + 1, 12345.0f), scores(static_cast<std::size_t>(n));
        attend_head_f32(q.data(), kv.data(), kv.data(), stride, n, hd, scale, scores.data(), out.data());
        EXPECT_EQ(out[static_cast<std::size_t>(hd)], 12345.0f) << "wrote past the head";
        for (int i = 0; i < hd; ++i)
          ASSERT_LE(std::fabs(static_cast<double>(out[i]) - ref[i]), output_bound(q, kv, stride, n, hd, scale, p, i))
              << isa_name(isa) << " head_dim " << hd << " keys " << n << " index " << i;
      }
    }
}

}  // namespace
}  // namespace qkvshare::kernels::testing
