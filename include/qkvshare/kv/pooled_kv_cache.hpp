#pragma once
// A context's KV storage in the pool: a block table (a list of segments) in
// one KvFormat, implementing the engine's KvCache interface.
//
// Writes are quantized as they arrive, prefill included: the tokens of a
// block that this forward pass fills go straight into a cold (quantized)
// block, so the attention of the same pass already reads quantized keys. Hot
// blocks (the partly filled tail, the window, the sinks) are f16 (f32 for f32
// codecs). A hot block that turns cold is requantized into a new block during
// the pass and swapped in at commit(); a shared block (refcount > 1) is never
// written: the tail is copied on write. All blocks a pass needs are allocated
// by its first write(), before anything is stored, so pool exhaustion fails
// the request (Error(out_of_memory)) and leaves this and every other context
// as they were.
#include <memory>
#include <vector>

#include "qkvshare/kv/kv_cache.hpp"
#include "qkvshare/kv/kv_format.hpp"
#include "qkvshare/kv/kv_pool.hpp"

namespace qkvshare {

namespace kv {
class BlockAttend;
}

// A run of blocks holding consecutive tokens. Keys were rotated (RoPE) at the
// positions they were computed at; a segment placed `position_offset` tokens
// away from there would be read by rotating the query back by the offset
// (docs/design.md "Context"). Offsets are zero until splice exists.
struct KvSegment {
  int position_offset = 0;
  std::vector<BlockRef> blocks;
};

// How attention reads the blocks: the automatic choice uses the best SIMD
// kernels of the CPU, and for f32 K and V the exact reference sequence of
// DenseKvCache (so an f32 pool reproduces its logits; see kv_attention.cpp).
enum class AttendPath { automatic, scalar, avx2, avx512, exact };

class PooledKvCache final : public KvCache {
 public:
  // Throws Error(invalid_argument) when the format does not fit the pool's shape.
  PooledKvCache(std::shared_ptr<KvPool> pool, const KvFormat& format, int capacity);
  ~PooledKvCache() override;
  PooledKvCache(const PooledKvCache&) = delete;
  PooledKvCache& operator=(const PooledKvCache&) = delete;

  const KvShape& shape() const noexcept override { return pool_->shape(); }
  int size() const noexcept override { return size_; }
  int capacity() const noexcept override { return capacity_; }
  void write(int layer, int n, const float* k, const float* v) override;
  AttendWork& plan_attend(int layer, int n, const float* q, float* out) override;
  void commit(int n) override;

  // A context over existing blocks (a handed-off one): takes its own
  // reference on every block, which must still be live at the given
  // generation (else Error(bad_descriptor)), and checks that the blocks fit
  // `tokens`, `capacity` and the format's codecs (else Error(invalid_argument)).
  static std::unique_ptr<PooledKvCache> adopt(std::shared_ptr<KvPool> pool, const KvFormat& format, int capacity,
                                              std::vector<KvSegment> segments, int tokens);

  // A second context sharing every block (reference counts); the first write
  // of either into a shared partly filled block copies that block.
  std::unique_ptr<PooledKvCache> fork() const;

  const KvFormat& format() const noexcept { return format_; }
  const std::vector<KvSegment>& segments() const noexcept { return segments_; }
  KvPool& pool() const noexcept { return *pool_; }
  // Bytes of the pages this context's blocks hold.
  std::size_t kv_bytes() const;
  void set_attend_path(AttendPath path) noexcept { path_ = path; }

 private:
  struct Step;  // the pass between the first write() and commit()
  int block_count() const noexcept;
  BlockRef table_at(int b) const noexcept;
  void plan(int n);
  void discard_step() noexcept;
  void write_block(int layer, int b, const float* k, const float* v, int n);
  std::uint32_t block_flags() const noexcept;

  std::shared_ptr<KvPool> pool_;
  KvFormat format_;
  int capacity_;
  int size_ = 0;
  std::vector<KvSegment> segments_;
  std::unique_ptr<Step> step_;
  AttendPath path_ = AttendPath::automatic;
  std::vector<float> rotated_;  // k/v rows of a write, rotated per head
  // The planned attention and the tile pointers it reads (one plan at a time per cache).
  std::unique_ptr<kv::BlockAttend> attend_work_;
  std::vector<const std::byte*> attend_tiles_;
};

}  // namespace qkvshare
