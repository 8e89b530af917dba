// What a context's producer does to it when it is sealed or handed off, once
// the whole context is known: re-precision of the least attended blocks
// (demote) and dropping them (evict), both ranked by the attention that the
// context's last queries give each block.
#include <algorithm>
#include <cmath>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_kernels.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {

std::vector<double> PooledKvCache::block_importance() const {
  const KvShape& s = shape();
  const int T = pool_->block_tokens(), D = s.head_dim, qd = s.q_dim(), L = s.n_layers;
  const int group = s.n_heads / s.n_kv_heads;
  const std::size_t nb = segments_[0].blocks.size();
  std::vector<double> importance(nb, 0.0);
  std::vector<float> keys(static_cast<std::size_t>(size_) * D), p(static_cast<std::size_t>(size_)), q(static_cast<std::size_t>(D));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int l = 0; l < L; ++l) {
    // A sliding-window layer counts the keys its later queries still see: the
    // last W - 1 (never a block it has left behind, windowed_kept_from()).
    const int W = s.window(l), k0 = W > 0 ? std::max(0, size_ + 1 - W) : 0;
    for (int kh = 0; kh < s.n_kv_heads && k0 < size_; ++kh) {
      read_rows(l, 0, kh, k0, size_ - k0, keys.data());
      for (std::size_t w = 0; w < observed_pos_.size(); ++w) {
        const int n_keys = std::min(observed_pos_[w] + 1, size_) - k0;
        if (n_keys <= 0) continue;
        for (int g = 0; g < group; ++g) {
          const float* src = &observed_[(w * static_cast<std::size_t>(L) + static_cast<std::size_t>(l)) * qd +
                                        static_cast<std::size_t>((kh * group + g) * D)];
          std::copy(src, src + D, q.begin());
          if (format_.rotate_k) kv::rotate(q.data(), D);  // the keys are stored rotated
          const float* k = keys.data();
          for (int j = 0; j < n_keys; ++j)
            p[static_cast<std::size_t>(j)] = kernels::dot_f32(q.data(), k + static_cast<std::size_t>(j) * D, D) * scale;
          kernels::softmax(p.data(), n_keys);
          for (int j = 0; j < n_keys; ++j) importance[static_cast<std::size_t>((k0 + j) / T)] += p[static_cast<std::size_t>(j)];
        }
      }
    }
  }
  return importance;
}

// What the blocks are ranked by: their attention, or nothing to compute for rank=recent.
std::vector<double> PooledKvCache::ranking() const {
  if (format_.rank == KvFormat::Rank::recent) return std::vector<double>(segments_[0].blocks.size(), 0.0);
  return block_importance();
}

// The cold blocks, most attended (or, for rank=recent, newest) first.
std::vector<int> PooledKvCache::cold_by_importance(const std::vector<double>& importance) const {
  const int T = pool_->block_tokens();
  std::vector<int> cold;
  for (int b = 0; b < static_cast<int>(importance.size()); ++b)
    if (!format_.block_is_hot(b, size_, T)) cold.push_back(b);
  if (format_.rank == KvFormat::Rank::recent) {
    std::reverse(cold.begin(), cold.end());
    return cold;
  }
  std::stable_sort(cold.begin(), cold.end(), [&](int a, int b) {
    return importance[static_cast<std::size_t>(a)] > importance[static_cast<std::size_t>(b)];
  });
  return cold;
}

int PooledKvCache::demote() {
  QKV_CHECK(!step_);
  if (!format_.mixed() || segments_.size() != 1 || observed_pos_.empty()) return 0;
  std::vector<BlockRef>& blocks = segments_[0].blocks;
  const std::vector<int> cold = cold_by_importance(ranking());
  // All but the top share of the cold blocks end in the lo codecs.
  int recoded = 0;
  for (std::size_t i = static_cast<std::size_t>(format_.kept_blocks(static_cast<int>(cold.size()))); i < cold.size(); ++i) {
    BlockRef& ref = blocks[static_cast<std::size_t>(cold[i])];
    const BlockInfo info = pool_->info(ref);
    if (info.k != format_.k || info.v != format_.v) continue;  // demoted already
    const BlockRef lo = recode_block(ref, format_.lo_k, format_.lo_v, format_);
    pool_->release(ref);
    ref = lo;
    ++recoded;
  }
  return recoded;
}

std::vector<std::pair<int, int>> PooledKvCache::evict() {
  QKV_CHECK(!step_);
  // Dropping tokens moves later ones back; blocks that left a window behind could come into it again.
  if (!format_.evicts() || segments_.size() != 1 || observed_pos_.empty() || windowed_kept_from() > 0) return {};
  const int T = pool_->block_tokens();
  const std::vector<BlockRef> blocks = segments_[0].blocks;
  const int nb = static_cast<int>(blocks.size());
  if (nb < 3) return {};  // the first and the last block always stay
  // Sinks and the recent window (the format's, and at least a block each) stay.
  std::vector<char> keep(static_cast<std::size_t>(nb), 0);
  keep.front() = keep.back() = 1;
  int kept = 2;
  for (int b = 0; b < nb; ++b)
    if (!keep[static_cast<std::size_t>(b)] && format_.block_is_hot(b, size_, T)) keep[static_cast<std::size_t>(b)] = 1, ++kept;
  const int target = static_cast<int>(std::ceil(format_.budget * nb - 1e-9));
  for (const int b : cold_by_importance(ranking())) {
    if (kept >= target) break;
    if (!keep[static_cast<std::size_t>(b)]) keep[static_cast<std::size_t>(b)] = 1, ++kept;
  }
  if (kept == nb) return {};
  // Each run of kept blocks becomes a segment: where it was computed
  // (offset 0), or moved back over the gaps before it (offset = its new
  // position - the position it was computed at).
  std::vector<KvSegment> segs;
  std::vector<std::pair<int, int>> ranges;
  int placed = 0;
  for (int b = 0; b < nb;) {
    if (!keep[static_cast<std::size_t>(b)]) {
      pool_->release(blocks[static_cast<std::size_t>(b)]);
      ++b;
      continue;
    }
    int e = b;
    while (e < nb && keep[static_cast<std::size_t>(e)]) ++e;
    const int begin = b * T, end = std::min(size_, e * T);
    const int offset = format_.close_positions ? placed - begin : 0;
    segs.push_back(KvSegment{offset, std::vector<BlockRef>(blocks.begin() + b, blocks.begin() + e), 0, end - begin});
    ranges.emplace_back(begin, end);
    placed += end - begin;
    b = e;
  }
  // As adopt() leaves a context whose last segment was moved: new tokens go
  // to a fresh tail; a last run left in place stays the writable tail.
  if (segs.back().position_offset != 0) segs.push_back(KvSegment{0, {}, 0, 0});
  if (!format_.close_positions) position_gap_ += size_ - placed;
  segments_ = std::move(segs);
  size_ = placed;
  base_ = size_ - segments_.back().tokens;
  observed_.clear();
  observed_pos_.clear();
  return ranges;
}

bool PooledKvCache::code_tail() {
  QKV_CHECK(!step_);
  const KvSegment& seg = segments_.back();
  if (!format_.cold_tail || seg.blocks.empty()) return false;
  const int T = pool_->block_tokens();
  const BlockRef ref = seg.blocks.back();
  const BlockInfo info = pool_->info(ref);
  if (static_cast<int>(info.fill) >= T || info.k.quantized() || info.v.quantized()) return false;
  // Hot for another reason than being partly filled: a sink (only the first segment holds the context's first tokens).
  const int block = static_cast<int>(seg.blocks.size()) - 1;
  if (segments_.size() == 1 && format_.block_is_hot(block, (block + 1) * T, T)) return false;
  const BlockRef coded = recode_block(ref, format_.k, format_.v, format_);
  pool_->release(ref);
  segments_.back().blocks.back() = coded;
  return true;
}

}  // namespace qkvshare
