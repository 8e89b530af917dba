// Memory tiers (issue 16): what it costs to move a context out of the pool
// and back, against re-encoding it, and what prefetching buys a consumer.
//   bench_tiers [--model GGUF] [--sizes 2048,16384] [--formats f16,int8,int4,int2]
//               [--reps 5] [--prefill 2048] [--ttft-reps 3] [--json out.json]
// 1. Disk: spill (export + fsync + rename) and open from disk (mmap, verify
//    every block, copy into pool blocks, seal, grant, open) of a context in
//    SmolLM2-135M's KV shape with synthetic values (cost does not depend on
//    them), plain and encrypted, per format; bytes on disk against f16.
//    Formats and encryption alternate inside each repetition; medians.
// 2. Re-prefill: the same number of tokens through the real model (measured
//    up to --prefill tokens; none above: SmolLM2's context is 8192).
// 3. Consumer TTFT under a budget: a workflow of two producers and their
//    consumers (a ~2,000- and a ~1,000-token document) run by the orchestrator
//    at 75% of its peak KV (room for the larger context at rest, not both),
//    prefetch on and off alternating, --ttft-reps times; the consumer whose
//    context was spilled reports its time to first token.
#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <thread>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "qkvshare/agents/orchestrator.hpp"
#include "bench_util.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/share/handoff.hpp"
#include "qkvshare/tiers/crypto.hpp"
#include "qkvshare/tiers/disk_tier.hpp"
#include "qkvshare/tiers/redis_tier.hpp"

using namespace qkvshare;
using qkvshare::bench::fill_random_kv;
using qkvshare::bench::median;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

struct DiskRow {
  int tokens = 0;
  std::string format;
  bool encrypted = false;
  double kv_mib = 0, file_mib = 0, ratio_vs_f16 = 0;
  std::vector<double> spill_ms, open_ms, push_ms, redis_open_ms;
  double sent_mib = 0;
};

// A private redis-server on a free port for the remote-tier rows.
struct Server {
  pid_t pid = -1;
  int port = 0;
  Server() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
    ::close(fd);
    pid = ::fork();
    if (pid == 0) {
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 1);
      ::dup2(null, 2);
      const std::string p = std::to_string(port);
      ::execlp("redis-server", "redis-server", "--port", p.c_str(), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 300; ++i) {
      timeval tv{0, 100000};
      redisContext* c = redisConnectWithTimeout("127.0.0.1", port, tv);
      const bool ok = c && !c->err;
      if (c) redisFree(c);
      if (ok) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    fail(ErrorCode::io, "bench: redis-server did not start");
  }
  void flush() const {
    timeval tv{5, 0};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port, tv);
    freeReplyObject(redisCommand(c, "FLUSHALL"));
    redisFree(c);
  }
  ~Server() {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
};

const char* kTtftWorkflow = R"(name: tiers-ttft
documents:
  article: data/robert_boulter.txt
  half: data/robert_boulter_first_half.txt
agents:
  reader:
    system: You answer questions about the document the user gives you.
    prompt: "Document:\n{doc:article}"
    max_tokens: 0
  other:
    system: You answer questions about the document the user gives you.
    prompt: "Document:\n{doc:half}"
    max_tokens: 0
  asker:
    prompt: "Which television series did Robert Boulter appear in? Answer briefly."
    max_tokens: 16
  asker2:
    prompt: "Which plays did he perform in? Answer briefly."
    max_tokens: 16
steps:
  - {id: read, agent: reader}
  - {id: read_half, agent: other}
  - {id: ask_half, agent: asker2, inputs: [{from: read_half, mode: continue}]}
  - {id: ask_read, agent: asker, inputs: [{from: read, mode: continue}]}
)";

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Memory tiers: spill / open from disk vs re-prefill; TTFT with and without prefetch");
  std::string model_path, json_path, formats_text = "f16,int8,int4,int2";
  std::vector<int> sizes{2048, 16384};
  int reps = 5, prefill_max = 2048, ttft_reps = 3, threads = 0;
  app.add_option("--model", model_path, "SmolLM2 GGUF (default: $QKVSHARE_MODEL)");
  const CLI::Validator token_count(
      [](std::string& item) {
        int v = 0;
        const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
        return ec == std::errc{} && end == item.data() + item.size() && v >= 1
                   ? std::string()
                   : "'" + item + "' is not a positive token count";
      },
      "TOKENS");
  app.add_option("--sizes", sizes, "Context sizes in tokens")->delimiter(',')->check(token_count);
  app.add_option("--formats", formats_text, "KV formats");
  app.add_option("--reps", reps, "Repetitions of the disk measurements");
  app.add_option("--prefill", prefill_max, "Largest size re-prefilled on the real model");
  app.add_option("--ttft-reps", ttft_reps, "Repetitions of each TTFT mode (0: skip)");
  app.add_option("--threads", threads, "Engine threads (0: all cores)");
  app.add_option("--json", json_path, "Write the results as JSON");
  CLI11_PARSE(app, argc, argv);
  try {
    if (model_path.empty()) {
      if (const char* env = std::getenv("QKVSHARE_MODEL")) model_path = env;
      else model_path = std::string(std::getenv("HOME")) + "/.cache/qkvshare/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    }
    std::vector<std::string> formats;
    for (std::size_t p = 0; p <= formats_text.size();) {
      const std::size_t e = std::min(formats_text.find(',', p), formats_text.size());
      formats.push_back(formats_text.substr(p, e - p));
      p = e + 1;
    }
    auto model = Model::load(model_path);
    EngineOptions eo;
    eo.n_threads = threads;
    Engine engine(*model, eo);
    const KvShape shape = engine.kv_shape();
    const ModelFingerprint fp = model_fingerprint(*model);
    const std::string dir = (std::filesystem::temp_directory_path() / ("qkvshare-bench-tiers." + std::to_string(::getpid()))).string();
    std::array<std::uint8_t, KeyCipher::kKeyBytes> key{};
    key[0] = 1;
    const auto cipher = std::make_shared<KeyCipher>(key);
    const DiskTier plain_disk(dir), sealed_disk(dir, cipher);
    const Server server;
    RedisOptions ro;
    ro.port = server.port;
    ro.timeout_ms = 30000;
    RedisTier plain_remote(ro);
    ro.cipher = cipher;
    RedisTier sealed_remote(ro);
    nlohmann::json out;

    // 1. Disk tier.
    std::vector<DiskRow> rows;
    for (int n : sizes) {
      ShareConfig sc;
      sc.max_tokens = n;
      sc.bytes = 4 * KvPool::arena_bytes_for(shape, 32, KvFormat::parse("f16"), n, 1) + (std::size_t{64} << 20);
      auto pool = SharePool::create_anonymous(sc);
      auto kv = pool->kv_pool(shape);
      std::vector<Descriptor> ds;
      std::vector<TokenId> ids(static_cast<std::size_t>(n));
      for (int i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = 1 + i % 1000;
      for (const auto& f : formats) {
        auto cache = std::make_unique<PooledKvCache>(kv, KvFormat::parse(f), n);
        fill_random_kv(*cache, n);
        const SealedContext s = pool->seal(*cache, ids, "", fp, "bench");
        ds.push_back(pool->grant(s, "bench", "reader"));
        pool->release(s);
        for (const bool enc : {false, true}) {
          DiskRow r;
          r.tokens = n;
          r.format = f;
          r.encrypted = enc;
          r.kv_mib = static_cast<double>(cache->kv_bytes()) / (1 << 20);
          rows.push_back(r);
        }
      }
      for (int rep = 0; rep < reps; ++rep) {
        for (std::size_t fi = 0; fi < formats.size(); ++fi) {
          for (const bool enc : {false, true}) {
            DiskRow& r = rows[rows.size() - 2 * formats.size() + 2 * fi + (enc ? 1 : 0)];
            const DiskTier& disk = enc ? sealed_disk : plain_disk;
            auto t0 = Clock::now();
            const SpillResult sp = disk.spill(*pool, ds[fi], "reader", "ctx");
            r.spill_ms.push_back(ms_since(t0));
            r.file_mib = static_cast<double>(sp.file_bytes) / (1 << 20);
            t0 = Clock::now();
            const RestoreResult rr = disk.restore(*pool, "ctx", "bench", &fp);
            const Descriptor d = pool->grant(rr.sealed, "bench", "consumer");
            pool->release(rr.sealed);
            HandoffOptions ho;
            ho.mode = HandoffMode::kv;
            ho.capacity = n + 16;
            HandoffResult h = open_session(*pool, engine, fp, d, "consumer", ho);
            r.open_ms.push_back(ms_since(t0));
            if (!h.kv) fail(ErrorCode::internal, "restored context fell back to text");
            h.session.reset();
            pool->release(d, "consumer");
            disk.remove("ctx");
            // Remote tier: push to an empty Redis (every block sent), then pull, import and open.
            RedisTier& remote = enc ? sealed_remote : plain_remote;
            server.flush();
            t0 = Clock::now();
            const PushResult pr = remote.push(*pool, ds[fi], "reader", "ctx");
            r.push_ms.push_back(ms_since(t0));
            r.sent_mib = static_cast<double>(pr.bytes_sent) / (1 << 20);
            t0 = Clock::now();
            RemoteOpen ro2 = remote.open(*pool, engine, fp, pr.ref, "consumer", n + 16);
            r.redis_open_ms.push_back(ms_since(t0));
            if (!ro2.handoff.kv) fail(ErrorCode::internal, "remote open fell back: {}", ro2.problem);
            ro2.handoff.session.reset();
          }
        }
      }
    }
    double f16_bytes = 0;
    for (auto& r : rows) {
      if (r.format == "f16" && !r.encrypted && r.tokens == sizes.front()) f16_bytes = r.file_mib;
    }
    std::printf("| tokens | format | encrypted | KV MiB in pool | file MiB | f16 / file | spill (ms) | open from disk (ms) | push to Redis (ms) | open from Redis (ms) |\n");
    std::printf("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (auto& r : rows) {
      double f16_same = 0;
      for (const auto& q : rows)
        if (q.tokens == r.tokens && q.format == "f16" && q.encrypted == r.encrypted) f16_same = q.file_mib;
      r.ratio_vs_f16 = f16_same / r.file_mib;
      std::printf("| %d | %s | %s | %.1f | %.1f | %.2fx | %.1f | %.1f | %.1f | %.1f |\n", r.tokens, r.format.c_str(),
                  r.encrypted ? "yes" : "no", r.kv_mib, r.file_mib, r.ratio_vs_f16, median(r.spill_ms),
                  median(r.open_ms), median(r.push_ms), median(r.redis_open_ms));
      out["disk"].push_back({{"tokens", r.tokens},
                             {"format", r.format},
                             {"encrypted", r.encrypted},
                             {"kv_mib", r.kv_mib},
                             {"file_mib", r.file_mib},
                             {"ratio_vs_f16", r.ratio_vs_f16},
                             {"spill_ms", r.spill_ms},
                             {"open_ms", r.open_ms},
                             {"push_ms", r.push_ms},
                             {"redis_open_ms", r.redis_open_ms},
                             {"redis_sent_mib", r.sent_mib}});
    }
    (void)f16_bytes;

    // 2. Re-prefill on the real model.
    std::printf("\n| tokens | re-prefill (ms) |\n|---:|---:|\n");
    for (int n : sizes) {
      if (n > prefill_max || n > model->config().context_length) {
        std::printf("| %d | not measured (above --prefill %d or the model's context %d) |\n", n, prefill_max,
                    model->config().context_length);
        continue;
      }
      std::vector<double> ms;
      for (int rep = 0; rep < 2; ++rep) {
        auto s = engine.new_session(n + 16);
        std::vector<TokenId> ids(static_cast<std::size_t>(n));
        for (int i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = 1 + (i * 7919) % 40000;
        const auto t0 = Clock::now();
        engine.forward(*s, ids);
        ms.push_back(ms_since(t0));
      }
      std::printf("| %d | %.0f |\n", n, median(ms));
      out["prefill"].push_back({{"tokens", n}, {"ms", ms}});
    }

    // 3. Consumer TTFT under a budget, prefetch on and off alternating.
    if (ttft_reps > 0) {
      const auto wf_path = std::filesystem::path(QKVSHARE_SOURCE_DIR) / "examples" / "tiers_ttft.yaml";
      const agents::Workflow wf = agents::Workflow::parse(kTtftWorkflow, wf_path.string());
      agents::RunOptions o;
      o.kv = "int8";
      o.context = 4096;
      o.threads = threads;
      const agents::RunReport free_run = agents::run_workflow(wf, model_path, "", o);
      o.tiers.budget_bytes = free_run.peak_kv_bytes * 3 / 4;
      o.tiers.spill_dir = dir + "/ttft";
      std::map<bool, std::vector<double>> ttft, wait;
      std::map<bool, agents::RunReport> last;
      for (int rep = 0; rep < ttft_reps; ++rep)
        for (const bool prefetch : {true, false}) {
          o.tiers.prefetch = prefetch;
          const agents::RunReport r = agents::run_workflow(wf, model_path, "", o);
          for (const auto& s : r.steps)
            if (s.step == "ask_read") ttft[prefetch].push_back(s.ttft_seconds * 1000);
          wait[prefetch].push_back(r.tiers.restore_wait_seconds * 1000);
          for (std::size_t i = 0; i < r.steps.size(); ++i)
            if (r.steps[i].output_tokens != free_run.steps[i].output_tokens)
              fail(ErrorCode::internal, "step {} generated other tokens under the budget", r.steps[i].step);
          last[prefetch] = r;
        }
      double no_budget = 0;
      for (const auto& s : free_run.steps)
        if (s.step == "ask_read") no_budget = s.ttft_seconds * 1000;
      std::printf("\npeak KV without a budget %.2f MiB, budget %.2f MiB (75%%)\n",
                  static_cast<double>(free_run.peak_kv_bytes) / (1 << 20),
                  static_cast<double>(o.tiers.budget_bytes) / (1 << 20));
      std::printf("| consumer ask_read | TTFT (ms, median) | waiting for the restore (ms) | prefetched | restored on demand |\n|---|---:|---:|---:|---:|\n");
      std::printf("| no budget | %.1f | 0 | 0 | 0 |\n", no_budget);
      for (const bool prefetch : {true, false})
        std::printf("| budget, %s | %.1f | %.1f | %d | %d |\n", prefetch ? "prefetch" : "no prefetch",
                    median(ttft[prefetch]), median(wait[prefetch]), last[prefetch].tiers.prefetches,
                    last[prefetch].tiers.restores_on_demand);
      out["ttft"] = {{"no_budget_ms", no_budget},
                     {"budget_bytes", o.tiers.budget_bytes},
                     {"peak_kv_bytes", free_run.peak_kv_bytes},
                     {"prefetch_ms", ttft[true]},
                     {"no_prefetch_ms", ttft[false]},
                     {"prefetch_wait_ms", wait[true]},
                     {"no_prefetch_wait_ms", wait[false]}};
    }
    std::filesystem::remove_all(dir);
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
