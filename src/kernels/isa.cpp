#include "qkvshare/kernels/isa.hpp"

#include <atomic>

#if defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#include "kernel_table.hpp"
#include "qkvshare/core/error.hpp"

namespace qkvshare::kernels {

namespace {

#if QKVSHARE_X86_KERNELS || QKVSHARE_ARM64_KERNELS
#define QKVSHARE_ISA_TABLE(ns)                                                                                     \
  detail::KernelTable {                                                                                            \
    .gemm_f32 = detail::ns::gemm_f32, .gemm_f16 = detail::ns::gemm_f16, .gemm_bf16 = detail::ns::gemm_bf16,        \
    .gemm_q8_0 = detail::ns::gemm_q8_0, .gemm_q4_0 = detail::ns::gemm_q4_0, .gemm_q4_1 = detail::ns::gemm_q4_1,    \
    .gemm_q6_k = detail::ns::gemm_q6_k, .gemm_q5_0 = detail::ns::gemm_q5_0, .gemm_q5_1 = detail::ns::gemm_q5_1,    \
    .gemm_q2_k = detail::ns::gemm_q2_k, .gemm_q3_k = detail::ns::gemm_q3_k, .gemm_q4_k = detail::ns::gemm_q4_k,    \
    .gemm_q5_k = detail::ns::gemm_q5_k, .gemm_iq4_nl = detail::ns::gemm_iq4_nl,                                    \
    .gemm_iq4_xs = detail::ns::gemm_iq4_xs, .quantize_act = detail::ns::quantize_act,                              \
    .silu_mul = detail::ns::silu_mul, .gelu_mul = detail::ns::gelu_mul,                                            \
    .tiles = {detail::ns::tile_decode, detail::ns::tile_scores, detail::ns::tile_weighted_sum,                     \
              detail::ns::tile_exp_sum, detail::ns::tile_query_codes, detail::ns::tile_code_scores,               \
              detail::ns::tile_code_sum, detail::ns::tile_rope, detail::ns::tile_fit,                  \
              detail::ns::tile_encode_f16, detail::ns::tile_max},                                                                        \
  }
#endif
// Constant-initialised, so that reading a table runs no code of its level.
#if QKVSHARE_X86_KERNELS
constinit const detail::KernelTable kAvx2 = QKVSHARE_ISA_TABLE(avx2);
constinit const detail::KernelTable kAvx512 = [] {
  detail::KernelTable t = QKVSHARE_ISA_TABLE(avx512);
  t.gemm_q4_0_packed = detail::avx512::gemm_q4_0_packed;
  t.gemm_q4_1_packed = detail::avx512::gemm_q4_1_packed;
  t.gemm_q8_0_packed = detail::avx512::gemm_q8_0_packed;
  return t;
}();
#endif
#if QKVSHARE_ARM64_KERNELS
constinit const detail::KernelTable kNeon = QKVSHARE_ISA_TABLE(neon);
constinit const detail::KernelTable kNeonDot = QKVSHARE_ISA_TABLE(neon_dot);
#endif
#undef QKVSHARE_ISA_TABLE

const detail::KernelTable* table_of(Isa isa) noexcept {
  switch (isa) {
    case Isa::portable: return &detail::portable_table();
#if QKVSHARE_X86_KERNELS
    case Isa::avx2: return &kAvx2;
    case Isa::avx512: return &kAvx512;
#endif
#if QKVSHARE_ARM64_KERNELS
    case Isa::neon: return &kNeon;
    case Isa::neon_dot: return &kNeonDot;
#endif
    default: return nullptr;
  }
}

bool cpu_supports(Isa isa) noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (isa) {
    case Isa::portable: return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::avx512:
      return cpu_supports(Isa::avx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
#elif defined(__aarch64__)
  // NEON is part of every AArch64 CPU; dotprod is reported in the ELF hwcaps.
  switch (isa) {
    case Isa::portable:
    case Isa::neon: return true;
    case Isa::neon_dot: return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
    default: return false;
  }
#else
  return isa == Isa::portable;
#endif
}

Isa probe() noexcept {
  for (Isa isa : {Isa::avx512, Isa::avx2, Isa::neon_dot, Isa::neon})
    if (isa_available(isa)) return isa;
  return Isa::portable;
}

struct Active {
  std::atomic<Isa> isa{probe()};
  std::atomic<const detail::KernelTable*> table{table_of(isa.load())};
};

Active& active() noexcept {
  static Active a;
  return a;
}

}  // namespace

std::string_view isa_name(Isa isa) noexcept {
  switch (isa) {
    case Isa::portable: return "portable";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::neon: return "neon";
    case Isa::neon_dot: return "neon_dot";
  }
  return "?";
}

bool isa_available(Isa isa) noexcept { return table_of(isa) != nullptr && cpu_supports(isa); }

Isa best_isa() noexcept {
  static const Isa best = probe();
  return best;
}

Isa active_isa() noexcept { return active().isa.load(std::memory_order_relaxed); }

void set_active_isa(Isa isa) {
  if (!isa_available(isa))
    fail(ErrorCode::invalid_argument, "kernel ISA '{}' is not available on this CPU or in this build", isa_name(isa));
  active().table.store(table_of(isa), std::memory_order_release);
  active().isa.store(isa, std::memory_order_release);
}

namespace detail {
const KernelTable& kernels() noexcept { return *active().table.load(std::memory_order_acquire); }
}  // namespace detail

const TileKernels& tile_kernels(Isa isa) {
  if (!isa_available(isa))
    fail(ErrorCode::invalid_argument, "kernel ISA '{}' is not available on this CPU or in this build", isa_name(isa));
  return table_of(isa)->tiles;
}

const TileKernels& tile_kernels() noexcept { return detail::kernels().tiles; }

}  // namespace qkvshare::kernels
