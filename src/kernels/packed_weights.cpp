#include "qkvshare/kernels/packed_weights.hpp"

#include <atomic>
#include <cstring>

#include "kernel_table.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/isa.hpp"
#include "qkvshare/kernels/quant.hpp"

namespace qkvshare::kernels {

namespace {
std::atomic<bool> g_packing{true};
}  // namespace

void set_weight_packing(bool on) noexcept { g_packing.store(on); }
bool weight_packing() noexcept { return g_packing.load(); }

bool packs(const TensorView& w) noexcept {
  return weight_packing() && w.type == GgmlType::Q4_0 && w.rows() % kPackedTileRows == 0 && w.cols() % 32 == 0 &&
         detail::kernels().gemm_q4_0_packed != nullptr;
}

void pack_tiles(const TensorView& w, std::int64_t tile_begin, std::int64_t tile_end, std::uint8_t* out) {
  QKV_CHECK(w.type == GgmlType::Q4_0 && w.rows() % kPackedTileRows == 0 && tile_begin >= 0 &&
            tile_end * kPackedTileRows <= w.rows());
  constexpr int R = kPackedTileRows;
  const std::int64_t nb = w.cols() / 32;
  const std::size_t tile_bytes = R * w.row_bytes();
  for (std::int64_t t = tile_begin; t < tile_end; ++t) {
    std::uint8_t* dst = out + static_cast<std::size_t>(t) * tile_bytes;
    for (std::int64_t b = 0; b < nb; ++b, dst += R * sizeof(BlockQ4_0)) {
      for (int r = 0; r < R; ++r) {
        const auto* blk = reinterpret_cast<const BlockQ4_0*>(w.row(t * R + r)) + b;
        std::memcpy(dst + 2 * r, &blk->d, 2);
        for (int c = 0; c < 4; ++c) std::memcpy(dst + 2 * R + 64 * c + 4 * r, blk->qs + 4 * c, 4);
      }
    }
  }
}

}  // namespace qkvshare::kernels
