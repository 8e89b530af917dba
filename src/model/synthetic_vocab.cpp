// The synthetic byte-level BPE vocabulary of `make-model` files: valid for this
// engine's GPT-2 tokenizer and for llama.cpp's (every merge joins two tokens
// that exist and makes a token that exists; all 256 byte tokens are present).
#include <array>
#include <string_view>

#include "qkvshare/core/error.hpp"
#include "qkvshare/model/synthetic_model.hpp"

namespace qkvshare {

namespace {

constexpr std::array<std::string_view, 3> kSpecials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
constexpr std::int64_t kMaxFillers = 65536 + 65536LL * 256;

std::string utf8(std::uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others
// are shifted to U+0100 and up in byte order.
std::array<std::string, 256> byte_symbols() {
  const auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE); };
  std::array<std::string, 256> out;
  std::uint32_t shifted = 256;
  for (int b = 0; b < 256; ++b)
    out[static_cast<std::size_t>(b)] = utf8(printable(b) ? static_cast<std::uint32_t>(b) : shifted++);
  return out;
}

// Bytes in the order merges use them: frequent English characters first, so
// that ordinary text tokenizes into multi-byte tokens.
std::array<int, 256> byte_priority() {
  constexpr std::string_view first = " etaoinsrhldcumfpgwybvkxjqz\nETAOINSRHLDCUMFPGWYBVKXJQZ0123456789.,;:!?'\"-()";
  std::array<bool, 256> used{};
  std::array<int, 256> order{};
  std::size_t n = 0;
  for (const char c : first) {
    const auto b = static_cast<unsigned char>(c);
    if (used[b]) continue;
    order[n++] = b;
    used[b] = true;
  }
  for (int b = 0; b < 256; ++b)
    if (!used[static_cast<std::size_t>(b)]) order[n++] = b;
  return order;
}

}  // namespace

SyntheticVocab make_synthetic_vocab(int vocab_size) {
  const std::int64_t n_fillers = static_cast<std::int64_t>(vocab_size) - 256 - static_cast<std::int64_t>(kSpecials.size());
  if (n_fillers < 0 || n_fillers > kMaxFillers)
    fail(ErrorCode::invalid_argument, "synthetic vocabulary: size {} is outside [{}, {}]", vocab_size,
         256 + kSpecials.size(), 256 + kSpecials.size() + kMaxFillers);
  const auto sym = byte_symbols();
  const auto prio = byte_priority();
  SyntheticVocab v;
  const auto n = static_cast<std::size_t>(vocab_size);
  v.tokens.reserve(n);
  v.merges.reserve(static_cast<std::size_t>(n_fillers));
  v.types.reserve(n);
  for (const std::string& s : sym) {
    v.tokens.push_back(s);
    v.types.push_back(1);
  }
  const auto add_merge = [&](const std::string& left, const std::string& right) {
    v.merges.push_back(left + " " + right);
    v.tokens.push_back(left + right);
    v.types.push_back(1);
  };
  // Level 2: every pair of byte symbols, growing over the priority order.
  std::int64_t left = n_fillers;
  for (std::size_t k = 0; k < 256 && left > 0; ++k) {
    const std::string& sk = sym[static_cast<std::size_t>(prio[k])];
    for (std::size_t j = 0; j < k && left > 0; ++j) {
      const std::string& sj = sym[static_cast<std::size_t>(prio[j])];
      add_merge(sj, sk);
      if (--left > 0) {
        add_merge(sk, sj);
        --left;
      }
    }
    if (left > 0) {
      add_merge(sk, sk);
      --left;
    }
  }
  // Level 3: a level-2 token followed by one byte symbol.
  for (std::size_t i = 256; left > 0; ++i) {
    const std::string base = v.tokens[i];  // a copy: add_merge may reallocate
    for (std::size_t s = 0; s < 256 && left > 0; ++s, --left) add_merge(base, sym[static_cast<std::size_t>(prio[s])]);
  }
  for (const std::string_view s : kSpecials) {
    v.tokens.emplace_back(s);
    v.types.push_back(3);
  }
  v.bos_id = vocab_size - 3;  // <|endoftext|>
  v.eos_id = vocab_size - 1;  // <|im_end|>
  QKV_CHECK(v.tokens.size() == n && v.types.size() == n);
  return v;
}

}  // namespace qkvshare
