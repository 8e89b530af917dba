// qkvshare eval: perplexity, KL and top-1 agreement of KV formats against the
// f32 KV cache over a text (docs/kv-quality.md). Progress goes to stderr, the
// table to stdout, and everything to --json.
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"
#include "qkvshare/engine/eval.hpp"

namespace qkvshare::cli {

namespace {

struct EvalArgs {
  ModelArgs model;
  std::string text_path;
  std::string kv = "all";
  int ctx = 512;
  long max_tokens = 0;
  std::string score = "half";
  std::string protocol = "prefill";
  int chunk = 0;  // 0: not given (64 under --protocol handoff)
  int block = 32;
  int decode = 0;
  bool speed_only = false;
  std::string json_path;
};

std::vector<KvFormat> parse_formats(const std::string& text) {
  if (text == "all") return all_eval_formats();
  std::vector<KvFormat> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(pos, end - pos);
    if (item == "all") {
      for (const KvFormat& f : all_eval_formats()) out.push_back(f);
    } else {
      out.push_back(KvFormat::parse(item));
    }
    pos = end + 1;
  }
  return out;
}

void print_table(const EvalReport& r, bool decode, bool handoff) {
  std::printf("%-28s %8s", "format", "bits/el");
  if (handoff) std::printf(" %8s", "shipped");
  std::printf(" %9s %10s %8s %9s %9s %7s %9s", "KV B/tok", "PPL", "delta %", "mean KL", "p99 KL", "top-1", "prefill/s");
  std::printf(decode ? " %9s\n" : "\n", "decode/s");
  for (const EvalFormatResult& f : r.results) {
    std::printf("%-28s %8.2f", f.format.c_str(), f.bits_per_element);
    if (handoff) std::printf(" %8.2f", f.handoff_bits_per_element);
    if (f.scored == 0) {  // --speed-only
      std::printf(" %9s %10s %8s %9s %9s %7s %9s", "-", "-", "-", "-", "-", "-", "-");
    } else {
      std::printf(" %9.0f %10.4f %+8.3f %9.6f %9.6f %6.2f%% %9.1f", f.kv_bytes_per_token, f.ppl, f.ppl_delta_pct,
                  f.mean_kl, f.p99_kl, f.top1 * 100.0, f.prefill_tokens_per_s);
    }
    if (decode) std::printf(" %9.1f", f.decode_tokens_per_s);
    std::printf("\n");
  }
}

nlohmann::json to_json(const EvalArgs& a, const EvalReport& r) {
  nlohmann::json j;
  j["model"] = a.model.model_path;
  j["text"] = a.text_path;
  j["ctx"] = r.ctx;
  j["block_tokens"] = a.block;
  j["windows"] = r.windows;
  j["scored_per_format"] = r.scored;
  j["text_tokens"] = r.text_tokens;
  j["scored_positions"] = r.score_all ? "all" : "second half of each window";
  j["protocol"] = a.protocol;
  if (a.protocol == "handoff") j["consumer_chunk"] = a.chunk;
  j["activations"] = a.model.float_activations ? "f32" : a.model.exact_matmul ? "f32 (reference dots)" : "8-bit";
  j["pass_precision"] = a.model.kv_stored_in_pass ? "stored" : "full";
  j["formats"] = nlohmann::json::array();
  for (const EvalFormatResult& f : r.results)
    j["formats"].push_back({{"format", f.format},
                            {"bits_per_element", f.bits_per_element},
                            {"cold_bits_per_element", f.cold_bits_per_element},
                            {"handoff_bits_per_element", f.handoff_bits_per_element},
                            {"kv_bytes_per_token", f.kv_bytes_per_token},
                            {"ppl", f.ppl},
                            {"ppl_delta_pct", f.ppl_delta_pct},
                            {"mean_kl", f.mean_kl},
                            {"p99_kl", f.p99_kl},
                            {"top1", f.top1},
                            {"scored", f.scored},
                            {"prefill_tokens_per_s", f.prefill_tokens_per_s},
                            {"decode_tokens_per_s", f.decode_tokens_per_s}});
  return j;
}

void run_eval(EvalArgs a) {
  if (!a.json_path.empty()) check_output_file(a.json_path, "--json");  // not after the whole evaluation
  if (a.score != "half" && a.score != "all")
    fail(ErrorCode::invalid_argument, "--score must be half or all, got '{}'", a.score);
  if (a.protocol != "prefill" && a.protocol != "handoff")
    fail(ErrorCode::invalid_argument, "--protocol must be prefill or handoff, got '{}'", a.protocol);
  if (a.chunk != 0 && a.protocol != "handoff")
    fail(ErrorCode::invalid_argument, "--chunk sets the consumer's pass under --protocol handoff; this is --protocol {}",
         a.protocol);
  if (a.chunk == 0) a.chunk = 64;
  const std::vector<KvFormat> formats = parse_formats(a.kv);  // bad formats fail before the model loads
  const std::string text = read_text(a.text_path);
  auto model = load_model(a.model);
  for (const KvFormat& f : formats) check_codebook(f, *model);
  const auto tokens = model->tokenizer().encode(text);
  std::fprintf(stderr, "%s: %zu tokens\n", a.text_path.c_str(), tokens.size());
  EngineOptions eo = engine_options(a.model);
  if (a.protocol == "handoff") eo.max_batch = std::max(eo.max_batch, a.chunk);  // a consumer chunk is one pass
  Engine engine(*model, eo);
  EvalOptions o;
  o.ctx = a.ctx;
  if (a.speed_only && a.decode <= 0) fail(ErrorCode::invalid_argument, "--speed-only needs --decode N");
  o.max_scored = a.speed_only ? -1 : a.max_tokens;
  o.score_all = a.score == "all";
  o.block_tokens = a.block;
  o.protocol = a.protocol == "handoff" ? EvalProtocol::handoff : EvalProtocol::prefill;
  o.chunk = a.chunk;
  o.decode_tokens = a.decode;
  const bool tty = isatty(fileno(stderr)) != 0;
  o.progress = [tty](const std::string& line) {
    std::fprintf(stderr, tty ? "\r\033[K%s" : "%s\n", line.c_str());
    std::fflush(stderr);
  };
  const EvalReport r = evaluate_kv(engine, tokens, formats, o);
  if (tty) std::fputc('\n', stderr);
  const std::string protocol =
      a.protocol == "handoff" ? fmt::format("handoff, consumer chunks of {}", a.chunk) : std::string("prefill");
  std::printf("%s | %s | ctx %d | %ld windows | %ld tokens scored per format (%s) | protocol %s | %s activations%s\n",
              a.model.model_path.c_str(), a.text_path.c_str(), r.ctx, r.windows, r.scored,
              r.score_all ? "all positions" : "second half of each window", protocol.c_str(),
              a.model.float_activations || a.model.exact_matmul ? "f32" : "8-bit (on quantized weights)",
              a.model.kv_stored_in_pass ? " | passes read their own tokens as stored" : "");
  print_table(r, a.decode > 0, a.protocol == "handoff");
  if (!a.json_path.empty()) {
    std::ofstream out(a.json_path);
    if (!out) fail(ErrorCode::io, "--json {}: cannot write", a.json_path);
    out << to_json(a, r).dump(2) << "\n";
  }
}

}  // namespace

void register_eval(CLI::App& app) {
  auto args = std::make_shared<EvalArgs>();
  CLI::App* cmd = app.add_subcommand("eval", "Perplexity, KL and top-1 agreement of KV formats vs the f32 KV cache");
  add_model_args(*cmd, args->model);
  cmd->add_option("--text", args->text_path, "Text file to score")->required();
  cmd->add_option("--kv", args->kv,
                  "KV formats, comma-separated (f32, f16, int8, int4, int3, int2, kXvY, with :window=N:sink=N:rot=kv..., "
                  "mixed precision with :lo=int2:top=0.2 under --protocol handoff), or 'all'");
  cmd->add_option("--ctx", args->ctx, "Window length in tokens")->check(CLI::Range(4, 1 << 20));
  cmd->add_option("--max-tokens", args->max_tokens, "Stop after about this many scored tokens (whole windows; 0: all)")
      ->check(CLI::Range(0L, 1L << 40));
  cmd->add_option("--score", args->score, "Positions scored per window: half (the second half, as llama.cpp) or all");
  cmd->add_option("--protocol", args->protocol,
                  "prefill: one session runs each window; handoff: a producer prefills the first half and seals it, "
                  "a consumer continues it in --chunk passes and is scored on the second half");
  cmd->add_option("--chunk", args->chunk, "Consumer tokens per forward pass (--protocol handoff)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--block", args->block, "KV block size in tokens (power of two)")->check(CLI::Range(1, 4096));
  cmd->add_option("--decode", args->decode, "Also time this many decode steps ending at depth --ctx, per format")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_flag("--speed-only", args->speed_only, "Skip the quality windows: only the --decode timing");
  cmd->add_option("--json", args->json_path, "Write the results as JSON to this file");
  cmd->callback([args] { run_eval(*args); });
}

}  // namespace qkvshare::cli
