#pragma once
// SentencePiece-style tokenizer with llama2.c run.c encode semantics.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "qkvshare/model/tokenizer.hpp"
#include "tokenizer_common.hpp"

namespace qkvshare::detail {

struct SpmVocabulary {
  std::vector<std::string> pieces;  // as stored: spaces are ' ' (llama2.c) or U+2581 (GGUF)
  std::vector<float> scores;
  std::vector<TokenType> types;  // byte tokens must be "<0xNN>" pieces
  TokenId bos_id = -1;
  TokenId eos_id = -1;
  TokenId unk_id = -1;
  bool add_bos = true;
  bool add_space_prefix = true;
  bool escape_whitespace = false;  // ' ' <-> U+2581 (GGUF llama vocabularies)
};

class SpmTokenizer final : public Tokenizer {
 public:
  explicit SpmTokenizer(SpmVocabulary vocab);

  std::vector<TokenId> encode(std::string_view text, bool parse_special = false) const override;
  std::string token_to_piece(TokenId prev, TokenId id) const override;

 private:
  void build_pair_merges();
  // run.c: code points (or their byte tokens), then greedy best-score merging.
  void encode_text(std::string_view text, bool space_prefix, std::vector<TokenId>& out) const;

  static std::uint64_t pair_key(TokenId a, TokenId b) noexcept {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }

  std::vector<float> scores_;
  // The merge for every pair of pieces whose concatenation is a piece with a
  // mergeable score, keyed by canonical ids (the lowest id of equal pieces):
  // an integer lookup instead of concatenating and hashing strings.
  std::unordered_map<std::uint64_t, TokenId> pair_merges_;
  std::vector<TokenId> canonical_;
  std::array<TokenId, 256> byte_ids_{};  // byte fallback token per byte value
  std::vector<std::string> decoded_;     // per token: its bytes in decoded text
  bool add_space_prefix_ = true;
  bool escape_whitespace_ = false;
  SpecialTokenMatcher specials_;
};

}  // namespace qkvshare::detail
