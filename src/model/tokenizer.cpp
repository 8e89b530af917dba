#include "qkvshare/model/tokenizer.hpp"

#include <algorithm>

#include "qkvshare/core/error.hpp"
#include "tokenizer_common.hpp"

namespace qkvshare {

namespace detail {

std::size_t utf8_sequence_length(unsigned char lead) noexcept {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

std::string utf8_encode(char32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

std::optional<char32_t> utf8_decode(std::string_view s, std::size_t& pos) {
  if (pos >= s.size()) return std::nullopt;
  const auto lead = static_cast<unsigned char>(s[pos]);
  const std::size_t len = utf8_sequence_length(lead);
  if (len == 1) {
    if (lead >= 0x80) return std::nullopt;
    ++pos;
    return lead;
  }
  if (pos + len > s.size()) return std::nullopt;
  char32_t cp = lead & (0x7F >> len);
  for (std::size_t i = 1; i < len; ++i) {
    const auto c = static_cast<unsigned char>(s[pos + i]);
    if ((c & 0xC0) != 0x80) return std::nullopt;
    cp = (cp << 6) | (c & 0x3F);
  }
  pos += len;
  return cp;
}

std::optional<std::uint8_t> parse_byte_piece(std::string_view piece) noexcept {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return std::nullopt;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int hi = hex(piece[3]);
  const int lo = hex(piece[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<std::uint8_t>(hi * 16 + lo);
}

std::string byte_piece(std::uint8_t byte) {
  return fmt::format("<0x{:02X}>", byte);
}

SpecialTokenMatcher::SpecialTokenMatcher(const std::vector<std::string>& pieces,
                                         const std::vector<TokenType>& types) {
  for (std::size_t id = 0; id < pieces.size() && id < types.size(); ++id) {
    if (!is_special_type(types[id]) || pieces[id].empty()) continue;
    by_first_byte_[static_cast<unsigned char>(pieces[id][0])].emplace_back(pieces[id],
                                                                           static_cast<TokenId>(id));
    empty_ = false;
  }
  for (auto& list : by_first_byte_) {
    // Longest first; equal texts keep the lowest id first.
    std::stable_sort(list.begin(), list.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  }
}

std::vector<TextFragment> SpecialTokenMatcher::split(std::string_view text, bool parse_special) const {
  std::vector<TextFragment> out;
  if (!parse_special || empty_) {
    if (!text.empty()) out.push_back({text, -1});
    return out;
  }
  std::size_t plain_start = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    const auto& candidates = by_first_byte_[static_cast<unsigned char>(text[pos])];
    const std::pair<std::string, TokenId>* hit = nullptr;
    for (const auto& c : candidates) {
      if (text.substr(pos, c.first.size()) == c.first) {
        hit = &c;
        break;
      }
    }
    if (hit == nullptr) {
      ++pos;
      continue;
    }
    if (pos > plain_start) out.push_back({text.substr(plain_start, pos - plain_start), -1});
    out.push_back({text.substr(pos, hit->first.size()), hit->second});
    pos += hit->first.size();
    plain_start = pos;
  }
  if (pos > plain_start) out.push_back({text.substr(plain_start, pos - plain_start), -1});
  return out;
}

}  // namespace detail

namespace {
void check_id(const Tokenizer& t, TokenId id) {
  if (id < 0 || id >= t.vocab_size())
    fail(ErrorCode::invalid_argument, "token id {} out of range [0, {})", id, t.vocab_size());
}
}  // namespace

std::string Tokenizer::decode(std::span<const TokenId> ids) const {
  std::string out;
  TokenId prev = -1;
  for (const TokenId id : ids) {
    out += token_to_piece(prev, id);
    prev = id;
  }
  return out;
}

const std::string& Tokenizer::piece(TokenId id) const {
  check_id(*this, id);
  return pieces_[static_cast<std::size_t>(id)];
}

TokenType Tokenizer::token_type(TokenId id) const {
  check_id(*this, id);
  return types_[static_cast<std::size_t>(id)];
}

std::optional<TokenId> Tokenizer::find(std::string_view piece) const {
  const auto it = piece_ids_.find(piece);
  if (it == piece_ids_.end()) return std::nullopt;
  return it->second;
}

bool Tokenizer::is_end_of_generation(TokenId id) const noexcept {
  return std::find(eog_ids_.begin(), eog_ids_.end(), id) != eog_ids_.end();
}

void Tokenizer::index_vocabulary() {
  QKV_CHECK(types_.size() == pieces_.size());
  piece_ids_.clear();
  piece_ids_.reserve(pieces_.size());
  for (std::size_t id = 0; id < pieces_.size(); ++id)
    piece_ids_.emplace(pieces_[id], static_cast<TokenId>(id));  // keeps the first on duplicates

  eog_ids_.clear();
  if (eos_id_ >= 0) eog_ids_.push_back(eos_id_);
  // Every chat family's end-of-turn tokens that this vocabulary has.
  for (ChatFamily f : {ChatFamily::chatml, ChatFamily::llama3, ChatFamily::gemma, ChatFamily::phi3, ChatFamily::mistral})
    for (std::string_view text : ChatTemplate(f).stop_pieces())
      if (auto id = find(text)) eog_ids_.push_back(*id);
  std::sort(eog_ids_.begin(), eog_ids_.end());
  eog_ids_.erase(std::unique(eog_ids_.begin(), eog_ids_.end()), eog_ids_.end());
}

}  // namespace qkvshare
