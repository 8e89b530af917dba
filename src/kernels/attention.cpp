#include "qkvshare/kernels/attention.hpp"

#include <cstring>

#include "kernel_table.hpp"
#include "qkvshare/kernels/ops.hpp"

namespace qkvshare::kernels {

void attend_head_f32_ref(const float* q, const float* keys, const float* values, std::int64_t stride,
                         int n_keys, int head_dim, float scale, float* scores, float* out) {
  for (int j = 0; j < n_keys; ++j) scores[j] = dot_f32(q, keys + j * stride, head_dim) * scale;
  softmax(scores, n_keys);
  std::memset(out, 0, sizeof(float) * static_cast<std::size_t>(head_dim));
  for (int j = 0; j < n_keys; ++j) axpy(out, scores[j], values + j * stride, head_dim);
}

void attend_head_f32(const float* q, const float* keys, const float* values, std::int64_t stride,
                     int n_keys, int head_dim, float scale, float* scores, float* out) {
  detail::kernels().attend(q, keys, values, stride, n_keys, head_dim, scale, scores, out);
}

}  // namespace qkvshare::kernels
