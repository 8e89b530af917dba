// Kernels of Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, IQ4_NL and IQ4_XS weights at
// the AVX-512 level: vpdpbusd on 256-bit registers (AVX-512VL + VNNI; 32 registers hold a 4 x 3 tile). Built with AVX-512 flags; reached only through isa.cpp after the CPU check. The formats
// are in gemm_formats_256.hpp, but for Q4_K and Q5_K (gemm_formats_512.hpp:
// a super-block per step, its scales unpacked once; the 256-bit format's
// per-sub-block scalar unpacking made their decode compute-bound).
#define QKVSHARE_F256_ISA avx512
#include "gemm_formats_256.hpp"
#include "gemm_formats_512.hpp"

namespace qkvshare::kernels::detail::avx512 {

void gemm_q5_0(const GemmArgs& a) { gemm_tiled<f256::FQ5_0, 4, 3>(a); }
void gemm_q5_1(const GemmArgs& a) { gemm_tiled<f256::FQ5_1, 4, 3>(a); }
void gemm_q2_k(const GemmArgs& a) { gemm_tiled<f256::FQ2_K, 4, 3>(a); }
void gemm_q3_k(const GemmArgs& a) { gemm_tiled<f256::FQ3_K, 4, 3>(a); }
void gemm_q4_k(const GemmArgs& a) { gemm_tiled<f512::FQ4_K, 2, 3>(a); }
void gemm_q5_k(const GemmArgs& a) { gemm_tiled<f512::FQ5_K, 2, 3>(a); }
void gemm_iq4_nl(const GemmArgs& a) { gemm_tiled<f256::FIQ4_NL, 4, 3>(a); }
void gemm_iq4_xs(const GemmArgs& a) { gemm_tiled<f256::FIQ4_XS, 4, 3>(a); }

}  // namespace qkvshare::kernels::detail::avx512
