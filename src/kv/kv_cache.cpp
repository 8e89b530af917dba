#include "qkvshare/kv/kv_cache.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace qkvshare {

void KvCache::attend(int layer, int n, const float* q, float* out, ThreadPool& pool, int window) {
  AttendWork* work = &plan_attend(layer, n, q, out, window);
  run_attend_works(std::span<AttendWork* const>(&work, 1), pool);
}

void run_attend_works(std::span<AttendWork* const> works, ThreadPool& pool) {
  // Lay the jobs of all works on one cost axis; thread p runs the jobs whose
  // midpoints fall in [p, p + 1) * total / P. A decode session's few cheap
  // jobs and a prefill chunk's many heavy ones then share the threads evenly
  // (ThreadPool splits item counts, not costs).
  std::vector<double> start(works.size() + 1, 0.0);
  for (std::size_t i = 0; i < works.size(); ++i)
    start[i + 1] = start[i] + static_cast<double>(works[i]->jobs()) * std::max(works[i]->job_cost(), 1e-9);
  const double total = start.back();
  if (total > 0.0) {
    const auto shares = static_cast<std::size_t>(pool.size());
    const auto boundary = [&](std::size_t p) { return p >= shares ? total : total * static_cast<double>(p) / static_cast<double>(shares); };
    pool.parallel_for(shares, 1, [&](std::size_t begin, std::size_t end, int) {
      const double lo = boundary(begin), hi = boundary(end);
      for (std::size_t i = 0; i < works.size(); ++i) {
        const double jobs = static_cast<double>(works[i]->jobs());
        const double c = std::max(works[i]->job_cost(), 1e-9);
        // Job k's midpoint start + (k + 0.5) c lies in [lo, hi) for k in [first, last).
        const auto index = [&](double x) { return std::clamp(std::ceil((x - start[i]) / c - 0.5), 0.0, jobs); };
        const auto first = static_cast<std::size_t>(index(lo));
        const auto last = static_cast<std::size_t>(end >= shares ? jobs : index(hi));
        for (std::size_t k = first; k < last; ++k) works[i]->run(k);
      }
    });
  }
  for (AttendWork* w : works) w->finish();
}

}  // namespace qkvshare
