#pragma once
// `qkvshare serve`: an OpenAI-compatible HTTP server (cpp-httplib) over the
// scheduler, with context handles, automatic prefix reuse within a tenant,
// tenants by API key, Prometheus metrics and graceful shutdown. The routes
// and their behaviour are documented in docs/server.md.
#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "qkvshare/engine/engine.hpp"
#include "qkvshare/kv/kv_format.hpp"
#include "qkvshare/server/api.hpp"
#include "qkvshare/server/tenants.hpp"

namespace httplib {
class Server;
}

namespace qkvshare {
class BlockCipher;
}

namespace qkvshare::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                        // 0: any free port (see Server::port())
  std::string model_id;                   // what /v1/models lists and requests may name
  std::string kv = "int8";                // default KV format of new contexts
  std::string pool;                       // named shared pool to attach (or create); empty: a private one
  std::size_t pool_bytes = std::size_t{512} << 20;  // a pool this server creates
  std::size_t cache_bytes = 0;            // KV bytes kept for cached contexts (0: 3/4 of the pool arena)
  int parallel = 4, queue = 64, ctx = 0;  // ctx 0: the model's context length
  int max_contexts = 256;                 // sealed contexts a pool this server creates can hold
  std::string api_key_file;               // empty: one tenant, "default", no authentication
  bool auto_reuse = true;
  std::size_t max_body_bytes = std::size_t{8} << 20;
  int http_threads = 0;                   // most connections served at once (0: 1000), threads started as needed
  Limits limits;
  bool log_requests = true;               // one JSON line per request on stderr
  std::string chat_template;              // a family name (model/chat_template.hpp); empty: the model's own
  bool thinking = true;                   // Qwen3: false answers without a reasoning block
  // Tiers (docs/tiers.md, "The server"): evicted contexts are recoded to
  // `demote` once, then spilled to files in `spill_dir` (sealed with
  // `cipher`) and restored when reused; without them they are dropped.
  std::string spill_dir;
  std::optional<KvFormat> demote;
  std::shared_ptr<const BlockCipher> cipher;
};

class Server {
 public:
  // Validates the options (Error(invalid_argument) naming the flag), attaches
  // or creates the pool, starts the scheduler and binds the socket.
  Server(Engine& engine, ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const noexcept;
  // Serves until stop(); returns false when the socket failed.
  bool run();
  // Graceful: refuses new completions (503), lets running ones finish (or,
  // with `cancel`, ends them at their next step), stops the HTTP server and
  // releases every cached context so that the pool is left consistent.
  void stop(bool cancel = false);

  // The routes, on any httplib::Server (the fuzzer drives them without a socket).
  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Routes that only decode (no engine): what tests/fuzz/fuzz_http.cpp installs
// to fuzz the HTTP parser and the request decoder together.
void install_decode_only_routes(httplib::Server& http);

}  // namespace qkvshare::server
