// Kernels of Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL and IQ4_XS weights at the AVX-512
// level: vpdpbusd on 256-bit registers (AVX-512VL + VNNI; 32 registers hold a
// 4 x 3 tile), formats in gemm_formats_256.hpp. Q4_K and Q5_K run on 16-row
// tiles (isa_avx512_rows.cpp). Built with AVX-512 flags; reached only through
// isa.cpp after the CPU check.
#define QKVSHARE_F256_ISA avx512
#include "gemm_formats_256.hpp"

namespace qkvshare::kernels::detail::avx512 {

// 16-row tiles (isa_avx512_rows.cpp).
void gemm_q4_k_rows(const GemmArgs& a);
void gemm_q5_k_rows(const GemmArgs& a);

void gemm_q5_0(const GemmArgs& a) { gemm_tiled<f256::FQ5_0, 4, 3>(a); }
void gemm_q5_1(const GemmArgs& a) { gemm_tiled<f256::FQ5_1, 4, 3>(a); }
void gemm_q2_k(const GemmArgs& a) { gemm_tiled<f256::FQ2_K, 4, 3>(a); }
void gemm_q3_k(const GemmArgs& a) { gemm_tiled<f256::FQ3_K, 4, 3>(a); }
void gemm_q4_k(const GemmArgs& a) { gemm_q4_k_rows(a); }
void gemm_q5_k(const GemmArgs& a) { gemm_q5_k_rows(a); }
void gemm_iq4_nl(const GemmArgs& a) { gemm_tiled<f256::FIQ4_NL, 4, 3>(a); }
void gemm_iq4_xs(const GemmArgs& a) { gemm_tiled<f256::FIQ4_XS, 4, 3>(a); }

}  // namespace qkvshare::kernels::detail::avx512
