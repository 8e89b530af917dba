// Test helper for tests/reference/test_dequant_reference.py: dequantizes raw
// blocks of one type with the scalar reference and writes the f32 values, so
// that the PyPI gguf package's NumPy dequantization can check them bit for bit.
//   qkvshare_dequant_tool TYPE IN.bin OUT.bin
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string_view>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/quant.hpp"

int main(int argc, char** argv) {
  using namespace qkvshare;
  try {
    if (argc != 4) fail(ErrorCode::invalid_argument, "usage: {} TYPE IN.bin OUT.bin", argv[0]);
    const std::string_view name = argv[1];
    const TypeTraits* tt = nullptr;
    GgmlType type{};
    for (std::uint32_t raw = 0; raw < 64; ++raw)
      if (const TypeTraits* t = find_type_traits(raw); t != nullptr && t->name == name) {
        tt = t;
        type = static_cast<GgmlType>(raw);
      }
    if (tt == nullptr) fail(ErrorCode::invalid_argument, "unknown type '{}'", name);
    std::ifstream in(argv[2], std::ios::binary);
    if (!in) fail(ErrorCode::io, "{}: cannot open", argv[2]);
    const std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (bytes.size() % tt->type_size != 0)
      fail(ErrorCode::invalid_argument, "{}: {} bytes is not a whole number of {} blocks", argv[2], bytes.size(), name);
    const std::int64_t n = static_cast<std::int64_t>(bytes.size() / tt->type_size) * tt->block_size;
    std::vector<float> out(static_cast<std::size_t>(n));
    kernels::dequantize_row_ref(type, bytes.data(), out.data(), n);
    std::ofstream o(argv[3], std::ios::binary);
    o.write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size() * sizeof(float)));
    if (!o) fail(ErrorCode::io, "{}: cannot write", argv[3]);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
