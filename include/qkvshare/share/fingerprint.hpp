#pragma once
// Model fingerprints: a consumer may use another agent's KV only if it runs
// the very same model, so a descriptor names the model by a hash of what
// determines K and V: architecture, shapes, RoPE and norm parameters, the
// tokenizer and every weight tensor's type, shape and leading and trailing
// bytes. Hashing the ends of each tensor instead of all its bytes keeps the
// fingerprint cheap (tens of microseconds) while any retrained or requantized
// weight file still changes it.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "qkvshare/kv/kv_format.hpp"
#include "qkvshare/model/model.hpp"

namespace qkvshare {

struct ModelFingerprint {
  std::array<std::uint8_t, 16> model{};  // XXH3-128 of everything above
  std::uint64_t tokenizer = 0;           // XXH3-64 of the vocabulary alone

  // Equal tokenizers make token ids portable: the text fallback can then
  // prefill the producer's ids exactly instead of re-encoding its text.
  bool operator==(const ModelFingerprint&) const = default;
  std::string hex() const {  // 32 hex digits of `model`
    static constexpr char digits[] = "0123456789abcdef";
    std::string s;
    for (std::uint8_t b : model) {
      s += digits[b >> 4];
      s += digits[b & 15];
    }
    return s;
  }
};

ModelFingerprint model_fingerprint(const Model& model);

// Throws Error(invalid_argument) naming `where` when `format` is pq and its
// codebook was learned on another model than `fp`'s (a codebook holds for the
// model it was learned on only).
void check_codebook_model(const KvFormat& format, const ModelFingerprint& fp, std::string_view where);
std::uint64_t tokenizer_fingerprint(const Tokenizer& tokenizer);

}  // namespace qkvshare
