#pragma once
// API keys -> tenants. A tenant is the unit of isolation: it sees, opens and
// automatically reuses only its own contexts and those granted to it. Its
// name is also the agent id that descriptors made for it are granted to, so
// a tenant can hand a context to another process on the same pool.
//
// Keys are kept only as SHA-256 digests and every lookup compares the
// presented key's digest with every stored digest in constant time, so
// neither the time nor the memory access pattern depends on which key (or
// how much of one) matched.
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace qkvshare::server {

class Tenants {
 public:
  // No keys: every request belongs to the tenant "default", unauthenticated.
  Tenants() = default;
  // File format: one "KEY TENANT" per line; blank lines and lines starting
  // with '#' are skipped. Keys are 16..256 printable non-space bytes, tenants
  // are agent ids. Throws Error(io / invalid_argument) naming path and line.
  static Tenants load(const std::string& path);
  static Tenants parse(std::string_view text, std::string_view source);

  bool enabled() const noexcept { return !entries_.empty(); }
  std::size_t size() const noexcept { return entries_.size(); }
  // The tenant of an Authorization header value ("Bearer KEY"); nullopt when
  // keys are enabled and it matches none (the caller answers 401).
  std::optional<std::string> authenticate(std::string_view authorization) const;

 private:
  struct Entry {
    std::array<std::uint8_t, 32> digest;
    std::string tenant;
  };
  std::vector<Entry> entries_;
};

}  // namespace qkvshare::server
