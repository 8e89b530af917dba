// libFuzzer target: the PQ codebook parser (KvCodebook::parse) on arbitrary
// bytes must either return a codebook or throw qkvshare::Error, never crash,
// read out of bounds or allocate for a size the bytes do not hold.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_codebook.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const qkvshare::KvCodebook book =
        qkvshare::KvCodebook::parse(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    (void)book.id();
  } catch (const qkvshare::Error&) {
  }
  return 0;
}
