#pragma once
// The tensor level, between core and the kernels and model layers that both
// use it: weight tensors as views into a mapped model file (type, shape,
// bytes) and the RoPE style an architecture names. The bytes stay in their
// stored (possibly quantized) format (docs/design.md rule 2).
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace qkvshare {

// Numbering follows ggml/GGUF so that file values map directly.
enum class GgmlType : std::uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ4_NL = 20,
  IQ4_XS = 23,
  BF16 = 30,
};

enum class RopeStyle {
  interleaved,  // rotate pairs (2i, 2i+1): llama2.c, GGUF `llama` (ggml "normal" mode)
  neox,         // rotate pairs (i, i + d/2): GGUF `qwen2` (ggml "neox" mode)
};

struct TypeTraits {
  std::string_view name;
  std::int64_t block_size;  // elements per block
  std::size_t type_size;    // bytes per block
};

// nullptr when `raw` is not a type this build knows how to size.
const TypeTraits* find_type_traits(std::uint32_t raw) noexcept;
const TypeTraits& type_traits(GgmlType type);
std::string_view type_name(GgmlType type);
// True for the weight types the kernels can multiply (others load but are rejected by the model).
bool is_supported_weight_type(GgmlType type) noexcept;

struct TensorView {
  std::string name;
  GgmlType type = GgmlType::F32;
  int n_dims = 0;
  std::array<std::int64_t, 4> ne{1, 1, 1, 1};  // ne[0] is the contiguous dimension
  const std::uint8_t* data = nullptr;
  std::size_t nbytes = 0;
  // The same rows in the matmul kernels' packed tile layout
  // (kernels/packed_weights.hpp), when the model made one; data stays valid.
  const std::uint8_t* packed = nullptr;

  std::int64_t cols() const noexcept { return ne[0]; }
  std::int64_t rows() const noexcept { return ne[1] * ne[2] * ne[3]; }
  std::int64_t n_elements() const noexcept { return ne[0] * ne[1] * ne[2] * ne[3]; }
  std::size_t row_bytes() const noexcept;
  const std::uint8_t* row(std::int64_t r) const noexcept { return data + static_cast<std::size_t>(r) * row_bytes(); }
};

}  // namespace qkvshare
