#pragma once
// Shared helpers of the kernel tests: weight matrices of every type from
// random or edge-case data, the ISA levels to test, and the error bound of a
// dot product with 8-bit activations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "qkvshare/core/half.hpp"
#include "qkvshare/kernels/isa.hpp"
#include "qkvshare/kernels/matmul.hpp"
#include "qkvshare/kernels/quant.hpp"
#include "qkvshare/tensor/tensor.hpp"

namespace qkvshare::kernels::testing {

inline constexpr double kU = 0x1p-24;  // unit roundoff of f32

// Every level this CPU and build can run, the portable one first.
inline std::vector<Isa> available_isas() {
  std::vector<Isa> out;
  for (Isa isa : kAllIsas)
    if (isa_available(isa)) out.push_back(isa);
  return out;
}

// Restores the best level when a test ends, whatever it forced.
struct IsaGuard {
  IsaGuard() = default;
  explicit IsaGuard(Isa isa) { set_active_isa(isa); }
  ~IsaGuard() { set_active_isa(best_isa()); }
  IsaGuard(const IsaGuard&) = delete;
  IsaGuard& operator=(const IsaGuard&) = delete;
};

inline bool quantizes_activations(GgmlType t) { return activation_block(t) != 0; }

// Every block-quantized weight type the kernels multiply.
inline constexpr GgmlType kBlockTypes[] = {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q6_K,
                                           GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q2_K, GgmlType::Q3_K,
                                           GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS};

// `blocks32` blocks of 32 values, rounded up to whole super-blocks for the 256-value types.
inline std::int64_t cols_of(GgmlType t, std::int64_t blocks32) {
  const std::int64_t bs = type_traits(t).block_size;
  const std::int64_t n = 32 * blocks32;
  return bs <= 1 ? n : (n + bs - 1) / bs * bs;
}

// A weight matrix that owns its bytes.
struct Weights {
  std::vector<std::uint8_t> bytes;
  TensorView view;
  std::vector<float> dequant;  // rows x cols, what the reference multiplies
  // |w| as the kernels' f32 arithmetic sees it: the types with a minimum
  // scale q * d and m separately, so rounding follows |q d| + |m|, not |q d + m|.
  std::vector<float> magnitude;
  void refresh() {
    const std::int64_t rows = view.rows(), cols = view.cols();
    dequant.resize(static_cast<std::size_t>(rows * cols));
    magnitude.resize(dequant.size());
    for (std::int64_t r = 0; r < rows; ++r) dequantize_row(view, r, dequant.data() + r * cols);
    std::vector<float> min(static_cast<std::size_t>(cols));
    for (std::int64_t r = 0; r < rows; ++r) {
      dequantize_row_min_ref(view.type, view.row(r), min.data(), cols);
      for (std::int64_t c = 0; c < cols; ++c) {
        const auto i = static_cast<std::size_t>(r * cols + c);
        const float m = min[static_cast<std::size_t>(c)];
        magnitude[i] = std::fabs(dequant[i] - m) + std::fabs(m);
      }
    }
  }
};

inline Weights make_weights(GgmlType type, std::int64_t rows, std::int64_t cols, const std::vector<float>& values) {
  Weights w;
  const TypeTraits& tt = type_traits(type);
  const std::size_t row_bytes = static_cast<std::size_t>(cols / tt.block_size) * tt.type_size;
  w.bytes.resize(row_bytes * static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r)
    quantize_row_ref(type, values.data() + r * cols, w.bytes.data() + static_cast<std::size_t>(r) * row_bytes, cols);
  w.view.name = "test";
  w.view.type = type;
  w.view.n_dims = 2;
  w.view.ne = {cols, rows, 1, 1};
  w.view.data = w.bytes.data();
  w.view.nbytes = w.bytes.size();
  w.refresh();
  return w;
}

// Random codes over their whole range (Q8_0 includes -128, Q4/Q6 every
// nibble) with scales drawn near `scale`: blocks no quantizer would write but
// a file may hold.
inline void randomize_codes(Weights& w, float scale, std::mt19937& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : w.bytes) b = static_cast<std::uint8_t>(byte(rng));
  std::uniform_real_distribution<float> s(0.5f * scale, scale);
  const TypeTraits& tt = type_traits(w.view.type);
  const std::size_t n_blocks = w.bytes.size() / tt.type_size;
  for (std::size_t i = 0; i < n_blocks; ++i) {
    std::uint8_t* blk = w.bytes.data() + i * tt.type_size;
    const auto put_f16 = [](std::uint8_t* p, float v) {
      const std::uint16_t h = fp32_to_fp16(v);
      std::memcpy(p, &h, 2);
    };
    switch (w.view.type) {
      case GgmlType::Q8_0:
      case GgmlType::Q4_0: put_f16(blk, s(rng)); break;
      case GgmlType::Q4_1:
        put_f16(blk, s(rng));
        put_f16(blk + 2, -8.0f * s(rng));
        break;
      case GgmlType::Q6_K: put_f16(blk + offsetof(BlockQ6_K, d), s(rng) / 64.0f); break;
      case GgmlType::Q5_0:
      case GgmlType::IQ4_NL: put_f16(blk, s(rng)); break;
      case GgmlType::Q5_1:
        put_f16(blk, s(rng));
        put_f16(blk + 2, -16.0f * s(rng));
        break;
      case GgmlType::Q2_K:
        put_f16(blk + offsetof(BlockQ2_K, d), s(rng) / 16.0f);
        put_f16(blk + offsetof(BlockQ2_K, dmin), s(rng) / 16.0f);
        break;
      case GgmlType::Q3_K: put_f16(blk + offsetof(BlockQ3_K, d), s(rng) / 32.0f); break;
      case GgmlType::Q4_K:
      case GgmlType::Q5_K:  // d and dmin first in both
        put_f16(blk, s(rng) / 64.0f);
        put_f16(blk + 2, s(rng) / 64.0f);
        break;
      case GgmlType::IQ4_XS: put_f16(blk, s(rng) / 32.0f); break;
      default: FAIL() << "randomize_codes: not a block type";
    }
  }
  w.refresh();
}

inline std::vector<float> normal(std::size_t n, float sigma, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Largest error of one dot W.row(r) . x[t] that a correct kernel may make,
// in two parts. `quant`, with 8-bit activations: block b of x is replaced by
// d_b * q with d_b = amax_b / 127 and |x - d_b q| <= d_b / 2 (round to
// nearest), plus the f32 rounding of x / d_b and of d_b itself (a few u *
// amax_b); a block below the flush threshold becomes zero (error <= amax_b).
// `fp`, the f32 rounding of the products and sums: any order of summing m
// terms errs by at most (m - 1) u sum|terms| (to first order), and a block's
// integer dot is exact, so m <= blocks + lanes + a few scalings: c = cols / 16
// + 24 covers every level (16 lanes, 4 reduction steps, 3 scalings; Q6_K's
// groups of 16 are the most terms). Float weights (no activation rounding):
// c = cols + 8, a plain recursive sum. Each f32 operation may also underflow
// by half the smallest subnormal. wmag holds Weights::magnitude.
struct DotBound {
  double quant = 0.0;
  double fp = 0.0;
  double total() const { return quant + fp; }
};

inline DotBound dot_error_bound(GgmlType type, const float* wmag, const float* x, std::int64_t cols) {
  double sum_abs = 0.0;
  DotBound out;
  const bool q8 = quantizes_activations(type);
  const std::int64_t ab = q8 ? activation_block(type) : kQK;
  for (std::int64_t b0 = 0; b0 < cols; b0 += ab) {
    const std::int64_t n = std::min<std::int64_t>(ab, cols - b0);
    double amax = 0.0, wsum = 0.0;
    for (std::int64_t i = b0; i < b0 + n; ++i) {
      amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
      wsum += static_cast<double>(wmag[i]);
    }
    const double e = !q8 ? 0.0 : (amax < 1e-30 ? amax : amax / 254.0 + 4.0 * kU * amax);
    out.quant += e * wsum;
    for (std::int64_t i = b0; i < b0 + n; ++i)
      sum_abs += static_cast<double>(wmag[i]) * (std::fabs(static_cast<double>(x[i])) + e);
  }
  const double c = q8 ? static_cast<double>(cols) / 16.0 + 24.0 : static_cast<double>(cols) + 8.0;
  out.fp = c * kU * sum_abs + 4.0 * static_cast<double>(cols + 32) * 0x1p-150;
  return out;
}

inline std::string shape_name(GgmlType type, std::int64_t rows, std::int64_t cols, std::int64_t tokens) {
  return std::string(type_name(type)) + " " + std::to_string(rows) + "x" + std::to_string(cols) + " tokens " +
         std::to_string(tokens);
}

}  // namespace qkvshare::kernels::testing
