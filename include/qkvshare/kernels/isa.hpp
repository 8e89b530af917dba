#pragma once
// The one run-time dispatch point of the ISA-specific kernels (matmul,
// activation quantization, attention, the KV tile kernels of kv_tiles.hpp). The CPU is probed once; tests and
// benchmarks may force a lower level to compare it with the others.
#include <string_view>

namespace qkvshare::kernels {

enum class Isa : int {
  portable = 0,  // plain C++: every CPU
  avx2 = 1,      // x86-64: AVX2 + FMA + F16C, integer dots with maddubs
  avx512 = 2,    // x86-64: AVX-512 F/BW/VL/DQ + VNNI, integer dots with vpdpbusd
  neon = 3,      // ARM64: base ARMv8-A NEON, integer dots with smull + sadalp
  neon_dot = 4,  // ARM64: NEON + dotprod (ARMv8.2-A sdot)
};
// Every level, the portable one first (tests compare each available one with it).
inline constexpr Isa kAllIsas[] = {Isa::portable, Isa::avx2, Isa::avx512, Isa::neon, Isa::neon_dot};

std::string_view isa_name(Isa isa) noexcept;
// Compiled into this build and supported by this CPU (and its OS).
bool isa_available(Isa isa) noexcept;
Isa best_isa() noexcept;
// The level the kernels use now: best_isa() unless forced.
Isa active_isa() noexcept;
// Throws Error(invalid_argument) when `isa` is not available here. Not meant to
// race with running kernels: set it before starting work.
void set_active_isa(Isa isa);

}  // namespace qkvshare::kernels
