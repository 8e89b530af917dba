#pragma once
// Elementwise and reduction kernels of the forward pass.
#include <cstdint>

#include "qkvshare/tensor/tensor.hpp"

namespace qkvshare::kernels {

// The model's architecture names its RoPE style; the enum lives in the tensor
// level below both layers (docs/design.md, layering).
using qkvshare::RopeStyle;

float dot_f32(const float* a, const float* b, std::int64_t n);
// out = x * w / rms(x); out may alias x.
void rmsnorm(float* out, const float* x, const float* w, std::int64_t n, float eps);
// Rotates each head of x (n_heads * head_dim floats) for position pos.
// inv_freq holds head_dim/2 frequencies theta^(-2i/head_dim).
void rope(float* x, int n_heads, int head_dim, float pos, const float* inv_freq, RopeStyle style);
// The same in two parts, so that a forward pass computes each position's
// angles once for all layers and for q and k: rope_angles fills cos and sin
// (head_dim/2 each) for pos, rope_rotate applies them. rope() is exactly
// rope_angles + rope_rotate.
void rope_angles(float pos, const float* inv_freq, int head_dim, float* cos, float* sin);
void rope_rotate(float* x, int n_heads, int head_dim, const float* cos, const float* sin, RopeStyle style);
// In place; returns nothing, handles -inf entries.
void softmax(float* x, std::int64_t n);
// gate = silu(gate) * up (SwiGLU). Runs the active ISA's kernel, whose
// vector exp is within 2 ulp of std::exp.
void silu_mul(float* gate, const float* up, std::int64_t n);
// Scalar reference of silu_mul (std::exp).
void silu_mul_ref(float* gate, const float* up, std::int64_t n);
// gate = gelu(gate) * up (GeGLU, Gemma), GELU in its tanh approximation as
// the models were trained with, computed as g / (1 + exp(-2y)),
// y = sqrt(2/pi) (g + 0.044715 g^3). Runs the active ISA's kernel.
void gelu_mul(float* gate, const float* up, std::int64_t n);
// Scalar reference of gelu_mul (std::exp).
void gelu_mul_ref(float* gate, const float* up, std::int64_t n);
// y += x
void add_inplace(float* y, const float* x, std::int64_t n);
// y += a * x
void axpy(float* y, float a, const float* x, std::int64_t n);

}  // namespace qkvshare::kernels
