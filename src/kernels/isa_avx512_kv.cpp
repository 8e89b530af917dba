// AVX-512 (16 lanes) instantiation of the KV tile kernels (kv_tiles.hpp).
// Heads that are not a multiple of 16 go to the AVX2 instantiation (every
// AVX-512 CPU has AVX2). Built with AVX-512 flags; reached only through
// isa.cpp after the CPU check.
#include "kernel_table.hpp"
#include "kv_codes.hpp"
#include "kv_tiles.hpp"

namespace qkvshare::kernels::detail::avx512 {

void tile_decode(const TileCodes& t, const std::byte* tile, int n_rows, float* out) {
  if (t.head_dim % Vec::N != 0) return avx2::tile_decode(t, tile, n_rows, out);
  detail::tile_decode<Vec>(t, tile, n_rows, out);
}
float tile_scores(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s) {
  if (head_dim % Vec::N != 0) return avx2::tile_scores(q, rows, n_rows, head_dim, scale, s);
  return detail::tile_scores<Vec>(q, rows, n_rows, head_dim, scale, s);
}
void tile_weighted_sum(float* o, const float* p, const float* rows, int n_rows, int head_dim) {
  if (head_dim % Vec::N != 0) return avx2::tile_weighted_sum(o, p, rows, n_rows, head_dim);
  detail::tile_weighted_sum<Vec>(o, p, rows, n_rows, head_dim);
}
float tile_exp_sum(float* x, int n, float max) { return detail::tile_exp_sum<Vec>(x, n, max); }
float tile_max(const float* x, int n, float m) { return detail::tile_max<Vec>(x, n, m); }
void tile_rope(float* rows, int n_rows, int head_dim, const float* table, std::ptrdiff_t step, RopeStyle style) {
  if ((head_dim / 2) % Vec::N != 0) return avx2::tile_rope(rows, n_rows, head_dim, table, step, style);
  detail::tile_rope<Vec>(rows, n_rows, head_dim, table, step, style);
}
// Whole groups of 16 series here, the rest through the AVX2 level.
void tile_fit(const float* x, int n, std::ptrdiff_t stride, int lanes, int qmax, float* lo, float* hi) {
  const int main = lanes / Vec::N * Vec::N;
  if (main > 0) detail::tile_fit<Vec>(x, n, stride, main, qmax, lo, hi);
  if (main < lanes) avx2::tile_fit(x + main, n, stride, lanes - main, qmax, lo + main, hi + main);
}
void tile_encode_f16(const float* x, std::size_t n, std::uint16_t* out) { detail::tile_encode_f16<Vec>(x, n, out); }
// The code kernels take 32 channels at a time (2 x 16 lanes of int16), 64
// for 4- and 2-bit keys (4 x 16 bytes).
void tile_query_codes(const TileCodes& t, const std::byte* tile, const float* q, int nq, float score_scale,
                      void* qc, float* ab) {
  detail::tile_query_codes<VecCodes>(t, tile, q, nq, score_scale, qc, ab);
}
void tile_code_scores(const TileCodes& t, const std::byte* tile, int lo, int hi, const void* qc, const float* ab,
                      int nq, float* s, std::size_t s_stride) {
  if (t.head_dim % (2 * Vec::N) != 0 || (byte_query_codes(t.bits) && t.head_dim % (4 * Vec::N) != 0))
    return avx2::tile_code_scores(t, tile, lo, hi, qc, ab, nq, s, s_stride);
  detail::tile_code_scores<VecCodes>(t, tile, lo, hi, qc, ab, nq, s, s_stride);
}
void tile_code_sum(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p, std::size_t p_stride,
                   int nq, float* o) {
  if (t.head_dim % (2 * Vec::N) != 0 || t.group % (2 * Vec::N) != 0)
    return avx2::tile_code_sum(t, tile, lo, hi, p, p_stride, nq, o);
  detail::tile_code_sum<VecCodes>(t, tile, lo, hi, p, p_stride, nq, o);
}

}  // namespace qkvshare::kernels::detail::avx512
