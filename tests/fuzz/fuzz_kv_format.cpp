// libFuzzer target: KV format names (KvFormat::parse, from --kv flags,
// workflow `kv:` fields and the server's options) on arbitrary text. A text
// either throws qkvshare::Error or gives a format whose canonical text parses
// back to the same format, and whose size arithmetic stays finite. Texts that
// name a codebook file (book=) are skipped: they read the disk.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_cache.hpp"
#include "qkvshare/kv/kv_format.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (text.find("book") != std::string::npos) return 0;
  qkvshare::KvFormat f;
  try {
    f = qkvshare::KvFormat::parse(text);
  } catch (const qkvshare::Error&) {
    return 0;
  }
  const std::string canonical = f.to_string();
  try {
    if (!(qkvshare::KvFormat::parse(canonical) == f)) {
      std::fprintf(stderr, "'%s' -> '%s' parses to another format\n", text.c_str(), canonical.c_str());
      std::abort();
    }
  } catch (const qkvshare::Error& e) {
    std::fprintf(stderr, "'%s' -> '%s' does not parse: %s\n", text.c_str(), canonical.c_str(), e.what());
    std::abort();
  }
  qkvshare::KvShape shape;
  shape.n_layers = 30;
  shape.n_heads = 9;
  shape.n_kv_heads = 3;
  shape.head_dim = 64;
  try {
    f.validate(shape, 32);
    if (!std::isfinite(f.cold_bits(32, 64))) std::abort();
    (void)f.context_bytes(shape, 32, 2048);
  } catch (const qkvshare::Error&) {
  }
  return 0;
}
