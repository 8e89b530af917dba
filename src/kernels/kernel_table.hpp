#pragma once
// Internal: the table of ISA-specific kernels behind the one dispatch point
// (isa.cpp). Each ISA lives in its own translation units compiled with their
// own -m flags. Those units must not define or odr-use inline functions of
// shared headers (std templates, half.hpp, TensorView members): the linker
// keeps one copy of an inline function, and if it kept the AVX-512 one, a CPU
// without AVX-512 would fault in code that never asked for it. Hence this
// header holds only plain structs and function-pointer types.
#include <cstddef>
#include <cstdint>

#include "qkvshare/kernels/kv_tiles.hpp"

namespace qkvshare::kernels::detail {

// Activations of n_tokens rows of `cols` values rounded to 8 bits in blocks of
// 32 (cols % 32 == 0), as ggml's Q8_0/Q8_1 but laid out for SIMD: besides the
// int8 values, every group of 4 consecutive values (one 32-bit dot lane of
// VNNI / maddubs+madd) carries its block's scale and its sum, so the kernels
// load these lanes instead of broadcasting per block.
struct ActQ8 {
  const std::int8_t* qs = nullptr;    // [t * cols + i]
  const float* d = nullptr;           // [t * cols / 32 + b]: x ~= d * q
  const float* dl = nullptr;          // [t * cols / 4 + g]: d of the group's block
  const std::int32_t* bias = nullptr;  // [t * cols / 4 + g]: bias_mult * sum of the group's 4 q
  const float* xs = nullptr;          // [t * cols / 4 + g]: d * sum of the group's 4 q (Q4_1's min term)
  // The same per block, for kernels whose 32-bit lanes each hold a whole block.
  const std::int32_t* bsum = nullptr;  // [t * cols / 32 + b]: bias_mult * sum of the block's q
  const float* s = nullptr;            // [t * cols / 32 + b]: d * sum of the block's q
  // The super-block kind (quantize_act_k, for Q4_K, Q5_K and Q6_K weights;
  // ggml's Q8_K): one scale per 256 values, so that a kernel sums a whole
  // super-block's integer products, each sub-block's times its integer scale,
  // before it converts once to float. Then qs, bsum (bias_mult 1), s (dk *
  // the block's sum), dk and g16 are filled; d, dl, bias and xs are not.
  const float* dk = nullptr;          // [t * cols / 256 + j]: x ~= dk * q over super-block j
  const std::int32_t* g16 = nullptr;  // [t * cols / 16 + g]: sum of the codes of group g (16 values)
  std::int64_t cols = 0;
};

// Multiplier of ActQ8::bias for a weight type whose SIMD kernels multiply
// unsigned weight codes u = q + offset: sum(q * x) = sum(u * x) - offset * sum(x).
inline constexpr std::int32_t kBiasQ4_0 = -8;
inline constexpr std::int32_t kBiasQ8_0 = -128;
inline constexpr std::int32_t kBiasQ5_0 = -16;
inline constexpr std::int32_t kBiasQ3_K = -4;
// IQ4_NL / IQ4_XS share Q8_0's activations: signed codes offset by 128 where
// the kernel needs unsigned ones (gemm_formats_256.hpp).

// y[t * ldy + r] = W.row(r0 + r) . x[t] for r < n_rows, t < n_tokens.
struct GemmArgs {
  const std::uint8_t* w = nullptr;  // row 0 of the range
  std::size_t row_bytes = 0;
  std::int64_t n_rows = 0;
  std::int64_t cols = 0;
  std::int64_t n_tokens = 0;
  const float* x = nullptr;  // float activations [t * cols + i] (F32, F16, BF16 weights)
  ActQ8 act;                 // quantized activations (every block-quantized weight type)
  float* y = nullptr;
  std::int64_t ldy = 0;
};
using GemmFn = void (*)(const GemmArgs&);

// Quantizes one token row: n values (n % 32 == 0) into the ActQ8 arrays,
// each pointer at that row's offset. Every ISA must produce the same bytes as the portable one.
struct ActQ8Out {
  std::int8_t* qs;
  float* d;
  float* dl;
  std::int32_t* bias;
  float* xs;
  std::int32_t* bsum;
  float* s;
  float* dk = nullptr;  // the super-block kind only
  std::int32_t* g16 = nullptr;
};
using QuantizeActFn = void (*)(const float* x, std::int64_t n, std::int32_t bias_mult, const ActQ8Out& out);

// The super-block kind of one token row (n % 256 == 0): plain C++, one
// function for every ISA (isa_portable.cpp), so the bytes never depend on the level.
void quantize_act_k(const float* x, std::int64_t n, const ActQ8Out& out);

// gate = silu(gate) * up (see ops.hpp).
using SiluMulFn = void (*)(float* gate, const float* up, std::int64_t n);
// gate = gelu(gate) * up (see ops.hpp).
using GeluMulFn = void (*)(float* gate, const float* up, std::int64_t n);

struct KernelTable {
  GemmFn gemm_f32 = nullptr;
  GemmFn gemm_f16 = nullptr;
  GemmFn gemm_bf16 = nullptr;
  GemmFn gemm_q8_0 = nullptr;
  GemmFn gemm_q4_0 = nullptr;
  GemmFn gemm_q4_1 = nullptr;
  GemmFn gemm_q6_k = nullptr;
  GemmFn gemm_q5_0 = nullptr;
  GemmFn gemm_q5_1 = nullptr;
  GemmFn gemm_q2_k = nullptr;
  GemmFn gemm_q3_k = nullptr;
  GemmFn gemm_q4_k = nullptr;
  GemmFn gemm_q5_k = nullptr;
  GemmFn gemm_iq4_nl = nullptr;
  GemmFn gemm_iq4_xs = nullptr;
  // Rows in packed 16-row tiles (packed_weights.hpp); only levels that read them.
  GemmFn gemm_q4_0_packed = nullptr;
  GemmFn gemm_q4_1_packed = nullptr;
  GemmFn gemm_q8_0_packed = nullptr;
  QuantizeActFn quantize_act = nullptr;
  SiluMulFn silu_mul = nullptr;
  GeluMulFn gelu_mul = nullptr;
  TileKernels tiles;  // KV tile kernels (kv_tiles.hpp)
};

// Activation blocks whose largest |x| is below this are stored as zero: their
// scale would be subnormal and 1/d would overflow. Dropping them changes a dot
// by at most kActFlush * sum|w| over the block (the tests add that to the bound).
inline constexpr float kActFlush = 1e-30f;

// The active table (isa.cpp): the one dispatch point.
const KernelTable& kernels() noexcept;
// The table's kernel of packed rows of type t (packed_weights.hpp), or null.
GemmFn packed_gemm(const KernelTable& k, GgmlType t) noexcept;

const KernelTable& portable_table() noexcept;

// The entry points of each SIMD level, defined in its own translation units
// and gathered into tables by isa.cpp (built with base flags, so that nothing
// of a level runs before the CPU check).
#define QKVSHARE_DECLARE_MORE_GEMMS                                                                          \
  void gemm_q5_0(const GemmArgs& a);                                                                         \
  void gemm_q5_1(const GemmArgs& a);                                                                         \
  void gemm_q2_k(const GemmArgs& a);                                                                         \
  void gemm_q3_k(const GemmArgs& a);                                                                         \
  void gemm_q4_k(const GemmArgs& a);                                                                         \
  void gemm_q5_k(const GemmArgs& a);                                                                         \
  void gemm_iq4_nl(const GemmArgs& a);                                                                       \
  void gemm_iq4_xs(const GemmArgs& a);
#define QKVSHARE_DECLARE_ISA_KERNELS                                                                         \
  void gemm_f32(const GemmArgs& a);                                                                          \
  void gemm_f16(const GemmArgs& a);                                                                          \
  void gemm_bf16(const GemmArgs& a);                                                                         \
  void gemm_q8_0(const GemmArgs& a);                                                                         \
  void gemm_q4_0(const GemmArgs& a);                                                                         \
  void gemm_q4_1(const GemmArgs& a);                                                                         \
  void gemm_q6_k(const GemmArgs& a);                                                                         \
  QKVSHARE_DECLARE_MORE_GEMMS                                                                                \
  void quantize_act(const float* x, std::int64_t n, std::int32_t bias_mult, const ActQ8Out& out);           \
  void silu_mul(float* gate, const float* up, std::int64_t n);                                               \
  void gelu_mul(float* gate, const float* up, std::int64_t n);                                               \
  void tile_decode(const TileCodes& t, const std::byte* tile, int n_rows, float* out);                       \
  float tile_scores(const float* q, const float* rows, int n_rows, int head_dim, float scale, float* s);      \
  void tile_weighted_sum(float* o, const float* p, const float* rows, int n_rows, int head_dim);              \
  float tile_exp_sum(float* x, int n, float max);                                                             \
  float tile_max(const float* x, int n, float m);                                                             \
  void tile_query_codes(const TileCodes& t, const std::byte* tile, const float* q, int nq, float score_scale,  \
                        void* qc, float* ab);                                                        \
  void tile_code_scores(const TileCodes& t, const std::byte* tile, int lo, int hi, const void* qc,     \
                        const float* ab, int nq, float* s, std::size_t s_stride);                            \
  void tile_code_sum(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p,                \
                     std::size_t p_stride, int nq, float* o);                                                \
  void tile_rope(float* rows, int n_rows, int head_dim, const float* table, std::ptrdiff_t table_step,            \
                 RopeStyle style);                                                                           \
  void tile_fit(const float* x, int n, std::ptrdiff_t stride, int lanes, int qmax, float* lo, float* hi);        \
  void tile_encode_f16(const float* x, std::size_t n, std::uint16_t* out);
namespace avx2 {
QKVSHARE_DECLARE_ISA_KERNELS
}
// The portable kernels of the types above (isa_portable_more.cpp).
namespace portable {
QKVSHARE_DECLARE_MORE_GEMMS
}
namespace avx512 {
QKVSHARE_DECLARE_ISA_KERNELS
void gemm_q4_0_packed(const GemmArgs& a);
void gemm_q4_1_packed(const GemmArgs& a);
void gemm_q8_0_packed(const GemmArgs& a);
}
namespace neon {
QKVSHARE_DECLARE_ISA_KERNELS
}
namespace neon_dot {
QKVSHARE_DECLARE_ISA_KERNELS
}
#undef QKVSHARE_DECLARE_ISA_KERNELS
#undef QKVSHARE_DECLARE_MORE_GEMMS

}  // namespace qkvshare::kernels::detail
