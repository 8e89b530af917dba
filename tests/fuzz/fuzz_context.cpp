// libFuzzer target: the portable context file reader (tiers/context_file.hpp)
// on arbitrary bytes, as a disk tier or Redis hands it over: the reader must
// either accept the file or throw qkvshare::Error, and reading every block of
// an accepted file must either give its checksummed plaintext or throw, never
// crash or read outside the bytes.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/tiers/context_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const qkvshare::ContextReader reader(std::span<const std::uint8_t>(data, size), "fuzz");
    std::vector<std::uint8_t> plain;
    for (std::size_t b = 0; b < reader.meta().blocks.size(); ++b) {
      plain.resize(reader.plain_bytes(b));
      try {
        reader.read_block(b, plain, nullptr);
      } catch (const qkvshare::Error&) {
      }
    }
  } catch (const qkvshare::Error&) {
  }
  return 0;
}
