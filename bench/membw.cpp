// The machine's limits for decode-speed ratios (bench/compare_llamacpp.py):
//   - memory read bandwidth: N threads each stream their share of one large
//     buffer (default 1 GiB, larger than any L3) with 64-byte vector loads;
//   - arithmetic peak: f32 FMA throughput and, where the CPU has AVX-512 VNNI,
//     int8 dot-product (vpdpbusd) throughput, with enough independent
//     accumulators to hide latency.
// Each figure is the best of several passes. Prints one JSON object on stdout.
//
//   g++ -O3 -march=native -std=gnu++20 -pthread bench/membw.cpp -o membw
//   ./membw [--threads 2] [--mib 1024] [--passes 10]
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#if defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

namespace {

using u64x8 = std::uint64_t __attribute__((vector_size(64)));
using f32x16 = float __attribute__((vector_size(64)));

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Runs fn(thread_index) on n threads at once; returns the wall time of the slowest.
template <typename F>
double timed_parallel(int n, F fn) {
  std::vector<std::thread> threads;
  const double t0 = now();
  for (int i = 0; i < n; ++i) threads.emplace_back(fn, i);
  for (std::thread& t : threads) t.join();
  return now() - t0;
}

volatile std::uint64_t g_sink_u64;
volatile float g_sink_f32;
volatile int g_sink_i32;

std::uint64_t read_range(const u64x8* p, std::size_t n) {
  u64x8 a{}, b{}, c{}, d{};
  for (std::size_t i = 0; i + 4 <= n; i += 4) {
    a += p[i];
    b += p[i + 1];
    c += p[i + 2];
    d += p[i + 3];
  }
  const u64x8 s = a + b + c + d;
  std::uint64_t r = 0;
  for (int i = 0; i < 8; ++i) r += s[i];
  return r;
}

constexpr long kFmaIters = 20'000'000;

float fma_loop(float seed) {
  constexpr int kAcc = 16;
  f32x16 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = f32x16{} + seed * static_cast<float>(i);
  const f32x16 m = f32x16{} + 0.999999f, c = f32x16{} + 1e-7f;
  for (long it = 0; it < kFmaIters; ++it)
    for (int i = 0; i < kAcc; ++i) acc[i] = acc[i] * m + c;
  f32x16 s{};
  for (int i = 0; i < kAcc; ++i) s += acc[i];
  return s[0];
}
constexpr double kFmaFlops = 2.0 * 16 * 16 * kFmaIters;  // 2 flops x 16 lanes x 16 accumulators

#if defined(__AVX512VNNI__)
int vnni_loop(int seed) {
  constexpr int kAcc = 16;
  __m512i acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_epi32(seed + i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  for (long it = 0; it < kFmaIters; ++it)
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  __m512i s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm512_add_epi32(s, acc[i]);
  alignas(64) int lanes[16];
  _mm512_store_si512(lanes, s);
  int r = 0;
  for (const int v : lanes) r += v;
  return r;
}
constexpr double kVnniOps = 2.0 * 64 * 16 * kFmaIters;  // 64 int8 multiply-adds per instruction
#endif

int arg_int(int argc, char** argv, const char* flag, int fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], flag) == 0) return std::atoi(argv[i + 1]);
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int n_threads = arg_int(argc, argv, "--threads", 2);
  const std::size_t mib = static_cast<std::size_t>(arg_int(argc, argv, "--mib", 1024));
  const int passes = arg_int(argc, argv, "--passes", 10);
  if (n_threads < 1 || mib < 1 || passes < 1) {
    std::fprintf(stderr, "usage: membw [--threads N>=1] [--mib MiB>=1] [--passes N>=1]\n");
    return 2;
  }
  const std::size_t bytes = mib << 20;
  const std::size_t n_vec = bytes / sizeof(u64x8);
  auto* buf = static_cast<u64x8*>(std::aligned_alloc(4096, bytes));
  if (buf == nullptr) {
    std::fprintf(stderr, "membw: cannot allocate %zu MiB\n", mib);
    return 1;
  }
  // Each thread first touches its own share so pages are resident.
  const std::size_t share = n_vec / static_cast<std::size_t>(n_threads);
  timed_parallel(n_threads, [&](int t) { std::memset(buf + share * t, 1, share * sizeof(u64x8)); });

  double best_read = 1e30;
  for (int p = 0; p < passes; ++p) {
    const double s = timed_parallel(n_threads, [&](int t) { g_sink_u64 = read_range(buf + share * t, share); });
    best_read = std::min(best_read, s);
  }
  const double read_gbs = static_cast<double>(share * n_threads * sizeof(u64x8)) / best_read / 1e9;
  std::free(buf);

  double best_fma = 1e30;
  for (int p = 0; p < 3; ++p)
    best_fma = std::min(best_fma, timed_parallel(n_threads, [&](int t) { g_sink_f32 = fma_loop(1.0f + t); }));
  const double fma_gflops = kFmaFlops * n_threads / best_fma / 1e9;
  double vnni_gops = 0.0;
#if defined(__AVX512VNNI__)
  double best_vnni = 1e30;
  for (int p = 0; p < 3; ++p)
    best_vnni = std::min(best_vnni, timed_parallel(n_threads, [&](int t) { g_sink_i32 = vnni_loop(t); }));
  vnni_gops = kVnniOps * n_threads / best_vnni / 1e9;
#endif
  std::printf(
      "{\"threads\": %d, \"buffer_bytes\": %zu, \"passes\": %d, \"read_gb_per_s\": %.2f, "
      "\"f32_fma_gflops\": %.1f, \"int8_vnni_gops\": %.1f}\n",
      n_threads, bytes, passes, read_gbs, fma_gflops, vnni_gops);
  return 0;
}
