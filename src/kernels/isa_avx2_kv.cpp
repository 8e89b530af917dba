// AVX2 + FMA + F16C (8 lanes) instantiation of the KV tile kernels
// (kv_tiles.hpp). Built with AVX2 flags; reached only through isa.cpp after
// the CPU check.
#include "kernel_table.hpp"
#include "kv_codes.hpp"
#include "kv_tiles.hpp"

namespace qkvshare::kernels::detail::avx2 {

QKVSHARE_DEFINE_TILE_KERNELS
QKVSHARE_DEFINE_CODE_KERNELS

}  // namespace qkvshare::kernels::detail::avx2
