#pragma once
// The remote tier: sealed contexts pushed to and pulled from a Redis server
// in the portable format (context_file.hpp), so that another device (another
// process with its own pool and its own model load) continues from them.
//   - blocks are content-addressed: key "qkv:blk:<key id>:<XXH3-128 of the
//     block's canonical plaintext and table entry>", written with SET NX, so
//     a block shared by several contexts (a common prefix, a fork) is stored
//     once; its value is the block's stored payload (sealed when a cipher is
//     given: nothing readable leaves the device);
//   - a context is a manifest "qkv:ctx:<name>": the file's header and tables
//     followed by its block keys;
//   - every key gets the TTL; pushing again refreshes it; Redis' own
//     eviction (maxmemory) may drop keys earlier, which a pull reports as a
//     missing key.
// A RemoteRef (a small JSON file) names a remote context: server, name,
// token count, fingerprint, and the token ids, so that a consumer falls back
// to re-encoding them when Redis is down or the context is gone. Every call
// has a connect and a reply timeout: an unreachable or stalled server is an
// Error(io), never a hang.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "qkvshare/engine/engine.hpp"
#include "qkvshare/share/handoff.hpp"
#include "qkvshare/tiers/context_file.hpp"

namespace qkvshare {

struct RedisOptions {
  std::string host = "127.0.0.1";
  int port = 6379;
  int timeout_ms = 2000;   // connect, and each reply
  int ttl_seconds = 3600;  // of every key written
  std::shared_ptr<const BlockCipher> cipher;
};

struct RemoteRef {
  std::string host;
  int port = 0;
  std::string name;
  int tokens = 0;
  ModelFingerprint fingerprint;
  std::vector<TokenId> token_ids;  // for the text fallback
  std::string json() const;
  static RemoteRef parse(const std::string& json, const std::string& source);  // Error(bad_descriptor)
};

struct PushResult {
  RemoteRef ref;
  int blocks = 0, blocks_stored = 0;  // stored: new in Redis (the others were there already)
  std::uint64_t bytes_sent = 0;       // payload bytes actually sent (new blocks + manifest)
  double seconds = 0;
};

struct RemoteOpen {
  HandoffResult handoff;   // kv = true when the remote KV was used
  std::string problem;     // why it fell back to text, empty when kv
  std::uint64_t bytes_received = 0;
  double seconds = 0;
};

class RedisTier {
 public:
  explicit RedisTier(RedisOptions options);
  ~RedisTier();
  RedisTier(const RedisTier&) = delete;
  RedisTier& operator=(const RedisTier&) = delete;

  // Pushes the context `d` names (opened as its grantee `agent`) as `name`.
  PushResult push(SharePool& pool, const Descriptor& d, std::string_view agent, const std::string& name);
  // The whole file bytes of a remote context (validated by the caller's ContextReader).
  std::vector<std::uint8_t> fetch(const std::string& name, std::uint64_t* bytes_received = nullptr);
  // Fetches `ref`, imports it into `pool` and opens it for `agent`; on any
  // failure (server down, key missing, tampered block, wrong key, another
  // model) re-encodes ref.token_ids instead and says why.
  RemoteOpen open(SharePool& pool, Engine& engine, const ModelFingerprint& fingerprint, const RemoteRef& ref,
                  std::string_view agent, int capacity = 0);
  // Remaining TTL of a remote context's manifest in seconds (-2: missing).
  long long ttl(const std::string& name);

 private:
  struct Conn;
  Conn& conn();
  RedisOptions options_;
  std::unique_ptr<Conn> conn_;
};

}  // namespace qkvshare
