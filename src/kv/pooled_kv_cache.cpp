#include "qkvshare/kv/pooled_kv_cache.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "background_worker.hpp"
#include "kv_attention.hpp"
#include "rope_table.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"
#include "qkvshare/kv/block_checksums.hpp"
#include "qkvshare/kv/kv_kernels.hpp"

namespace qkvshare {

namespace kv {

// Attention over several segments as one AttendWork: one BlockAttend per
// segment (frozen segments are seen whole by every query, the tail causally),
// each reading its keys with the query rotated back by the segment's offset,
// so that (R(-d) q(m)) . k(n) = q(m) . R(d) k(n) puts them at their new
// positions; each writes softmax pieces, and finish() merges them as split-K
// decode does (weights exp(m - M)).
class SegmentAttend final : public AttendWork {
 public:
  struct Part {
    BlockAttend work;
    std::vector<const std::byte*> tiles;
    std::vector<KvCodec> codecs;
    std::vector<float> q;  // the rotated query, when the offset is not 0
    std::vector<int> pos;  // keys=pre|block: each block's key position
  };
  std::vector<Part> parts;
  std::size_t used = 0;  // parts of the current plan
  std::vector<float> ml, po;
  std::vector<std::size_t> first_job;  // [used + 1]
  float* out = nullptr;
  std::size_t slots = 0;
  int head_dim = 0;
  bool rotate_v = false;

  std::size_t jobs() const noexcept override { return first_job[used]; }
  double job_cost() const noexcept override {
    double c = 0;
    for (std::size_t i = 0; i < used; ++i) c += parts[i].work.job_cost() * static_cast<double>(parts[i].work.jobs());
    return jobs() == 0 ? 0.0 : c / static_cast<double>(jobs());
  }
  void run(std::size_t job) override {
    const std::size_t i =
        static_cast<std::size_t>(std::upper_bound(first_job.begin(), first_job.begin() + static_cast<std::ptrdiff_t>(used) + 1, job) -
                                 first_job.begin()) - 1;
    parts[i].work.run(job - first_job[i]);
  }
  void finish() override {
    for (std::size_t i = 0; i < used; ++i) parts[i].work.finish();
    const int D = head_dim;
    for (std::size_t slot = 0; slot < slots; ++slot) {
      float M = -std::numeric_limits<float>::infinity();
      for (std::size_t si = 0; si < used; ++si)
        if (ml[(si * slots + slot) * 2 + 1] > 0.0f) M = std::max(M, ml[(si * slots + slot) * 2]);
      float* dst = out + slot * static_cast<std::size_t>(D);
      std::fill(dst, dst + D, 0.0f);
      float L = 0.0f;
      for (std::size_t si = 0; si < used; ++si) {
        const float m = ml[(si * slots + slot) * 2], l = ml[(si * slots + slot) * 2 + 1];
        if (l == 0.0f) continue;
        const float w = std::exp(m - M);
        L += w * l;
        const float* o = &po[(si * slots + slot) * static_cast<std::size_t>(D)];
        for (int c = 0; c < D; ++c) dst[c] += w * o[c];
      }
      const float inv = 1.0f / L;
      for (int c = 0; c < D; ++c) dst[c] *= inv;
      if (rotate_v) unrotate(dst, D);
    }
  }
};

}  // namespace kv

// Blocks this pass writes: `dst` receives rows; `src` holds the committed rows
// [0, old_rows) (the same block when it is written in place).
struct PooledKvCache::Step {
  struct Work {
    int block = 0;
    BlockRef dst, src;
    KvCodec dk, dv, sk, sv;
    bool fresh = false;  // dst was allocated by this pass
    int slot = -1;       // its pass copy in pass_tiles (PassPrecision::full), or -1
    int key_pos = 0;     // BlockInfo::key_position
    int deferred = -1;   // its place in deferred_rows_ when quantized in the background
  };
  int n = 0;
  int next_layer = 0;
  std::vector<BlockRef> view;  // the table as attention reads it during the pass
  std::vector<KvCodec> view_k, view_v;  // the codecs attention reads (the pass copy's, where there is one)
  std::vector<int> view_slot;  // per view block and kind (K, V): its pass copy, or -1
  std::vector<int> view_pos;   // per view block: the position its row 0 was computed at
  std::vector<Work> work;
  std::vector<float> rows;  // one tile of rows being requantized
  // Pass copies of the current layer: [slot][kind][kv_head] tiles of the hot codec,
  // for the blocks that this pass quantizes and that hold tokens of this pass.
  std::vector<std::byte> pass_tiles;
  std::size_t pass_tile_bytes = 0;  // one tile, the larger of K's and V's hot layout
  int slots = 0;
  // Mixed formats: this pass's last queries, [obs_rows][n_layers][q_dim], kept at commit().
  std::vector<float> obs;
  int obs_rows = 0;

  std::byte* pass_copy(int slot, int kind, int kv_head, int n_kv_heads) {
    const auto i = (static_cast<std::size_t>(slot) * 2 + static_cast<std::size_t>(kind)) *
                       static_cast<std::size_t>(n_kv_heads) + static_cast<std::size_t>(kv_head);
    return pass_tiles.data() + i * pass_tile_bytes;
  }
};

namespace {
std::atomic<PassPrecision> g_pass_precision{PassPrecision::full};
std::atomic<bool> g_free_windowed{true};
std::atomic<bool> g_background_quantization{true};
// Decode steps fill one block per session at a time; a prefill chunk that fills
// many quantizes them itself (the rows kept for the worker would be the chunk's size).
constexpr int kDeferredBlocks = 2;
}

void set_default_pass_precision(PassPrecision p) noexcept { g_pass_precision.store(p, std::memory_order_relaxed); }
PassPrecision default_pass_precision() noexcept { return g_pass_precision.load(std::memory_order_relaxed); }
void set_free_windowed_layers(bool on) noexcept { g_free_windowed.store(on, std::memory_order_relaxed); }
bool free_windowed_layers_enabled() noexcept { return g_free_windowed.load(std::memory_order_relaxed); }
void set_background_quantization(bool on) noexcept { g_background_quantization.store(on, std::memory_order_relaxed); }
bool background_quantization() noexcept { return g_background_quantization.load(std::memory_order_relaxed); }

PooledKvCache::PooledKvCache(std::shared_ptr<KvPool> pool, const KvFormat& format, int capacity)
    : pool_(std::move(pool)), format_(format), capacity_(capacity) {
  if (!pool_) fail(ErrorCode::invalid_argument, "pooled KV cache: no pool");
  if (capacity <= 0) fail(ErrorCode::invalid_argument, "KV cache capacity must be positive, got {}", capacity);
  format_.validate(pool_->shape(), pool_->block_tokens());
  segments_.push_back(KvSegment{0, {}, 0, 0});
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
  copy->base_ = base_;
  copy->position_gap_ = position_gap_;
  copy->rope_ = rope_;
  copy->path_ = path_;
  copy->pass_precision_ = pass_precision_;
  copy->observed_ = observed_;
  copy->observed_pos_ = observed_pos_;
  copy->window_scan_ = window_scan_;
  return copy;
}

std::unique_ptr<PooledKvCache> PooledKvCache::adopt(std::shared_ptr<KvPool> pool, const KvFormat& format, int capacity,
                                                    std::vector<KvSegment> segments, int tokens) {
  auto cache = std::make_unique<PooledKvCache>(pool, format, capacity);
  const int T = pool->block_tokens();
  if (tokens < 0 || tokens > capacity)
    fail(ErrorCode::invalid_argument, "adopt: {} tokens do not fit a capacity of {}", tokens, capacity);
  // Token counts: a segment without one holds the rest.
  long long known = 0;
  int open = 0;
  for (const KvSegment& s : segments) {
    if (s.tokens < 0) ++open; else known += s.tokens;
  }
  if (open > 1 || known > tokens || (open == 0 && known != tokens))
    fail(ErrorCode::invalid_argument, "adopt: segment token counts do not add up to {} tokens", tokens);
  for (KvSegment& s : segments) {
    if (s.tokens < 0) s.tokens = tokens - static_cast<int>(known);
    if (s.first_row < 0 || s.first_row >= T ||
        s.blocks.size() != static_cast<std::size_t>((s.first_row + s.tokens + T - 1) / T))
      fail(ErrorCode::invalid_argument, "adopt: {} blocks of {} tokens cannot hold {} tokens from row {} (capacity {})",
           s.blocks.size(), T, s.tokens, s.first_row, capacity);
  }
  // The last segment stays writable when it sits where it was computed.
  const bool tail = !segments.empty() && segments.back().position_offset == 0 && segments.back().first_row == 0;
  // Take the references one by one; the destructor gives back those taken if a check fails.
  cache->segments_.clear();
  const KvCodec hk = hot_codec(format.k), hv = hot_codec(format.v);
  for (const KvSegment& s : segments) {
    cache->segments_.push_back(KvSegment{s.position_offset, {}, s.first_row, s.tokens});
    std::vector<BlockRef>& table = cache->segments_.back().blocks;
    for (const BlockRef b : s.blocks) {
      if (!pool->try_retain(b))
        fail(ErrorCode::bad_descriptor, "adopt: block {} (generation {}) is no longer live", b.index, b.generation);
      table.push_back(b);
      const BlockInfo info = pool->info(b);
      const int rows_used = std::min(T, s.first_row + s.tokens - (static_cast<int>(table.size()) - 1) * T);
      // Only rows coded one by one can be partly filled, and a segment's last block coded whole (code_tail).
      const bool partial = static_cast<int>(info.fill) < T;
      const bool coded_tail = table.size() == s.blocks.size() && info.k == format.k && info.v == format.v;
      if ((!format.demoted(info.k, info.v) && ((info.k != format.k && info.k != hk) || (info.v != format.v && info.v != hv))) ||
          (info.flags & ~kBlockWindowFreed) != cache->block_flags() || static_cast<int>(info.fill) < rows_used ||
          (partial && (info.k.quantized() || info.v.quantized()) && !coded_tail))
        fail(ErrorCode::invalid_argument, "adopt: block {} holds codecs {:#x}/{:#x} (flags {}, {} rows), not format {}",
             b.index, info.k.pack(), info.v.pack(), info.flags, info.fill, format.to_string());
    }
  }
  cache->require_windows(cache->segments_, tokens, "adopt");
  if (!tail) cache->segments_.push_back(KvSegment{0, {}, 0, 0});
  cache->size_ = tokens;
  cache->base_ = tokens - cache->segments_.back().tokens;
  return cache;
}

std::uint32_t PooledKvCache::block_flags() const noexcept {
  return (format_.rotate_k ? kBlockRotatedK : 0u) | (format_.rotate_v ? kBlockRotatedV : 0u) |
         (static_cast<std::uint32_t>(format_.key_rope) << 2);
}

void PooledKvCache::set_rope(const KvRope& rope) {
  if (rope == rope_) return;
  if (rope.layered() && static_cast<int>(rope.local_layers.size()) != shape().n_layers)
    fail(ErrorCode::invalid_argument, "RoPE of {} layers for a context of {}", rope.local_layers.size(), shape().n_layers);
  rope_ = rope;
  rope_table_.reset();
  rope_table_local_.reset();
}

void PooledKvCache::set_key_rope(kv::AttendInput& in, const int* positions, const float* table,
                                 const float* inverse) const {
  in.k_positions = positions;
  in.rope_table = table;
  in.rope_inverse = inverse;
  in.keys_relative = format_.key_rope == KeyRope::block;
  in.rope_style = rope_.style;
}

const float* PooledKvCache::rope_table(int layer, int end_position, bool inverse) const {
  const int D = shape().head_dim;
  const std::vector<float>& freq = rope_.freq(layer);
  if (static_cast<int>(freq.size()) * 2 != D)
    fail(ErrorCode::invalid_argument, "KV format {}: keys stored before RoPE need the model's RoPE frequencies "
         "(set_rope; the engine gives them before each pass)", format_.to_string());
  std::shared_ptr<const kv::RopeTable>& table = &freq == &rope_.inv_freq ? rope_table_ : rope_table_local_;
  if (!table || table->positions() < end_position)
    table = kv::RopeTable::at_least(KvRope{freq, rope_.style, {}, {}}, end_position);
  return inverse ? table->inverse_rows() : table->rows();
}

int PooledKvCache::windowed_kept_from(const std::vector<KvSegment>& segments) const {
  const int T = pool_->block_tokens();
  int from = 0, seg_start = 0;
  for (const KvSegment& seg : segments) {
    for (std::size_t b = 0; b < seg.blocks.size(); ++b)
      if ((pool_->info(seg.blocks[b]).flags & kBlockWindowFreed) != 0)
        from = std::max(from, seg_start + std::min(seg.tokens, (static_cast<int>(b) + 1) * T - seg.first_row));
    seg_start += std::max(seg.tokens, 0);
  }
  return from;
}

void PooledKvCache::require_windows(const std::vector<KvSegment>& segments, int tokens, std::string_view what) const {
  const int from = windowed_kept_from(segments), W = shape().max_window();
  // A block left behind at token index L is never read again once L <= tokens - W.
  if (from > 0 && from > tokens - W + 1)
    fail(ErrorCode::invalid_argument,
         "{}: tokens before index {} kept only the global layers' KV (they had left the {}-token sliding window); a "
         "context of {} tokens needs the windowed layers' KV of its last {} tokens: re-prefill them",
         what, from, W, tokens, W);
}

void PooledKvCache::free_windowed_layers() {
  if (!pool_->frees_windowed() || format_.evicts() || !free_windowed_layers_enabled()) return;
  const KvShape& s = shape();
  const int T = pool_->block_tokens();
  // Tokens before index `dead` are read by the global layers alone from now on.
  const int dead = size_ + 1 - s.max_window();
  if (dead < T || dead / T == window_scan_) return;  // no block crossed the window's start since the last scan
  window_scan_ = dead / T;
  int seg_start = 0;
  for (KvSegment& seg : segments_) {
    for (std::size_t b = 0; b < seg.blocks.size(); ++b) {
      if (seg_start + std::min(seg.tokens, (static_cast<int>(b) + 1) * T - seg.first_row) > dead) break;
      BlockRef& ref = seg.blocks[b];
      const BlockInfo info = pool_->info(ref);
      // A shared block stays whole: another context may still be within its window.
      if ((info.flags & kBlockWindowFreed) != 0 || info.refcount != 1 || static_cast<int>(info.fill) != T) continue;
      BlockRef lean;
      try {
        lean = pool_->without_windowed_layers(ref);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::out_of_memory) throw;
        window_scan_ = 0;  // no room for the copy now: a later commit tries again
        return;
      }
      pool_->release(ref);
      ref = lean;
      kv::checksum_later(pool_, lean);
    }
    seg_start += std::max(seg.tokens, 0);
  }
}

std::size_t PooledKvCache::kv_bytes() const {
  std::size_t total = 0;
  for (const KvSegment& s : segments_)
    for (BlockRef b : s.blocks) total += pool_->block_bytes(b);
  return total;
}

void PooledKvCache::settle_quantization() noexcept {
  if (deferred_ticket_ == 0) return;
  kv::BackgroundWorker::get(kv::BackgroundWorker::Purpose::quantization).wait(deferred_ticket_);
  deferred_ticket_ = 0;
}

void PooledKvCache::discard_step() noexcept {
  settle_quantization();  // the worker may still write into this pass's blocks
  if (!step_) return;
  for (const Step::Work& w : step_->work)
    if (w.fresh) pool_->release(w.dst);
  step_.reset();
}

void PooledKvCache::plan(int n) {
  // Only the tail segment is written; everything here is in its own indices.
  const std::vector<BlockRef>& tail = segments_.back().blocks;
  const int T = pool_->block_tokens(), done = size_ - base_, total = done + n;
  const int old_blocks = static_cast<int>(tail.size()), new_blocks = (total + T - 1) / T;
  KvFormat hot_format = format_;
  if (base_ > 0) hot_format.sink = 0;  // attention sinks are the context's first tokens, not the tail's
  auto step = std::make_unique<Step>();
  step->n = n;
  step->view.resize(static_cast<std::size_t>(new_blocks));
  step->view_k.resize(static_cast<std::size_t>(new_blocks));
  step->view_v.resize(static_cast<std::size_t>(new_blocks));
  step->view_pos.resize(static_cast<std::size_t>(new_blocks));
  const KvCodec hk = hot_codec(format_.k), hv = hot_codec(format_.v);
  const bool converts = hk != format_.k || hv != format_.v;
  try {
    for (int b = 0; b < new_blocks; ++b) {
      const bool hot = hot_format.block_is_hot(b, total, T);
      const KvCodec tk = hot ? hk : format_.k, tv = hot ? hv : format_.v;
      const bool touched = (b + 1) * T > done;
      Step::Work w{b, {}, {}, tk, tv, tk, tv, false};
      w.key_pos = next_position() + b * T - done;  // row 0 is this pass's token b * T - done
      std::uint32_t freed = 0;  // a block recoded keeps the layers it has
      if (b < old_blocks) {
        const BlockRef cur = tail[static_cast<std::size_t>(b)];
        const BlockInfo info = pool_->info(cur);
        freed = info.flags & kBlockWindowFreed;
        w.key_pos = info.key_position;
        step->view_pos[static_cast<std::size_t>(b)] = info.key_position;
        step->view[static_cast<std::size_t>(b)] = cur;
        step->view_k[static_cast<std::size_t>(b)] = info.k;
        step->view_v[static_cast<std::size_t>(b)] = info.v;
        const bool settled = (info.k == tk && info.v == tv) || (!hot && format_.demoted(info.k, info.v));
        const bool requantize = converts && !settled;
        if (!touched && !requantize) continue;
        w.src = cur;
        w.sk = info.k;
        w.sv = info.v;
        // A partly filled block coded whole (code_tail) is never written in place: its rows are decoded into a new one.
        const bool coded_partial = static_cast<int>(info.fill) < T && (info.k.quantized() || info.v.quantized());
        if (!requantize && info.refcount == 1 && !coded_partial) {
          w.dst = cur;  // the tail, written in place
          step->work.push_back(w);
          continue;
        }
      }
      w.dst = pool_->allocate(tk, tv, block_flags() | freed, w.key_pos);
      w.fresh = true;
      step->view_pos[static_cast<std::size_t>(b)] = w.key_pos;
      // A block this pass quantizes and puts its own tokens in: the pass reads a hot copy.
      const bool pass_copy =
          pass_precision_ == PassPrecision::full && touched && (tk.quantized() || tv.quantized());
      if (pass_copy) w.slot = step->slots++;
      step->work.push_back(w);
      step->view[static_cast<std::size_t>(b)] = w.dst;
      step->view_k[static_cast<std::size_t>(b)] = pass_copy ? hk : tk;
      step->view_v[static_cast<std::size_t>(b)] = pass_copy ? hv : tv;
    }
  } catch (const Error& e) {
    for (const Step::Work& w : step->work)
      if (w.fresh) pool_->release(w.dst);
    if (e.code() != ErrorCode::out_of_memory) throw;
    fail(ErrorCode::out_of_memory, "{} (storing {} more tokens in a {}-token context, format {})", e.what(), n, size_,
         format_.to_string());
  }
  step->view_slot.assign(static_cast<std::size_t>(new_blocks) * 2, -1);
  for (const Step::Work& w : step->work) {
    if (w.slot < 0) continue;  // a kind stored hot is read where it is stored
    if (w.dk.quantized()) step->view_slot[static_cast<std::size_t>(w.block) * 2] = w.slot;
    if (w.dv.quantized()) step->view_slot[static_cast<std::size_t>(w.block) * 2 + 1] = w.slot;
  }
  // Blocks this pass fills whose hot copies it reads: quantized in the background.
  int deferred = 0;
  if (background_quantization()) {
    for (const Step::Work& w : step->work)
      deferred += w.slot >= 0 && w.dst != w.src ? 1 : 0;
    if (deferred > kDeferredBlocks) deferred = 0;
  }
  if (deferred > 0) {
    int next = 0;
    for (Step::Work& w : step->work)
      if (w.slot >= 0 && w.dst != w.src) w.deferred = next++;
    const KvShape& s = shape();
    deferred_rows_.resize(static_cast<std::size_t>(deferred) * static_cast<std::size_t>(s.n_layers) * 2 *
                          static_cast<std::size_t>(s.n_kv_heads) * static_cast<std::size_t>(T) *
                          static_cast<std::size_t>(s.head_dim));
  }
  if (step->slots > 0) {
    const KvShape& s = shape();
    step->pass_tile_bytes = std::max(tile_layout(hk, T, s.head_dim).bytes, tile_layout(hv, T, s.head_dim).bytes);
    step->pass_tiles.resize(static_cast<std::size_t>(step->slots) * 2 * static_cast<std::size_t>(s.n_kv_heads) *
                            step->pass_tile_bytes);
  }
  step_ = std::move(step);
}

void PooledKvCache::pass_tiles(int b, int layer, const std::byte** k, const std::byte** v) const {
  const int H = shape().n_kv_heads;
  const int ks = step_->view_slot[static_cast<std::size_t>(b) * 2], vs = step_->view_slot[static_cast<std::size_t>(b) * 2 + 1];
  if (ks < 0 || vs < 0) pool_->stored_tiles(step_->view[static_cast<std::size_t>(b)], layer, k, v);
  for (int h = 0; h < H; ++h) {
    if (ks >= 0) k[h] = step_->pass_copy(ks, 0, h, H);
    if (vs >= 0) v[h] = step_->pass_copy(vs, 1, h, H);
  }
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
  const bool relative = format_.key_rope == KeyRope::block;
  if (format_.rotate_k || format_.rotate_v || relative) {
    rotated_.resize(static_cast<std::size_t>(n) * static_cast<std::size_t>(kvd) * 2);
    float* rk = rotated_.data();
    float* rv = rk + static_cast<std::size_t>(n) * static_cast<std::size_t>(kvd);
    std::memcpy(rk, k, sizeof(float) * static_cast<std::size_t>(n) * static_cast<std::size_t>(kvd));
    std::memcpy(rv, v, sizeof(float) * static_cast<std::size_t>(n) * static_cast<std::size_t>(kvd));
    for (int i = 0; i < n * s.n_kv_heads; ++i) {
      if (format_.rotate_k) kv::rotate(rk + static_cast<std::ptrdiff_t>(i) * D, D);
      if (format_.rotate_v) kv::rotate(rv + static_cast<std::ptrdiff_t>(i) * D, D);
    }
    if (relative) {  // keys=block: each key turned by its offset in its block (rows 0..T-1 of the table)
      const int T = pool_->block_tokens(), done = size_ - base_;
      const float* table = rope_table(layer, T);
      for (int t = 0; t < n; ++t)
        kernels::tile_kernels().rope(rk + static_cast<std::ptrdiff_t>(t) * kvd, s.n_kv_heads, D,
                                     table + static_cast<std::ptrdiff_t>((done + t) % T) * 2 * D, 0, rope_.style);
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
  if (!pool_->stores_layer(w.dst, layer)) return;  // a block recoded after it left the window
  const int T = pool_->block_tokens(), D = s.head_dim, kvd = s.kv_dim();
  const int first = w.block * T;
  const int done = size_ - base_;  // tail indices
  const int old_rows = std::clamp(done - first, 0, T), end_rows = std::clamp(done + n - first, 0, T);
  std::vector<float>& rows = step_->rows;
  rows.resize(static_cast<std::size_t>(T) * static_cast<std::size_t>(D));
  struct Encode {
    KvCodec codec;
    TileLayout layout;
    const float* rows;
    std::byte* tile;
    kv::CodebookSlice book;
  };
  std::vector<Encode> encodes;  // this layer's tiles of a block quantized in the background
  for (int kind = 0; kind < 2; ++kind) {
    const KvCodec& dc = kind == 0 ? w.dk : w.dv;
    const KvCodec& sc = kind == 0 ? w.sk : w.sv;
    const TileLayout dl = tile_layout(dc, T, D);
    const float* input = kind == 0 ? k : v;
    for (int h = 0; h < s.n_kv_heads; ++h) {
      std::byte* dst = pool_->tile(w.dst, kind, layer, h);
      // Input row of block row r (r >= old_rows: a token of this pass).
      const auto in_row = [&](int r) { return input + static_cast<std::ptrdiff_t>(first + r - done) * kvd + h * D; };
      if (w.dst == w.src) {  // in place: only the new rows
        for (int r = old_rows; r < end_rows; ++r) kv::encode_row(dc, dl, in_row(r), r, dst);
        continue;
      }
      if (old_rows > 0 && !sc.quantized())  // f16 and f32 decode exactly on every level
        kernels::tile_kernels().decode(kv::tile_codes(sc, tile_layout(sc, T, D)), pool_->tile(w.src, kind, layer, h),
                                       old_rows, rows.data());
      else if (old_rows > 0)
        kv::decode_tile_scalar(sc, tile_layout(sc, T, D), pool_->tile(w.src, kind, layer, h), old_rows, rows.data(),
                               kv::codebook_slice(format_, sc, kind, layer, h));
      for (int r = old_rows; r < end_rows; ++r)
        std::memcpy(&rows[static_cast<std::size_t>(r) * D], in_row(r), sizeof(float) * static_cast<std::size_t>(D));
      if (dc.quantized()) {
        QKV_CHECK(end_rows == T);  // only full blocks are quantized
        const kv::CodebookSlice book = kv::codebook_slice(format_, dc, kind, layer, h);
        if (w.deferred >= 0) {  // rows kept for the worker; queued below with the layer's other tiles
          float* kept = deferred_rows_.data() +
                        ((((static_cast<std::size_t>(w.deferred) * s.n_layers + static_cast<std::size_t>(layer)) * 2 +
                           static_cast<std::size_t>(kind)) * s.n_kv_heads + static_cast<std::size_t>(h)) *
                         static_cast<std::size_t>(T) * static_cast<std::size_t>(D));
          std::copy(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(T) * D, kept);
          encodes.push_back({dc, dl, kept, dst, book});
        } else {
          kv::encode_tile(dc, dl, rows.data(), dst, book);
        }
        if (w.slot >= 0) {  // the pass reads these rows at the hot precision
          const KvCodec hc = hot_codec(dc);
          const TileLayout hl = tile_layout(hc, T, D);
          std::byte* copy = step_->pass_copy(w.slot, kind, h, s.n_kv_heads);
          for (int r = 0; r < T; ++r) kv::encode_row(hc, hl, &rows[static_cast<std::size_t>(r) * D], r, copy);
        }
      } else {
        for (int r = 0; r < end_rows; ++r) kv::encode_row(dc, dl, &rows[static_cast<std::size_t>(r) * D], r, dst);
      }
    }
  }
  if (encodes.empty()) return;
  // The pass reads this block's hot copies; nothing reads its codes before commit(), which waits for them.
  const auto job = [encodes = std::move(encodes)] {
    for (const Encode& e : encodes) kv::encode_tile(e.codec, e.layout, e.rows, e.tile, e.book);
  };
  const std::uint64_t ticket = kv::BackgroundWorker::get(kv::BackgroundWorker::Purpose::quantization).push(job);
  if (ticket == 0) job();  // no worker in this process (a child of fork())
  else deferred_ticket_ = ticket;
}

AttendWork& PooledKvCache::plan_attend(int layer, int n, const float* q, float* out, int window) {
  const KvShape& s = shape();
  QKV_CHECK(step_ && step_->n == n && step_->next_layer == layer + 1 && window >= 0);
  if (segments_.size() > 1) return plan_segments(layer, n, q, out, window);
  if (format_.observes()) {  // demote()'s and evict()'s observation window
    const int m = std::min(n, kObservedQueries), qd = s.q_dim();
    step_->obs_rows = m;
    step_->obs.resize(static_cast<std::size_t>(m) * static_cast<std::size_t>(s.n_layers) * static_cast<std::size_t>(qd));
    for (int t = 0; t < m; ++t)
      std::memcpy(&step_->obs[(static_cast<std::size_t>(t) * s.n_layers + static_cast<std::size_t>(layer)) * qd],
                  q + static_cast<std::ptrdiff_t>(n - m + t) * qd, sizeof(float) * static_cast<std::size_t>(qd));
  }
  const int blocks = static_cast<int>(step_->view.size());
  std::vector<const std::byte*>& tiles = attend_tiles_;
  tiles.resize(static_cast<std::size_t>(blocks) * static_cast<std::size_t>(s.n_kv_heads) * 2);
  const std::size_t half = tiles.size() / 2;
  for (int b = 0; b < blocks; ++b) {
    const std::size_t i = static_cast<std::size_t>(b) * s.n_kv_heads;
    pass_tiles(b, layer, &tiles[i], &tiles[half + i]);
  }
  kv::AttendInput in = kv::causal_input(s, pool_->block_tokens(), blocks, size_, n, q, out, window);
  in.k_tiles = tiles.data();
  in.v_tiles = tiles.data() + half;
  in.k_codecs = step_->view_k.data();
  in.v_codecs = step_->view_v.data();
  in.rotate_k = format_.rotate_k;
  in.rotate_v = format_.rotate_v;
  in.book = format_.book.get();
  in.layer = layer;
  if (format_.key_rope != KeyRope::post) {
    const int end = *std::max_element(step_->view_pos.begin(), step_->view_pos.end()) + pool_->block_tokens();
    set_key_rope(in, step_->view_pos.data(), rope_table(layer, end), rope_table(layer, end, true));
  }
  if (!attend_work_) attend_work_ = std::make_unique<kv::BlockAttend>();
  attend_work_->prepare(in, path_);
  return *attend_work_;
}


AttendWork& PooledKvCache::plan_segments(int layer, int n, const float* q, float* out, int window) {
  const KvShape& s = shape();
  const int D = s.head_dim, qd = s.q_dim(), T = pool_->block_tokens();
  if (!segment_work_) segment_work_ = std::make_unique<kv::SegmentAttend>();
  kv::SegmentAttend& w = *segment_work_;
  const std::size_t segs = segments_.size();
  w.slots = static_cast<std::size_t>(n) * static_cast<std::size_t>(s.n_heads);
  w.head_dim = D;
  w.out = out;
  w.rotate_v = format_.rotate_v;
  if (w.parts.size() < segs) w.parts.resize(segs);
  w.used = segs;
  w.ml.resize(segs * w.slots * 2);
  w.po.resize(segs * w.slots * static_cast<std::size_t>(D));
  w.first_job.assign(segs + 1, 0);
  const AttendPath path = path_ == AttendPath::exact ? AttendPath::scalar : path_;
  const float* table = nullptr;  // keys=pre|block: one table for every segment (growing it moves it)
  const float* inverse = nullptr;
  if (format_.key_rope != KeyRope::post) {
    int end = 0;
    for (std::size_t si = 0; si + 1 < segs; ++si)
      for (const BlockRef b : segments_[si].blocks) end = std::max(end, pool_->info(b).key_position + T);
    for (const int p : step_->view_pos) end = std::max(end, p + T);
    table = rope_table(layer, end);
    inverse = rope_table(layer, end, true);
  }
  int seg_start = 0;  // the context's token index of the segment's first token
  for (std::size_t si = 0; si < segs; ++si) {
    const KvSegment& seg = segments_[si];
    kv::SegmentAttend::Part& part = w.parts[si];
    const bool tail = si + 1 == segs;
    const std::vector<BlockRef>& blocks = tail ? step_->view : seg.blocks;
    const int nb = static_cast<int>(blocks.size());
    QKV_CHECK(nb > 0);  // frozen segments hold tokens; the tail holds this pass's
    part.tiles.resize(static_cast<std::size_t>(nb) * static_cast<std::size_t>(s.n_kv_heads) * 2);
    part.codecs.resize(static_cast<std::size_t>(nb) * 2);
    part.pos.resize(static_cast<std::size_t>(nb));
    const std::size_t half = part.tiles.size() / 2;
    for (int b = 0; b < nb; ++b) {
      const BlockRef ref = blocks[static_cast<std::size_t>(b)];
      const std::size_t i = static_cast<std::size_t>(b) * s.n_kv_heads;
      if (tail) pass_tiles(b, layer, &part.tiles[i], &part.tiles[half + i]);
      else pool_->stored_tiles(ref, layer, &part.tiles[i], &part.tiles[half + i]);
      if (tail) {
        part.codecs[static_cast<std::size_t>(b)] = step_->view_k[static_cast<std::size_t>(b)];
        part.codecs[static_cast<std::size_t>(nb + b)] = step_->view_v[static_cast<std::size_t>(b)];
        part.pos[static_cast<std::size_t>(b)] = step_->view_pos[static_cast<std::size_t>(b)];
      } else {
        const BlockInfo info = pool_->info(ref);
        part.codecs[static_cast<std::size_t>(b)] = info.k;
        part.codecs[static_cast<std::size_t>(nb + b)] = info.v;
        part.pos[static_cast<std::size_t>(b)] = info.key_position;
      }
    }
    const float* qs = q;
    if (seg.position_offset != 0) {
      QKV_CHECK(static_cast<int>(rope_.freq(layer).size()) * 2 == D);  // set by splice() or set_rope()
      part.q.assign(q, q + static_cast<std::ptrdiff_t>(n) * qd);
      for (int t = 0; t < n; ++t)
        kernels::rope(&part.q[static_cast<std::size_t>(t) * qd], s.n_heads, D, static_cast<float>(-seg.position_offset),
                      rope_.freq(layer).data(), rope_.style);
      qs = part.q.data();
    }
    kv::AttendInput in;
    in.shape = s;
    in.block_tokens = T;
    in.n_blocks = nb;
    in.n = n;
    in.q = qs;
    in.k_tiles = part.tiles.data();
    in.v_tiles = part.tiles.data() + half;
    in.k_codecs = part.codecs.data();
    in.v_codecs = part.codecs.data() + nb;
    in.rotate_k = format_.rotate_k;
    in.rotate_v = format_.rotate_v;
    in.book = format_.book.get();
    in.layer = layer;
    if (format_.key_rope != KeyRope::post) set_key_rope(in, part.pos.data(), table, inverse);
    in.out_ml = &w.ml[si * w.slots * 2];
    in.out_o = &w.po[si * w.slots * static_cast<std::size_t>(D)];
    if (tail) {
      QKV_CHECK(seg_start == base_);
      in.first_pos = size_ - base_;
    } else {
      QKV_CHECK(seg.tokens >= 0);
      in.causal = false;
      in.key_lo = seg.first_row;
      in.key_end = seg.first_row + seg.tokens;
    }
    // Key row r of this part is token seg_start + r - key_lo of the context;
    // query t (token size_ + t) sees it when within the window.
    if (window > 0) in.visible_from = size_ + 1 - window - seg_start + in.key_lo;
    if (!tail) seg_start += seg.tokens;
    part.work.prepare(in, path);
    w.first_job[si + 1] = w.first_job[si] + part.work.jobs();
  }
  return w;
}

void PooledKvCache::commit(int n) {
  if (n == 0 && !step_) return;
  QKV_CHECK(step_ && step_->n == n && step_->next_layer == shape().n_layers);
  settle_quantization();  // from here on the blocks hold their codes, as if quantized in the pass
  const int T = pool_->block_tokens();
  for (const Step::Work& w : step_->work) {
    const int fill = std::clamp(size_ - base_ + n - w.block * T, 0, T);
    pool_->set_fill(w.dst, fill);
    if (fill == T) kv::checksum_later(pool_, w.dst);  // final from now on: seal will find its checksum kept
    if (w.fresh && w.src.valid()) pool_->release(w.src);
  }
  if (step_->obs_rows > 0) {
    const std::size_t row = step_->obs.size() / static_cast<std::size_t>(step_->obs_rows);
    observed_.insert(observed_.end(), step_->obs.begin(), step_->obs.end());
    for (int t = 0; t < step_->obs_rows; ++t) observed_pos_.push_back(size_ + n - step_->obs_rows + t);
    const std::size_t extra = observed_pos_.size() > static_cast<std::size_t>(kObservedQueries)
                                  ? observed_pos_.size() - static_cast<std::size_t>(kObservedQueries) : 0;
    observed_pos_.erase(observed_pos_.begin(), observed_pos_.begin() + static_cast<std::ptrdiff_t>(extra));
    observed_.erase(observed_.begin(), observed_.begin() + static_cast<std::ptrdiff_t>(extra * row));
  }
  size_ += n;
  segments_.back() = KvSegment{0, step_->view, 0, size_ - base_};
  step_.reset();
  free_windowed_layers();
  if (commit_hook_) commit_hook_->committed();
}

}  // namespace qkvshare
