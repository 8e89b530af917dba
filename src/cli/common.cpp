#include "common.hpp"

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"
#include "qkvshare/core/clock.hpp"
#include "qkvshare/kernels/packed_weights.hpp"
#include "qkvshare/kv/kv_kernels.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "qkvshare/kv/shared_block_reads.hpp"
#include "qkvshare/share/fingerprint.hpp"
#include "qkvshare/tiers/crypto.hpp"

namespace qkvshare::cli {

void add_model_args(CLI::App& cmd, ModelArgs& args) {
  cmd.add_option("-m,--model", args.model_path, "Model file: GGUF, or a llama2.c checkpoint")->required();
  cmd.add_option("-t,--tokenizer", args.tokenizer_path, "Tokenizer file (llama2.c checkpoints only)");
  cmd.add_option("--threads", args.threads, "Worker threads (0: all cores)")->check(CLI::Range(0, 1024));
  cmd.add_flag("--exact-matmul", args.exact_matmul,
               "Float activations in every matmul (scalar reference dots): slow, for checks against float references");
  cmd.add_flag("--float-activations", args.float_activations,
               "Float activations on the SIMD kernels (weights dequantized to f32 once, 4 bytes per weight): no 8-bit "
               "activation rounding, for quality measurements below its noise");
  cmd.add_flag("--unpacked-weights", args.unpacked_weights,
               "Q4_0, Q4_1 and Q8_0 matrices are multiplied as the file stores them, instead of from a copy packed at load into the "
               "kernels' 16-row tiles (the earlier behaviour; to measure both ways)");
  cmd.add_flag("--kv-decode-tiles", args.kv_decode_tiles,
               "Attention decodes each integer KV tile to f32 before reading it, instead of computing on its codes "
               "(the earlier, slower path; to compare the two)");
  cmd.add_flag("--kv-stored-in-pass", args.kv_stored_in_pass,
               "A forward pass attends to the quantized copies of the tokens it computes itself, instead of to "
               "their f16 values (the earlier behaviour; to measure both ways)");
  cmd.add_flag("--kv-keep-windowed-layers", args.kv_keep_windowed,
               "Blocks of the KV pool keep every layer's K/V after their tokens left the model's sliding window "
               "(gemma3's local layers), instead of only the global layers' (the earlier behaviour; to measure both ways)");
  cmd.add_flag("--kv-private-reads", args.kv_private_reads,
               "Sessions decoding in one batch each read the KV blocks they share (forks of one context) through their "
               "own attention, instead of once for all of them (the earlier behaviour; to measure both ways)");
  cmd.add_flag("--kv-quantize-in-pass", args.kv_quantize_in_pass,
               "A decode step quantizes the KV blocks it fills itself, instead of on a background thread while the pass "
               "goes on (the earlier behaviour; to measure both ways)");
}

EngineOptions engine_options(const ModelArgs& args) {
  EngineOptions o;
  o.n_threads = args.threads;
  o.exact_matmul = args.exact_matmul;
  o.float_activations = args.float_activations;
  if (o.exact_matmul && o.float_activations)
    fail(ErrorCode::invalid_argument, "--exact-matmul and --float-activations are two float paths: choose one");
  // A process-wide switch of the kv layer; every command builds its engine here.
  kv::set_codes_attention(!args.kv_decode_tiles);
  set_default_pass_precision(args.kv_stored_in_pass ? PassPrecision::stored : PassPrecision::full);
  set_free_windowed_layers(!args.kv_keep_windowed);
  kv::set_shared_block_reads(!args.kv_private_reads);
  set_background_quantization(!args.kv_quantize_in_pass);
  return o;
}

namespace {
bool is_gguf_file(const std::string& path) {
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  return in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}
}  // namespace

std::unique_ptr<Model> load_model(const ModelArgs& args) {
  const auto t0 = std::chrono::steady_clock::now();
  kernels::set_weight_packing(!args.unpacked_weights);  // read by Model::load
  auto model = Model::load(args.model_path, args.tokenizer_path);
  const double s = seconds_since(t0);
  if (!args.tokenizer_path.empty() && is_gguf_file(args.model_path))
    std::fprintf(stderr, "warning: -t/--tokenizer %s is not used: %s carries its own tokenizer\n",
                 args.tokenizer_path.c_str(), args.model_path.c_str());
  const ModelConfig& c = model->config();
  std::fprintf(stderr, "loaded %s (%s, %d layers, d_model %d, vocab %d, %.1f MiB weights, %.1f MiB packed) in %.3f s\n",
               args.model_path.c_str(), c.architecture.c_str(), c.n_layers, c.d_model, c.vocab_size,
               static_cast<double>(model->weight_bytes()) / (1024.0 * 1024.0),
               static_cast<double>(model->packed_bytes()) / (1024.0 * 1024.0), s);
  return model;
}

std::vector<TokenId> parse_ids(const std::string& text) {
  std::vector<TokenId> ids;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(pos, end - pos);
    TokenId v = 0;
    const auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || p != item.data() + item.size())
      fail(ErrorCode::invalid_argument, "--ids: '{}' is not a token id (expected e.g. 1,2,3)", item);
    ids.push_back(v);
    pos = end + 1;
  }
  return ids;
}

std::vector<TokenId> encode_prompt(const Tokenizer& tok, const std::string& text, bool special) {
  std::vector<TokenId> ids;
  if (tok.add_bos() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  const auto body = tok.encode(text, special);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

// "1073741824", "512M", "2G", "64K" (powers of 1024).
std::size_t parse_bytes(const std::string& text, std::string_view flag) {
  std::uint64_t v = 0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  std::string_view unit(p, static_cast<std::size_t>(text.data() + text.size() - p));
  int shift = 0;
  if (unit == "K" || unit == "KiB") shift = 10;
  else if (unit == "M" || unit == "MiB") shift = 20;
  else if (unit == "G" || unit == "GiB") shift = 30;
  else if (!unit.empty()) shift = -1;
  if (ec != std::errc() || shift < 0 || p == text.data() || v == 0 || v > (std::uint64_t{1} << (50 - shift)))
    fail(ErrorCode::invalid_argument, "{}: '{}' is not a size (e.g. 268435456, 256M, 2G)", flag, text);
  return static_cast<std::size_t>(v << shift);
}

void check_codebook(const KvFormat& format, const Model& model) {
  if (format.uses_pq()) check_codebook_model(format, model_fingerprint(model), "--kv");
}

std::string read_text(const std::string& path) {
  check_input_file(path, "--text");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::io, "--text {}: cannot open", path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::optional<KvFormat> parse_demote_flag(const std::string& text) {
  if (text.empty()) return std::nullopt;
  KvFormat to;
  try {
    to = KvFormat::parse(text);
  } catch (const Error& e) {
    fail(ErrorCode::invalid_argument, "--demote {}: {}", text, e.what());
  }
  if (to.mixed() || to.evicts())
    fail(ErrorCode::invalid_argument, "--demote {}: give a format of one precision (no lo=, no budget=)", text);
  return to;
}

std::shared_ptr<const BlockCipher> load_key_flag(const std::string& path) {
  if (path.empty()) return nullptr;
  try {
    return std::make_shared<KeyCipher>(KeyCipher::from_file(path));
  } catch (const Error& e) {
    fail(ErrorCode::invalid_argument, "--key {}: {}", path, e.what());
  }
}

CLI::Validator seed_validator() {
  return CLI::Validator(
      [](const std::string& v) -> std::string {
        unsigned long long x = 0;
        const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
        if (v.empty() || ec != std::errc() || end != v.data() + v.size())
          return "'" + v + "' is not a seed (a whole number from 0 to 18446744073709551615)";
        return {};
      },
      "SEED");
}

}  // namespace qkvshare::cli
