#include "qkvshare/server/tenants.hpp"

#include <fstream>
#include <sstream>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"
#include "qkvshare/share/descriptor.hpp"
#include "qkvshare/share/hmac_sha256.hpp"

namespace qkvshare::server {

namespace {

std::array<std::uint8_t, 32> digest_of(std::string_view key) {
  return share_detail::sha256({reinterpret_cast<const std::uint8_t*>(key.data()), key.size()});
}

}  // namespace

Tenants Tenants::load(const std::string& path) {
  check_input_file(path, "API key file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::io, "{}: cannot open the API key file", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path);
}

Tenants Tenants::parse(std::string_view text, std::string_view source) {
  Tenants t;
  int line_no = 0;
  while (!text.empty()) {
    const std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const std::size_t first = line.find_first_not_of(" \t");
    if (first == std::string_view::npos || line[first] == '#') continue;
    line.remove_prefix(first);
    const std::size_t sp = line.find_first_of(" \t");
    if (sp == std::string_view::npos)
      fail(ErrorCode::invalid_argument, "{}:{}: expected 'KEY TENANT', found one word", source, line_no);
    const std::string_view key = line.substr(0, sp);
    std::string_view tenant = line.substr(sp);
    tenant.remove_prefix(tenant.find_first_not_of(" \t"));
    while (!tenant.empty() && (tenant.back() == ' ' || tenant.back() == '\t')) tenant.remove_suffix(1);
    if (key.size() < 16 || key.size() > 256)
      fail(ErrorCode::invalid_argument, "{}:{}: the key is {} bytes; keys must be 16..256 bytes", source, line_no, key.size());
    for (char c : key)
      if (static_cast<unsigned char>(c) < 0x21 || static_cast<unsigned char>(c) > 0x7e)
        fail(ErrorCode::invalid_argument, "{}:{}: the key holds a non-printable byte", source, line_no);
    if (tenant.find_first_of(" \t") != std::string_view::npos)
      fail(ErrorCode::invalid_argument, "{}:{}: expected 'KEY TENANT', found more words", source, line_no);
    validate_agent_id(tenant, fmt::format("{}:{}: tenant", source, line_no));
    const auto d = digest_of(key);
    for (const Entry& e : t.entries_)
      if (e.digest == d) fail(ErrorCode::invalid_argument, "{}:{}: this key is listed twice", source, line_no);
    t.entries_.push_back({d, std::string(tenant)});
  }
  if (t.entries_.empty()) fail(ErrorCode::invalid_argument, "{}: no API keys in the file", source);
  return t;
}

std::optional<std::string> Tenants::authenticate(std::string_view authorization) const {
  if (entries_.empty()) return std::string("default");
  constexpr std::string_view bearer = "Bearer ";
  const bool has_bearer = authorization.substr(0, bearer.size()) == bearer;
  const auto d = digest_of(has_bearer ? authorization.substr(bearer.size()) : std::string_view{});
  // Visit every entry and fold the differences: no early exit on a match.
  std::size_t found = entries_.size();
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    std::uint8_t diff = 0;
    for (std::size_t b = 0; b < d.size(); ++b) diff |= static_cast<std::uint8_t>(entries_[i].digest[b] ^ d[b]);
    const std::size_t is_match = static_cast<std::size_t>(diff == 0);
    found = is_match * i + (1 - is_match) * found;
  }
  if (!has_bearer || found == entries_.size()) return std::nullopt;
  return entries_[found].tenant;
}

}  // namespace qkvshare::server
