#pragma once
// Dense f32 KV cache: the storage of a session that does not share its KV
// (Engine::new_session), and the f32 baseline the quantized pool is checked
// against. K and V are stored per layer and KV head as runs of rows,
// [layer][kv_head][token][head_dim], so that block_tokens consecutive rows of
// a head are one f32 tile: attention runs the pool's block attention
// (kv_attention.hpp) over them in place, with the same kernels, query
// chunks and split-K as an f32 pool of the same block size.
#include <memory>
#include <vector>

#include "qkvshare/kv/kv_cache.hpp"
#include "qkvshare/kv/kv_format.hpp"

namespace qkvshare {

namespace kv {
class BlockAttend;
}

class DenseKvCache final : public KvCache {
 public:
  // block_tokens: rows per tile (the pool's default size by default).
  DenseKvCache(const KvShape& shape, int capacity, int block_tokens = 32);
  ~DenseKvCache() override;

  const KvShape& shape() const noexcept override { return shape_; }
  int size() const noexcept override { return size_; }
  int capacity() const noexcept override { return capacity_; }
  void write(int layer, int n, const float* k, const float* v) override;
  AttendWork& plan_attend(int layer, int n, const float* q, float* out, int window = 0) override;
  void commit(int n) override;

  // Token `token`'s keys and values of `layer`, all KV heads: [kv_dim] each.
  void read_row(int layer, int token, float* k, float* v) const;

 private:
  std::size_t offset(int layer, int head, int token) const noexcept;
  KvShape shape_;
  int capacity_;
  int block_tokens_;
  int rows_;  // capacity rounded up to whole tiles
  int size_ = 0;
  std::vector<float> k_;
  std::vector<float> v_;
  std::vector<const std::byte*> tiles_;  // this pass's [blocks][kv_heads] keys, then values
  std::vector<KvCodec> codecs_;         // all f32
  std::unique_ptr<kv::BlockAttend> work_;
};

}  // namespace qkvshare
