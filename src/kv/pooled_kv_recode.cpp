// A sealed context copied into fewer (or more) bits: the memory tiers'
// demotion (tiers/context_tiers.hpp). Each block goes through f32 rows, the
// same path as demote()'s recode of a mixed format's cold blocks, and the
// change it makes to what attention reads is measured as it is made.
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
}  // namespace

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
  std::vector<float> old_rows(static_cast<std::size_t>(T) * D), new_rows(old_rows.size());
  double err[2] = {0, 0}, energy[2] = {0, 0};
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
      const bool same = info.k == tk && info.v == tv;
      const BlockRef dst = same ? ref : pool_->allocate(tk, tv, block_flags(), info.key_position);
      if (!same) held.blocks.push_back(dst);
      for (int kind = 0; kind < 2; ++kind) {
        const KvCodec& from = kind == 0 ? info.k : info.v;
        const KvCodec& into = kind == 0 ? tk : tv;
        const TileLayout fl = tile_layout(from, T, D), tl = tile_layout(into, T, D);
        for (int l = 0; l < s.n_layers; ++l)
          for (int kh = 0; kh < s.n_kv_heads; ++kh) {
            kv::decode_tile_scalar(from, fl, pool_->tile(ref, kind, l, kh), T, old_rows.data(),
                                   kv::codebook_slice(format_, from, kind, l, kh));
            if (same) {
              for (int r = row0; r < row1; ++r)
                for (int d = 0; d < D; ++d) energy[kind] += double(old_rows[std::size_t(r) * D + d]) * old_rows[std::size_t(r) * D + d];
              continue;
            }
            const kv::CodebookSlice book = kv::codebook_slice(to, into, kind, l, kh);
            if (into.quantized()) {
              kv::encode_tile(into, tl, old_rows.data(), pool_->tile(dst, kind, l, kh), book);
            } else {
              for (int r = 0; r < fill; ++r) kv::encode_row(into, tl, &old_rows[std::size_t(r) * D], r, pool_->tile(dst, kind, l, kh));
            }
            kv::decode_tile_scalar(into, tl, pool_->tile(dst, kind, l, kh), T, new_rows.data(), book);
            for (int r = row0; r < row1; ++r)
              for (int d = 0; d < D; ++d) {
                const double o = old_rows[std::size_t(r) * D + d], n = new_rows[std::size_t(r) * D + d];
                energy[kind] += o * o;
                err[kind] += (n - o) * (n - o);
              }
          }
      }
      if (!same) pool_->set_fill(dst, fill);
      ++(same ? c.blocks_shared : c.blocks_recoded);
      out.blocks.push_back(dst);
    }
    segments.push_back(std::move(out));
  }
  auto copy = adopt(pool_, to, capacity_, std::move(segments), size_);
  copy->set_position_gap(position_gap_);
  copy->set_rope(rope_);
  c.k_rel_rms = energy[0] > 0 ? std::sqrt(err[0] / energy[0]) : 0;
  c.v_rel_rms = energy[1] > 0 ? std::sqrt(err[1] / energy[1]) : 0;
  if (cost != nullptr) *cost = c;
  return copy;  // `held` drops the recode's own references: the copy holds one each
}

}  // namespace qkvshare
