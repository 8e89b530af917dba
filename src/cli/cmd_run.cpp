// qkvshare run / demo: multi-agent workflows, alone or compared across modes.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include "common.hpp"
#include "qkvshare/agents/compare.hpp"
#include "qkvshare/agents/demo_workflow.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"
#include "qkvshare/kv/kv_format.hpp"
#include "qkvshare/model/model.hpp"

namespace qkvshare::cli {

namespace {

using namespace qkvshare::agents;

struct RunArgs {
  ModelArgs model;
  std::string workflow;
  std::string mode = "qkvshare";
  std::string kv = "int8";
  int ctx = 4096;
  int max_tokens = 0;
  bool compare = false;
  double guard_threshold = -1;
  std::string modes;  // --modes: labels for --compare (the first is the reference)
  bool quiet = false;
  bool sequential = false;
  int token_budget = 256;
  std::string json;
  std::string kv_budget, spill_dir, key, demote;
  bool no_prefetch = false;
  int lease_ms = 30000;
  bool mode_given = false, kv_given = false;  // --mode / --kv on the command line
};

void print_outputs(const RunReport& r) {
  for (const auto& s : r.steps) {
    std::printf("=== %s (%s) ===\n%s\n\n", s.step.c_str(), s.agent.c_str(), s.output.c_str());
  }
  std::printf("%-12s %-18s %8s %9s %8s %8s %10s %9s\n", "step", "handoff", "ttft s", "prefill", "reused", "decode",
              "KV KiB", "step s");
  for (const auto& s : r.steps)
    std::printf("%-12s %-18s %8.3f %9d %8d %8d %10.1f %9.2f\n", s.step.c_str(), s.handoff.c_str(), s.ttft_seconds,
                s.prefill_computed, s.prefill_reused, s.decode_tokens, static_cast<double>(s.kv_bytes) / 1024.0,
                s.seconds);
  std::printf("total %.2f s (load %.2f s) | mode %s, KV %s | prefill computed %d, reused %d | peak KV %.2f MiB\n",
              r.total_seconds, r.load_seconds, std::string(to_string(r.mode)).c_str(), r.kv.c_str(),
              r.prefill_computed, r.prefill_reused, static_cast<double>(r.peak_kv_bytes) / (1 << 20));
  const TierStats& t = r.tiers;
  if (t.evictions + t.restores_on_demand + t.prefetches > 0 || !t.failures.empty())
    std::printf("tiers: %d evicted (%d spilled, %.2f MiB written), %d prefetched, %d restored on demand (%.2f MiB "
                "read, consumers waited %.3f s), peak at rest %.2f MiB\n",
                t.evictions, t.spills, static_cast<double>(t.bytes_written) / (1 << 20), t.prefetches,
                t.restores_on_demand, static_cast<double>(t.bytes_read) / (1 << 20), t.restore_wait_seconds,
                static_cast<double>(t.peak_at_rest_bytes) / (1 << 20));
  for (const auto& d : t.demotions)
    std::printf("tiers: demoted '%s' %s -> %s: %.1f -> %.1f KiB in %.1f ms, relative RMS change of K %.4f, V %.4f\n",
                d.producer.c_str(), d.from.c_str(), d.to.c_str(), static_cast<double>(d.bytes_before) / 1024.0,
                static_cast<double>(d.bytes_after) / 1024.0, d.seconds * 1e3, d.k_rel_rms, d.v_rel_rms);
  for (const auto& f : t.failures) std::printf("tiers: %s\n", f.c_str());
  std::fflush(stdout);
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  if (!out || !(out << text << "\n")) fail(ErrorCode::io, "{}: cannot write", path);
}

// The default spill folder belongs to this process: it goes when the run
// ends, and the folders of runs that were killed (their pid no longer runs;
// their spilled contexts hold the runs' tokens and text) go first.
class OwnSpillDir {
 public:
  OwnSpillDir() {
    const std::filesystem::path tmp = std::filesystem::temp_directory_path();
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(tmp, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind(kPrefix, 0) != 0 || !names_dead_process(std::string_view(name).substr(std::strlen(kPrefix))))
        continue;
      std::error_code rm;
      std::filesystem::remove_all(e.path(), rm);
    }
    path_ = (tmp / (kPrefix + std::to_string(::getpid()))).string();
  }
  ~OwnSpillDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  OwnSpillDir(const OwnSpillDir&) = delete;
  OwnSpillDir& operator=(const OwnSpillDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  static constexpr const char* kPrefix = "qkvshare-spill.";
  std::string path_;
};

void execute(const Workflow& wf, const RunArgs& a) {
  if (!a.json.empty()) check_output_file(a.json, "--json");  // not after the whole run
  RunOptions opts;
  opts.mode = parse_run_mode(a.mode);
  KvFormat::parse(a.kv);  // reject a bad --kv before loading anything
  opts.kv = a.kv;
  opts.threads = a.model.threads;
  opts.exact_matmul = a.model.exact_matmul;
  opts.float_activations = a.model.float_activations;
  if (opts.exact_matmul && opts.float_activations)
    fail(ErrorCode::invalid_argument, "--exact-matmul and --float-activations: choose one");
  opts.context = a.ctx;
  opts.max_tokens_cap = a.max_tokens;
  opts.splice.threshold = a.guard_threshold;
  opts.concurrent = !a.sequential;
  opts.token_budget = a.token_budget;
  opts.lease_ms = a.lease_ms;
  if (!a.quiet) opts.progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  std::optional<OwnSpillDir> own_spill;
  if (!a.kv_budget.empty()) {
    opts.tiers.budget_bytes = parse_bytes(a.kv_budget, "--kv-budget");
    if (a.spill_dir.empty()) own_spill.emplace();
    opts.tiers.spill_dir = a.spill_dir.empty() ? own_spill->path() : a.spill_dir;
    opts.tiers.cipher = load_key_flag(a.key);
    opts.tiers.prefetch = !a.no_prefetch;
    opts.tiers.demote = parse_demote_flag(a.demote);
  } else if (!a.spill_dir.empty() || !a.key.empty() || a.no_prefetch || !a.demote.empty()) {
    fail(ErrorCode::invalid_argument, "--spill-dir, --key, --demote and --no-prefetch need --kv-budget");
  }
  if (!a.compare) {
    const RunReport r = run_workflow(wf, a.model.model_path, a.model.tokenizer_path, opts);
    print_outputs(r);
    if (!a.json.empty()) write_file(a.json, r.json());
    return;
  }
  // A comparison runs every mode: --mode would pick none of them, and --kv
  // names the qkvshare run whose replies and steps are printed (int8 unless given).
  if (a.mode_given) fail(ErrorCode::invalid_argument, "--mode: a comparison runs every mode; choose them with --modes");
  std::vector<ModeSpec> specs = a.modes.empty() ? default_comparison() : parse_mode_specs(a.modes);
  const auto shown = [&](const ModeSpec& m) { return m.mode == RunMode::qkvshare && m.kv == a.kv; };
  if (a.kv_given && std::none_of(specs.begin(), specs.end(), shown)) {
    if (!a.modes.empty())
      fail(ErrorCode::invalid_argument, "--kv {}: qkvshare:{} is not among --modes '{}'", a.kv, a.kv, a.modes);
    specs.push_back({RunMode::qkvshare, a.kv});
  }
  const auto runs = compare_modes(wf, a.model.model_path, a.model.tokenizer_path, opts, specs);
  for (const auto& r : runs)
    if (shown(r.spec)) print_outputs(r.report);
  std::printf("\n%s", format_comparison(runs).c_str());
  std::printf("peak RSS: getrusage(RUSAGE_CHILDREN-style wait4) of a fresh child process per mode; independent "
              "agents hold private weight copies.\n");
  if (!a.json.empty()) write_file(a.json, comparison_json(runs));
}

std::string default_model_path() {
  if (const char* env = std::getenv("QKVSHARE_MODEL"); env != nullptr && *env != '\0') return env;
  std::filesystem::path dir;
  if (const char* cache = std::getenv("QKVSHARE_CACHE"); cache != nullptr && *cache != '\0') dir = cache;
  else if (const char* home = std::getenv("HOME"); home != nullptr) dir = std::filesystem::path(home) / ".cache/qkvshare/models";
  return (dir / "SmolLM2-135M-Instruct.Q4_1.gguf").string();
}

void add_common(CLI::App& cmd, RunArgs& a) {
  cmd.add_option("--threads", a.model.threads, "Worker threads (0: all cores)")->check(CLI::Range(0, 1024));
  cmd.add_flag("--exact-matmul", a.model.exact_matmul,
               "Float activations in every matmul: slow; isolates the KV formats' effect on agreement");
  cmd.add_flag("--float-activations", a.model.float_activations,
               "The SIMD kernels with float activations (weights dequantized to f32 once, 4 bytes per weight, "
               "counted in the report's weight bytes)");
  cmd.add_option("--mode", a.mode, "independent, shared-text or qkvshare")->each([&a](const std::string&) {
    a.mode_given = true;
  });
  cmd.add_option("--kv", a.kv, "KV format of qkvshare mode (f32, f16, int8, int4, int3, int2, kXvY[:options])")
      ->each([&a](const std::string&) { a.kv_given = true; });
  cmd.add_option("--ctx", a.ctx, "Token capacity of each session")->check(CLI::Range(16, 1 << 20));
  cmd.add_option("--max-tokens", a.max_tokens, "Cap every agent's new tokens (0: as the workflow says)")
      ->check(CLI::Range(0, 1 << 20));
  cmd.add_flag("--sequential", a.sequential, "One step at a time (default: ready steps share forward passes)");
  cmd.add_option("--token-budget", a.token_budget, "Tokens per scheduler pass (prompt chunks + decode tokens)")
      ->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  cmd.add_flag("--compare", a.compare, "Run in every mode and print one comparison table");
  cmd.add_option("--guard-threshold", a.guard_threshold,
                 "Splice guard: estimate above which more is recomputed (default: calibrated per KV format)")
      ->check(CLI::Validator(
          [](const std::string& v) -> std::string {
            char* end = nullptr;
            const double x = std::strtod(v.c_str(), &end);
            if (v.empty() || end != v.c_str() + v.size() || !std::isfinite(x) || x < 0)
              return "'" + v + "' is not a finite number >= 0";
            return {};
          },
          "NUMBER >= 0"));
  cmd.add_option("--modes", a.modes,
                 "With --compare: modes, comma separated (shared-text:f32, independent, shared-text, qkvshare:int8, ...); "
                 "the first is the reference the others are forced along");
  cmd.add_flag("-q,--quiet", a.quiet, "No progress lines on stderr");
  cmd.add_option("--json", a.json, "Write the report (or the comparison) as JSON to FILE");
  cmd.add_option("--kv-budget", a.kv_budget, "qkvshare mode: pool bytes for contexts at rest (e.g. 8M); spill the rest");
  cmd.add_option("--spill-dir", a.spill_dir, "Folder of spilled contexts (default: a temporary one)");
  cmd.add_option("--key", a.key, "Key file: encrypt spilled blocks (XChaCha20-Poly1305)");
  cmd.add_option("--demote", a.demote,
                 "With --kv-budget: recode contexts at rest to this KV format (e.g. int4) before spilling any "
                 "(lossy; each demotion's K/V change is reported)");
  cmd.add_flag("--no-prefetch", a.no_prefetch, "Restore spilled contexts only when their consumer starts");
  cmd.add_option("--lease", a.lease_ms,
                 "qkvshare mode: ms after which a holder that stopped using a context gives it up to the tiers first")
      ->check(CLI::Range(1, 86400000))
      ->capture_default_str();
}

}  // namespace

void register_run(CLI::App& app) {
  auto run = std::make_shared<RunArgs>();
  CLI::App* cmd = app.add_subcommand("run", "Run a multi-agent workflow file");
  cmd->add_option("workflow", run->workflow, "Workflow YAML file")->required();
  cmd->add_option("-m,--model", run->model.model_path, "Model file")->required();
  cmd->add_option("-t,--tokenizer", run->model.tokenizer_path, "Tokenizer (llama2.c models only)");
  add_common(*cmd, *run);
  cmd->callback([run] { execute(Workflow::load(run->workflow), *run); });

  auto demo = std::make_shared<RunArgs>();
  demo->compare = true;
  CLI::App* dcmd = app.add_subcommand("demo", "Researcher -> writer -> reviewer on a source text (examples/w4_roles.yaml) with QKVShare, then --compare");
  dcmd->add_option("-m,--model", demo->model.model_path, "Model file (default: the fetched SmolLM2-135M-Instruct)");
  dcmd->add_option("-t,--tokenizer", demo->model.tokenizer_path, "Tokenizer (llama2.c models only)");
  add_common(*dcmd, *demo);
  dcmd->add_flag("!--no-compare", demo->compare, "Only the QKVShare run");
  dcmd->callback([demo] {
    if (demo->model.model_path.empty()) demo->model.model_path = default_model_path();
    if (!std::filesystem::exists(demo->model.model_path))
      fail(ErrorCode::io, "{}: model not found: run scripts/fetch_model.sh or pass -m MODEL", demo->model.model_path);
    Workflow wf = demo_workflow();
    {
      const auto model = Model::load(demo->model.model_path, demo->model.tokenizer_path);
      const int context = std::min(model->config().context_length, demo->ctx);
      const SourceFit fit = fit_demo_source(wf, model->tokenizer(), context, demo->max_tokens);
      if (fit.cut())
        std::fprintf(stderr, "demo: the source text is cut to its first %d of %d sentences (%d of %d tokens) to fit "
                     "the %d-token context with every reply\n", fit.kept_sentences, fit.total_sentences,
                     fit.kept_tokens, fit.total_tokens, context);
      std::fprintf(stderr,
                   "demo: a researcher, a writer and a reviewer (examples/w4_roles.yaml), each with its own system "
                   "prompt, on a %d-token source; the writer and reviewer splice what they read from the producers' "
                   "KV. %s\n",
                   fit.kept_tokens,
                   demo->compare ? "Every mode below does the same work (the f32 text run's tokens forced); one "
                                   "table compares them at the end."
                                 : "QKVShare alone (--no-compare).");
    }
    execute(wf, *demo);
  });
}

}  // namespace qkvshare::cli
