#pragma once
// Attention of one query head over a run of f32 keys/values (reference path).
#include <cstdint>

namespace qkvshare::kernels {

// out[head_dim] = softmax(q . k_j * scale) . v_j over j < n_keys, where key j
// is at keys + j * stride (same for values). scores is scratch of n_keys.
void attend_head_f32(const float* q, const float* keys, const float* values, std::int64_t stride,
                     int n_keys, int head_dim, float scale, float* scores, float* out);

}  // namespace qkvshare::kernels
