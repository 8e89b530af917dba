// Kernel micro-benchmarks (Google Benchmark): matvec (decode) and matmat
// (prefill, 64 tokens) per weight type at SmolLM2-135M shapes, each next to
// the pre-SIMD baseline (dequantize a row to f32, then dot) in the same run;
// the activation quantizer, attention of one head, parallel_for overhead, and
// the KV pool's tile encoder (a filled block's quantization) on each level
// beside the portable level's scalar reference.
//
//   ./build/bench/bench_kernels --benchmark_min_time=0.5s
//   QKVSHARE_BENCH_ALL_ISAS=1 ./build/bench/bench_kernels   # every ISA level, not only the best
//
// Counters: "weights" = weight bytes read per second (decode is bound by it),
// "MAC" = multiply-accumulates per second.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "qkvshare/core/thread_pool.hpp"
#include "qkvshare/kernels/isa.hpp"
#include "qkvshare/kernels/matmul.hpp"
#include "qkvshare/kernels/ops.hpp"
#include "qkvshare/kernels/packed_weights.hpp"
#include "qkvshare/kernels/quant.hpp"
#include "qkvshare/kv/kv_kernels.hpp"

namespace {

using namespace qkvshare;
using namespace qkvshare::kernels;

struct Matrix {
  std::vector<std::uint8_t> bytes;
  std::vector<std::uint8_t> packed;  // the tile layout the engine packs at load (Q4_0, Q4_1, Q8_0)
  TensorView view;
};

// Random weights of a type, made once per (type, shape) and kept for the run.
const Matrix& matrix(GgmlType type, std::int64_t rows, std::int64_t cols) {
  static std::vector<std::unique_ptr<Matrix>> cache;
  for (const auto& m : cache)
    if (m->view.type == type && m->view.rows() == rows && m->view.cols() == cols) return *m;
  auto m = std::make_unique<Matrix>();
  const TypeTraits& tt = type_traits(type);
  const std::size_t row_bytes = static_cast<std::size_t>(cols / tt.block_size) * tt.type_size;
  m->bytes.resize(row_bytes * static_cast<std::size_t>(rows));
  std::mt19937 rng(static_cast<unsigned>(rows * 31 + cols));
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<float> row(static_cast<std::size_t>(cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (auto& v : row) v = dist(rng);
    quantize_row_ref(type, row.data(), m->bytes.data() + static_cast<std::size_t>(r) * row_bytes, cols);
  }
  m->view.name = "bench";
  m->view.type = type;
  m->view.n_dims = 2;
  m->view.ne = {cols, rows, 1, 1};
  m->view.data = m->bytes.data();
  m->view.nbytes = m->bytes.size();
  if (packs(m->view) && weight_packing()) {  // as Model::load does: the kernels then read the tiles
    m->packed.resize(m->bytes.size());
    pack_tiles(m->view, 0, (rows + kPackedTileRows - 1) / kPackedTileRows, m->packed.data());
    m->view.packed = m->packed.data();
  }
  cache.push_back(std::move(m));
  return *cache.back();
}

std::vector<float> activations(std::int64_t n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (auto& v : x) v = dist(rng);
  return x;
}

ThreadPool& pool(int threads) {
  static ThreadPool one(1), two(2);
  return threads == 1 ? one : two;
}

void set_counters(benchmark::State& st, const Matrix& m, std::int64_t tokens) {
  const double iters = static_cast<double>(st.iterations());
  st.counters["weights"] = benchmark::Counter(iters * static_cast<double>(m.view.nbytes), benchmark::Counter::kIsRate,
                                              benchmark::Counter::kIs1024);
  st.counters["MAC"] = benchmark::Counter(iters * static_cast<double>(m.view.rows() * m.view.cols() * tokens),
                                          benchmark::Counter::kIsRate);
}

void bm_matmul(benchmark::State& st, GgmlType type, std::int64_t rows, std::int64_t cols, std::int64_t tokens,
               Isa isa, int threads) {
  const Matrix& m = matrix(type, rows, cols);
  const auto x = activations(cols * tokens);
  std::vector<float> y(static_cast<std::size_t>(rows * tokens));
  set_active_isa(isa);
  for (auto _ : st) {
    matmul(pool(threads), m.view, x.data(), tokens, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  set_active_isa(best_isa());
  set_counters(st, m, tokens);
}

// The matmul before the SIMD kernels: each row dequantized to f32 once, then
// dotted with every token.
void bm_baseline(benchmark::State& st, GgmlType type, std::int64_t rows, std::int64_t cols, std::int64_t tokens,
                 int threads) {
  const Matrix& m = matrix(type, rows, cols);
  const auto x = activations(cols * tokens);
  std::vector<float> y(static_cast<std::size_t>(rows * tokens));
  for (auto _ : st) {
    pool(threads).parallel_for(static_cast<std::size_t>(rows), 16, [&](std::size_t b, std::size_t e, int) {
      thread_local std::vector<float> row;
      row.resize(static_cast<std::size_t>(cols));
      for (std::size_t r = b; r < e; ++r) {
        dequantize_row_ref(type, m.view.row(static_cast<std::int64_t>(r)), row.data(), cols);
        for (std::int64_t t = 0; t < tokens; ++t)
          y[static_cast<std::size_t>(t * rows) + r] = dot_f32(row.data(), x.data() + t * cols, cols);
      }
    });
    benchmark::DoNotOptimize(y.data());
  }
  set_counters(st, m, tokens);
}

void bm_parallel_for(benchmark::State& st) {
  std::vector<int> sink(64);
  for (auto _ : st) {
    pool(2).parallel_for(64, 8, [&](std::size_t b, std::size_t e, int) {
      for (std::size_t i = b; i < e; ++i) sink[i] += 1;
    });
  }
  benchmark::DoNotOptimize(sink.data());
}

struct Shape {
  const char* name;
  std::int64_t rows, cols;
};

// kv::encode_tile of one tile at level `isa` (the range search of int2-int4
// codes is TileKernels::fit; the portable level runs its scalar reference).
void bm_encode_tile(benchmark::State& state, const std::string& format, int kind, Isa isa) {
  constexpr int T = 32, D = 64;
  const KvFormat f = KvFormat::parse(format);
  const KvCodec codec = kind == 0 ? f.k : f.v;
  const TileLayout layout = tile_layout(codec, T, D);
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> rows(static_cast<std::size_t>(T) * D);
  for (auto& x : rows) x = g(rng);
  std::vector<std::byte> tile(layout.bytes);
  const Isa saved = active_isa();
  set_active_isa(isa);
  for (auto _ : state) {
    kv::encode_tile(codec, layout, rows.data(), tile.data());
    benchmark::DoNotOptimize(tile.data());
  }
  set_active_isa(saved);
}

void register_all() {
  const GgmlType types[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0,
                            GgmlType::Q4_1, GgmlType::Q6_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q5_0};
  // SmolLM2-135M: wq/wo 576x576, w_down 576x1536, w_gate/w_up 1536x576, output 49152x576 (rows x cols).
  const Shape decode_shapes[] = {{"576x576", 576, 576},
                                 {"576x1536", 576, 1536},
                                 {"1536x576", 1536, 576},
                                 {"49152x576", 49152, 576},
                                 // Llama-3.2-1B's w_gate: 16 MiB in Q8_0, read from DRAM as a decode reads it.
                                 {"8192x2048", 8192, 2048}};
  std::vector<Isa> isas{best_isa()};
  if (std::getenv("QKVSHARE_BENCH_ALL_ISAS") != nullptr) {
    isas.clear();
    for (Isa isa : {Isa::avx512, Isa::avx2, Isa::portable})
      if (isa_available(isa)) isas.push_back(isa);
  }
  for (GgmlType type : types)
    for (const Shape& s : decode_shapes)
      for (std::int64_t tokens : {1, 4, 64}) {
        if (tokens == 64 && s.rows > 4096) continue;  // prefill computes the output layer for one token only
        if (tokens == 4 && s.rows < 4096) continue;   // four sessions decoding together: the big matrices
        if (type_traits(type).block_size == 256 && s.cols % 256 != 0) continue;  // k-quants: whole super-blocks
        const std::string base = std::string(tokens == 1 ? "matvec/" : tokens == 4 ? "matvec4/" : "matmat64/") +
                                 std::string(type_name(type)) + "/" + s.name;
        for (int threads : {1, 2}) {
          const std::string suffix = "/threads:" + std::to_string(threads);
          for (Isa isa : isas)
            benchmark::RegisterBenchmark((base + "/" + std::string(isa_name(isa)) + suffix).c_str(), bm_matmul, type,
                                         s.rows, s.cols, tokens, isa, threads)
                ->UseRealTime()
                ->Unit(benchmark::kMicrosecond);
          benchmark::RegisterBenchmark((base + "/baseline" + suffix).c_str(), bm_baseline, type, s.rows, s.cols,
                                       tokens, threads)
              ->UseRealTime()
              ->Unit(benchmark::kMicrosecond);
        }
      }
  // One 32 x 64 tile (a SmolLM2 KV head of one block); K per channel, V per token.
  for (const char* format : {"int8", "int4", "int2", "int2:vgroup=64:outliers=0.01", "int4:params=8", "int2:params=8"})
    for (int kind = 0; kind < 2; ++kind)
      for (Isa isa : {best_isa(), Isa::portable})
        benchmark::RegisterBenchmark((std::string("encode_tile/") + format + (kind ? "/V/" : "/K/") + std::string(isa_name(isa))).c_str(),
                                     bm_encode_tile, std::string(format), kind, isa)
            ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("parallel_for/threads:2/empty", bm_parallel_for)->UseRealTime();
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
