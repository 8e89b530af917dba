// libFuzzer target for the descriptor parser: any input must either decode
// or throw qkvshare::Error(bad_descriptor); a decoded one must re-encode to
// the same bytes and render as JSON. Any other exception, and any sanitizer
// report, is a finding. The open() path against a live pool is exercised by
// the bounded mutation test tests/share/test_descriptor_mutation.cpp in CI.
//   cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DQKVSHARE_FUZZ=ON
//   cmake --build build-fuzz --target fuzz_descriptor
//   ./build-fuzz/tests/fuzz/fuzz_descriptor -max_len=512 -max_total_time=60
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <xxhash.h>

#include "qkvshare/core/error.hpp"
#include "qkvshare/share/descriptor.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // A 257-byte input is a descriptor whose self checksum gets fixed first, so
  // that the fuzzer also reaches the field checks behind the checksum.
  std::vector<std::uint8_t> bytes(data, data + size);
  if (size == qkvshare::kDescriptorBytes + 1) {
    bytes.pop_back();
    const std::uint64_t sum = XXH3_64bits(bytes.data(), 248);
    for (int i = 0; i < 8; ++i) bytes[248 + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(sum >> (8 * i));
  }
  try {
    const qkvshare::Descriptor d = qkvshare::Descriptor::decode(bytes, "fuzz");
    const qkvshare::DescriptorBytes again = d.encode();
    if (bytes.size() != again.size() || std::memcmp(bytes.data(), again.data(), bytes.size()) != 0) {
      std::fprintf(stderr, "decoded descriptor does not re-encode to its bytes\n");
      std::abort();
    }
    volatile std::size_t n = d.json().size();
    (void)n;
    (void)d.format();
  } catch (const qkvshare::Error& e) {
    if (e.code() != qkvshare::ErrorCode::bad_descriptor) {
      std::fprintf(stderr, "unexpected error code: %s\n", e.what());
      std::abort();
    }
  }
  return 0;
}
