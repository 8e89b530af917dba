#include "bench_batch.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <tuple>

#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/clock.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare::cli {

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Cell {
  std::vector<double> seconds;
};

}  // namespace

nlohmann::json run_batch_bench(Engine& engine, const BatchBenchArgs& a) {
  const ModelConfig& c = engine.model().config();
  if (a.batches.empty()) fail(ErrorCode::invalid_argument, "--batch: no batch sizes");
  for (int b : a.batches)
    if (b <= 0 || b > engine.options().max_batch)
      fail(ErrorCode::invalid_argument, "--batch: {} is not in [1, {}]", b, engine.options().max_batch);
  if (a.n_gen <= 0) fail(ErrorCode::invalid_argument, "--n-gen: batched decode needs at least one token");
  std::vector<KvFormat> formats;
  for (const std::string& f : a.kv) formats.push_back(KvFormat::parse(f));  // names the bad one
  for (const KvFormat& f : formats) check_codebook(f, engine.model());
  const int max_b = *std::max_element(a.batches.begin(), a.batches.end());
  std::vector<int> depths;
  for (int d : a.depths) {
    if (d + a.n_gen > c.context_length) {
      std::fprintf(stderr, "[bench] skipping depth %d: with %d new tokens it exceeds the context length %d\n", d,
                   a.n_gen, c.context_length);
      continue;
    }
    depths.push_back(d);
  }
  if (depths.empty())
    fail(ErrorCode::invalid_argument, "--depths: every depth with {} new tokens exceeds the context length {}: nothing to measure",
         a.n_gen, c.context_length);
  std::mt19937_64 rng(a.seed);
  std::uniform_int_distribution<TokenId> dist(0, c.vocab_size - 1);
  const auto random_tokens = [&](int n) {
    std::vector<TokenId> t(static_cast<std::size_t>(n));
    for (TokenId& id : t) id = dist(rng);
    return t;
  };

  std::map<std::tuple<std::size_t, int, int>, Cell> cells;  // (format, depth, batch)
  for (int rep = 0; rep < a.reps; ++rep) {
    for (const int depth : depths) {
      for (std::size_t fi = 0; fi < formats.size(); ++fi) {
        const KvFormat& f = formats[fi];
        const int capacity = depth + a.n_gen + 1;
        PoolConfig pc;
        pc.shape = engine.kv_shape();
        pc.block_tokens = a.block_tokens;
        pc.capacity_bytes = KvPool::arena_bytes_for(pc.shape, pc.block_tokens, f, capacity, 2 * max_b);
        auto pool = KvPool::create(pc);
        // max_b distinct contexts, filled once; each test decodes on forks of
        // the first B of them (the forks share the filled blocks, so every
        // batch size reads the same KV as a fresh fill would give it).
        std::vector<std::unique_ptr<PooledKvCache>> bases;
        std::vector<std::vector<TokenId>> base_tokens;
        const int n_bases = a.shared_prefix ? 1 : max_b;
        for (int s = 0; s < n_bases; ++s) {
          Session fill(std::make_unique<PooledKvCache>(pool, f, capacity));
          if (depth > 0) {
            std::fprintf(stderr, "[bench] %s d%d rep %d/%d: filling context %d/%d with %d tokens\n",
                         a.kv[fi].c_str(), depth, rep + 1, a.reps, s + 1, n_bases, depth);
            engine.forward(fill, random_tokens(depth));
          }
          bases.push_back(static_cast<PooledKvCache&>(fill.cache()).fork());
          base_tokens.push_back(fill.tokens());
        }
        for (const int b : a.batches) {
          std::vector<std::unique_ptr<Session>> sessions;
          for (int s = 0; s < b; ++s) {
            const auto base = static_cast<std::size_t>(a.shared_prefix ? 0 : s);
            sessions.push_back(std::make_unique<Session>(bases[base]->fork(), base_tokens[base]));
          }
          const std::vector<TokenId> stream = random_tokens(a.n_gen * b);
          std::vector<BatchEntry> entries(static_cast<std::size_t>(b));
          const auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < a.n_gen; ++i) {
            for (int s = 0; s < b; ++s)
              entries[static_cast<std::size_t>(s)] =
                  BatchEntry{sessions[static_cast<std::size_t>(s)].get(),
                             std::span<const TokenId>(&stream[static_cast<std::size_t>(i * b + s)], 1),
                             LogitsWanted::last};
            for (const BatchOutcome& o : engine.forward_batch(entries))
              if (!o.ok()) throw *o.error;
          }
          const double sec = seconds_since(t0);
          cells[{fi, depth, b}].seconds.push_back(sec);
          std::fprintf(stderr, "[bench] %s d%d B=%d rep %d/%d: %.3f s, aggregate %.2f tokens/s\n", a.kv[fi].c_str(),
                       depth, b, rep + 1, a.reps, sec, a.n_gen * b / std::max(sec, 1e-9));
        }
      }
    }
  }

  nlohmann::json tests = nlohmann::json::array();
  std::printf("%-12s %6s %5s %18s %18s %12s\n", "kv", "depth", "batch", "aggregate t/s", "per-session t/s",
              "vs batch 1");
  for (std::size_t fi = 0; fi < formats.size(); ++fi)
    for (const int depth : depths) {
      double single = 0.0;
      for (const int b : a.batches) {
        const Cell& cell = cells[{fi, depth, b}];
        std::vector<double> agg, per;
        for (double s : cell.seconds) {
          agg.push_back(a.n_gen * b / std::max(s, 1e-9));
          per.push_back(a.n_gen / std::max(s, 1e-9));
        }
        const double m = median(agg);
        if (b == 1) single = m;
        std::printf("%-12s %6d %5d %18.2f %18.2f %12s\n", a.kv[fi].c_str(), depth, b, m, median(per),
                    single > 0 ? fmt::format("{:.2f}x", m / single).c_str() : "-");
        tests.push_back({{"name", fmt::format("tg{}x{}", a.n_gen, b)},
                         {"kind", "batch_decode"},
                         {"kv", a.kv[fi]},
                         {"batch", b},
                         {"n_tokens", a.n_gen},
                         {"depth", depth},
                         {"shared_prefix", a.shared_prefix},
                         {"kv_block_tokens", a.block_tokens},
                         {"seconds", cell.seconds},
                         {"aggregate_tokens_per_s", {{"samples", agg}, {"median", m}}},
                         {"per_session_tokens_per_s", {{"samples", per}, {"median", median(per)}}}});
      }
    }
  std::fflush(stdout);
  return tests;
}

}  // namespace qkvshare::cli
