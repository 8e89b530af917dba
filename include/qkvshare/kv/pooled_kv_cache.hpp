#pragma once
// A context's KV storage in the pool: a block table (a list of segments) in
// one KvFormat, implementing the engine's KvCache interface.
//
// Writes are quantized as they arrive, prefill included: the tokens of a
// block that this forward pass fills go straight into a cold (quantized)
// block. The attention of that same pass reads the block's rows at the hot
// precision instead (PassPrecision::full, the default: an f16 copy kept for
// the pass, one layer at a time), as a GPU engine attends to the fresh K/V of
// a prefill; later passes read the stored codes. PassPrecision::stored makes
// the pass read its own quantized copies (the error then compounds through the
// layers of a prefill; kept to measure one against the other). Hot
// blocks (the partly filled tail, the window, the sinks) are f16 (f32 for f32
// codecs). A hot block that turns cold is requantized into a new block during
// the pass and swapped in at commit(); a shared block (refcount > 1) is never
// written: the tail is copied on write. All blocks a pass needs are allocated
// by its first write(), before anything is stored, so pool exhaustion fails
// the request (Error(out_of_memory)) and leaves this and every other context
// as they were.
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/ops.hpp"
#include "qkvshare/kv/kv_cache.hpp"
#include "qkvshare/kv/kv_format.hpp"
#include "qkvshare/kv/kv_pool.hpp"

namespace qkvshare {

namespace kv {
class BlockAttend;
class SegmentAttend;
class RopeTable;
struct AttendInput;
}

// A token range of a run of blocks: `tokens` tokens starting at row
// `first_row` of blocks[0] (start and end may fall inside a block). Keys were
// rotated (RoPE) at the positions they were computed at; the segment sits
// `position_offset` positions away from there (its position in this context
// minus the position it was computed at), and attention reads it by rotating
// the query back by the offset, once per segment (docs/design.md "Context"): no
// block is rewritten, requantized or copied to move it, so the same blocks can
// sit in several contexts at different positions. tokens < 0 means "up to the
// context's size" (a context's only segment, as adopt() is given it).
struct KvSegment {
  int position_offset = 0;
  std::vector<BlockRef> blocks;
  int first_row = 0;
  int tokens = -1;
};

// The rotary embedding the model used, so that a cache can rotate queries by
// a segment's offset (kernels::rope with the engine's frequencies).
struct KvRope {
  std::vector<float> inv_freq;  // head_dim / 2 frequencies
  kernels::RopeStyle style = kernels::RopeStyle::interleaved;
  // Layers that rotate with other frequencies (gemma3's sliding-window
  // layers): local_layers[l] != 0 selects local_inv_freq. Empty: inv_freq
  // for every layer.
  std::vector<float> local_inv_freq;
  std::vector<std::uint8_t> local_layers;

  const std::vector<float>& freq(int layer) const noexcept {
    return !local_layers.empty() && local_layers[static_cast<std::size_t>(layer)] != 0 ? local_inv_freq : inv_freq;
  }
  bool layered() const noexcept { return !local_layers.empty(); }
  bool operator==(const KvRope&) const = default;
};

// How attention reads the blocks: the automatic choice uses the active SIMD
// level's tile kernels (for f32 K and V too, as DenseKvCache does: an f32
// pool of the same block size gives its bits); exact is the scalar reference,
// one query at a time, for f32 K and V only (kv_attention.cpp).
enum class AttendPath { automatic, scalar, avx2, avx512, neon, neon_dot, exact };

// What a forward pass reads of the tokens it computes itself (see above).
enum class PassPrecision { full, stored };
// The precision new caches start with (process-wide; the CLI's
// --kv-stored-in-pass sets it to stored). Default: full.
void set_default_pass_precision(PassPrecision p) noexcept;
PassPrecision default_pass_precision() noexcept;
// Whether commit() frees the windowed layers of blocks that left every
// sliding window (PooledKvCache::windowed_kept_from; process-wide, default
// on; the CLI's --kv-keep-windowed-layers turns it off, to measure both ways).
void set_free_windowed_layers(bool on) noexcept;
bool free_windowed_layers_enabled() noexcept;
// Whether a decode step quantizes the blocks it fills on a background thread
// while the pass goes on (it reads their f16 pass copies meanwhile; commit()
// waits for the codes, so every later reader, and every result, is as
// without), or on the calling thread. Process-wide, default on; the CLI's
// --kv-quantize-in-pass turns it off, to measure both ways.
void set_background_quantization(bool on) noexcept;
bool background_quantization() noexcept;

// Told after each commit(): how a context opened from a shared pool renews
// its holder's lease (share/share_pool.hpp) without the kv layer knowing of it.
class CommitHook {
 public:
  virtual ~CommitHook() = default;
  virtual void committed() noexcept = 0;
};

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
  int next_position() const noexcept override { return size_ + position_gap_; }
  // Positions dropped before the context's end with their neighbours' positions
  // kept (evict(), positions=keep): next_position() - size(). A handed-off
  // context's consumer sets it from the descriptor (SharePool::open).
  int position_gap() const noexcept { return position_gap_; }
  void set_position_gap(int gap) noexcept { position_gap_ = gap; }
  // Not inherited by fork() or recoded(): those are contexts of their own.
  void set_commit_hook(std::shared_ptr<CommitHook> hook) noexcept { commit_hook_ = std::move(hook); }
  void write(int layer, int n, const float* k, const float* v) override;
  AttendWork& plan_attend(int layer, int n, const float* q, float* out, int window = 0) override;
  void commit(int n) override;

  // A context over existing blocks (a handed-off one): takes its own
  // reference on every block, which must still be live at the given
  // generation (else Error(bad_descriptor)), and checks that the blocks fit
  // `tokens`, `capacity` and the format's codecs (else Error(invalid_argument)).
  // A segment at a nonzero offset is frozen (new tokens go to a fresh tail
  // segment after it) and needs set_rope() before attention.
  static std::unique_ptr<PooledKvCache> adopt(std::shared_ptr<KvPool> pool, const KvFormat& format, int capacity,
                                              std::vector<KvSegment> segments, int tokens);

  // A second context sharing every block (reference counts); the first write
  // of either into a shared partly filled block copies that block.
  std::unique_ptr<PooledKvCache> fork() const;

  // Splice: places tokens [begin, end) of `src` (a context in the same pool
  // with the same rotation flags) at this context's end, as segments of src's
  // blocks at the offset that puts them at positions size()..size()+n-1.
  // Takes a reference on each block; nothing is copied or requantized. The
  // current tail becomes frozen (later tokens go into new blocks of this
  // context). Error(invalid_argument) for a bad range, another pool or other
  // rotation flags; Error(context_full) when the tokens do not fit.
  void splice(const PooledKvCache& src, int begin, int end, const KvRope& rope);
  // The last segment alone (the tokens this context wrote after its last
  // splice), as a context of its own whose keys sit at positions
  // [tail_begin(), size()): what a spliced context hands on (share/seal).
  std::unique_ptr<PooledKvCache> tail_context() const;
  int tail_begin() const noexcept { return base_; }
  void set_rope(const KvRope& rope) override;
  bool keys_before_rope() const noexcept override { return format_.key_rope != KeyRope::post; }

  // Decoded rows (f32, [count][head_dim], Hadamard-rotated as stored when the
  // format rotates) of one layer, kind (0 K, 1 V) and KV head for the
  // committed tokens [first, first + count): what the splice guard compares.
  // A windowed layer's rows left behind (windowed_kept_from) are an Error(invalid_argument).
  void read_rows(int layer, int kind, int kv_head, int first, int count, float* out) const;

  // Sliding-window layers (KvShape::layer_window, with global layers beside
  // them): once a full block's tokens are `max_window` or more behind the
  // context's end, no windowed layer of this context reads them again, so
  // commit() copies the block's global layers into a smaller block
  // (kBlockWindowFreed) and frees the whole one. A block shared with another
  // context stays whole (that one may still be within its window; it is
  // freed at a later commit once unshared), as do the blocks of formats with a
  // budget (evict() can bring tokens back into a window). A context that ends
  // earlier than its blocks allow (a prefix of another: adopt, splice) is
  // refused with Error(invalid_argument). The first token index from which
  // every block keeps its windowed layers (0: none was freed):
  int windowed_kept_from() const { return windowed_kept_from(segments_); }

  // Mixed formats (KvFormat::mixed): recodes the cold blocks that received
  // the least attention to the format's lo codecs, keeping the `top` share in
  // k/v; sinks, the window and the tail stay hot. Importance is the softmax
  // attention that the context's last kObservedQueries queries (every layer
  // and query head: SnapKV's observation window) give each block's tokens,
  // computed from the stored keys. Called when a context is sealed or handed
  // off, so the producer's whole context is known. A demoted block is a new
  // block (a fork sharing the old one keeps it); at most one extra block is
  // held at a time; pool exhaustion throws Error(out_of_memory) with the
  // context intact (the blocks recoded so far stay recoded). Returns the
  // blocks recoded: 0 for one-precision formats, a context with spliced
  // segments, or one whose queries this cache did not see.
  int demote();
  static constexpr int kObservedQueries = 16;
  // Formats with a budget (KvFormat::evicts): drops the least attended cold
  // blocks (ranked as demote() ranks them) until about `budget` of the
  // blocks are left, always keeping the hot ones (sinks, window, tail) and
  // the first and the last block (StreamingLLM's sinks and recent window).
  // The kept runs of blocks become segments of the context at the positions
  // they were computed at (the next token's position after the dropped ones'
  // too: position_gap()), or, with positions=close, moved back over the gaps
  // (StreamingLLM's cache; new tokens then go to a fresh tail). Nothing is
  // copied or requantized.
  // Returns the kept token ranges [begin, end) in the old positions (what a
  // caller keeps of its token ids); empty when nothing was dropped (the same
  // cases as demote(), and a budget that keeps every block).
  std::vector<std::pair<int, int>> evict();
  // Formats with tail=cold (KvFormat::cold_tail): recodes the partly filled
  // last block of the writable tail into the cold codecs (its unused rows
  // padded with its last row, so they widen no range), unless a sink keeps
  // it hot. Like demote(), a new block: a fork sharing the old one keeps it.
  // A later write there copies the decoded rows into a hot block first.
  // Returns whether a block was recoded.
  bool code_tail();

  // A copy of this context in another format of the same pool (the memory
  // tiers' demotion, tiers/context_tiers.hpp): every block is recoded to the
  // codec its place has in `to` (cold blocks to.k/to.v; hot ones, and any
  // block not full, f16 or f32) through f32 rows; a block already in that
  // codec is shared, not copied. Same segments, offsets, position gap and
  // tokens. `to` must store keys and values the same way (rotations, key
  // RoPE) and be of one precision (no mixed precision, no budget): else
  // Error(invalid_argument). Pool exhaustion: Error(out_of_memory), with
  // every block allocated given back and this context unchanged.
  struct RecodeCost {
    // Relative RMS change of the rows the copy reads against the rows this
    // context reads, over every committed row of every layer and KV head:
    // sqrt(sum (new - old)^2 / sum old^2), keys and values apart.
    double k_rel_rms = 0, v_rel_rms = 0;
    int blocks_recoded = 0, blocks_shared = 0;
  };
  std::unique_ptr<PooledKvCache> recoded(const KvFormat& to, RecodeCost* cost = nullptr) const;

  const KvFormat& format() const noexcept { return format_; }
  const std::vector<KvSegment>& segments() const noexcept { return segments_; }
  KvPool& pool() const noexcept { return *pool_; }
  // Bytes of the pages this context's blocks hold.
  std::size_t kv_bytes() const;
  void set_attend_path(AttendPath path) noexcept { path_ = path; }
  void set_pass_precision(PassPrecision p) noexcept { pass_precision_ = p; }
  PassPrecision pass_precision() const noexcept { return pass_precision_; }

 private:
  struct Step;  // the pass between the first write() and commit()
  AttendWork& plan_segments(int layer, int n, const float* q, float* out, int window);
  void plan(int n);
  void discard_step() noexcept;
  // Waits for this pass's blocks quantized in the background (see above).
  void settle_quantization() noexcept;
  void write_block(int layer, int b, const float* k, const float* v, int n);
  // The tiles attention reads this pass for view block b, k[h] and v[h] for
  // every KV head (the pass copies when it has them).
  void pass_tiles(int b, int layer, const std::byte** k, const std::byte** v) const;
  std::uint32_t block_flags() const noexcept;
  int windowed_kept_from(const std::vector<KvSegment>& segments) const;
  // Error(invalid_argument) when a context of `tokens` tokens over `segments` would read freed windowed layers.
  void require_windows(const std::vector<KvSegment>& segments, int tokens, std::string_view what) const;
  void free_windowed_layers();  // at commit, see windowed_kept_from()
  // demote() and evict(): the observed attention per block of the only segment, and its cold blocks ranked by it.
  std::vector<double> block_importance() const;
  std::vector<double> ranking() const;
  std::vector<int> cold_by_importance(const std::vector<double>& importance) const;
  // demote() and recoded(): a new block (one reference, held by the caller)
  // with `ref`'s rows recoded to (k, v) of format `to` through f32 rows. With
  // `sums`, adds each kind's squared change and energy over rows [row0, row1).
  struct RecodeSums {
    double change[2] = {0, 0}, energy[2] = {0, 0};
  };
  BlockRef recode_block(BlockRef ref, const KvCodec& k, const KvCodec& v, const KvFormat& to, RecodeSums* sums = nullptr,
                        int row0 = 0, int row1 = 0) const;

  std::shared_ptr<KvPool> pool_;
  KvFormat format_;
  int capacity_;
  int size_ = 0;
  std::vector<KvSegment> segments_;
  int base_ = 0;  // tokens before the last (writable) segment
  int position_gap_ = 0;
  std::shared_ptr<CommitHook> commit_hook_;
  int window_scan_ = 0;  // free_windowed_layers(): the window's start (in blocks) at its last scan
  KvRope rope_;
  // keys=pre: the RoPE rows of every position up to the largest one read
  // (kv/rope_table.hpp, shared by the process's caches); held until the next plan needs more.
  mutable std::shared_ptr<const kv::RopeTable> rope_table_, rope_table_local_;
  // The rows of `layer`'s frequencies (KvRope::freq) for positions [0, end_position).
  const float* rope_table(int layer, int end_position, bool inverse = false) const;
  // keys=pre|block: an attention input's key positions per block and the rows that turn them there.
  void set_key_rope(kv::AttendInput& in, const int* positions, const float* table, const float* inverse) const;
  std::unique_ptr<Step> step_;
  AttendPath path_ = AttendPath::automatic;
  PassPrecision pass_precision_ = default_pass_precision();
  std::vector<float> rotated_;  // k/v rows of a write, rotated per head
  // Rows of the blocks this pass fills, kept for the background quantization
  // ([block][layer][kind][kv_head][row][dim]), and the ticket of its last job.
  std::vector<float> deferred_rows_;
  std::uint64_t deferred_ticket_ = 0;
  // Mixed formats: the last kObservedQueries committed queries, [n][n_layers][q_dim], and their positions.
  std::vector<float> observed_;
  std::vector<int> observed_pos_;
  // The planned attention and the tile pointers it reads (one plan at a time per cache).
  std::unique_ptr<kv::BlockAttend> attend_work_;
  std::unique_ptr<kv::SegmentAttend> segment_work_;  // a spliced context's plan
  std::vector<const std::byte*> attend_tiles_;
};

// What a context ships when it is handed off (SharePool::seal, eval's
// handoff protocol): demote(), then evict(), then code_tail(); `ids` (one per
// token of the context, of whatever id type) keep the tokens that evict() kept.
template <class Id>
void reduce_for_handoff(PooledKvCache& cache, std::vector<Id>& ids) {
  QKV_CHECK(static_cast<int>(ids.size()) == cache.size());
  cache.demote();
  const std::vector<std::pair<int, int>> kept = cache.evict();
  cache.code_tail();
  if (kept.empty()) return;
  std::vector<Id> out;
  for (const auto& [begin, end] : kept) out.insert(out.end(), ids.begin() + begin, ids.begin() + end);
  ids = std::move(out);
}

}  // namespace qkvshare
