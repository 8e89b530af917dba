#pragma once
// Pieces shared by the SentencePiece and byte-level BPE tokenizers: UTF-8
// helpers, byte-token pieces and literal special-token matching.
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qkvshare/model/tokenizer.hpp"

namespace qkvshare::detail {

// Bytes of the UTF-8 sequence that `lead` starts; 1 for bytes that cannot
// start one, so that invalid input still advances.
std::size_t utf8_sequence_length(unsigned char lead) noexcept;
std::string utf8_encode(char32_t cp);
// Decodes the code point at s[pos]; nullopt for an invalid sequence.
std::optional<char32_t> utf8_decode(std::string_view s, std::size_t& pos);

// "<0x0A>" -> 0x0A; nullopt for anything else (SentencePiece byte pieces are
// exactly six characters with upper- or lower-case hex digits).
std::optional<std::uint8_t> parse_byte_piece(std::string_view piece) noexcept;
std::string byte_piece(std::uint8_t byte);  // 0x0A -> "<0x0A>"

inline bool is_special_type(TokenType t) noexcept {
  return t == TokenType::control || t == TokenType::user_defined;
}

// A stretch of the input: plain text, or one literally matched special token.
struct TextFragment {
  std::string_view text;
  TokenId special = -1;
};

// Finds special-token texts leftmost-longest, as HuggingFace tokenizers'
// added-vocabulary matching does, so both split the same way.
class SpecialTokenMatcher {
 public:
  SpecialTokenMatcher() = default;
  SpecialTokenMatcher(const std::vector<std::string>& pieces, const std::vector<TokenType>& types);
  // Without parse_special, or without any special tokens, the whole text is
  // one plain fragment. Empty plain fragments are never produced.
  std::vector<TextFragment> split(std::string_view text, bool parse_special) const;

 private:
  // Candidates by first byte, longest first.
  std::array<std::vector<std::pair<std::string, TokenId>>, 256> by_first_byte_;
  bool empty_ = true;
};

}  // namespace qkvshare::detail
