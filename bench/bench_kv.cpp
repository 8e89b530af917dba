// Attention-only cost of each KV format, without the model: one context of
// --depth tokens in the pool, then single-token decode steps (write + attend
// over every layer), timed. Isolates what the KV format changes in decode
// (bytes read, decode work) from the weight matmuls that dominate a real
// step. Shape defaults to SmolLM2-135M (30 layers, 9 heads, 3 KV heads, 64).
//
//   bench_kv [--depth 2048] [--steps 64] [--threads 2] [--formats f16,int8,int4,...] [--path auto|scalar|avx2|avx512|neon]
//            [--block-tokens 32] [--head-dim 64]
//            [--tiles codes|decode]   (attention on integer codes, or each tile decoded to f32 first)
//            [--pq-tables off|on]     (pq tiles through per-query lookup tables instead of decoded)
// Prints a table on stdout and one JSON object per format on stderr.
#include <time.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_kernels.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace {

using namespace qkvshare;

std::vector<float> noise(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = g(rng);
  return x;
}

// CPU time of the calling thread: with --threads 1 it is the step's compute
// cost even on a loaded machine, where wall time is not.
double cpu_now() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct Timing {
  double wall = 1e30, cpu = 1e30;
};

Timing run(const KvShape& s, const KvFormat& f, int depth, int steps, int block, AttendPath path, ThreadPool& threads,
           std::size_t& bytes) {
  auto pool = KvPool::create(PoolConfig{s, block, KvPool::arena_bytes_for(s, block, f, depth + steps)});
  PooledKvCache cache(pool, f, depth + steps);
  cache.set_attend_path(path);
  if (cache.keys_before_rope()) {  // keys=pre: RoPE is applied to every key row read (what it costs is measured here)
    KvRope rope;
    for (int i = 0; i < s.head_dim / 2; ++i)
      rope.inv_freq.push_back(static_cast<float>(std::pow(10000.0, -2.0 * i / s.head_dim)));
    cache.set_rope(rope);
  }
  const int chunk = 256;
  const auto k = noise(static_cast<std::size_t>(chunk) * s.kv_dim(), 1), v = noise(k.size(), 2);
  const auto q = noise(static_cast<std::size_t>(chunk) * s.q_dim(), 3);
  std::vector<float> out(q.size());
  for (int done = 0; done < depth;) {
    const int n = std::min(chunk, depth - done);
    for (int l = 0; l < s.n_layers; ++l) {
      cache.write(l, n, k.data(), v.data());
      cache.attend(l, n, q.data(), out.data(), threads);
    }
    cache.commit(n);
    done += n;
  }
  Timing best;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = cpu_now();
    for (int l = 0; l < s.n_layers; ++l) {
      cache.write(l, 1, k.data() + (i % chunk) * s.kv_dim(), v.data() + (i % chunk) * s.kv_dim());
      cache.attend(l, 1, q.data() + (i % chunk) * s.q_dim(), out.data(), threads);
    }
    cache.commit(1);
    best.cpu = std::min(best.cpu, cpu_now() - c0);
    best.wall = std::min(best.wall, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  bytes = cache.kv_bytes();
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int depth = 2048, steps = 64, n_threads = 1, block = 32;
  std::string formats = "f32,f16,int8,k8v4,int4,int3,int2,int2:window=128:sink=32";
  std::string path_name = "auto", tiles = "codes", pq_tables = "off";
  KvShape shape{30, 9, 3, 64};
  CLI::App app{"Attention-only decode step of each KV format (no model): write + attend over every layer"};
  app.add_option("--depth", depth, "Context tokens before the timed steps")->check(CLI::Range(1, 1 << 20));
  app.add_option("--steps", steps, "Timed decode steps (best of)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--threads", n_threads, "Threads of the attention")->check(CLI::Range(1, 1024));
  app.add_option("--formats", formats, "KV formats, comma separated");
  app.add_option("--block-tokens", block, "The pool's block size (a power of two)")->check(CLI::Range(1, 1 << 16));
  app.add_option("--path", path_name, "Attention kernels")->check(CLI::IsMember({"auto", "scalar", "avx2", "avx512", "neon"}));
  app.add_option("--head-dim", shape.head_dim, "Head dimension of the synthetic shape")->check(CLI::Range(1, 1024));
  app.add_option("--tiles", tiles, "Attention on integer codes, or each tile decoded to f32 first")
      ->check(CLI::IsMember({"codes", "decode"}));
  app.add_option("--pq-tables", pq_tables, "pq tiles through per-query lookup tables instead of decoded")
      ->check(CLI::IsMember({"off", "on"}));
  CLI11_PARSE(app, argc, argv);
  kv::set_codes_attention(tiles == "codes");
  kv::set_pq_lookup_tables(pq_tables == "on");
  const AttendPath path = path_name == "scalar"   ? AttendPath::scalar
                          : path_name == "avx2"   ? AttendPath::avx2
                          : path_name == "avx512" ? AttendPath::avx512
                          : path_name == "neon"   ? AttendPath::neon
                                                  : AttendPath::automatic;
  try {
    ThreadPool threads(n_threads);
    std::printf("attention-only decode step (30 layers, write + attend), depth %d, best of %d, %d threads, path %s, %d-token blocks\n",
                depth, steps, n_threads, path_name.c_str(), block);
    std::printf("%-28s %10s %14s %14s\n", "format", "KV MiB", "wall us/step", "cpu us/step");
    for (std::size_t pos = 0; pos <= formats.size();) {
      std::size_t end = formats.find(',', pos);
      if (end == std::string::npos) end = formats.size();
      const KvFormat f = KvFormat::parse(formats.substr(pos, end - pos));
      pos = end + 1;
      std::size_t bytes = 0;
      const Timing t = run(shape, f, depth, steps, block, path, threads, bytes);
      std::printf("%-28s %10.2f %14.1f %14.1f\n", f.to_string().c_str(), static_cast<double>(bytes) / (1 << 20),
                  t.wall * 1e6, t.cpu * 1e6);
      std::fprintf(stderr, "{\"format\": \"%s\", \"depth\": %d, \"kv_bytes\": %zu, \"wall_s\": %.9f, \"cpu_s\": %.9f}\n",
                   f.to_string().c_str(), depth, bytes, t.wall, t.cpu);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
