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

// A block type's parts: the f16 scale (and minimum) first, then the codes.
struct BlockParts {
  int head_halves;   // f16 values before the codes: 1 (d) or 2 (d, m)
  int code_bytes;    // 16 (4-bit) or 32 (8-bit)
  std::uint8_t flip; // XORed into every code byte: Q8_0's signed codes to the kernel's unsigned ones
};

bool parts_of(GgmlType t, BlockParts& p) {
  switch (t) {
    case GgmlType::Q4_0: p = {1, 16, 0}; return true;
    case GgmlType::Q4_1: p = {2, 16, 0}; return true;
    case GgmlType::Q8_0: p = {1, 32, 0x80}; return true;
    default: return false;
  }
}

}  // namespace

void set_weight_packing(bool on) noexcept { g_packing.store(on); }
bool weight_packing() noexcept { return g_packing.load(); }

namespace detail {
GemmFn packed_gemm(const KernelTable& k, GgmlType t) noexcept {
  switch (t) {
    case GgmlType::Q4_0: return k.gemm_q4_0_packed;
    case GgmlType::Q4_1: return k.gemm_q4_1_packed;
    case GgmlType::Q8_0: return k.gemm_q8_0_packed;
    default: return nullptr;
  }
}
}  // namespace detail

bool packs(const TensorView& w) noexcept {
  return weight_packing() && w.rows() % kPackedTileRows == 0 && w.cols() % 32 == 0 &&
         detail::packed_gemm(detail::kernels(), w.type) != nullptr;
}

void pack_tiles(const TensorView& w, std::int64_t tile_begin, std::int64_t tile_end, std::uint8_t* out) {
  BlockParts parts{};
  QKV_CHECK(parts_of(w.type, parts) && w.rows() % kPackedTileRows == 0 && tile_begin >= 0 &&
            tile_end * kPackedTileRows <= w.rows());
  constexpr int R = kPackedTileRows;
  const std::int64_t nb = w.cols() / 32;
  const std::size_t block_bytes = type_traits(w.type).type_size, tile_bytes = R * w.row_bytes();
  const int head_bytes = 2 * parts.head_halves;
  for (std::int64_t t = tile_begin; t < tile_end; ++t) {
    std::uint8_t* dst = out + static_cast<std::size_t>(t) * tile_bytes;
    for (std::int64_t b = 0; b < nb; ++b, dst += R * block_bytes) {
      std::uint8_t* codes = dst + R * head_bytes;
      for (int r = 0; r < R; ++r) {
        const std::uint8_t* blk = w.row(t * R + r) + static_cast<std::size_t>(b) * block_bytes;
        for (int h = 0; h < parts.head_halves; ++h) std::memcpy(dst + 2 * (h * R + r), blk + 2 * h, 2);
        // Dword c of the row's codes goes to lane r of code vector c.
        for (int c = 0; c < parts.code_bytes / 4; ++c)
          for (int i = 0; i < 4; ++i) codes[64 * c + 4 * r + i] = blk[head_bytes + 4 * c + i] ^ parts.flip;
      }
    }
  }
}

void unpack_row(const TensorView& w, std::int64_t r, std::uint8_t* out) {
  BlockParts parts{};
  QKV_CHECK(w.packed != nullptr && parts_of(w.type, parts) && r >= 0 && r < w.rows());
  constexpr int R = kPackedTileRows;
  const std::int64_t nb = w.cols() / 32, t = r / R;
  const int lane = static_cast<int>(r % R), head_bytes = 2 * parts.head_halves;
  const std::size_t block_bytes = type_traits(w.type).type_size;
  const std::uint8_t* src = w.packed + static_cast<std::size_t>(t) * R * w.row_bytes();
  for (std::int64_t b = 0; b < nb; ++b, src += R * block_bytes, out += block_bytes) {
    for (int h = 0; h < parts.head_halves; ++h) std::memcpy(out + 2 * h, src + 2 * (h * R + lane), 2);
    const std::uint8_t* codes = src + R * head_bytes;
    for (int c = 0; c < parts.code_bytes / 4; ++c)
      for (int i = 0; i < 4; ++i) out[head_bytes + 4 * c + i] = codes[64 * c + 4 * lane + i] ^ parts.flip;
  }
}

}  // namespace qkvshare::kernels
