#pragma once
// Helpers for the share tests: stories260K, small pools, synthetic contexts
// (written through the KvCache interface without a model) and child processes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "qkvshare/core/thread_pool.hpp"
#include "qkvshare/engine/engine.hpp"
#include "qkvshare/share/handoff.hpp"
#include "qkvshare/share/share_pool.hpp"
#include "test_paths.hpp"

namespace qkvshare::testing {

inline std::unique_ptr<Model> load_stories() {
  return Model::load(shared_path("models/stories260K.bin"), shared_path("models/tok512.bin"));
}

inline ShareConfig small_config(std::size_t bytes = std::size_t{32} << 20) {
  ShareConfig c;
  c.bytes = bytes;
  c.max_contexts = 64;
  c.max_grants = 256;
  c.max_processes = 16;
  c.max_tokens = 1024;
  c.reap_interval_ms = 1;
  return c;
}

// A pool name no other test run uses.
inline std::string unique_pool_name(const char* what) {
  static std::atomic<int> n{0};
  return std::string("qkvtest.") + what + "." + std::to_string(::getpid()) + "." + std::to_string(n++);
}

// Removes a named pool at scope exit (also when the test fails).
struct PoolName {
  std::string name;
  explicit PoolName(const char* what) : name(unique_pool_name(what)) {}
  ~PoolName() { ShmRegion::unlink(name); }
};

// Appends `n` tokens of random K/V to a cache the way the forward pass does.
inline void append_random(KvCache& cache, int n, unsigned seed, ThreadPool& threads) {
  const KvShape& s = cache.shape();
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> k(static_cast<std::size_t>(n) * s.kv_dim()), v(k.size()), q(static_cast<std::size_t>(n) * s.q_dim()),
      out(q.size());
  for (int l = 0; l < s.n_layers; ++l) {
    for (auto& x : k) x = g(rng);
    for (auto& x : v) x = g(rng);
    for (auto& x : q) x = g(rng);
    cache.write(l, n, k.data(), v.data());
    cache.attend(l, n, q.data(), out.data(), threads);
  }
  cache.commit(n);
}

inline KvShape tiny_shape() { return KvShape{2, 2, 2, 8}; }

// Runs `body` in a forked child; returns its exit status (0 = success).
// The child must not touch the parent's thread pools: make new ones.
inline pid_t spawn(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 1;
    try {
      rc = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", static_cast<int>(::getpid()), e.what());
      rc = 3;
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  return pid;
}

inline int wait_exit(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

}  // namespace qkvshare::testing
