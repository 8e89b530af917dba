#include "qkvshare/kv/pooled_kv_cache.hpp"

#include <algorithm>
#include <cstring>

#include "kv_attention.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_kernels.hpp"

namespace qkvshare {

// Blocks this pass writes: `dst` receives rows; `src` holds the committed rows
// [0, old_rows) (the same block when it is written in place).
struct PooledKvCache::Step {
  struct Work {
    int block = 0;
    BlockRef dst, src;
    KvCodec dk, dv, sk, sv;
    bool fresh = false;  // dst was allocated by this pass
  };
  int n = 0;
  int next_layer = 0;
  std::vector<BlockRef> view;  // the table as attention reads it during the pass
  std::vector<KvCodec> view_k, view_v;
  std::vector<Work> work;
  std::vector<float> rows;  // one tile of rows being requantized
};

PooledKvCache::PooledKvCache(std::shared_ptr<KvPool> pool, const KvFormat& format, int capacity)
    : pool_(std::move(pool)), format_(format), capacity_(capacity) {
  if (!pool_) fail(ErrorCode::invalid_argument, "pooled KV cache: no pool");
  if (capacity <= 0) fail(ErrorCode::invalid_argument, "KV cache capacity must be positive, got {}", capacity);
  format_.validate(pool_->shape(), pool_->block_tokens());
  segments_.push_back(KvSegment{});
}

PooledKvCache::~PooledKvCache() {
  discard_step();
  for (const KvSegment& s : segments_)
    for (BlockRef b : s.blocks) pool_->release(b);
}

std::unique_ptr<PooledKvCache> PooledKvCache::fork() const {
  QKV_CHECK(!step_);
  auto copy = std::make_unique<PooledKvCache>(pool_, format_, capacity_);
  copy->segments_ = segments_;
  for (const KvSegment& s : copy->segments_)
    for (BlockRef b : s.blocks) pool_->retain(b);
  copy->size_ = size_;
  copy->path_ = path_;
  return copy;
}

std::unique_ptr<PooledKvCache> PooledKvCache::adopt(std::shared_ptr<KvPool> pool, const KvFormat& format, int capacity,
                                                    std::vector<KvSegment> segments, int tokens) {
  auto cache = std::make_unique<PooledKvCache>(pool, format, capacity);
  const int T = pool->block_tokens();
  std::size_t blocks = 0;
  for (const KvSegment& s : segments) {
    if (s.position_offset != 0) fail(ErrorCode::unsupported, "adopt: segments at a position offset (splice) are not supported yet");
    blocks += s.blocks.size();
  }
  if (tokens < 0 || tokens > capacity || blocks != static_cast<std::size_t>((tokens + T - 1) / T))
    fail(ErrorCode::invalid_argument, "adopt: {} blocks of {} tokens cannot hold {} tokens (capacity {})", blocks, T,
         tokens, capacity);
  // Take the references one by one; the destructor gives back those taken if a check fails.
  cache->segments_.assign(1, KvSegment{});
  std::vector<BlockRef>& table = cache->segments_[0].blocks;
  const KvCodec hk = hot_codec(format.k), hv = hot_codec(format.v);
  for (const KvSegment& s : segments)
    for (const BlockRef b : s.blocks) {
      if (!pool->try_retain(b))
        fail(ErrorCode::bad_descriptor, "adopt: block {} (generation {}) is no longer live", b.index, b.generation);
      table.push_back(b);
      const BlockInfo info = pool->info(b);
      const bool partial = static_cast<int>(table.size()) * T > tokens;  // only rows coded one by one can be partial
      if ((info.k != format.k && info.k != hk) || (info.v != format.v && info.v != hv) ||
          info.flags != cache->block_flags() || (partial && (info.k.quantized() || info.v.quantized())))
        fail(ErrorCode::invalid_argument, "adopt: block {} holds codecs {:#x}/{:#x} (flags {}), not format {}", b.index,
             info.k.pack(), info.v.pack(), info.flags, format.to_string());
    }
  cache->size_ = tokens;
  return cache;
}

int PooledKvCache::block_count() const noexcept {
  int n = 0;
  for (const KvSegment& s : segments_) n += static_cast<int>(s.blocks.size());
  return n;
}

BlockRef PooledKvCache::table_at(int b) const noexcept {
  for (const KvSegment& s : segments_) {
    if (b < static_cast<int>(s.blocks.size())) return s.blocks[static_cast<std::size_t>(b)];
    b -= static_cast<int>(s.blocks.size());
  }
  return {};
}

std::uint32_t PooledKvCache::block_flags() const noexcept {
  return (format_.rotate_k ? kBlockRotatedK : 0u) | (format_.rotate_v ? kBlockRotatedV : 0u);
}

std::size_t PooledKvCache::kv_bytes() const {
  std::size_t total = 0;
  for (const KvSegment& s : segments_)
    for (BlockRef b : s.blocks) total += pool_->block_bytes(b);
  return total;
}

void PooledKvCache::discard_step() noexcept {
  if (!step_) return;
  for (const Step::Work& w : step_->work)
    if (w.fresh) pool_->release(w.dst);
  step_.reset();
}

void PooledKvCache::plan(int n) {
  const int T = pool_->block_tokens(), total = size_ + n;
  const int old_blocks = block_count(), new_blocks = (total + T - 1) / T;
  auto step = std::make_unique<Step>();
  step->n = n;
  step->view.resize(static_cast<std::size_t>(new_blocks));
  step->view_k.resize(static_cast<std::size_t>(new_blocks));
  step->view_v.resize(static_cast<std::size_t>(new_blocks));
  const KvCodec hk = hot_codec(format_.k), hv = hot_codec(format_.v);
  const bool converts = hk != format_.k || hv != format_.v;
  try {
    for (int b = 0; b < new_blocks; ++b) {
      const bool hot = format_.block_is_hot(b, total, T);
      const KvCodec tk = hot ? hk : format_.k, tv = hot ? hv : format_.v;
      const bool touched = (b + 1) * T > size_;
      Step::Work w{b, {}, {}, tk, tv, tk, tv, false};
      if (b < old_blocks) {
        const BlockRef cur = table_at(b);
        const BlockInfo info = pool_->info(cur);
        step->view[static_cast<std::size_t>(b)] = cur;
        step->view_k[static_cast<std::size_t>(b)] = info.k;
        step->view_v[static_cast<std::size_t>(b)] = info.v;
        const bool requantize = converts && (info.k != tk || info.v != tv);
        if (!touched && !requantize) continue;
        w.src = cur;
        w.sk = info.k;
        w.sv = info.v;
        if (!requantize && info.refcount == 1) {
          w.dst = cur;  // the tail, written in place
          step->work.push_back(w);
          continue;
        }
      }
      w.dst = pool_->allocate(tk, tv, block_flags());
      w.fresh = true;
      step->work.push_back(w);
      step->view[static_cast<std::size_t>(b)] = w.dst;
      step->view_k[static_cast<std::size_t>(b)] = tk;
      step->view_v[static_cast<std::size_t>(b)] = tv;
    }
  } catch (const Error& e) {
    for (const Step::Work& w : step->work)
      if (w.fresh) pool_->release(w.dst);
    if (e.code() != ErrorCode::out_of_memory) throw;
    fail(ErrorCode::out_of_memory, "{} (storing {} more tokens in a {}-token context, format {})", e.what(), n, size_,
         format_.to_string());
  }
  step_ = std::move(step);
}

void PooledKvCache::write(int layer, int n, const float* k, const float* v) {
  const KvShape& s = shape();
  QKV_CHECK(layer >= 0 && layer < s.n_layers && n > 0);
  if (layer == 0) {
    discard_step();  // a pass that failed before commit(): its blocks go back
    if (size_ + n > capacity_)
      fail(ErrorCode::context_full, "KV cache full: {} + {} tokens exceed its capacity of {}", size_, n, capacity_);
    plan(n);
  }
  QKV_CHECK(step_ && step_->n == n && step_->next_layer == layer);
  const int D = s.head_dim, kvd = s.kv_dim();
  if (format_.rotate_k || format_.rotate_v) {
    rotated_.resize(static_cast<std::size_t>(n) * static_cast<std::size_t>(kvd) * 2);
    float* rk = rotated_.data();
    float* rv = rk + static_cast<std::size_t>(n) * static_cast<std::size_t>(kvd);
    std::memcpy(rk, k, sizeof(float) * static_cast<std::size_t>(n) * static_cast<std::size_t>(kvd));
    std::memcpy(rv, v, sizeof(float) * static_cast<std::size_t>(n) * static_cast<std::size_t>(kvd));
    for (int i = 0; i < n * s.n_kv_heads; ++i) {
      if (format_.rotate_k) kv::rotate(rk + static_cast<std::ptrdiff_t>(i) * D, D);
      if (format_.rotate_v) kv::rotate(rv + static_cast<std::ptrdiff_t>(i) * D, D);
    }
    k = rk;
    v = rv;
  }
  for (std::size_t i = 0; i < step_->work.size(); ++i) write_block(layer, static_cast<int>(i), k, v, n);
  step_->next_layer = layer + 1;
}

// Stores this layer's rows of one work block: committed rows from src, new
// rows from the input, coded in dst's codec.
void PooledKvCache::write_block(int layer, int wi, const float* k, const float* v, int n) {
  const KvShape& s = shape();
  const Step::Work& w = step_->work[static_cast<std::size_t>(wi)];
  const int T = pool_->block_tokens(), D = s.head_dim, kvd = s.kv_dim();
  const int first = w.block * T;
  const int old_rows = std::clamp(size_ - first, 0, T), end_rows = std::clamp(size_ + n - first, 0, T);
  std::vector<float>& rows = step_->rows;
  rows.resize(static_cast<std::size_t>(T) * static_cast<std::size_t>(D));
  for (int kind = 0; kind < 2; ++kind) {
    const KvCodec& dc = kind == 0 ? w.dk : w.dv;
    const KvCodec& sc = kind == 0 ? w.sk : w.sv;
    const TileLayout dl = tile_layout(dc, T, D);
    const float* input = kind == 0 ? k : v;
    for (int h = 0; h < s.n_kv_heads; ++h) {
      std::byte* dst = pool_->tile(w.dst, kind, layer, h);
      // Input row of block row r (r >= old_rows: a token of this pass).
      const auto in_row = [&](int r) { return input + static_cast<std::ptrdiff_t>(first + r - size_) * kvd + h * D; };
      if (w.dst == w.src) {  // in place: only the new rows
        for (int r = old_rows; r < end_rows; ++r) kv::encode_row(dc, dl, in_row(r), r, dst);
        continue;
      }
      if (old_rows > 0)
        kv::decode_tile_scalar(sc, tile_layout(sc, T, D), pool_->tile(w.src, kind, layer, h), old_rows, rows.data());
      for (int r = old_rows; r < end_rows; ++r)
        std::memcpy(&rows[static_cast<std::size_t>(r) * D], in_row(r), sizeof(float) * static_cast<std::size_t>(D));
      if (dc.quantized()) {
        QKV_CHECK(end_rows == T);  // only full blocks are quantized
        kv::encode_tile(dc, dl, rows.data(), dst);
      } else {
        for (int r = 0; r < end_rows; ++r) kv::encode_row(dc, dl, &rows[static_cast<std::size_t>(r) * D], r, dst);
      }
    }
  }
}

AttendWork& PooledKvCache::plan_attend(int layer, int n, const float* q, float* out) {
  const KvShape& s = shape();
  QKV_CHECK(step_ && step_->n == n && step_->next_layer == layer + 1);
  for (const KvSegment& seg : segments_) QKV_CHECK(seg.position_offset == 0);  // splice is not there yet
  const int blocks = static_cast<int>(step_->view.size());
  std::vector<const std::byte*>& tiles = attend_tiles_;
  tiles.resize(static_cast<std::size_t>(blocks) * static_cast<std::size_t>(s.n_kv_heads) * 2);
  const std::size_t half = tiles.size() / 2;
  for (int b = 0; b < blocks; ++b)
    for (int h = 0; h < s.n_kv_heads; ++h) {
      const std::size_t i = static_cast<std::size_t>(b) * s.n_kv_heads + h;
      tiles[i] = pool_->tile(step_->view[static_cast<std::size_t>(b)], 0, layer, h);
      tiles[half + i] = pool_->tile(step_->view[static_cast<std::size_t>(b)], 1, layer, h);
    }
  kv::AttendInput in;
  in.shape = s;
  in.block_tokens = pool_->block_tokens();
  in.n_blocks = blocks;
  in.first_pos = size_;
  in.n = n;
  in.q = q;
  in.out = out;
  in.k_tiles = tiles.data();
  in.v_tiles = tiles.data() + half;
  in.k_codecs = step_->view_k.data();
  in.v_codecs = step_->view_v.data();
  in.rotate_k = format_.rotate_k;
  in.rotate_v = format_.rotate_v;
  if (!attend_work_) attend_work_ = std::make_unique<kv::BlockAttend>();
  attend_work_->prepare(in, path_);
  return *attend_work_;
}

void PooledKvCache::commit(int n) {
  if (n == 0 && !step_) return;
  QKV_CHECK(step_ && step_->n == n && step_->next_layer == shape().n_layers);
  const int T = pool_->block_tokens();
  for (const Step::Work& w : step_->work) {
    pool_->set_fill(w.dst, std::clamp(size_ + n - w.block * T, 0, T));
    if (w.fresh && w.src.valid()) pool_->release(w.src);
  }
  // One segment at offset 0 until splice exists.
  segments_.assign(1, KvSegment{0, step_->view});
  size_ += n;
  step_.reset();
}

}  // namespace qkvshare
