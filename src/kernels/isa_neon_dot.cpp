// NEON + dotprod level (ARMv8.2-A sdot, chosen at run time when the CPU
// reports it): the quantized matmuls with sdot; every other kernel is the
// base NEON level's (isa_neon.cpp). Built with -march=armv8.2-a+dotprod;
// reached only through isa.cpp after the CPU check.
#define QKVSHARE_NEON_NS neon_dot
#define QKVSHARE_NEON_DOT 1
#include "neon_gemm.hpp"

namespace qkvshare::kernels::detail::neon_dot {

void gemm_f32(const GemmArgs& a) { neon::gemm_f32(a); }
void gemm_f16(const GemmArgs& a) { neon::gemm_f16(a); }
void gemm_bf16(const GemmArgs& a) { neon::gemm_bf16(a); }
void quantize_act(const float* x, std::int64_t n, std::int32_t bias_mult, const ActQ8Out& out) {
  neon::quantize_act(x, n, bias_mult, out);
}
void silu_mul(float* gate, const float* up, std::int64_t n) { neon::silu_mul(gate, up, n); }
void gelu_mul(float* gate, const float* up, std::int64_t n) { neon::gelu_mul(gate, up, n); }
void tile_decode(const TileCodes& t, const std::byte* tile, int n_rows, float* out) { neon::tile_decode(t, tile, n_rows, out); }
float tile_scores(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s) {
  return neon::tile_scores(q, rows, n_rows, head_dim, scale, s);
}
void tile_weighted_sum(float* o, const float* p, const float* rows, int n_rows, int head_dim) {
  neon::tile_weighted_sum(o, p, rows, n_rows, head_dim);
}
float tile_exp_sum(float* x, int n, float max) { return neon::tile_exp_sum(x, n, max); }
float tile_max(const float* x, int n, float m) { return neon::tile_max(x, n, m); }
void tile_rope(float* rows, int n_rows, int head_dim, const float* table, std::ptrdiff_t step, RopeStyle style) {
  neon::tile_rope(rows, n_rows, head_dim, table, step, style);
}
void tile_fit(const float* x, int n, std::ptrdiff_t stride, int lanes, int qmax, float* lo, float* hi) {
  neon::tile_fit(x, n, stride, lanes, qmax, lo, hi);
}
void tile_encode_f16(const float* x, std::size_t n, std::uint16_t* out) { neon::tile_encode_f16(x, n, out); }
void tile_query_codes(const TileCodes& t, const std::byte* tile, const float* q, int nq, float score_scale,
                      void* qc, float* ab) {
  neon::tile_query_codes(t, tile, q, nq, score_scale, qc, ab);
}
void tile_code_scores(const TileCodes& t, const std::byte* tile, int lo, int hi, const void* qc, const float* ab,
                      int nq, float* s, std::size_t s_stride) {
  neon::tile_code_scores(t, tile, lo, hi, qc, ab, nq, s, s_stride);
}
void tile_code_sum(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p, std::size_t p_stride,
                   int nq, float* o) {
  neon::tile_code_sum(t, tile, lo, hi, p, p_stride, nq, o);
}

}  // namespace qkvshare::kernels::detail::neon_dot
