#pragma once
// qkvshare bench --batch: batched decode, llama-batched-bench's measurement.
// B sessions, each with its own context of `depth` random tokens (filled
// first, not timed), decode `n_gen` tokens together: every pass is one
// Engine::forward_batch of B one-token entries. Reported per (KV format,
// depth, B): aggregate decode tokens/s (B * n_gen / time) and per session
// (n_gen / time). Within a repetition the formats and batch sizes alternate,
// so a busy machine slows all of them alike; medians over the repetitions.
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "qkvshare/engine/engine.hpp"

namespace qkvshare::cli {

struct BatchBenchArgs {
  std::vector<int> batches;        // e.g. 1,2,4,8
  std::vector<std::string> kv;     // pool KV formats
  std::vector<int> depths;
  int n_gen = 64;
  int reps = 3;
  std::uint64_t seed = 1234;
  // All B sessions fork one filled context (llama-batched-bench -pps): a
  // fan-out's forks, and one fill instead of B.
  bool shared_prefix = false;
  int block_tokens = 32;  // the pool's block size (a power of two)
};

// Runs the tests, prints the table on stdout and returns the JSON tests array.
nlohmann::json run_batch_bench(Engine& engine, const BatchBenchArgs& args);

}  // namespace qkvshare::cli
