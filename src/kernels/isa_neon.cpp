// NEON level for ARM64 (base ARMv8-A, every AArch64 CPU): matmul for every
// weight type (neon_gemm.hpp), SwiGLU with the one vector exp, and the KV
// tile kernels (kv_tiles.hpp, 4 lanes). The activation quantizer is the
// portable level's: it is a small share of a decode step, and the portable
// quantizer is what every level must match byte for byte. isa_neon_dot.cpp adds the dotprod level on top of this one.
#define QKVSHARE_NEON_NS neon
#define QKVSHARE_NEON_DOT 0
#include "neon_gemm.hpp"

#include "kv_codes.hpp"
#include "kv_tiles.hpp"
#include "vec_math.hpp"

namespace qkvshare::kernels::detail::neon {

void gemm_f32(const GemmArgs& a) { gemm_tiled<FFloat<Kind::f32>, 4, 2>(a); }
void gemm_f16(const GemmArgs& a) { gemm_tiled<FFloat<Kind::f16>, 4, 2>(a); }
void gemm_bf16(const GemmArgs& a) { gemm_tiled<FFloat<Kind::bf16>, 4, 2>(a); }

void quantize_act(const float* x, std::int64_t n, std::int32_t bias_mult, const ActQ8Out& out) {
  portable_table().quantize_act(x, n, bias_mult, out);
}

void gelu_mul(float* gate, const float* up, std::int64_t n) { gelu_mul_rows<Vec>(gate, up, n); }

void silu_mul(float* gate, const float* up, std::int64_t n) {
  const auto step = [](float32x4_t g, float32x4_t u) {
    const float32x4_t e = vexp<Vec>(vnegq_f32(g));
    return vmulq_f32(vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.0f), e)), u);
  };
  std::int64_t i = 0;
  for (; i + 4 <= n; i += 4) vst1q_f32(gate + i, step(vld1q_f32(gate + i), vld1q_f32(up + i)));
  if (i < n) {
    float g[4] = {0, 0, 0, 0}, u[4] = {0, 0, 0, 0};
    std::memcpy(g, gate + i, static_cast<std::size_t>(n - i) * sizeof(float));
    std::memcpy(u, up + i, static_cast<std::size_t>(n - i) * sizeof(float));
    vst1q_f32(g, step(vld1q_f32(g), vld1q_f32(u)));
    std::memcpy(gate + i, g, static_cast<std::size_t>(n - i) * sizeof(float));
  }
}

QKVSHARE_DEFINE_TILE_KERNELS
QKVSHARE_DEFINE_CODE_KERNELS

}  // namespace qkvshare::kernels::detail::neon
