// Kernels of Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, IQ4_NL and IQ4_XS weights at
// the AVX2 (maddubs + madd). Built with AVX2/FMA/F16C flags; reached only through isa.cpp after the CPU check. The formats
// are in gemm_formats_256.hpp. Decoding is bound by memory bandwidth, so
// 256-bit steps (one activation block each) lose nothing to 512-bit ones.
#define QKVSHARE_F256_ISA avx2
#include "gemm_formats_256.hpp"

namespace qkvshare::kernels::detail::avx2 {

void gemm_q5_0(const GemmArgs& a) { gemm_tiled<f256::FQ5_0, 2, 2>(a); }
void gemm_q5_1(const GemmArgs& a) { gemm_tiled<f256::FQ5_1, 2, 2>(a); }
void gemm_q2_k(const GemmArgs& a) { gemm_tiled<f256::FQ2_K, 2, 2>(a); }
void gemm_q3_k(const GemmArgs& a) { gemm_tiled<f256::FQ3_K, 2, 2>(a); }
void gemm_q4_k(const GemmArgs& a) { gemm_tiled<f256::FQ4_K, 2, 2>(a); }
void gemm_q5_k(const GemmArgs& a) { gemm_tiled<f256::FQ5_K, 2, 2>(a); }
void gemm_iq4_nl(const GemmArgs& a) { gemm_tiled<f256::FIQ4_NL, 2, 2>(a); }
void gemm_iq4_xs(const GemmArgs& a) { gemm_tiled<f256::FIQ4_XS, 2, 2>(a); }

}  // namespace qkvshare::kernels::detail::avx2
