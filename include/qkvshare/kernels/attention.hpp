#pragma once
// Attention of one query head over a run of f32 keys/values.
#include <cstdint>

namespace qkvshare::kernels {

// out[head_dim] = softmax(q . k_j * scale) . v_j over j < n_keys, where key j
// is at keys + j * stride (same for values). scores is scratch of n_keys.
// Runs the active ISA's kernel (kernels/isa.hpp).
void attend_head_f32(const float* q, const float* keys, const float* values, std::int64_t stride,
                     int n_keys, int head_dim, float scale, float* scores, float* out);
// Scalar reference of the same (docs/design.md rule 3); also the portable kernel.
void attend_head_f32_ref(const float* q, const float* keys, const float* values, std::int64_t stride,
                         int n_keys, int head_dim, float scale, float* scores, float* out);

}  // namespace qkvshare::kernels
