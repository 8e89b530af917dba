// qkvshare bench: load time, prefill and decode tokens/s at several context
// depths, peak RSS; repeated, with median and spread. A table on stdout, JSON
// with --json, progress on stderr. The tests mirror llama-bench's (pp512,
// tg128 at depth d: the context is filled first and only the decode is timed).
#include <sys/resource.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>

#include "bench_batch.hpp"
#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"
#include "qkvshare/core/clock.hpp"
#include "qkvshare/engine/engine.hpp"

namespace qkvshare::cli {

namespace {

struct BenchArgs {
  ModelArgs model;
  int reps = 3;
  int n_prompt = 512;
  int n_gen = 128;
  std::vector<int> depths{0, 1024, 2048};
  std::string json_path;
  std::uint64_t seed = 1234;
  bool no_warmup = false;
  std::vector<int> batches;  // non-empty: the batched decode tests (bench_batch.hpp) instead
  std::vector<std::string> kv{"f16"};
  bool shared_prefix = false;
  int kv_block_tokens = 32;
};

struct TestResult {
  std::string name;
  std::string kind;  // "prefill" or "decode"
  int n_tokens = 0;
  int depth = 0;
  std::vector<double> seconds;
  std::vector<double> tps;
};

struct Summary {
  double median = 0, min = 0, max = 0, mean = 0, stdev = 0;
};

Summary summarize(std::vector<double> v) {
  Summary s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  s.median = n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  s.min = v.front();
  s.max = v.back();
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(n);
  double ss = 0;
  for (const double x : v) ss += (x - s.mean) * (x - s.mean);
  s.stdev = n > 1 ? std::sqrt(ss / static_cast<double>(n - 1)) : 0.0;
  return s;
}

// Peak resident set: VmHWM from /proc/self/status, else getrusage's ru_maxrss.
std::uint64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<std::uint64_t>(ru.ru_maxrss) * 1024;
}

// Elements of the weights Model::weight_bytes counts (for FLOPs per token).
std::int64_t weight_params(const Model& m) {
  const ModelWeights& w = m.weights();
  std::int64_t n = w.output.n_elements() + w.output_norm.n_elements();
  for (const LayerWeights& l : w.layers)
    for (const TensorView* t : {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.w_gate, &l.w_up, &l.w_down})
      n += t->n_elements();
  return n;
}

class Bench {
 public:
  Bench(const BenchArgs& a, Engine& engine) : a_(a), engine_(engine), rng_(a.seed) {}

  std::vector<TokenId> random_tokens(int n) {
    std::uniform_int_distribution<TokenId> dist(0, engine_.model().config().vocab_size - 1);
    std::vector<TokenId> t(static_cast<std::size_t>(n));
    for (TokenId& id : t) id = dist(rng_);
    return t;
  }

  void warmup() {
    const int n = std::min(16, std::max(1, engine_.model().config().context_length - 1));
    auto session = engine_.new_session(n + 1);
    engine_.forward(*session, random_tokens(n));
    engine_.forward(*session, random_tokens(1));
  }

  TestResult prefill(int n) {
    TestResult r{"pp" + std::to_string(n), "prefill", n, 0, {}, {}};
    for (int rep = 0; rep < a_.reps; ++rep) {
      auto session = engine_.new_session(n);
      const auto tokens = random_tokens(n);
      const auto t0 = std::chrono::steady_clock::now();
      engine_.forward(*session, tokens);
      record(r, rep, seconds_since(t0));
    }
    return r;
  }

  TestResult decode(int n, int depth) {
    TestResult r{"tg" + std::to_string(n), "decode", n, depth, {}, {}};
    for (int rep = 0; rep < a_.reps; ++rep) {
      auto session = engine_.new_session(depth + n);
      if (depth > 0) {
        std::fprintf(stderr, "[bench] %s @ d%d rep %d/%d: filling the context with %d tokens\n", r.name.c_str(), depth,
                     rep + 1, a_.reps, depth);
        engine_.forward(*session, random_tokens(depth));
      }
      const auto tokens = random_tokens(n);
      const auto t0 = std::chrono::steady_clock::now();
      for (const TokenId t : tokens) engine_.forward(*session, std::span<const TokenId>(&t, 1));
      record(r, rep, seconds_since(t0));
    }
    return r;
  }

 private:
  void record(TestResult& r, int rep, double s) {
    r.seconds.push_back(s);
    r.tps.push_back(r.n_tokens / std::max(s, 1e-9));
    std::fprintf(stderr, "[bench] %s @ d%d rep %d/%d: %.3f s, %.2f tokens/s\n", r.name.c_str(), r.depth, rep + 1,
                 a_.reps, s, r.tps.back());
  }

  const BenchArgs& a_;
  Engine& engine_;
  std::mt19937_64 rng_;
};

nlohmann::json to_json(const TestResult& r) {
  const Summary s = summarize(r.tps);
  return {{"name", r.name},
          {"kind", r.kind},
          {"n_tokens", r.n_tokens},
          {"depth", r.depth},
          {"seconds", r.seconds},
          {"tokens_per_s", {{"samples", r.tps}, {"median", s.median}, {"min", s.min}, {"max", s.max},
                            {"mean", s.mean}, {"stdev", s.stdev}}}};
}

void print_table(const Model& model, int threads, const BenchArgs& a, double load_s, std::uint64_t rss,
                 const std::vector<TestResult>& results) {
  const ModelConfig& c = model.config();
  std::printf("model: %s\n", a.model.model_path.c_str());
  std::printf("       %s, %d layers, d_model %d, %d/%d heads, vocab %d, weights %s %.1f MiB | threads %d | reps %d\n",
              c.architecture.c_str(), c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.vocab_size,
              std::string(type_name(model.weights().layers.front().wq.type)).c_str(),
              static_cast<double>(model.weight_bytes()) / (1024.0 * 1024.0), threads, a.reps);
  std::printf("%-8s %6s %14s %10s %10s %9s\n", "test", "depth", "t/s (median)", "min", "max", "stdev");
  for (const TestResult& r : results) {
    const Summary s = summarize(r.tps);
    std::printf("%-8s %6d %14.2f %10.2f %10.2f %9.2f\n", r.name.c_str(), r.depth, s.median, s.min, s.max, s.stdev);
  }
  std::printf("load %.3f s | peak RSS %.1f MiB\n", load_s, static_cast<double>(rss) / (1024.0 * 1024.0));
  std::fflush(stdout);
}

void run_bench(const BenchArgs& a) {
  if (!a.json_path.empty()) check_output_file(a.json_path, "--json");  // not after the whole benchmark
  const auto t0 = std::chrono::steady_clock::now();
  auto model = load_model(a.model);
  const double load_s = seconds_since(t0);
  const ModelConfig& c = model->config();
  Engine engine(*model, engine_options(a.model));
  const int threads = engine.pool().size();
  Bench bench(a, engine);
  if (!a.no_warmup) bench.warmup();

  std::vector<TestResult> results;
  nlohmann::json batch_tests;
  if (!a.batches.empty()) {
    BatchBenchArgs ba{a.batches, a.kv, a.depths, a.n_gen, a.reps, a.seed, a.shared_prefix, a.kv_block_tokens};
    batch_tests = run_batch_bench(engine, ba);
  } else if (a.n_prompt > 0) {
    if (a.n_prompt > c.context_length)
      fail(ErrorCode::invalid_argument, "--n-prompt: {} tokens exceed the model's context length {}", a.n_prompt,
           c.context_length);
    results.push_back(bench.prefill(a.n_prompt));
  }
  if (a.n_gen > 0 && a.batches.empty()) {
    for (const int depth : a.depths) {
      if (depth + a.n_gen > c.context_length) {
        std::fprintf(stderr, "[bench] skipping tg%d @ d%d: exceeds the model's context length %d\n", a.n_gen, depth,
                     c.context_length);
        continue;
      }
      results.push_back(bench.decode(a.n_gen, depth));
    }
  }
  if (results.empty() && batch_tests.empty())
    fail(ErrorCode::invalid_argument, "nothing was measured: every test was skipped (see above) or -p and -n are both 0");
  const std::uint64_t rss = peak_rss_bytes();
  print_table(*model, threads, a, load_s, rss, results);

  if (!a.json_path.empty()) {
    nlohmann::json j{{"engine", "qkvshare"},
                     {"model", a.model.model_path},
                     {"model_name", c.name},
                     {"architecture", c.architecture},
                     {"n_layers", c.n_layers},
                     {"d_model", c.d_model},
                     {"n_heads", c.n_heads},
                     {"n_kv_heads", c.n_kv_heads},
                     {"head_dim", c.head_dim},
                     {"d_ff", c.d_ff},
                     {"vocab_size", c.vocab_size},
                     {"context_length", c.context_length},
                     {"weight_type", type_name(model->weights().layers.front().wq.type)},
                     {"weight_bytes", model->weight_bytes()},
                     {"weight_params", weight_params(*model)},
                     {"threads", threads},
                     {"reps", a.reps},
                     {"load_seconds", load_s},
                     {"peak_rss_bytes", rss},
                     {"tests", nlohmann::json::array()}};
    for (const TestResult& r : results) j["tests"].push_back(to_json(r));
    for (const auto& t : batch_tests) j["tests"].push_back(t);
    std::ofstream out(a.json_path);
    out << j.dump(2) << "\n";
    out.close();
    if (!out) fail(ErrorCode::io, "{}: cannot write the JSON results", a.json_path);
    std::fprintf(stderr, "[bench] wrote %s\n", a.json_path.c_str());
  }
}

}  // namespace

void register_bench(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand("bench", "Measure load time, prefill and decode tokens/s, peak RSS");
  add_model_args(*cmd, args->model);
  cmd->add_option("-r,--reps", args->reps, "Repetitions of each test")->check(CLI::Range(1, 1000))->capture_default_str();
  cmd->add_option("-p,--n-prompt", args->n_prompt, "Prompt tokens of the prefill test (0: skip)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("-n,--n-gen", args->n_gen, "Tokens of each decode test (0: skip)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("-d,--depths", args->depths, "Context depths of the decode tests, e.g. 0,1024,2048")
      ->delimiter(',')
      ->check(CLI::Range(0, 1 << 22))
      ->capture_default_str();
  cmd->add_option("--json", args->json_path, "Also write the results as JSON to this file");
  cmd->add_option("--seed", args->seed, "Seed of the random token ids")->capture_default_str()->check(seed_validator());
  cmd->add_flag("--no-warmup", args->no_warmup, "Skip the warm-up pass (which pages the weights in)");
  cmd->add_option("--batch", args->batches,
                  "Batched decode instead: sessions decoding together, e.g. 1,2,4,8 (llama-batched-bench's test)")
      ->delimiter(',')
      ->check(CLI::Range(1, EngineOptions{}.max_batch));  // one forward pass holds them all
  cmd->add_flag("--shared-prefix", args->shared_prefix,
                "Batched decode: all sessions fork one filled context (llama-batched-bench -pps)");
  cmd->add_option("--kv", args->kv, "KV formats of the batched decode tests, e.g. f16,int8,int4")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--kv-block-tokens", args->kv_block_tokens, "Batched decode: tokens per pool block (a power of two)")
      ->check(CLI::IsMember({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}))
      ->capture_default_str();
  cmd->callback([args] { run_bench(*args); });
}

}  // namespace qkvshare::cli
