// Scalar references of the KV tile kernels (kv_tiles.hpp), and the portable
// level's versions of them. The SIMD bodies in kv_tiles.hpp are tested
// against these.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/half.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"

namespace qkvshare::kernels {

namespace {

int unpack_code(const std::byte* row, int i, int bits) {
  const int u = i / 8, k = i % 8;
  std::uint64_t word = 0;
  for (int b = 0; b < bits; ++b) word |= static_cast<std::uint64_t>(row[u * bits + b]) << (8 * b);
  return static_cast<int>((word >> (k * bits)) & ((1u << bits) - 1u));
}

}  // namespace

void decode_tile_ref(const TileCodes& t, const std::byte* tile, int n_rows, float* out) {
  const int D = t.head_dim;
  const std::size_t n = static_cast<std::size_t>(n_rows) * static_cast<std::size_t>(D);
  if (t.bits == 32) {
    std::memcpy(out, tile, n * sizeof(float));
    return;
  }
  if (t.bits == 16) {
    const auto* h = reinterpret_cast<const std::uint16_t*>(tile);
    for (std::size_t i = 0; i < n; ++i) out[i] = fp16_to_fp32(h[i]);
    return;
  }
  const int bits = t.bits;
  const auto* scales = reinterpret_cast<const std::uint16_t*>(tile + t.param_offset);
  const auto* mins = scales + t.param_stride;
  const int G = t.per_channel ? 1 : t.group, groups = t.per_channel ? 1 : D / G;
  for (int j = 0; j < n_rows; ++j) {
    const std::byte* row = tile + static_cast<std::size_t>(j) * t.row_bytes;
    for (int c = 0; c < D; ++c) {
      const std::size_t p = t.per_channel ? static_cast<std::size_t>(c) : static_cast<std::size_t>(j * groups + c / G);
      // fma, like the SIMD levels, so that every level decodes to the same bits.
      out[static_cast<std::size_t>(j) * D + c] =
          std::fma(static_cast<float>(unpack_code(row, c, bits)), fp16_to_fp32(scales[p]), fp16_to_fp32(mins[p]));
    }
  }
}

float scores_ref(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s) {
  float m = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n_rows; ++j) {
    const float* k = rows + static_cast<std::ptrdiff_t>(j) * head_dim;
    float acc = 0.0f;
    for (int c = 0; c < head_dim; ++c) acc += q[c] * k[c];
    s[j] = acc * scale;
    m = std::max(m, s[j]);
  }
  return m;
}

void weighted_sum_ref(float* o, const float* p, const float* rows, int n_rows, int head_dim) {
  for (int j = 0; j < n_rows; ++j) {
    const float* v = rows + static_cast<std::ptrdiff_t>(j) * head_dim;
    for (int c = 0; c < head_dim; ++c) o[c] += p[j] * v[c];
  }
}

float exp_sum_ref(float* x, int n, float max) {
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  return sum;
}

}  // namespace qkvshare::kernels
