// qkvshare serve: the OpenAI-compatible server (src/server, docs/server.md).
// SIGINT/SIGTERM stop it gracefully (running requests finish, queued ones get
// 503, the pool is left consistent); a second signal cancels running requests.
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <thread>

#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/server/server.hpp"

namespace qkvshare::cli {

namespace {

struct ServeArgs {
  ModelArgs model;
  server::ServerOptions o;
  int pool_mib = 512, cache_mib = 0, max_body_kib = 8192;
  std::string demote, key;
  bool no_auto_reuse = false, quiet = false, no_think = false;
};

void run_serve(ServeArgs& a) {
  server::ServerOptions o = a.o;
  o.pool_bytes = static_cast<std::size_t>(a.pool_mib) << 20;
  o.cache_bytes = static_cast<std::size_t>(a.cache_mib) << 20;
  o.max_body_bytes = static_cast<std::size_t>(a.max_body_kib) << 10;
  o.auto_reuse = !a.no_auto_reuse;
  o.log_requests = !a.quiet;
  o.thinking = !a.no_think;
  if (!a.key.empty() && o.spill_dir.empty())
    fail(ErrorCode::invalid_argument, "--key {}: it encrypts spill files; give --spill-dir too", a.key);
  o.demote = parse_demote_flag(a.demote);
  o.cipher = load_key_flag(a.key);
  if (o.model_id.empty()) o.model_id = std::filesystem::path(a.model.model_path).stem().string();
  // Block the stop signals before any thread starts, so only the waiter below sees them.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  auto model = load_model(a.model);
  Engine engine(*model, engine_options(a.model));
  server::Server srv(engine, o);
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&stop, &sig);
    std::fprintf(stderr, "{\"event\":\"shutdown\",\"signal\":%d,\"mode\":\"drain\"}\n", sig);
    std::thread second([&] {
      int again = 0;
      sigwait(&stop, &again);
      std::fprintf(stderr, "{\"event\":\"shutdown\",\"signal\":%d,\"mode\":\"cancel\"}\n", again);
      std::_Exit(130);
    });
    second.detach();
    srv.stop(false);
  });
  std::printf("qkvshare serve: listening on http://%s:%d (model %s, kv %s, parallel %d)\n", o.host.c_str(), srv.port(),
              o.model_id.c_str(), o.kv.c_str(), o.parallel);
  std::fflush(stdout);
  const bool ok = srv.run();
  srv.stop(false);
  if (waiter.joinable()) {
    pthread_kill(waiter.native_handle(), SIGTERM);  // wake the waiter if the server ended by itself
    waiter.join();
  }
  if (!ok) fail(ErrorCode::io, "serve: the HTTP server stopped with an error");
  std::fprintf(stderr, "{\"event\":\"stopped\"}\n");
}

}  // namespace

void register_serve(CLI::App& app) {
  auto args = std::make_shared<ServeArgs>();
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible server with shared, quantized KV contexts");
  add_model_args(*cmd, args->model);
  cmd->add_option("--host", args->o.host, "Address to listen on");
  cmd->add_option("--port", args->o.port, "Port (0: any free port, printed on stdout)")->check(CLI::Range(0, 65535));
  cmd->add_option("--kv", args->o.kv, "KV format of new contexts (kv_format syntax: f16, int8, int4, k8v4, ...)");
  cmd->add_option("--pool", args->o.pool, "Named shared pool to attach (created if absent), so other processes can open handles");
  cmd->add_option("--pool-mib", args->pool_mib, "Size of a pool this server creates, MiB")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-contexts", args->o.max_contexts, "Sealed contexts a pool this server creates can hold")
      ->check(CLI::Range(8, 65536));
  cmd->add_option("--cache-mib", args->cache_mib, "KV MiB kept for cached contexts before LRU eviction (0: 3/4 of the pool)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--spill-dir", args->o.spill_dir,
                  "Spill evicted cached contexts to files here (created) and restore them when reused, instead of dropping them");
  cmd->add_option("--demote", args->demote,
                  "Recode an evicted cached context to this KV format (one precision, e.g. int4) before spilling or dropping it");
  cmd->add_option("--key", args->key, "Key file: encrypt spilled blocks (XChaCha20-Poly1305); needs --spill-dir");
  cmd->add_option("--parallel", args->o.parallel, "Requests decoding at once")->check(CLI::Range(1, 256));
  cmd->add_option("--queue", args->o.queue, "Requests waiting beyond --parallel before 429")->check(CLI::Range(0, 65536));
  cmd->add_option("--ctx", args->o.ctx, "Context size in tokens per request (0: the model's)")->check(CLI::Range(0, 1 << 22));
  cmd->add_option("--api-key-file", args->o.api_key_file, "File of 'KEY TENANT' lines; without it there is one tenant and no keys");
  cmd->add_option("--model-id", args->o.model_id, "Model name in /v1/models (default: the file name)");
  cmd->add_option("--max-body-kib", args->max_body_kib, "Largest request body, KiB (413 above)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-tokens", args->o.limits.max_tokens, "Largest max_tokens a request may ask for")->check(CLI::Range(1, 1 << 22));
  cmd->add_flag("--no-auto-reuse", args->no_auto_reuse, "Do not reuse other requests' KV unless a request names a context");
  cmd->add_flag("--quiet", args->quiet, "No per-request log lines on stderr");
  cmd->add_option("--chat-template", args->o.chat_template,
                  "Chat template family instead of the model's (chatml, qwen3, llama3, gemma, phi3, mistral, plain)");
  cmd->add_flag("--no-think", args->no_think, "Qwen3: answer without a reasoning block");
  cmd->callback([args] { run_serve(*args); });
}

}  // namespace qkvshare::cli
