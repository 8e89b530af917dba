// Every ISA level's matmul, for every weight type, against the scalar
// reference (dequantized weights, f32 activations, double sums) within the
// bound of kernel_test_util.hpp, and against the portable level within the
// f32 part of it alone (same activation rounding, other summation order).
#include <gtest/gtest.h>

#include <cstring>

#include "kernel_test_util.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/thread_pool.hpp"

namespace qkvshare::kernels::testing {
namespace {

const GgmlType kAllTypes[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16, GgmlType::Q8_0,   GgmlType::Q4_0,
                              GgmlType::Q4_1, GgmlType::Q6_K, GgmlType::Q5_0, GgmlType::Q5_1,   GgmlType::Q2_K,
                              GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS};

std::vector<std::int64_t> cols_for(GgmlType type) {
  if (!quantizes_activations(type)) return {1, 7, 17, 172, 576};  // 172: stories260K's hidden size
  if (type_traits(type).block_size == kQK_K) return {256, 768};
  return {32, 96, 576};  // 96: an odd number of blocks (AVX-512 pairs them)
}

// Runs matmul at every level and checks each output.
void check_all_isas(const Weights& w, const std::vector<float>& x, std::int64_t tokens, const std::string& what) {
  const std::int64_t rows = w.view.rows(), cols = w.view.cols();
  std::vector<float> ref(static_cast<std::size_t>(rows * tokens));
  matmul_ref(w.view, x.data(), tokens, ref.data());
  std::vector<float> portable;
  ThreadPool pool(2);
  for (Isa isa : available_isas()) {
    const IsaGuard guard(isa);
    std::vector<float> y(ref.size(), -1.0f);
    matmul(pool, w.view, x.data(), tokens, y.data());
    if (isa == Isa::portable) portable = y;
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t r = 0; r < rows; ++r) {
        const auto i = static_cast<std::size_t>(t * rows + r);
        const DotBound b = dot_error_bound(w.view.type, w.magnitude.data() + r * cols, x.data() + t * cols, cols);
        ASSERT_LE(std::fabs(static_cast<double>(y[i]) - ref[i]), b.total())
            << what << " isa " << isa_name(isa) << " row " << r << " token " << t << ": got " << y[i] << ", reference "
            << ref[i];
        ASSERT_LE(std::fabs(static_cast<double>(y[i]) - portable[i]), 2.0 * b.fp)
            << what << " isa " << isa_name(isa) << " vs portable, row " << r << " token " << t << ": got " << y[i]
            << ", portable " << portable[i];
      }
  }
}

TEST(MatmulIsa, RandomDataEveryTypeShapeAndLevel) {
  std::mt19937 rng(42);
  for (GgmlType type : kAllTypes)
    for (std::int64_t cols : cols_for(type))
      for (std::int64_t rows : {1, 5, 17})
        for (std::int64_t tokens : {1, 2, 3, 4, 7, 8, 12, 33}) {
          const Weights w = make_weights(type, rows, cols, normal(static_cast<std::size_t>(rows * cols), 1.0f, rng));
          const auto x = normal(static_cast<std::size_t>(tokens * cols), 1.0f, rng);
          check_all_isas(w, x, tokens, shape_name(type, rows, cols, tokens));
          if (HasFatalFailure()) return;
        }
}

// The threaded float-activation path is the scalar reference, bit for bit,
// whatever the thread count and the split of rows between threads.
TEST(MatmulIsa, ExactMatmulIsTheReferenceOnEveryThreadCount) {
  std::mt19937 rng(7);
  for (GgmlType type : kAllTypes) {
    const std::int64_t cols = cols_for(type).back();
    const Weights w = make_weights(type, 37, cols, normal(static_cast<std::size_t>(37 * cols), 1.0f, rng));
    const auto x = normal(static_cast<std::size_t>(5 * cols), 1.0f, rng);
    std::vector<float> ref(37 * 5);
    matmul_ref(w.view, x.data(), 5, ref.data());
    for (int threads : {1, 2, 3}) {
      ThreadPool pool(threads);
      std::vector<float> y(ref.size(), -1.0f);
      matmul_exact(pool, w.view, x.data(), 5, y.data());
      EXPECT_EQ(0, std::memcmp(y.data(), ref.data(), y.size() * sizeof(float))) << shape_name(type, 37, cols, 5)
                                                                                    << " threads " << threads;
    }
  }
}

// More tokens than one activation chunk (64) and rows that fill several tiles.
TEST(MatmulIsa, BatchLargerThanATokenChunk) {
  std::mt19937 rng(7);
  for (GgmlType type : kAllTypes) {
    const std::int64_t cols = quantizes_activations(type) ? cols_of(type, 2) : 64, rows = 37, tokens = 70;
    const Weights w = make_weights(type, rows, cols, normal(static_cast<std::size_t>(rows * cols), 1.0f, rng));
    check_all_isas(w, normal(static_cast<std::size_t>(tokens * cols), 1.0f, rng), tokens,
                   shape_name(type, rows, cols, tokens));
  }
}

// Codes over their whole range (Q8_0's -128, every nibble and 6-bit value).
TEST(MatmulIsa, RandomCodesOverTheFullRange) {
  std::mt19937 rng(3);
  for (GgmlType type : kBlockTypes) {
    const std::int64_t cols = cols_of(type, 5) == 160 ? 160 : 512, rows = 9;
    Weights w = make_weights(type, rows, cols, std::vector<float>(static_cast<std::size_t>(rows * cols), 0.0f));
    randomize_codes(w, 0.05f, rng);
    check_all_isas(w, normal(static_cast<std::size_t>(3 * cols), 2.0f, rng), 3, shape_name(type, rows, cols, 3));
  }
}

TEST(MatmulIsa, ZerosGiveExactZeros) {
  std::mt19937 rng(5);
  ThreadPool pool(2);
  for (GgmlType type : kAllTypes) {
    const std::int64_t cols = quantizes_activations(type) ? cols_of(type, 3) : 96, rows = 6, tokens = 3;
    const Weights zero_w = make_weights(type, rows, cols, std::vector<float>(static_cast<std::size_t>(rows * cols), 0.0f));
    const Weights rand_w = make_weights(type, rows, cols, normal(static_cast<std::size_t>(rows * cols), 1.0f, rng));
    const auto rand_x = normal(static_cast<std::size_t>(tokens * cols), 1.0f, rng);
    const std::vector<float> zero_x(rand_x.size(), 0.0f);
    for (Isa isa : available_isas()) {
      const IsaGuard guard(isa);
      for (const auto& [w, x] : {std::pair{&zero_w, &rand_x}, std::pair{&rand_w, &zero_x}}) {
        std::vector<float> y(static_cast<std::size_t>(rows * tokens), -1.0f);
        matmul(pool, w->view, x->data(), tokens, y.data());
        for (float v : y) ASSERT_EQ(v, 0.0f) << type_name(type) << " " << isa_name(isa);
      }
    }
  }
}

// Large activations and weights (no overflow of f32 or of the f16 scales),
// activations around the flush threshold, and weights so small that their
// f16 scales are subnormal.
TEST(MatmulIsa, MagnitudeEdgeCases) {
  std::mt19937 rng(11);
  struct Scale {
    float w, x;
  };
  for (GgmlType type : kAllTypes) {
    // The largest weights whose f16 values or block scales stay finite.
    const bool f16_scale_x_codes = type == GgmlType::Q4_0 || type == GgmlType::Q4_1 || type == GgmlType::Q5_0 ||
                                   type == GgmlType::Q5_1 || type == GgmlType::IQ4_NL;
    // K-quant super-block scales are the largest group scale / 63 or less: f16 holds less.
    const bool kquant = type_traits(type).block_size == kQK_K && type != GgmlType::Q6_K;
    const float big = type == GgmlType::F16 ? 1e3f : (f16_scale_x_codes ? 1e4f : (kquant ? 1e3f : 1e6f));
    const bool half = type == GgmlType::F16;
    for (const Scale s : {Scale{big, 1e15f}, Scale{1.0f, 1e-25f}, Scale{1.0f, 1e-31f},
                          Scale{1e-6f, 1.0f}, Scale{half ? 1e-6f : 1e-30f, 1e-3f}}) {
      const std::int64_t cols = cols_of(type, 5) == 160 ? 160 : 256, rows = 7, tokens = 3;
      const Weights w = make_weights(type, rows, cols, normal(static_cast<std::size_t>(rows * cols), s.w, rng));
      auto x = normal(static_cast<std::size_t>(tokens * cols), s.x, rng);
      x[5] *= 50.0f;  // an outlier that sets its block's scale
      check_all_isas(w, x, tokens, shape_name(type, rows, cols, tokens) + " scales " + std::to_string(s.w) + "/" +
                                       std::to_string(s.x));
    }
  }
}

// Results do not depend on the thread count or on how outputs are grouped:
// each output is computed by the same instructions in the same order.
TEST(MatmulIsa, ThreadCountAndMultiMatmulGiveIdenticalBits) {
  std::mt19937 rng(13);
  const std::int64_t cols = 256, tokens = 5;
  const Weights a = make_weights(GgmlType::Q4_0, 50, cols, normal(50 * cols, 1.0f, rng));
  const Weights b = make_weights(GgmlType::Q8_0, 30, cols, normal(30 * cols, 1.0f, rng));
  const Weights c = make_weights(GgmlType::F16, 20, cols, normal(20 * cols, 1.0f, rng));
  const Weights d = make_weights(GgmlType::Q4_0, 9, cols, normal(9 * cols, 1.0f, rng));
  const auto x = normal(tokens * cols, 1.0f, rng);
  for (Isa isa : available_isas()) {
    const IsaGuard guard(isa);
    ThreadPool one(1), two(2);
    std::vector<std::vector<float>> single, multi;
    std::vector<MatmulOut> outs;
    for (const Weights* w : {&a, &b, &c, &d}) {
      single.emplace_back(static_cast<std::size_t>(w->view.rows() * tokens));
      multi.emplace_back(single.back().size());
      matmul(one, w->view, x.data(), tokens, single.back().data());
      outs.push_back({&w->view, multi.back().data()});
    }
    matmul_multi(two, outs, x.data(), tokens);
    for (std::size_t i = 0; i < single.size(); ++i) EXPECT_EQ(single[i], multi[i]) << isa_name(isa) << " output " << i;
  }
}

// Prefill (weights decoded once into a buffer, register tiles of several
// tokens) and decode (one token, weights read as used) run the same
// arithmetic per output: a token's result does not depend on its batch.
TEST(MatmulIsa, BatchedTokensGiveTheBitsOfSingleTokens) {
  std::mt19937 rng(19);
  ThreadPool pool(2);
  for (GgmlType type : kAllTypes) {
    const std::int64_t cols = quantizes_activations(type) ? cols_of(type, 3) == 96 ? 96 : 512 : 103;
    const std::int64_t rows = 13;
    const Weights w = make_weights(type, rows, cols, normal(static_cast<std::size_t>(rows * cols), 1.0f, rng));
    const auto x = normal(static_cast<std::size_t>(70 * cols), 1.0f, rng);
    // 2-9: the few-token streaming paths (sessions decoding together); 12, 17: buffered tiles and remainders.
    for (std::int64_t tokens : {2, 3, 4, 5, 6, 7, 8, 9, 12, 17, 70})
      for (Isa isa : available_isas()) {
        const IsaGuard guard(isa);
        std::vector<float> batched(static_cast<std::size_t>(rows * tokens)), single(batched.size());
        matmul(pool, w.view, x.data(), tokens, batched.data());
        for (std::int64_t t = 0; t < tokens; ++t)
          matmul(pool, w.view, x.data() + t * cols, 1, single.data() + t * rows);
        EXPECT_EQ(batched, single) << type_name(type) << " " << isa_name(isa) << " tokens " << tokens;
      }
  }
}

// Q4_K and Q5_K decode reads rows as they lie and sums each super-block
// across lanes, where prefill reads transposed 16-row tiles: the same bits
// all the same, over every code, scale and minimum (random bytes), several
// tiles and a partial one, and many super-blocks.
TEST(MatmulIsa, KQuantDecodeGivesThePrefillBits) {
  std::mt19937 rng(23);
  ThreadPool pool(2);
  for (GgmlType type : {GgmlType::Q4_K, GgmlType::Q5_K}) {
    const std::int64_t rows = 53, cols = 2304, tokens = 70;
    Weights w = make_weights(type, rows, cols, std::vector<float>(static_cast<std::size_t>(rows * cols), 0.0f));
    randomize_codes(w, 0.05f, rng);
    const auto x = normal(static_cast<std::size_t>(tokens * cols), 2.0f, rng);
    for (Isa isa : available_isas()) {
      const IsaGuard guard(isa);
      std::vector<float> batched(static_cast<std::size_t>(rows * tokens)), single(batched.size());
      matmul(pool, w.view, x.data(), tokens, batched.data());
      for (std::int64_t t = 0; t < tokens; ++t) matmul(pool, w.view, x.data() + t * cols, 1, single.data() + t * rows);
      EXPECT_EQ(0, std::memcmp(batched.data(), single.data(), batched.size() * sizeof(float)))
          << type_name(type) << " " << isa_name(isa);
    }
  }
}

TEST(MatmulIsa, RejectsUnsupportedTypesAndForcedUnavailableLevels) {
  std::vector<std::uint8_t> bytes(292 * 4);
  TensorView w;
  w.type = GgmlType::Q8_K;  // a known type without a matmul kernel
  w.n_dims = 2;
  w.ne = {256, 4, 1, 1};
  w.data = bytes.data();
  w.nbytes = bytes.size();
  std::vector<float> x(32), y(4);
  ThreadPool pool(1);
  EXPECT_THROW(matmul(pool, w, x.data(), 1, y.data()), Error);
  for (Isa isa : kAllIsas)
    if (!isa_available(isa)) {
      EXPECT_THROW(set_active_isa(isa), Error);
    }
  EXPECT_EQ(active_isa(), best_isa());
}

}  // namespace
}  // namespace qkvshare::kernels::testing
