// Recoding blocks into other codecs: the memory tiers' demotion of a whole
// context (recoded(), tiers/context_tiers.hpp) and a mixed format's demote()
// of its least attended blocks. Each block goes through f32 rows, and the
// change it makes to what attention reads can be measured as it is made.
#include <algorithm>
#include <cmath>

#include "qkvshare/kv/kv_kernels.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {

namespace {
// Gives back the references the recode took itself if anything fails
// (adopt() takes its own).
struct Held {
  KvPool& pool;
  std::vector<BlockRef> blocks;
  ~Held() {
    for (const BlockRef b : blocks) pool.release(b);
  }
};

// Adds the energy of rows [row0, row1) of `rows` ([T][D]) and, with `other`, their squared change.
void add_rows(const std::vector<float>& rows, const std::vector<float>* other, int row0, int row1, int D,
              double& energy, double& change) {
  for (std::size_t i = static_cast<std::size_t>(row0) * D; i < static_cast<std::size_t>(row1) * D; ++i) {
    const double o = rows[i];
    energy += o * o;
    if (other != nullptr) change += ((*other)[i] - o) * ((*other)[i] - o);
  }
}
}  // namespace

BlockRef PooledKvCache::recode_block(BlockRef ref, const KvCodec& k, const KvCodec& v, const KvFormat& to,
                                     RecodeSums* sums, int row0, int row1) const {
  const KvShape& s = shape();
  const int T = pool_->block_tokens(), D = s.head_dim;
  const BlockInfo info = pool_->info(ref);
  const int fill = static_cast<int>(info.fill);
  const BlockRef dst = pool_->allocate(k, v, block_flags() | (info.flags & kBlockWindowFreed), info.key_position);
  std::vector<float> old_rows(static_cast<std::size_t>(T) * D),
      new_rows(sums != nullptr ? old_rows.size() : 0);
  try {
    for (int kind = 0; kind < 2; ++kind) {
      const KvCodec& from = kind == 0 ? info.k : info.v;
      const KvCodec& into = kind == 0 ? k : v;
      const TileLayout fl = tile_layout(from, T, D), tl = tile_layout(into, T, D);
      for (int l = 0; l < s.n_layers; ++l)
        for (int kh = 0; kh < s.n_kv_heads && pool_->stores_layer(ref, l); ++kh) {
          kv::decode_tile_scalar(from, fl, pool_->tile(ref, kind, l, kh), T, old_rows.data(),
                                 kv::codebook_slice(format_, from, kind, l, kh));
          // A partly filled block coded whole (code_tail): the unused rows repeat the last one.
          if (into.quantized() && fill > 0)
            for (int r = fill; r < T; ++r)
              std::copy_n(&old_rows[static_cast<std::size_t>(fill - 1) * D], D, &old_rows[static_cast<std::size_t>(r) * D]);
          const kv::CodebookSlice book = kv::codebook_slice(to, into, kind, l, kh);
          std::byte* tile = pool_->tile(dst, kind, l, kh);
          if (into.quantized()) {
            kv::encode_tile(into, tl, old_rows.data(), tile, book);  // codes every row
          } else {
            for (int r = 0; r < fill; ++r)
              kv::encode_row(into, tl, &old_rows[static_cast<std::size_t>(r) * D], r, tile);
          }
          if (sums == nullptr) continue;
          kv::decode_tile_scalar(into, tl, tile, T, new_rows.data(), book);
          add_rows(old_rows, &new_rows, row0, row1, D, sums->energy[kind], sums->change[kind]);
        }
    }
  } catch (...) {
    pool_->release(dst);
    throw;
  }
  pool_->set_fill(dst, fill);
  return dst;
}

std::unique_ptr<PooledKvCache> PooledKvCache::recoded(const KvFormat& to, RecodeCost* cost) const {
  QKV_CHECK(!step_);
  if (to.rotate_k != format_.rotate_k || to.rotate_v != format_.rotate_v || to.key_rope != format_.key_rope)
    fail(ErrorCode::invalid_argument,
         "recode: format {} stores keys or values otherwise (rotation, keys=) than this context's {}",
         to.to_string(), format_.to_string());
  if (to.mixed() || to.evicts())
    fail(ErrorCode::invalid_argument, "recode: format {} is not of one precision (no lo=, no budget=)",
         to.to_string());
  const KvShape& s = shape();
  to.validate(s, pool_->block_tokens());
  const int T = pool_->block_tokens(), D = s.head_dim;
  const KvCodec hk = hot_codec(to.k), hv = hot_codec(to.v);
  std::vector<float> rows(static_cast<std::size_t>(T) * D);
  RecodeSums sums;
  RecodeCost c;
  Held held{*pool_, {}};
  std::vector<KvSegment> segments;
  int flat = 0;  // the block's index over the whole context: what block_is_hot ranks
  for (const KvSegment& seg : segments_) {
    KvSegment out{seg.position_offset, {}, seg.first_row, seg.tokens};
    for (std::size_t i = 0; i < seg.blocks.size(); ++i, ++flat) {
      const BlockRef ref = seg.blocks[i];
      const BlockInfo info = pool_->info(ref);
      const int fill = static_cast<int>(info.fill);
      const bool hot = fill < T || to.block_is_hot(flat, size_, T);
      const KvCodec tk = hot ? hk : to.k, tv = hot ? hv : to.v;
      // Rows this context reads of the block: the segment's range within it.
      const int row0 = i == 0 ? seg.first_row : 0;
      const int row1 = std::min(fill, seg.first_row + seg.tokens - static_cast<int>(i) * T);
      if (info.k == tk && info.v == tv) {  // already in place: shared, unchanged
        for (int kind = 0; kind < 2; ++kind)
          for (int l = 0; l < s.n_layers; ++l)
            for (int kh = 0; kh < s.n_kv_heads && pool_->stores_layer(ref, l); ++kh) {
              const KvCodec& from = kind == 0 ? info.k : info.v;
              kv::decode_tile_scalar(from, tile_layout(from, T, D), pool_->tile(ref, kind, l, kh), T,
                                     rows.data(), kv::codebook_slice(format_, from, kind, l, kh));
              add_rows(rows, nullptr, row0, row1, D, sums.energy[kind], sums.change[kind]);
            }
        ++c.blocks_shared;
        out.blocks.push_back(ref);
        continue;
      }
      held.blocks.push_back(recode_block(ref, tk, tv, to, &sums, row0, row1));
      ++c.blocks_recoded;
      out.blocks.push_back(held.blocks.back());
    }
    segments.push_back(std::move(out));
  }
  auto copy = adopt(pool_, to, capacity_, std::move(segments), size_);
  copy->set_position_gap(position_gap_);
  copy->set_rope(rope_);
  c.k_rel_rms = sums.energy[0] > 0 ? std::sqrt(sums.change[0] / sums.energy[0]) : 0;
  c.v_rel_rms = sums.energy[1] > 0 ? std::sqrt(sums.change[1] / sums.energy[1]) : 0;
  if (cost != nullptr) *cost = c;
  return copy;  // `held` drops the recode's own references: the copy holds one each
}

}  // namespace qkvshare
