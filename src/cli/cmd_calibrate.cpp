// qkvshare calibrate: learns the PQ codebooks of the pqN KV formats
// (kv/kv_codebook.hpp) from the K and V rows a model computes over a
// calibration text. Take the text apart from what is evaluated: by default
// the rows come from the END of the file, and `qkvshare eval` scores windows
// from its start.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"
#include "qkvshare/kernels/ops.hpp"
#include "qkvshare/kv/dense_kv_cache.hpp"
#include "qkvshare/kv/kv_codebook.hpp"
#include "qkvshare/share/fingerprint.hpp"

namespace qkvshare::cli {

namespace {

struct CalibrateArgs {
  ModelArgs model;
  std::string text_path;
  std::string out_path;
  int sub = 4;
  int tokens = 8192;
  int ctx = 2048;
  int iterations = 12;
  unsigned seed = 1;
  bool from_start = false;
  std::string keys = "post";
  int block_tokens = 32;
};

void run_calibrate(const CalibrateArgs& a) {
  check_output_file(a.out_path, "-o");  // not after the whole calibration
  const std::string text = read_text(a.text_path);
  auto model = load_model(a.model);
  const Tokenizer& tok = model->tokenizer();
  const std::vector<TokenId> all = tok.encode(text);
  if (static_cast<long>(all.size()) < a.tokens)
    fail(ErrorCode::invalid_argument, "--text {}: {} tokens, fewer than --tokens {}", a.text_path, all.size(), a.tokens);
  const std::size_t first = a.from_start ? 0 : all.size() - static_cast<std::size_t>(a.tokens);
  Engine engine(*model, engine_options(a.model));
  const KvShape shape = engine.kv_shape();
  KvCodebook::Header h = KvCodebook::Header::of(shape, a.sub, a.tokens);
  h.seed = a.seed;
  h.model = model_fingerprint(*model).model;
  h.keys = a.keys == "pre" ? KeyRope::pre : a.keys == "block" ? KeyRope::block : KeyRope::post;
  h.block_tokens = h.keys == KeyRope::block ? a.block_tokens : 0;
  const KvRope rope = engine.rope();
  KvCodebook check(h);  // a bad --sub fails before the forward passes
  const std::size_t kvd = static_cast<std::size_t>(shape.kv_dim());
  const std::size_t per_layer = static_cast<std::size_t>(a.tokens) * kvd;
  std::vector<float> keys(per_layer * static_cast<std::size_t>(shape.n_layers)), values(keys.size());
  const auto t0 = std::chrono::steady_clock::now();
  for (int done = 0; done < a.tokens;) {
    const int n = std::min(a.ctx, a.tokens - done);
    Session session(std::make_unique<DenseKvCache>(shape, n));
    const auto begin = all.begin() + static_cast<std::ptrdiff_t>(first) + done;
    engine.forward(session, std::span<const TokenId>(&*begin, static_cast<std::size_t>(n)));
    const auto& cache = static_cast<const DenseKvCache&>(session.cache());
    for (int l = 0; l < shape.n_layers; ++l)
      for (int t = 0; t < n; ++t) {
        const std::size_t at = static_cast<std::size_t>(l) * per_layer + static_cast<std::size_t>(done + t) * kvd;
        cache.read_row(l, t, &keys[at], &values[at]);
        // As the pool stores them: the window's RoPE undone (keys=pre), or all of it but the
        // part within a block of --block-tokens (keys=block); exact rotations, to rounding.
        const int undo = h.keys == KeyRope::pre ? t : h.keys == KeyRope::block ? t - t % a.block_tokens : 0;
        if (undo != 0)
          kernels::rope(&keys[at], shape.n_kv_heads, shape.head_dim, -static_cast<float>(undo), rope.freq(l).data(),
                        rope.style);
      }
    done += n;
    std::fprintf(stderr, "calibrate: %d / %d tokens through the model\n", done, a.tokens);
  }
  const auto t1 = std::chrono::steady_clock::now();
  std::fprintf(stderr, "calibrate: k-means of %d x %d x 2 x %d sub-spaces, %d centroids, %d iterations...\n",
               shape.n_layers, shape.n_kv_heads, shape.head_dim / a.sub, KvCodebook::kCentroids, a.iterations);
  CodebookTraining how;
  how.iterations = a.iterations;
  how.seed = a.seed;
  how.threads = a.model.threads > 0 ? a.model.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const KvCodebook book = train_codebook(h, keys, values, a.tokens, how);
  book.save(a.out_path);
  const auto t2 = std::chrono::steady_clock::now();
  std::printf("%s: pq%d codebook (%d-channel sub-vectors, %d centroids, keys=%s) of %s, %d tokens of %s (%s), id %016llx; "
              "forward %.1f s, k-means %.1f s\n",
              a.out_path.c_str(), 8 / a.sub, a.sub, KvCodebook::kCentroids, key_rope_name(h.keys),
              a.model.model_path.c_str(), a.tokens,
              a.text_path.c_str(), a.from_start ? "from its start" : "from its end",
              static_cast<unsigned long long>(book.id()), std::chrono::duration<double>(t1 - t0).count(),
              std::chrono::duration<double>(t2 - t1).count());
}

}  // namespace

void register_calibrate(CLI::App& app) {
  auto args = std::make_shared<CalibrateArgs>();
  CLI::App* cmd = app.add_subcommand("calibrate", "Learn the PQ codebooks of the pqN KV formats from a text");
  add_model_args(*cmd, args->model);
  cmd->add_option("--text", args->text_path, "Calibration text (keep it apart from what you evaluate)")->required();
  cmd->add_option("-o,--output", args->out_path, "Codebook file to write (.kvc)")->required();
  cmd->add_option("--sub", args->sub, "Channels per sub-vector: 2 (pq4), 4 (pq2) or 8 (pq1)");
  cmd->add_option("--tokens", args->tokens, "Calibration tokens")->check(CLI::Range(256, 1 << 22));
  cmd->add_option("--ctx", args->ctx, "Tokens per forward window (the positions the keys are learned at)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--iterations", args->iterations, "k-means iterations")->check(CLI::Range(1, 1000));
  cmd->add_option("--seed", args->seed, "k-means seed (the result is deterministic for it)")->check(seed_validator());
  cmd->add_option("--keys", args->keys,
                  "Learn keys as the pool stores them: post (after RoPE), pre or block (for keys=pre / keys=block formats)")
      ->check(CLI::IsMember({"post", "pre", "block"}));
  cmd->add_option("--block-tokens", args->block_tokens, "Pool block size that keys=block rows are relative to")
      ->check(CLI::IsMember({8, 16, 32, 64, 128}));
  cmd->add_flag("--from-start", args->from_start, "Take the tokens from the start of the text instead of its end");
  cmd->callback([args] { run_calibrate(*args); });
}

}  // namespace qkvshare::cli
