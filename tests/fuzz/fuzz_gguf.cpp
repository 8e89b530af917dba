// libFuzzer target for the GGUF reader. GgufFile::open takes a path, so each
// input goes into an in-memory file (memfd) opened through /proc; nothing
// touches the disk. Any exception other than qkvshare::Error, and any
// sanitizer report, is a finding.
//   cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DQKVSHARE_FUZZ=ON
//   cmake --build build-fuzz --target fuzz_gguf
//   mkdir corpus && QKVSHARE_FUZZ_SEED_DIR=corpus ./build-fuzz/tests/fuzz/fuzz_gguf -runs=0
//   ./build-fuzz/tests/fuzz/fuzz_gguf -max_len=4096 corpus/
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "memory_file.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/model/gguf.hpp"

namespace {

volatile unsigned g_sink;  // keeps the reads of tensor bytes from being optimised away

// Well-formed seeds, so the fuzzer starts from files that get past the header.
void write_seeds(const std::string& dir) {
  using qkvshare::GgmlType;
  for (const std::size_t alignment : {std::size_t{0}, std::size_t{64}}) {
    qkvshare::GgufWriter w;
    w.set_string("general.architecture", "llama");
    w.set_u32("llama.block_count", 2);
    w.set_i32("test.i32", -7);
    w.set_u64("test.u64", 1);
    w.set_f32("test.f32", 0.5f);
    w.set_bool("test.bool", true);
    w.set_string_array("tokenizer.ggml.tokens", {"<s>", "a"});
    w.set_f32_array("tokenizer.ggml.scores", {0.f, -1.f});
    w.set_i32_array("tokenizer.ggml.token_type", {3, 1});
    if (alignment != 0) w.set_alignment(alignment);
    w.add_tensor("t.f32", GgmlType::F32, {4, 2}, std::vector<std::uint8_t>(32, 1));
    w.add_tensor("t.q8_0", GgmlType::Q8_0, {32, 1, 2}, std::vector<std::uint8_t>(68, 2));
    w.write(dir + "/seed" + std::to_string(alignment) + ".gguf");
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("QKVSHARE_FUZZ_SEED_DIR"); dir != nullptr && *dir != '\0')
    write_seeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = qkvshare::fuzz::memory_file_with(data, size);
  try {
    const auto f = qkvshare::GgufFile::open(path);
    unsigned sum = 0;
    for (const auto& t : f->tensors())
      for (std::size_t i = 0; i < t.nbytes; ++i) sum += t.data[i];
    for (const auto& [key, value] : f->metadata()) {
      try {
        sum += static_cast<unsigned>(f->get_float(key));
      } catch (const qkvshare::Error&) {
      }
    }
    g_sink = sum;
  } catch (const qkvshare::Error& e) {
    if (e.code() != qkvshare::ErrorCode::bad_model_file) {
      std::fprintf(stderr, "unexpected error code: %s\n", e.what());
      std::abort();
    }
  }
  return 0;
}
