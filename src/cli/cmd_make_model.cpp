// qkvshare make-model: write a random-weight GGUF of a named shape (for
// benchmarks and tests; speed does not depend on weight values).
#include <chrono>
#include <cstdio>

#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/clock.hpp"
#include "qkvshare/model/synthetic_model.hpp"

namespace qkvshare::cli {

namespace {

struct MakeModelArgs {
  std::string shape;
  std::string type = "Q8_0";
  std::string output;
  std::uint64_t seed = 1;
  int threads = 0;
  bool list = false;
  // Overrides of the named shape's dimensions (0: keep).
  int layers = 0, d_model = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0, ctx = 0;
};

void list_shapes() {
  std::printf("%-14s %-6s %6s %6s %6s %8s %6s %7s %8s %9s\n", "shape", "arch", "layers", "d", "heads", "kv_heads",
              "ffn", "vocab", "ctx", "params");
  for (const SyntheticShape& s : synthetic_shapes())
    std::printf("%-14s %-6s %6d %6d %6d %8d %6d %7d %8d %8.1fM\n", s.name.c_str(), s.architecture.c_str(), s.n_layers,
                s.d_model, s.n_heads, s.n_kv_heads, s.d_ff, s.vocab_size, s.context_length,
                static_cast<double>(s.n_params()) / 1e6);
}

void run_make_model(const MakeModelArgs& a) {
  if (a.list) {
    list_shapes();
    return;
  }
  if (a.shape.empty()) fail(ErrorCode::invalid_argument, "--shape is required (or --list-shapes)");
  if (a.output.empty()) fail(ErrorCode::invalid_argument, "-o/--output is required");
  SyntheticShape shape = find_synthetic_shape(a.shape);
  bool custom = false;
  const auto override_dim = [&custom](int& field, int value) {
    if (value <= 0) return;
    field = value;
    custom = true;
  };
  override_dim(shape.n_layers, a.layers);
  override_dim(shape.d_model, a.d_model);
  override_dim(shape.n_heads, a.heads);
  override_dim(shape.n_kv_heads, a.kv_heads);
  override_dim(shape.d_ff, a.ffn);
  override_dim(shape.vocab_size, a.vocab);
  override_dim(shape.context_length, a.ctx);
  if (custom) shape.name += "-custom";

  SyntheticOptions options;
  options.type = parse_synthetic_type(a.type);
  options.seed = a.seed;
  options.n_threads = a.threads;
  validate_shape(shape, options.type);
  std::fprintf(stderr, "make-model: %s (%s, %d layers, d %d, %d/%d heads, ffn %d, vocab %d), %s, %.1fM params -> %s\n",
               shape.name.c_str(), shape.architecture.c_str(), shape.n_layers, shape.d_model, shape.n_heads,
               shape.n_kv_heads, shape.d_ff, shape.vocab_size, std::string(type_name(options.type)).c_str(),
               static_cast<double>(shape.n_params()) / 1e6, a.output.c_str());
  const auto t0 = std::chrono::steady_clock::now();
  const std::uint64_t bytes = write_synthetic_model(shape, options, a.output);
  const double s = seconds_since(t0);
  std::fprintf(stderr, "make-model: wrote %s (%.1f MiB) in %.1f s\n", a.output.c_str(),
               static_cast<double>(bytes) / (1024.0 * 1024.0), s);
}

}  // namespace

void register_make_model(CLI::App& app) {
  auto args = std::make_shared<MakeModelArgs>();
  CLI::App* cmd = app.add_subcommand(
      "make-model", "Write a random-weight GGUF of a named shape (benchmarks and tests only)");
  cmd->add_option("--shape", args->shape, "A named shape (--list-shapes): smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, llama3.2-1b, phi3-mini, gemma3-1b, tiny-*");
  cmd->add_option("--type", args->type, "Weight type of the matrices and token_embd: F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS")
      ->capture_default_str();
  cmd->add_option("-o,--output", args->output, "Output GGUF file (written atomically)");
  cmd->add_option("--seed", args->seed, "Random seed (same seed, shape and type: same bytes)")->capture_default_str()->check(seed_validator());
  cmd->add_option("--threads", args->threads, "Threads (0: all cores)")->check(CLI::Range(0, 1024));
  cmd->add_flag("--list-shapes", args->list, "List the named shapes and exit");
  const auto dim = [&](const char* flag, int& field, const char* what) {
    cmd->add_option(flag, field, what)->check(CLI::Range(1, 1 << 22))->group("Shape overrides");
  };
  dim("--layers", args->layers, "Number of layers");
  dim("--d-model", args->d_model, "Embedding width");
  dim("--heads", args->heads, "Query heads");
  dim("--kv-heads", args->kv_heads, "Key/value heads");
  dim("--ffn", args->ffn, "Feed-forward width");
  dim("--vocab", args->vocab, "Vocabulary size (>= 259)");
  dim("--ctx", args->ctx, "Context length written to the file");
  cmd->callback([args] { run_make_model(*args); });
}

}  // namespace qkvshare::cli
