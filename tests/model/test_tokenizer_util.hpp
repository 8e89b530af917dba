#pragma once
// Shared by the tokenizer tests: file reading, random text generators and a
// naive port of llama2.c run.c's encode() to compare the fast one with.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "qkvshare/model/tokenizer.hpp"

namespace qkvshare::testing {

inline std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void append_utf8(std::string& out, char32_t cp) {
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
}

// Random valid UTF-8 mixing ASCII, whitespace runs, Latin, CJK, emoji and
// other planes; `accept` may reject code points (e.g. ones a vocabulary
// cannot represent).
inline std::string random_utf8(std::mt19937& rng, std::size_t n_code_points,
                               const std::function<bool(char32_t)>& accept = {}) {
  std::string out;
  std::uniform_int_distribution<int> kind(0, 9);
  while (n_code_points > 0) {
    char32_t cp = 0;
    switch (kind(rng)) {
      case 0:
        cp = U" \n\t\r"[rng() % 4];
        break;
      case 1:
      case 2:
      case 3:
        cp = static_cast<char32_t>(0x20 + rng() % 0x5F);
        break;
      case 4:
        cp = static_cast<char32_t>(0x01 + rng() % 0x7F);
        break;
      case 5:
        cp = static_cast<char32_t>(0xA0 + rng() % 0x560);
        break;
      case 6:
        cp = static_cast<char32_t>(0x4E00 + rng() % 0x5000);
        break;
      case 7:
        cp = static_cast<char32_t>(0x1F300 + rng() % 0x300);
        break;
      case 8:
        cp = static_cast<char32_t>(0x800 + rng() % 0xD000);
        break;
      default:
        cp = static_cast<char32_t>(0x10000 + rng() % 0x100000);
        break;
    }
    if (cp >= 0xD800 && cp < 0xE000) continue;  // surrogates are not UTF-8
    if (accept && !accept(cp)) continue;
    append_utf8(out, cp);
    --n_code_points;
  }
  return out;
}

// Random bytes 1..255 (any of them, so mostly invalid UTF-8).
inline std::string random_bytes(std::mt19937& rng, std::size_t n) {
  std::string out;
  for (std::size_t i = 0; i < n; ++i) out += static_cast<char>(1 + rng() % 255);
  return out;
}

// llama2.c run.c encode(), naive O(n^2) merging, from the file's own data.
class NaiveRunC {
 public:
  explicit NaiveRunC(const std::string& path, int vocab_size) {
    const std::string bytes = read_text_file(path);
    std::size_t p = 4;
    for (int i = 0; i < vocab_size; ++i) {
      float score;
      std::int32_t len;
      std::memcpy(&score, bytes.data() + p, 4);
      std::memcpy(&len, bytes.data() + p + 4, 4);
      vocab_.push_back(bytes.substr(p + 8, static_cast<std::size_t>(len)));
      scores_.push_back(score);
      lookup_.emplace(vocab_.back(), i);
      p += 8 + static_cast<std::size_t>(len);
    }
  }

  std::vector<TokenId> encode(const std::string& text) const {
    std::vector<TokenId> tokens;
    if (!text.empty()) tokens.push_back(lookup(" "));
    std::string buf;
    for (std::size_t i = 0; i < text.size(); ++i) {
      const auto c = static_cast<unsigned char>(text[i]);
      if ((c & 0xC0) != 0x80) buf.clear();
      buf += static_cast<char>(c);
      const auto next = i + 1 < text.size() ? static_cast<unsigned char>(text[i + 1]) : 0;
      if ((next & 0xC0) == 0x80 && buf.size() < 4) continue;
      if (const TokenId id = lookup(buf); id != -1) {
        tokens.push_back(id);
      } else {
        for (const char b : buf) tokens.push_back(static_cast<unsigned char>(b) + 3);
      }
      buf.clear();
    }
    while (true) {
      float best_score = -1e10f;
      TokenId best_id = -1;
      std::size_t best_idx = 0;
      for (std::size_t i = 0; i + 1 < tokens.size(); ++i) {
        const TokenId id = lookup(vocab_[static_cast<std::size_t>(tokens[i])] +
                                  vocab_[static_cast<std::size_t>(tokens[i + 1])]);
        if (id != -1 && scores_[static_cast<std::size_t>(id)] > best_score) {
          best_score = scores_[static_cast<std::size_t>(id)];
          best_id = id;
          best_idx = i;
        }
      }
      if (best_id == -1) break;
      tokens[best_idx] = best_id;
      tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(best_idx) + 1);
    }
    return tokens;
  }

 private:
  TokenId lookup(const std::string& s) const {
    const auto it = lookup_.find(s);
    return it == lookup_.end() ? -1 : it->second;
  }
  std::vector<std::string> vocab_;
  std::vector<float> scores_;
  std::unordered_map<std::string, TokenId> lookup_;
};

}  // namespace qkvshare::testing
