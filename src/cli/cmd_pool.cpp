// qkvshare pool serve|stat|ls|unlink: the shared-memory pool other processes map.
#include <signal.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <nlohmann/json.hpp>

#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/share/share_pool.hpp"

namespace qkvshare::cli {

namespace {

struct PoolArgs {
  std::string name, bytes = "256M";
  ShareConfig config;
  bool json = false;
};

void run_serve(PoolArgs& a) {
  a.config.bytes = parse_bytes(a.bytes, "--bytes");
  // Block the signals first, so that one arriving while the pool is being
  // created is not lost: the loop below collects it and cleans up.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  auto pool = SharePool::create(a.name, a.config);
  std::printf("pool %s ready: %zu bytes, %d contexts of up to %d tokens, %d processes, lease %d ms\n", a.name.c_str(),
              a.config.bytes, a.config.max_contexts, a.config.max_tokens, a.config.max_processes, a.config.lease_ms);
  std::fflush(stdout);
  const long ms = a.config.reap_interval_ms;
  const timespec wait{ms / 1000, (ms % 1000) * 1000000L};
  int sig = -1;
  while (sig < 0) {
    sig = sigtimedwait(&stop, nullptr, &wait);
    if (sig < 0 && errno != EAGAIN && errno != EINTR)
      fail(ErrorCode::io, "pool serve: sigtimedwait failed: {}", std::strerror(errno));
    try {
      if (const int n = pool->reap(); n > 0)
        std::fprintf(stderr, "pool %s: reclaimed %d dead process%s\n", a.name.c_str(), n, n == 1 ? "" : "es");
    } catch (const Error& e) {
      std::fprintf(stderr, "pool %s: reaper: %s\n", a.name.c_str(), e.what());
    }
  }
  if (SharePool::unlink_if_same(a.name, pool->pool_id()))
    std::fprintf(stderr, "pool %s: %s, unlinked\n", a.name.c_str(), strsignal(sig));
  else
    std::fprintf(stderr, "pool %s: %s; the name no longer refers to this pool, left as it is\n", a.name.c_str(),
                 strsignal(sig));
}

void run_stat(const PoolArgs& a) {
  auto pool = SharePool::attach(a.name);
  pool->reap();
  std::cout << pool->stats().json() << "\n";
}

void run_ls(const PoolArgs& a) {
  auto pool = SharePool::attach(a.name);
  pool->reap();
  const std::vector<GrantInfo> grants = pool->grants();
  if (a.json) {
    nlohmann::json j = nlohmann::json::array();
    for (const GrantInfo& g : grants)
      j.push_back({{"grant", g.slot}, {"generation", g.generation}, {"context", g.context_id}, {"producer", g.producer},
                   {"grantee", g.grantee}, {"holder_pid", g.holder_pid}, {"state", to_string(g.state)}, {"idle_ms", g.idle_ms}});
    std::cout << nlohmann::json{{"lease_ms", pool->lease_ms()}, {"grants", j}}.dump(2) << "\n";
    return;
  }
  std::printf("%-8s %-10s %-16s %-16s %-10s %-10s %10s\n", "grant", "context", "producer", "grantee", "holder", "state",
              "idle ms");
  for (const GrantInfo& g : grants) {
    const std::string_view state = to_string(g.state);
    std::printf("%-8u %-10llu %-16s %-16s %-10d %-10.*s %10llu\n", g.slot, static_cast<unsigned long long>(g.context_id),
                g.producer.c_str(), g.grantee.c_str(), g.holder_pid, static_cast<int>(state.size()), state.data(),
                static_cast<unsigned long long>(g.idle_ms));
  }
  std::printf("%zu grant%s, lease %d ms\n", grants.size(), grants.size() == 1 ? "" : "s", pool->lease_ms());
}

// For pools whose `pool serve` was killed: a pool that live processes still
// use (its server among them) keeps its name unless --force, since unlinking
// it would hide every context stored there from the processes that come next.
void run_unlink(const PoolArgs& a, bool force) {
  ShmRegion::validate_name(a.name);
  if (!force) {
    int others = 0;
    try {
      auto pool = SharePool::attach(a.name);
      pool->reap();
      others = pool->stats().processes - 1;  // not this one
    } catch (const Error& e) {
      if (e.code() == ErrorCode::io && std::string_view(e.what()).find("does not exist") != std::string_view::npos)
        fail(ErrorCode::io, "pool '{}' does not exist", a.name);
      // A region too damaged to attach is left over by definition: remove it.
    }
    if (others > 0)
      fail(ErrorCode::invalid_argument,
           "pool '{}' is in use by {} live process{} (see `pool ls`): stop its `pool serve` with SIGINT or SIGTERM "
           "(it unlinks the pool), or pass --force",
           a.name, others, others == 1 ? "" : "es");
  }
  if (!ShmRegion::unlink(a.name)) fail(ErrorCode::io, "pool '{}' does not exist", a.name);
}

}  // namespace

void register_pool(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("pool", "Serve or examine a shared-memory KV pool");
  cmd->require_subcommand(1);

  auto s = std::make_shared<PoolArgs>();
  CLI::App* serve = cmd->add_subcommand("serve", "Create a pool and hold it until SIGINT/SIGTERM (then unlink it)");
  serve->add_option("--name", s->name, "Pool name (/dev/shm/qkvshare.NAME)")->required();
  serve->add_option("--bytes", s->bytes, "Size of the whole pool: registry, ledgers and KV (e.g. 256M, 2G)");
  serve->add_option("--contexts", s->config.max_contexts, "Sealed contexts alive at once")->check(CLI::Range(1, 65536));
  serve->add_option("--grants", s->config.max_grants, "Descriptors alive at once")->check(CLI::Range(1, 1 << 20));
  serve->add_option("--processes", s->config.max_processes, "Processes attached at once")->check(CLI::Range(1, 4096));
  serve->add_option("--max-tokens", s->config.max_tokens, "Tokens of one sealed context")->check(CLI::Range(1, 1 << 24));
  serve->add_option("--block-tokens", s->config.block_tokens, "Tokens per KV block (a power of two)");
  serve->add_option("--reap-ms", s->config.reap_interval_ms, "How often dead processes are reclaimed")
      ->check(CLI::Range(1, 3600000));
  serve->add_option("--lease", s->config.lease_ms,
                    "ms after which a holder that stopped using an opened context gives it up to the tiers first")
      ->check(CLI::Range(1, 86400000))
      ->capture_default_str();
  serve->callback([s] { run_serve(*s); });

  auto st = std::make_shared<PoolArgs>();
  CLI::App* stat = cmd->add_subcommand("stat", "Print a pool's counters as JSON");
  stat->add_option("--name", st->name, "Pool name")->required();
  stat->callback([st] { run_stat(*st); });

  auto ls = std::make_shared<PoolArgs>();
  CLI::App* lsc = cmd->add_subcommand("ls", "List a pool's grants: context, grantee, holder pid, state, idle ms");
  lsc->add_option("--name", ls->name, "Pool name")->required();
  lsc->add_flag("--json", ls->json, "JSON instead of a table");
  lsc->callback([ls] { run_ls(*ls); });

  auto un = std::make_shared<PoolArgs>();
  CLI::App* unlink = cmd->add_subcommand("unlink", "Remove a pool left behind by a `pool serve` that was killed");
  unlink->add_option("--name", un->name, "Pool name")->required();
  auto force = std::make_shared<bool>(false);
  unlink->add_flag("--force", *force, "Unlink even while live processes use the pool");
  unlink->callback([un, force] { run_unlink(*un, *force); });
}

}  // namespace qkvshare::cli
