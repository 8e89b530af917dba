#include "qkvshare/kernels/ops.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include "kernel_table.hpp"

namespace qkvshare::kernels {

float dot_f32(const float* a, const float* b, std::int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (std::int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void rmsnorm(float* out, const float* x, const float* w, std::int64_t n, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (std::int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  ss /= static_cast<float>(n);
  ss += eps;
  const float scale = 1.0f / std::sqrt(ss);
  for (std::int64_t i = 0; i < n; ++i) out[i] = w[i] * (scale * x[i]);
}

void rope_angles(float pos, const float* inv_freq, int head_dim, float* cos, float* sin) {
  for (int i = 0; i < head_dim / 2; ++i) {
    const float angle = pos * inv_freq[i];
    cos[i] = std::cos(angle);
    sin[i] = std::sin(angle);
  }
}

void rope_rotate(float* x, int n_heads, int head_dim, const float* cos, const float* sin, RopeStyle style) {
  const int half = head_dim / 2;
  for (int h = 0; h < n_heads; ++h) {
    float* v = x + static_cast<std::int64_t>(h) * head_dim;
    for (int i = 0; i < half; ++i) {
      const int a = style == RopeStyle::interleaved ? 2 * i : i;
      const int b = style == RopeStyle::interleaved ? 2 * i + 1 : i + half;
      const float v0 = v[a];
      const float v1 = v[b];
      v[a] = v0 * cos[i] - v1 * sin[i];
      v[b] = v0 * sin[i] + v1 * cos[i];
    }
  }
}

void rope(float* x, int n_heads, int head_dim, float pos, const float* inv_freq, RopeStyle style) {
  // The angles depend on the position only: once per call, not per head.
  constexpr int kStackPairs = 256;
  float cs[2 * kStackPairs];
  std::vector<float> heap;
  float* c = cs;
  if (head_dim / 2 > kStackPairs) {
    heap.resize(static_cast<std::size_t>(head_dim));
    c = heap.data();
  }
  rope_angles(pos, inv_freq, head_dim, c, c + head_dim / 2);
  rope_rotate(x, n_heads, head_dim, c, c + head_dim / 2, style);
}

void softmax(float* x, std::int64_t n) {
  if (n <= 0) return;
  float max = -std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < n; ++i) max = x[i] > max ? x[i] : max;
  if (std::isinf(max) && max < 0) {  // every entry masked: a uniform distribution is the safe answer
    for (std::int64_t i = 0; i < n; ++i) x[i] = 1.0f / static_cast<float>(n);
    return;
  }
  float sum = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  const float inv = 1.0f / sum;
  for (std::int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void silu_mul(float* gate, const float* up, std::int64_t n) { detail::kernels().silu_mul(gate, up, n); }

void silu_mul_ref(float* gate, const float* up, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void gelu_mul(float* gate, const float* up, std::int64_t n) { detail::kernels().gelu_mul(gate, up, n); }

void gelu_mul_ref(float* gate, const float* up, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    // Separate roundings, as the vector levels do (vec_math.hpp vgelu).
    volatile float g3 = g * g;
    g3 = g3 * g;
    volatile float inner = 0.044715f * g3;
    inner = g + inner;
    volatile float y = 0.7978845608028654f * inner;
    gate[i] = g / (1.0f + std::exp(-2.0f * y)) * up[i];
  }
}

void add_inplace(float* y, const float* x, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void axpy(float* y, float a, const float* x, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace qkvshare::kernels
