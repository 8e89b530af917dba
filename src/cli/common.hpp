#pragma once
// Shared pieces of the qkvshare subcommands.
#include <CLI/CLI.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qkvshare/engine/engine.hpp"
#include "qkvshare/model/model.hpp"
#include "qkvshare/tiers/context_file.hpp"

namespace qkvshare::cli {

struct ModelArgs {
  std::string model_path;
  std::string tokenizer_path;
  int threads = 0;
  bool exact_matmul = false;
  bool float_activations = false;
  bool kv_stored_in_pass = false;
  bool kv_decode_tiles = false;
  bool unpacked_weights = false;
  bool kv_keep_windowed = false;
  bool kv_private_reads = false;
  bool kv_quantize_in_pass = false;
};

// -m MODEL, -t TOKENIZER, --threads N, --exact-matmul, --float-activations, --kv-decode-tiles,
// --kv-stored-in-pass, --kv-keep-windowed-layers, --kv-private-reads, --kv-quantize-in-pass
void add_model_args(CLI::App& cmd, ModelArgs& args);
EngineOptions engine_options(const ModelArgs& args);
// Loads the model, reporting the load time on stderr.
std::unique_ptr<Model> load_model(const ModelArgs& args);
// The whole file given to --text; Error(io) naming it when it cannot be read.
std::string read_text(const std::string& path);
// Throws Error(invalid_argument) when a pq format's codebook was learned on
// another model (its fingerprint) or another shape.
void check_codebook(const KvFormat& format, const Model& model);
// "1073741824", "512M", "2G", "64K" (powers of 1024); Error(invalid_argument) naming `flag`.
std::size_t parse_bytes(const std::string& text, std::string_view flag);
// A seed: digits only, 0 .. 2^64-1 (a '-1' would otherwise wrap to 2^64-1
// and look like "random" while it is one fixed seed).
CLI::Validator seed_validator();
// "1,2,3" -> ids; throws Error(invalid_argument) naming the bad item.
std::vector<TokenId> parse_ids(const std::string& text);
// The prompt's ids: BOS when the model wants it, then the text (special tokens parsed when `special`).
std::vector<TokenId> encode_prompt(const Tokenizer& tok, const std::string& text, bool special);

// The tiers' flags, shared by `run` and `serve`: --demote FMT (one
// precision: a demoted context is recoded once, not mixed) and --key FILE.
// Error(invalid_argument) naming the flag and the value.
std::optional<KvFormat> parse_demote_flag(const std::string& text);
std::shared_ptr<const BlockCipher> load_key_flag(const std::string& path);

void register_generate(CLI::App& app);
void register_inspect(CLI::App& app);
void register_bench(CLI::App&);
void register_make_model(CLI::App&);
void register_context(CLI::App&);  // share: cmd_context.cpp
void register_pool(CLI::App&);     // share: cmd_pool.cpp
void register_eval(CLI::App&);
void register_calibrate(CLI::App&);
void register_run(CLI::App&);
void register_splice_eval(CLI::App&);
void register_serve(CLI::App&);  // server: cmd_serve.cpp

}  // namespace qkvshare::cli
