// Handoff cost: seal + grant + open of a context of 128 .. 16k tokens, in
// process and across processes, against (a) re-encoding the text (prefill on
// the real model) and (b) copying the context's KV bytes (what llama.cpp's
// state save/load does). The contexts hold synthetic K/V in the model's KV
// shape: handoff cost does not depend on the values.
//   bench_handoff [--model GGUF] [--sizes 128,1024,4096,16384] [--format f16]
//                 [--prefill-max 1024] [--reps 200] [--json out.json]
// Prefill is measured up to --prefill-max tokens and extrapolated linearly
// above (a lower bound: attention grows with the context); the table and the
// JSON say which numbers are extrapolated.
// The first seal of a context is timed three ways (issue 16 item 2): with
// block checksums computed at seal (background checksums off, as before);
// with them kept by the background thread, right after the last write (the
// worst case: a bulk fill the thread may not have caught up with) and once the
// thread has caught up (a producer whose blocks filled while it decoded). A
// second table times decode on the real model with background checksums on
// and off, alternating, on identical token streams.
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "bench_util.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/block_checksums.hpp"
#include "qkvshare/share/handoff.hpp"

using namespace qkvshare;
using qkvshare::bench::fill_random_kv;
using qkvshare::bench::median;
using Clock = std::chrono::steady_clock;

namespace {

double us_since(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }

struct Row {
  int tokens = 0;
  double kv_mib = 0, seal_first_us = 0, seal_us = 0, grant_us = 0, open_us = 0, handoff_us = 0;
  double seal_first_sync_us = 0, seal_first_immediate_us = 0, catch_up_us = 0;
  double remote_open_us = 0, remote_first_open_us = 0, remote_round_trip_us = 0;
  double copy_us = 0, prefill_us = 0;
  bool prefill_extrapolated = false;
};

// Child: opens every descriptor that arrives on `in`, answers its open time on `out`.
int consumer(const std::string& pool_name, const KvShape& shape, int in, int out) {
  auto pool = SharePool::attach(pool_name);
  pool->kv_pool(shape);
  for (;;) {
    DescriptorBytes b;
    if (::read(in, b.data(), b.size()) != static_cast<ssize_t>(b.size())) return 0;
    const auto t0 = Clock::now();
    const Descriptor d = Descriptor::decode(b);
    OpenedContext o = pool->open(d, d.grantee, true, static_cast<int>(d.token_count));
    Session session(std::move(o.cache), std::move(o.tokens));
    const double us = us_since(t0);
    pool->release(d, d.grantee);
    if (::write(out, &us, sizeof us) != sizeof us) return 1;
  }
}

Row measure(int n, const KvShape& shape, const KvFormat& format, int reps, const std::string& shm_name) {
  Row row;
  row.tokens = n;
  ShareConfig config;
  config.max_tokens = std::max(n, 1024);
  config.max_contexts = 8;
  config.max_grants = 16;
  config.bytes = KvPool::arena_bytes_for(shape, 32, format, n, 2) + (std::size_t{64} << 20) +
                 static_cast<std::size_t>(config.max_tokens) * 8 * 20;
  auto pool = SharePool::create(shm_name, config);
  auto kv = pool->kv_pool(shape);
  const std::vector<TokenId> ids(static_cast<std::size_t>(n), 1);
  const ModelFingerprint fp{};
  // The first seal without background checksums, then with them right after the last write.
  for (const bool background : {false, true}) {
    kv::set_background_checksums(background);
    PooledKvCache first(kv, format, n);
    fill_random_kv(first, n);
    const auto t0 = Clock::now();
    SealedContext s = pool->seal(first, ids, "", fp, "A");
    (background ? row.seal_first_immediate_us : row.seal_first_sync_us) = us_since(t0);
    pool->release(s);
    kv::wait_for_checksums();
  }
  PooledKvCache cache(kv, format, n);
  fill_random_kv(cache, n);
  auto t0 = Clock::now();
  kv::wait_for_checksums();
  row.catch_up_us = us_since(t0);
  row.kv_mib = static_cast<double>(cache.kv_bytes()) / (1024.0 * 1024.0);

  t0 = Clock::now();
  SealedContext sealed = pool->seal(cache, ids, "", fp, "A");
  row.seal_first_us = us_since(t0);
  std::vector<double> seal, grant, open, handoff;
  for (int r = 0; r < reps; ++r) {
    pool->release(sealed);
    t0 = Clock::now();
    sealed = pool->seal(cache, ids, "", fp, "A");
    seal.push_back(us_since(t0));
    t0 = Clock::now();
    const DescriptorBytes bytes = pool->grant(sealed, "A", "B").encode();
    grant.push_back(us_since(t0));
    const auto t1 = Clock::now();
    const Descriptor d = Descriptor::decode(bytes);
    OpenedContext o = pool->open(d, "B", true, n);
    Session session(std::move(o.cache), std::move(o.tokens));
    open.push_back(us_since(t1));
    handoff.push_back(us_since(t0));
    pool->release(d, "B");
  }
  row.seal_us = median(seal);
  row.grant_us = median(grant);
  row.open_us = median(open);
  row.handoff_us = median(handoff);

  // Across processes: the consumer is another process mapping the pool.
  int to_child[2], to_parent[2];
  if (::pipe(to_child) != 0 || ::pipe(to_parent) != 0) fail(ErrorCode::io, "pipe failed");
  std::fflush(nullptr);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(to_child[1]);
    ::close(to_parent[0]);
    int rc = 1;
    try {
      rc = consumer(shm_name, shape, to_child[0], to_parent[1]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "consumer: %s\n", e.what());
    }
    ::_exit(rc);
  }
  ::close(to_child[0]);
  ::close(to_parent[1]);
  std::vector<double> remote, trip;
  for (int r = 0; r < reps; ++r) {
    t0 = Clock::now();
    const DescriptorBytes bytes = pool->grant(sealed, "A", "B").encode();
    double us = 0;
    if (::write(to_child[1], bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size()) ||
        ::read(to_parent[0], &us, sizeof us) != sizeof us)
      fail(ErrorCode::io, "consumer process failed");
    trip.push_back(us_since(t0));
    if (r == 0) row.remote_first_open_us = us; else remote.push_back(us);
  }
  ::close(to_child[1]);
  int status = 0;
  ::waitpid(child, &status, 0);
  ::close(to_parent[0]);
  row.remote_open_us = median(remote);
  row.remote_round_trip_us = median(trip);
  pool->release(sealed);

  // (b) copying the KV bytes: a state save into a buffer and a load back.
  const std::size_t bytes = cache.kv_bytes();
  std::vector<std::byte> a(bytes, std::byte{1}), b(bytes, std::byte{2});
  std::vector<double> copy;
  for (int r = 0; r < std::max(5, reps / 10); ++r) {
    t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    copy.push_back(us_since(t0));
  }
  // The fastest copy: the baseline at its best. Save + load copy twice.
  row.copy_us = 2 * *std::min_element(copy.begin(), copy.end());
  ShmRegion::unlink(shm_name);
  return row;
}

// Decode on the real model into a pooled context, then seal it: background
// checksums on and off alternately, on the same token stream and threads.
struct DecodeRow {
  bool background = false;
  double tokens_per_s = 0, seal_us = 0;
};

std::vector<DecodeRow> decode_then_seal(Engine& engine, const KvFormat& format, int prompt, int steps, int rounds) {
  const KvShape shape = engine.kv_shape();
  const int n = prompt + steps;
  ShareConfig config;
  config.max_tokens = n;
  config.max_contexts = 4;
  config.bytes = KvPool::arena_bytes_for(shape, 32, format, n, 2) + (std::size_t{16} << 20);
  const std::string name = "bench-handoff-decode." + std::to_string(::getpid());
  auto pool = SharePool::create(name, config);
  auto kv = pool->kv_pool(shape);
  std::vector<TokenId> ids(static_cast<std::size_t>(n));
  std::mt19937 rng(3);
  for (auto& t : ids) t = static_cast<TokenId>(rng() % 1000u + 100u);
  std::vector<DecodeRow> rows;
  for (int r = 0; r < 2 * rounds; ++r) {
    const bool background = r % 2 == 1;
    kv::set_background_checksums(background);
    Session session(std::make_unique<PooledKvCache>(kv, format, n));
    engine.forward(session, std::span<const TokenId>(ids.data(), static_cast<std::size_t>(prompt)));
    const auto t0 = Clock::now();
    for (int i = prompt; i < n; ++i) engine.forward(session, std::span<const TokenId>(&ids[static_cast<std::size_t>(i)], 1));
    DecodeRow row{background, steps / (us_since(t0) / 1e6), 0};
    const auto t1 = Clock::now();
    SealedContext sealed = pool->seal(static_cast<PooledKvCache&>(session.cache()), ids, "", ModelFingerprint{}, "A");
    row.seal_us = us_since(t1);
    pool->release(sealed);
    kv::wait_for_checksums();
    rows.push_back(row);
  }
  kv::set_background_checksums(true);
  ShmRegion::unlink(name);
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Handoff cost: seal + grant + open vs prefill and KV copy"};
  std::string model_path, json_path, format_text = "f16";
  std::vector<int> sizes{128, 1024, 4096, 16384};
  int prefill_max = 1024, reps = 200, threads = 0, decode_prompt = 1024, decode_steps = 256, decode_rounds = 3;
  if (const char* home = std::getenv("HOME")) model_path = std::string(home) + "/.cache/qkvshare/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  app.add_option("--model", model_path, "GGUF model (KV shape, prefill)");
  app.add_option("--sizes", sizes, "Context sizes in tokens")->delimiter(',');
  app.add_option("--format", format_text, "KV format of the contexts");
  app.add_option("--prefill-max", prefill_max, "Largest context whose prefill is measured (larger: extrapolated)");
  app.add_option("--reps", reps, "Repetitions of each handoff measurement")->check(CLI::Range(2, 100000));
  app.add_option("--threads", threads, "Threads for the prefill (0: all cores)");
  app.add_option("--json", json_path, "Write the results here as JSON");
  app.add_option("--decode-prompt", decode_prompt, "Decode comparison: prompt tokens before decoding");
  app.add_option("--decode-steps", decode_steps, "Decode comparison: tokens decoded, then sealed (0: skip)");
  app.add_option("--decode-rounds", decode_rounds, "Decode comparison: rounds of background off/on")->check(CLI::Range(1, 100));
  CLI11_PARSE(app, argc, argv);
  try {
    auto model = Model::load(model_path);
    Engine engine(*model, EngineOptions{threads});
    const KvShape shape = engine.kv_shape();
    const KvFormat format = KvFormat::parse(format_text);
    std::vector<Row> rows;
    double per_token_us = 0;
    int measured_max = 0;
    for (int n : sizes) {
      Row row = measure(n, shape, format, n >= 4096 ? std::max(20, reps / 4) : reps,
                        "bench-handoff." + std::to_string(::getpid()));
      if (n <= prefill_max && n <= model->config().context_length) {
        std::vector<TokenId> ids(static_cast<std::size_t>(n));
        std::mt19937 rng(1);
        for (auto& t : ids) t = static_cast<TokenId>(rng() % static_cast<unsigned>(model->config().vocab_size));
        auto session = engine.new_session(n);
        const auto t0 = Clock::now();
        engine.forward(*session, ids);
        row.prefill_us = us_since(t0);
        if (n >= measured_max) {
          measured_max = n;
          per_token_us = row.prefill_us / n;
        }
      } else {
        row.prefill_us = per_token_us * n;
        row.prefill_extrapolated = true;
      }
      rows.push_back(row);
      std::fprintf(stderr, "%d tokens done\n", n);
    }
    std::printf("model %s, KV format %s, %d layers x %d KV heads x %d dims; median of %d reps (fewer at >= 4k)\n\n",
                model->config().name.c_str(), format.to_string().c_str(), shape.n_layers, shape.n_kv_heads,
                shape.head_dim, reps);
    std::printf("| tokens | KV MiB | seal, first, hashing at seal (ms) | seal, first, background, right after the fill (us) |"
                " background catch-up after the fill (ms) | seal, first, background caught up (us) | seal again (us) |"
                " grant + open, same process (us) | open, other process (us) | round trip to other process (us) |"
                " KV copy save+load (ms) | prefill (ms) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    nlohmann::json j;
    j["model"] = model_path;
    j["format"] = format.to_string();
    j["shape"] = {shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.head_dim};
    j["prefill_measured_up_to"] = measured_max;
    for (const Row& r : rows) {
      std::printf("| %d | %.1f | %.2f | %.1f | %.2f | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f | %.0f%s |\n", r.tokens,
                  r.kv_mib, r.seal_first_sync_us / 1000, r.seal_first_immediate_us, r.catch_up_us / 1000,
                  r.seal_first_us, r.seal_us, r.handoff_us, r.remote_open_us, r.remote_round_trip_us,
                  r.copy_us / 1000, r.prefill_us / 1000, r.prefill_extrapolated ? " (extrapolated)" : "");
      j["rows"].push_back({{"tokens", r.tokens}, {"kv_mib", r.kv_mib}, {"seal_first_us", r.seal_first_us},
                           {"seal_first_hashing_at_seal_us", r.seal_first_sync_us},
                           {"seal_first_right_after_fill_us", r.seal_first_immediate_us},
                           {"background_catch_up_us", r.catch_up_us},
                           {"seal_again_us", r.seal_us}, {"grant_us", r.grant_us}, {"open_us", r.open_us},
                           {"handoff_open_us", r.handoff_us}, {"remote_open_us", r.remote_open_us},
                           {"remote_first_open_us", r.remote_first_open_us},
                           {"remote_round_trip_us", r.remote_round_trip_us}, {"kv_copy_us", r.copy_us},
                           {"prefill_us", r.prefill_us}, {"prefill_extrapolated", r.prefill_extrapolated}});
    }
    if (decode_steps > 0) {
      const std::vector<DecodeRow> dec = decode_then_seal(engine, format, decode_prompt, decode_steps, decode_rounds);
      std::printf("\nDecode %d tokens after a %d-token prompt (%s KV, pooled), then seal; rounds alternate:\n\n"
                  "| background checksums | decode tok/s (median) | seal after decode (us, median) | runs |\n"
                  "|---|---:|---:|---:|\n", decode_steps, decode_prompt, format.to_string().c_str());
      for (const bool background : {false, true}) {
        std::vector<double> tps, seal;
        for (const DecodeRow& d : dec)
          if (d.background == background) {
            tps.push_back(d.tokens_per_s);
            seal.push_back(d.seal_us);
            j["decode"].push_back({{"background", d.background}, {"tokens_per_s", d.tokens_per_s}, {"seal_us", d.seal_us}});
          }
        std::printf("| %s | %.1f | %.1f | %zu |\n", background ? "on" : "off", median(tps), median(seal), tps.size());
      }
      j["decode_prompt"] = decode_prompt;
      j["decode_steps"] = decode_steps;
    }
    if (!json_path.empty()) std::ofstream(json_path) << j.dump(2) << "\n";
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
