#include "qkvshare/tensor/tensor.hpp"

#include "qkvshare/core/error.hpp"

namespace qkvshare {

namespace {
struct Entry {
  std::uint32_t raw;
  TypeTraits traits;
};
constexpr Entry kTypes[] = {
    {0, {"F32", 1, 4}},      {1, {"F16", 1, 2}},       {2, {"Q4_0", 32, 18}},
    {3, {"Q4_1", 32, 20}},   {6, {"Q5_0", 32, 22}},    {7, {"Q5_1", 32, 24}},
    {8, {"Q8_0", 32, 34}},   {9, {"Q8_1", 32, 36}},    {10, {"Q2_K", 256, 84}},
    {11, {"Q3_K", 256, 110}}, {12, {"Q4_K", 256, 144}}, {13, {"Q5_K", 256, 176}},
    {14, {"Q6_K", 256, 210}}, {15, {"Q8_K", 256, 292}}, {30, {"BF16", 1, 2}},
};
}  // namespace

const TypeTraits* find_type_traits(std::uint32_t raw) noexcept {
  for (const auto& e : kTypes)
    if (e.raw == raw) return &e.traits;
  return nullptr;
}

const TypeTraits& type_traits(GgmlType type) {
  const TypeTraits* t = find_type_traits(static_cast<std::uint32_t>(type));
  if (t == nullptr) fail(ErrorCode::internal, "unknown tensor type {}", static_cast<std::uint32_t>(type));
  return *t;
}

std::string_view type_name(GgmlType type) {
  const TypeTraits* t = find_type_traits(static_cast<std::uint32_t>(type));
  return t != nullptr ? t->name : std::string_view("unknown");
}

bool is_supported_weight_type(GgmlType type) noexcept {
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q8_0:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q6_K:
      return true;
    default:
      return false;
  }
}

std::size_t TensorView::row_bytes() const noexcept {
  const TypeTraits* t = find_type_traits(static_cast<std::uint32_t>(type));
  if (t == nullptr) return 0;
  return static_cast<std::size_t>(ne[0] / t->block_size) * t->type_size;
}

}  // namespace qkvshare
