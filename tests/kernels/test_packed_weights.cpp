// Packed Q4_0, Q4_1 and Q8_0 weights (packed_weights.hpp): the packed kernels give the bits
// of the rows it was packed from, for one token, a batch of sessions and a
// prefill chunk, on every thread count; rows of a matmul group that do not
// start on a whole tile fall back to the rows as stored; what packs and what
// does not.
#include <gtest/gtest.h>

#include <cstring>
#include <new>

#include "kernel_test_util.hpp"
#include "qkvshare/core/thread_pool.hpp"
#include "qkvshare/kernels/packed_weights.hpp"

namespace qkvshare::kernels::testing {
namespace {

struct Packed {
  std::vector<std::uint8_t> bytes;
  TensorView view;
};

Packed pack(const Weights& w) {
  Packed p;
  p.bytes.resize(w.view.nbytes);
  pack_tiles(w.view, 0, w.view.rows() / kPackedTileRows, p.bytes.data());
  p.view = w.view;
  p.view.packed = p.bytes.data();
  return p;
}

constexpr GgmlType kPackedTypes[] = {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0};

bool packed_level_active() {
  Weights w = make_weights(GgmlType::Q4_0, 16, 32, std::vector<float>(16 * 32, 1.0f));
  return packs(w.view);
}

TEST(PackedWeights, GiveTheBitsOfTheRowsAsStored) {
  if (!packed_level_active()) GTEST_SKIP() << "*** no kernel level on this CPU reads packed Q4_0 tiles (AVX-512 does) ***";
  std::mt19937 rng(71);
  for (const int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (const GgmlType type : kPackedTypes)
    for (const std::int64_t rows : {16, 48, 160})
      for (const std::int64_t cols : {32, 96, 256}) {
        Weights w = make_weights(type, rows, cols, normal(static_cast<std::size_t>(rows * cols), 1.0f, rng));
        randomize_codes(w, 0.05f, rng);
        const Packed p = pack(w);
        for (const std::int64_t n : {1, 2, 3, 4, 5, 8, 9, 17, 70}) {
          const auto x = normal(static_cast<std::size_t>(n * cols), 1.0f, rng);
          std::vector<float> plain(static_cast<std::size_t>(n * rows)), packed(plain.size(), -1.0f);
          matmul(pool, w.view, x.data(), n, plain.data());
          matmul(pool, p.view, x.data(), n, packed.data());
          ASSERT_EQ(0, std::memcmp(plain.data(), packed.data(), plain.size() * sizeof(float)))
              << type_name(type) << " rows " << rows << " cols " << cols << " tokens " << n << " threads " << threads;
        }
      }
  }
}

// In a group, a packed matrix after one of 24 rows starts mid-tile of the
// group's row ranges: its ranges take the rows as stored; one after 32 rows
// reads packed tiles. Both give the bits of separate matmuls.
TEST(PackedWeights, GroupsWithUnalignedRangesFallBackToTheRows) {
  if (!packed_level_active()) GTEST_SKIP() << "*** no kernel level on this CPU reads packed Q4_0 tiles (AVX-512 does) ***";
  std::mt19937 rng(73);
  ThreadPool pool(2);
  const std::int64_t cols = 64;
  for (const GgmlType type : kPackedTypes)
  for (const std::int64_t first_rows : {24, 32}) {
    Weights a = make_weights(type, first_rows, cols, normal(static_cast<std::size_t>(first_rows * cols), 1.0f, rng));
    Weights b = make_weights(type, 64, cols, normal(static_cast<std::size_t>(64 * cols), 1.0f, rng));
    const Packed pb = pack(b);
    for (const std::int64_t n : {1, 4, 20}) {
      const auto x = normal(static_cast<std::size_t>(n * cols), 1.0f, rng);
      std::vector<float> ya(static_cast<std::size_t>(n * first_rows)), yb(static_cast<std::size_t>(n * 64));
      std::vector<float> ga(ya.size(), -1.0f), gb(yb.size(), -1.0f);
      matmul(pool, a.view, x.data(), n, ya.data());
      matmul(pool, b.view, x.data(), n, yb.data());
      const MatmulOut outs[] = {{&a.view, ga.data()}, {&pb.view, gb.data()}};
      matmul_multi(pool, outs, x.data(), n);
      EXPECT_EQ(ya, ga) << type_name(type) << " " << first_rows << " " << n;
      EXPECT_EQ(yb, gb) << type_name(type) << " " << first_rows << " " << n;
    }
  }
}

// Packing is lossless: every row comes back as the file stores it, and a
// row dequantized from the packed copy (a tied embedding's lookup) is the
// stored row's. Needs no packed kernel level.
TEST(PackedWeights, RowsComeBackAsStored) {
  std::mt19937 rng(83);
  for (const GgmlType type : kPackedTypes) {
    Weights w = make_weights(type, 48, 96, normal(48 * 96, 1.0f, rng));
    randomize_codes(w, 0.05f, rng);
    const Packed p = pack(w);
    std::vector<std::uint8_t> row(w.view.row_bytes());
    std::vector<float> a(96), b(96);
    for (std::int64_t r = 0; r < 48; ++r) {
      unpack_row(p.view, r, row.data());
      ASSERT_EQ(0, std::memcmp(row.data(), w.view.row(r), row.size())) << type_name(type) << " row " << r;
      dequantize_row(w.view, r, a.data());
      dequantize_row(p.view, r, b.data());
      ASSERT_EQ(a, b) << type_name(type) << " row " << r;
    }
  }
}

TEST(PackedWeights, WhatPacks) {
  std::mt19937 rng(79);
  const auto make = [&](GgmlType t, std::int64_t rows) {
    return make_weights(t, rows, 64, normal(static_cast<std::size_t>(rows * 64), 1.0f, rng));
  };
  EXPECT_FALSE(packs(make(GgmlType::Q5_0, 32).view));  // a type with no packed kernel
  EXPECT_FALSE(packs(make(GgmlType::Q4_0, 24).view));  // not whole tiles
  EXPECT_EQ(packs(make(GgmlType::Q4_1, 32).view), isa_available(Isa::avx512));
  EXPECT_EQ(packs(make(GgmlType::Q8_0, 32).view), isa_available(Isa::avx512));
  const Weights q = make(GgmlType::Q4_0, 32);
  {
    IsaGuard portable(Isa::portable);
    EXPECT_FALSE(packs(q.view));  // the portable level reads rows as stored
  }
  set_weight_packing(false);
  EXPECT_FALSE(packs(q.view));
  set_weight_packing(true);
  EXPECT_EQ(packs(q.view), isa_available(Isa::avx512));
}

}  // namespace
}  // namespace qkvshare::kernels::testing
