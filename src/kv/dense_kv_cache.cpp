#include "qkvshare/kv/dense_kv_cache.hpp"

#include <algorithm>
#include <cstring>

#include "kv_attention.hpp"
#include "qkvshare/core/error.hpp"

namespace qkvshare {

DenseKvCache::DenseKvCache(const KvShape& shape, int capacity, int block_tokens)
    : shape_(shape), capacity_(capacity), block_tokens_(block_tokens) {
  if (capacity <= 0) fail(ErrorCode::invalid_argument, "KV cache capacity must be positive, got {}", capacity);
  if (block_tokens <= 0)
    fail(ErrorCode::invalid_argument, "KV cache tile size must be positive, got {}", block_tokens);
  rows_ = (capacity + block_tokens - 1) / block_tokens * block_tokens;
  const std::size_t n = static_cast<std::size_t>(shape.n_layers) * static_cast<std::size_t>(rows_) *
                        static_cast<std::size_t>(shape.kv_dim());
  k_.resize(n);
  v_.resize(n);
}

DenseKvCache::~DenseKvCache() = default;

std::size_t DenseKvCache::offset(int layer, int head, int token) const noexcept {
  const auto rows = static_cast<std::size_t>(rows_);
  return ((static_cast<std::size_t>(layer) * static_cast<std::size_t>(shape_.n_kv_heads) +
           static_cast<std::size_t>(head)) * rows + static_cast<std::size_t>(token)) *
         static_cast<std::size_t>(shape_.head_dim);
}

void DenseKvCache::write(int layer, int n, const float* k, const float* v) {
  QKV_CHECK(layer >= 0 && layer < shape_.n_layers && n >= 0);
  if (size_ + n > capacity_)
    fail(ErrorCode::context_full, "KV cache full: {} + {} tokens exceed its capacity of {}", size_, n, capacity_);
  const int D = shape_.head_dim, kvd = shape_.kv_dim();
  const std::size_t row_bytes = sizeof(float) * static_cast<std::size_t>(D);
  for (int h = 0; h < shape_.n_kv_heads; ++h) {
    float* kd = &k_[offset(layer, h, size_)];
    float* vd = &v_[offset(layer, h, size_)];
    for (int t = 0; t < n; ++t) {
      const std::size_t src = static_cast<std::size_t>(t) * kvd + static_cast<std::size_t>(h) * D;
      std::memcpy(kd + static_cast<std::size_t>(t) * D, k + src, row_bytes);
      std::memcpy(vd + static_cast<std::size_t>(t) * D, v + src, row_bytes);
    }
  }
}

void DenseKvCache::read_row(int layer, int token, float* k, float* v) const {
  QKV_CHECK(layer >= 0 && layer < shape_.n_layers && token >= 0 && token < size_);
  const int D = shape_.head_dim;
  for (int h = 0; h < shape_.n_kv_heads; ++h) {
    std::memcpy(k + static_cast<std::size_t>(h) * D, &k_[offset(layer, h, token)], sizeof(float) * D);
    std::memcpy(v + static_cast<std::size_t>(h) * D, &v_[offset(layer, h, token)], sizeof(float) * D);
  }
}

AttendWork& DenseKvCache::plan_attend(int layer, int n, const float* q, float* out, int window) {
  QKV_CHECK(layer >= 0 && layer < shape_.n_layers && n > 0 && size_ + n <= capacity_ && window >= 0);
  const int T = block_tokens_, H = shape_.n_kv_heads;
  const int blocks = (size_ + n + T - 1) / T;
  tiles_.resize(static_cast<std::size_t>(blocks) * static_cast<std::size_t>(H) * 2);
  const std::size_t half = tiles_.size() / 2;
  for (int b = 0; b < blocks; ++b)
    for (int h = 0; h < H; ++h) {
      const std::size_t i = static_cast<std::size_t>(b) * H + h;
      tiles_[i] = reinterpret_cast<const std::byte*>(&k_[offset(layer, h, b * T)]);
      tiles_[half + i] = reinterpret_cast<const std::byte*>(&v_[offset(layer, h, b * T)]);
    }
  if (codecs_.size() < static_cast<std::size_t>(blocks))  // every tile is f32: grown, never rewritten
    codecs_.resize(static_cast<std::size_t>(blocks), KvCodec::f32());
  kv::AttendInput in = kv::causal_input(shape_, T, blocks, size_, n, q, out, window);
  in.k_tiles = tiles_.data();
  in.v_tiles = tiles_.data() + half;
  in.k_codecs = codecs_.data();
  in.v_codecs = codecs_.data();
  in.layer = layer;
  if (!work_) work_ = std::make_unique<kv::BlockAttend>();
  // The tile kernels need head_dim % 8 == 0 (tile_layout); any other size takes the exact per-query path.
  work_->prepare(in, shape_.head_dim % 8 == 0 ? AttendPath::automatic : AttendPath::exact);
  return *work_;
}

void DenseKvCache::commit(int n) {
  QKV_CHECK(n >= 0 && size_ + n <= capacity_);
  size_ += n;
}

}  // namespace qkvshare
