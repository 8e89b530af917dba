// qkvshare splice-eval: many real splices of text chunks between agents with
// different roles, each one measured against the text re-prefill (f32 KV)
// along the reference's greedy continuation; one JSON line per splice, for
// the guard's calibration (bench/splice_calibrate.py).
#include <cstdio>
#include <fstream>
#include <sstream>

#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"
#include "qkvshare/engine/splice_eval.hpp"

namespace qkvshare::cli {

namespace {

struct SpliceEvalArgs {
  ModelArgs model;
  std::vector<std::string> sources;
  int cases = 8;
  int chunk = 256;
  int forced = 16;
  int probe = 8;
  std::string formats = "int8,int4,int2";
  std::string fractions = "0,0.05,0.15,0.3,0.5,1";
  std::string output;
  std::size_t max_source_bytes = 200000;
  std::string select = "head";
  std::string check_layers = "1";
};

// Roles: the producer read the chunk under one, the consumer splices it under another.
const char* const kProducers[] = {
    "You are a careful researcher. You extract facts from sources and never invent any.",
    "You are a librarian who summarizes documents for a catalogue.",
    "You answer questions about the document the user gives you.",
    "You are a teacher preparing a lesson from this text."};
const char* const kConsumers[] = {
    "You are a newspaper writer. You write vivid, accurate short articles for general readers.",
    "You are a strict fact-checking editor. You compare articles with their sources.",
    "You are a translator's assistant. You list the hard words of a text.",
    "You write quiz questions for students."};
const char* const kQuestions[] = {"Write a short headline and a first sentence about this.",
                                  "List two facts from the text above.", "What is the text above about?",
                                  "Write one quiz question about the text above."};

// A comma-separated list; Error(invalid_argument) for an empty item or list,
// which would otherwise measure less than asked, or nothing.
std::vector<std::string> split(const std::string& s, const char* flag) {
  if (s.empty()) fail(ErrorCode::invalid_argument, "{}: the list is empty", flag);
  std::vector<std::string> out;
  std::stringstream ss(s + ",");  // so that a trailing comma leaves an empty last item
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.empty()) fail(ErrorCode::invalid_argument, "{}: empty item in '{}'", flag, s);
    out.push_back(item);
  }
  return out;
}

// A comma-separated list of numbers, each read whole by `parse` (std::stod,
// std::stoi) and accepted by `ok`; else Error(invalid_argument) "FLAG: 'ITEM' is not WHAT".
template <class T, class Parse, class Ok>
std::vector<T> parse_list(const std::string& list, Parse parse, Ok ok, const char* flag, const char* what) {
  std::vector<T> out;
  for (const auto& item : split(list, flag)) {
    std::size_t used = 0;
    T v{};
    bool read = false;
    try {
      v = parse(item, &used);
      read = used == item.size();
    } catch (const std::exception&) {
    }
    if (!read || !ok(v)) fail(ErrorCode::invalid_argument, "{}: '{}' is not {}", flag, item, what);
    out.push_back(v);
  }
  return out;
}

void run_splice_eval(const SpliceEvalArgs& a) {
  if (a.sources.empty()) fail(ErrorCode::invalid_argument, "--source FILE is required (one or more)");
  if (!a.output.empty()) check_output_file(a.output, "-o");
  const auto fractions = parse_list<double>(
      a.fractions, [](const std::string& x, std::size_t* used) { return std::stod(x, used); },
      [](double v) { return v >= 0 && v <= 1; }, "--fractions", "a fraction from 0 to 1");
  const auto formats = split(a.formats, "--kv");
  for (const auto& f : formats) KvFormat::parse(f);  // reject a bad one before loading
  SpliceSelection selection;
  selection.head = false;
  for (const auto& s : split(a.select, "--select")) {
    if (s == "head") selection.head = true;
    else if (s == "deviation") selection.deviation = true;
    else fail(ErrorCode::invalid_argument, "--select: '{}' is not head or deviation", s);
  }
  if (!selection.head && !selection.deviation) fail(ErrorCode::invalid_argument, "--select: name head and/or deviation");
  selection.check_layers = parse_list<int>(
      a.check_layers, [](const std::string& x, std::size_t* used) { return std::stoi(x, used); },
      [](int v) { return v >= 0; }, "--check-layers", "a layer number");
  if (selection.check_layers.empty()) fail(ErrorCode::invalid_argument, "--check-layers: name at least one layer");
  auto model = load_model(a.model);
  Engine engine(*model, engine_options(a.model));
  for (int l : selection.check_layers)
    if (l >= model->config().n_layers)
      fail(ErrorCode::invalid_argument, "--check-layers: layer {} is not in [0, {})", l, model->config().n_layers);
  const Tokenizer& tok = model->tokenizer();
  const bool chatml = tok.find("<|im_start|>").has_value();
  const auto opening = [&](const std::string& system) {
    std::vector<TokenId> ids;
    if (tok.add_bos() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
    const auto t = tok.encode(chatml ? "<|im_start|>system\n" + system + "<|im_end|>\n<|im_start|>user\n" : system + "\n", true);
    ids.insert(ids.end(), t.begin(), t.end());
    return ids;
  };
  std::vector<std::vector<TokenId>> texts;
  for (const auto& path : a.sources) {
    check_input_file(path, "--source");
    std::ifstream in(path, std::ios::binary);
    if (!in) fail(ErrorCode::io, "{}: cannot open", path);
    std::string text(a.max_source_bytes, '\0');
    in.read(text.data(), static_cast<std::streamsize>(text.size()));
    text.resize(static_cast<std::size_t>(in.gcount()));
    texts.push_back(tok.encode(text));
    if (static_cast<int>(texts.back().size()) < a.chunk)
      fail(ErrorCode::invalid_argument, "{}: {} tokens, fewer than --chunk {}", path, texts.back().size(), a.chunk);
  }
  PoolConfig pc;
  pc.shape = engine.kv_shape();
  pc.block_tokens = 32;
  pc.capacity_bytes = KvPool::arena_bytes_for(pc.shape, 32, KvFormat::parse("f32"), a.chunk + 256, 4);
  // A scattered choice starts a block per recomputed run (a splice freezes the tail).
  if (selection.deviation)
    pc.capacity_bytes += KvPool::arena_bytes_for(pc.shape, 32, KvFormat::parse("f32"), 32 * ((a.chunk + 3) / 4), 1);
  auto pool = KvPool::create(pc);
  std::FILE* out = a.output.empty() ? stdout : std::fopen(a.output.c_str(), "w");
  if (out == nullptr) fail(ErrorCode::io, "{}: cannot write", a.output);
  for (int i = 0; i < a.cases; ++i) {
    const auto& ids = texts[static_cast<std::size_t>(i) % texts.size()];
    const int per_source = (a.cases + static_cast<int>(texts.size()) - 1) / static_cast<int>(texts.size());
    const int slot = i / static_cast<int>(texts.size());
    const std::size_t stride = (ids.size() - static_cast<std::size_t>(a.chunk)) / static_cast<std::size_t>(std::max(1, per_source));
    SpliceCase c;
    c.producer_prefix = opening(kProducers[i % 4]);
    const auto lead = tok.encode("Source:\n", true);
    c.producer_prefix.insert(c.producer_prefix.end(), lead.begin(), lead.end());
    c.consumer_prefix = opening(kConsumers[(i / 4 + i) % 4]);
    const auto head = tok.encode("[research]\n", true);
    c.consumer_prefix.insert(c.consumer_prefix.end(), head.begin(), head.end());
    c.chunk.assign(ids.begin() + static_cast<std::ptrdiff_t>(stride * static_cast<std::size_t>(slot)),
                   ids.begin() + static_cast<std::ptrdiff_t>(stride * static_cast<std::size_t>(slot)) + a.chunk);
    c.suffix = tok.encode(std::string("\n\n") + kQuestions[i % 4] + (chatml ? "<|im_end|>\n<|im_start|>assistant\n" : "\n"), true);
    const auto samples = evaluate_splices(engine, pool, c, formats, fractions, a.forced, a.probe, selection);
    for (const auto& s : samples)
      std::fprintf(out,
                   "{\"case\": %d, \"source\": %zu, \"format\": \"%s\", \"select\": \"%s\", \"fraction\": %.4f, \"estimate\": %.6f, "
                   "\"kl\": %.6f, \"kl_text\": %.6f, \"text_kl\": %.6f, \"kl_fallback\": %.6f, \"fallback_kl\": %.6f, "
                   "\"top1\": %.4f, \"nll\": %.5f, \"recomputed\": %d, \"reused\": %d, "
                   "\"ttft_splice\": %.5f, \"ttft_text\": %.5f, \"v_dev\": %.6f, \"k_dev\": %.6f}\n",
                   i, static_cast<std::size_t>(i) % texts.size(), s.format.c_str(), s.select.c_str(), s.fraction, s.estimate, s.kl, s.kl_text,
                   s.text_kl, s.kl_fallback, s.fallback_kl, s.top1, s.nll, s.recomputed, s.reused, s.ttft_splice, s.ttft_text, s.v_dev, s.k_dev);
    std::fflush(out);
    std::fprintf(stderr, "case %d/%d done\n", i + 1, a.cases);
  }
  if (out != stdout) std::fclose(out);
}

}  // namespace

void register_splice_eval(CLI::App& app) {
  auto args = std::make_shared<SpliceEvalArgs>();
  CLI::App* cmd = app.add_subcommand("splice-eval", "Measure splices (KL to the text re-prefill, guard estimate)");
  add_model_args(*cmd, args->model);
  cmd->add_option("--source", args->sources, "Text file(s) to cut the spliced chunks from")->required();
  cmd->add_option("--cases", args->cases, "Producer/consumer pairs")->check(CLI::Range(1, 100000));
  cmd->add_option("--chunk", args->chunk, "Spliced tokens per case")->check(CLI::Range(16, 8192));
  cmd->add_option("--forced", args->forced, "Reference tokens scored after the consumer's turn")->check(CLI::Range(1, 4096));
  cmd->add_option("--probe", args->probe, "Guard probe tokens")->check(CLI::Range(1, 256));
  cmd->add_option("--kv", args->formats, "KV formats, comma separated");
  cmd->add_option("--fractions", args->fractions, "Recompute fractions, comma separated");
  cmd->add_option("-o,--output", args->output, "JSON lines file (default stdout)");
  cmd->add_option("--select", args->select,
                  "Which tokens are recomputed: head (the engine's choice), deviation (CacheBlend's: largest K+V "
                  "deviation at --check-layers; its ranking pass is not timed), or both, comma separated");
  cmd->add_option("--check-layers", args->check_layers, "Layers whose deviation ranks tokens for --select deviation");
  cmd->callback([args] { run_splice_eval(*args); });
}

}  // namespace qkvshare::cli
