#include "qkvshare/kv/dense_kv_cache.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/attention.hpp"

namespace qkvshare {

DenseKvCache::DenseKvCache(const KvShape& shape, int capacity) : shape_(shape), capacity_(capacity) {
  if (capacity <= 0) fail(ErrorCode::invalid_argument, "KV cache capacity must be positive, got {}", capacity);
  const std::size_t n = static_cast<std::size_t>(shape.n_layers) * static_cast<std::size_t>(capacity) *
                        static_cast<std::size_t>(shape.kv_dim());
  k_.resize(n);
  v_.resize(n);
}

float* DenseKvCache::k_at(int layer, int token) {
  return k_.data() + (static_cast<std::size_t>(layer) * static_cast<std::size_t>(capacity_) +
                      static_cast<std::size_t>(token)) * static_cast<std::size_t>(shape_.kv_dim());
}
float* DenseKvCache::v_at(int layer, int token) {
  return v_.data() + (static_cast<std::size_t>(layer) * static_cast<std::size_t>(capacity_) +
                      static_cast<std::size_t>(token)) * static_cast<std::size_t>(shape_.kv_dim());
}
const float* DenseKvCache::keys(int layer, int token) const { return const_cast<DenseKvCache*>(this)->k_at(layer, token); }
const float* DenseKvCache::values(int layer, int token) const {
  return const_cast<DenseKvCache*>(this)->v_at(layer, token);
}

void DenseKvCache::write(int layer, int n, const float* k, const float* v) {
  QKV_CHECK(layer >= 0 && layer < shape_.n_layers && n >= 0);
  if (size_ + n > capacity_)
    fail(ErrorCode::context_full, "KV cache full: {} + {} tokens exceed its capacity of {}", size_, n, capacity_);
  const std::size_t bytes = static_cast<std::size_t>(n) * static_cast<std::size_t>(shape_.kv_dim()) * sizeof(float);
  std::memcpy(k_at(layer, size_), k, bytes);
  std::memcpy(v_at(layer, size_), v, bytes);
}

AttendWork& DenseKvCache::plan_attend(int layer, int n, const float* q, float* out, int window) {
  QKV_CHECK(layer >= 0 && layer < shape_.n_layers && n > 0 && size_ + n <= capacity_ && window >= 0);
  work_.window = window;
  work_.cache = this;
  work_.layer = layer;
  work_.n = n;
  work_.q = q;
  work_.out = out;
  return work_;
}

std::size_t DenseKvCache::Work::jobs() const noexcept {
  return static_cast<std::size_t>(n) * static_cast<std::size_t>(cache->shape_.n_heads);
}

double DenseKvCache::Work::job_cost() const noexcept {
  const double keys = cache->size_ + 0.5 * n + 1.0;
  return (window > 0 ? std::min(keys, static_cast<double>(window)) : keys) * cache->shape_.head_dim;
}

void DenseKvCache::Work::run(std::size_t job) {
  const KvShape& s = cache->shape_;
  const int hd = s.head_dim;
  const int group = s.n_heads / s.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const std::int64_t stride = s.kv_dim();
  const float* k0 = cache->keys(layer, 0);
  const float* v0 = cache->values(layer, 0);
  const int t = static_cast<int>(job / static_cast<std::size_t>(s.n_heads));
  const int h = static_cast<int>(job % static_cast<std::size_t>(s.n_heads));
  const int kvh = h / group;
  const int end = cache->size_ + t + 1, first = window > 0 ? std::max(0, end - window) : 0;
  thread_local std::vector<float> scores;
  scores.resize(static_cast<std::size_t>(end - first));
  const std::int64_t qoff = static_cast<std::int64_t>(t) * s.q_dim() + static_cast<std::int64_t>(h) * hd;
  const std::int64_t skip = static_cast<std::int64_t>(first) * stride;
  kernels::attend_head_f32(q + qoff, k0 + skip + kvh * hd, v0 + skip + kvh * hd, stride, end - first, hd, scale,
                           scores.data(), out + qoff);
}

void DenseKvCache::commit(int n) {
  QKV_CHECK(n >= 0 && size_ + n <= capacity_);
  size_ += n;
}

}  // namespace qkvshare
