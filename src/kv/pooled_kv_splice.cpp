// Splice: a context's segments placed at another position (docs/design.md
// "Context"), the tail handed on alone, and decoded rows for the guard.
#include <algorithm>
#include <cstring>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"
#include "qkvshare/kv/kv_kernels.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {

std::unique_ptr<PooledKvCache> PooledKvCache::tail_context() const {
  QKV_CHECK(!step_);
  if (base_ == 0) return fork();
  auto copy = std::make_unique<PooledKvCache>(pool_, format_, capacity_);
  const KvSegment& tail = segments_.back();
  for (BlockRef b : tail.blocks) pool_->retain(b);
  // Frozen at the offset that names where its keys were rotated: [base_, size_).
  copy->segments_.assign(
      {KvSegment{-(base_ + position_gap_), tail.blocks, 0, size_ - base_}, KvSegment{0, {}, 0, 0}});
  copy->size_ = copy->base_ = size_ - base_;
  copy->rope_ = rope_;
  copy->path_ = path_;
  return copy;
}

void PooledKvCache::splice(const PooledKvCache& src, int begin, int end, const KvRope& rope) {
  QKV_CHECK(!step_ && !src.step_);
  if (src.pool_ != pool_) fail(ErrorCode::invalid_argument, "splice: the source context lives in another KV pool");
  if (src.block_flags() != block_flags())
    fail(ErrorCode::invalid_argument, "splice: the source context's format {} rotates or stores K/V differently from {}",
         src.format_.to_string(), format_.to_string());
  if (src.position_gap_ != 0)
    fail(ErrorCode::unsupported, "splice: the source context dropped tokens and kept their neighbours' positions; "
                                 "splice its text instead");
  if (begin < 0 || end > src.size_ || begin >= end)
    fail(ErrorCode::invalid_argument, "splice: token range [{}, {}) is not inside the source's {} tokens", begin, end,
         src.size_);
  const int n = end - begin;
  if (size_ + n > capacity_)
    fail(ErrorCode::context_full, "KV cache full: splicing {} tokens after {} exceeds its capacity of {}", n, size_,
         capacity_);
  if (static_cast<int>(rope.inv_freq.size()) * 2 != shape().head_dim ||
      (rope.layered() && static_cast<int>(rope.local_inv_freq.size()) * 2 != shape().head_dim))
    fail(ErrorCode::invalid_argument, "splice: {} RoPE frequencies for heads of {}", rope.inv_freq.size(),
         shape().head_dim);
  const int T = pool_->block_tokens();
  std::vector<KvSegment> added;
  int sb = 0;  // source logical index of the segment's first token
  for (const KvSegment& s : src.segments_) {
    const int lo = std::max(begin, sb), hi = std::min(end, sb + s.tokens);
    if (lo < hi) {
      const int row = s.first_row + (lo - sb), first_block = row / T, last_block = (row + (hi - lo) - 1) / T;
      KvSegment seg;
      seg.position_offset = s.position_offset + next_position() - begin;  // new minus computed position, as in src
      seg.first_row = row % T;
      seg.tokens = hi - lo;
      seg.blocks.assign(s.blocks.begin() + first_block, s.blocks.begin() + last_block + 1);
      added.push_back(std::move(seg));
    }
    sb += s.tokens;
  }
  {
    std::vector<KvSegment> after = segments_;
    after.insert(after.end(), added.begin(), added.end());
    require_windows(after, size_ + n, "splice");
  }
  for (const KvSegment& seg : added)
    for (BlockRef b : seg.blocks) pool_->retain(b);
  // The tail is frozen where it stands; later tokens go into a new tail.
  if (segments_.back().tokens == 0) segments_.pop_back();
  for (KvSegment& seg : added) segments_.push_back(std::move(seg));
  segments_.push_back(KvSegment{0, {}, 0, 0});
  size_ += n;
  base_ = size_;
  set_rope(rope);
}

void PooledKvCache::read_rows(int layer, int kind, int kv_head, int first, int count, float* out) const {
  const KvShape& s = shape();
  QKV_CHECK(!step_ && layer >= 0 && layer < s.n_layers && (kind == 0 || kind == 1) && kv_head >= 0 &&
            kv_head < s.n_kv_heads && first >= 0 && count >= 0 && first + count <= size_);
  const int T = pool_->block_tokens(), D = s.head_dim;
  std::vector<float> tile(static_cast<std::size_t>(T) * D);
  int sb = 0;
  for (const KvSegment& seg : segments_) {
    const int lo = std::max(first, sb), hi = std::min(first + count, sb + seg.tokens);
    for (int i = lo; i < hi;) {
      const int row = seg.first_row + (i - sb), b = row / T, r = row % T;
      const int take = std::min(hi - i, T - r);
      const BlockRef ref = seg.blocks[static_cast<std::size_t>(b)];
      const BlockInfo info = pool_->info(ref);
      if (!pool_->stores_layer(ref, layer))
        fail(ErrorCode::invalid_argument, "read_rows: token {} of sliding-window layer {} left the window; its KV was "
             "freed (windowed layers are kept from token {})", i, layer, windowed_kept_from());
      const KvCodec& c = kind == 0 ? info.k : info.v;
      kv::decode_tile_scalar(c, tile_layout(c, T, D), pool_->tile(ref, kind, layer, kv_head), r + take, tile.data(),
                             kv::codebook_slice(format_, c, kind, layer, kv_head));
      // The keys as attention reads them: each row turned to its own position (keys=pre), or all of
      // a block's rows by its first position, the rest being stored (keys=block).
      const bool pre = (info.flags & kBlockPreRopeK) != 0, relative = (info.flags & kBlockRelativeK) != 0;
      if (kind == 0 && (pre || relative)) {
        const float* table = rope_table(layer, info.key_position + T);
        kernels::tile_kernels().rope(&tile[static_cast<std::size_t>(r) * D], take, D,
                                     table + static_cast<std::ptrdiff_t>(info.key_position + (pre ? r : 0)) * 2 * D,
                                     pre ? 2 * D : 0, rope_.style);
      }
      std::memcpy(out + static_cast<std::ptrdiff_t>(i - first) * D, &tile[static_cast<std::size_t>(r) * D],
                  sizeof(float) * static_cast<std::size_t>(take) * static_cast<std::size_t>(D));
      i += take;
    }
    sb += seg.tokens;
  }
}

}  // namespace qkvshare
