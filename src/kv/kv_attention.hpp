#pragma once
// Attention over a context's blocks, read in place (docs/design.md rule 4): each
// job decodes one tile at a time into a block-sized scratch and reuses it for
// every query head of the KV group and every query token of its chunk.
#include <cstddef>
#include <vector>

#include "qkvshare/core/thread_pool.hpp"
#include "qkvshare/kv/kv_codebook.hpp"
#include "qkvshare/kv/kv_format.hpp"
#include "qkvshare/kv/kv_kernels.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare::kv {

struct AttendInput {
  KvShape shape;
  int block_tokens = 0;
  int n_blocks = 0;   // blocks holding tokens [0, first_pos + n)
  int first_pos = 0;  // position of the first query
  int n = 0;          // queries (tokens)
  const float* q = nullptr;  // [n][q_dim]
  float* out = nullptr;      // [n][q_dim]
  const std::byte* const* k_tiles = nullptr;  // [n_blocks][n_kv_heads]
  const std::byte* const* v_tiles = nullptr;
  const KvCodec* k_codecs = nullptr;  // [n_blocks]
  const KvCodec* v_codecs = nullptr;
  bool rotate_k = false;
  bool rotate_v = false;
  // The centroids of pq tiles (KvFormat::book) and the layer they are read for.
  const KvCodebook* book = nullptr;
  int layer = 0;
  // Keys stored before RoPE (keys=pre): row r of block b was computed at
  // position k_positions[b] + r, and is rotated there when read by
  // rope_table ([position][2 * head_dim], kernels::rope_table_row). With
  // keys_relative (keys=block) the rows hold their in-block part already and
  // the queries are turned back by k_positions[b] instead (rope_inverse, the
  // rows of -position).
  const int* k_positions = nullptr;
  const float* rope_table = nullptr;
  const float* rope_inverse = nullptr;
  bool keys_relative = false;
  RopeStyle rope_style = RopeStyle::interleaved;
  // A segment of a spliced context: its keys are rows [key_lo, key_end) of
  // the blocks (key_end < 0: first_pos + n); causal == false when every query
  // sees all of them (a segment before the queries).
  int key_lo = 0;
  int key_end = -1;
  bool causal = true;
  // A sliding-window layer: query t sees no key row below visible_from + t
  // (kWholeContext: no such bound).
  static constexpr int kWholeContext = -(1 << 30);
  int visible_from = kWholeContext;
  // When set, the softmax pieces are written instead of `out`, per slot
  // t * n_heads + h: running max and sum of exp in out_ml[2 * slot], the
  // unnormalized weighted sum of values (still Hadamard-rotated) in
  // out_o[slot * head_dim]; a query that sees no key gets (-inf, 0, 0).
  float* out_ml = nullptr;
  float* out_o = nullptr;
  int key_total() const noexcept { return key_end >= 0 ? key_end : first_pos + n; }
};

// The causal attention of n queries at positions first_pos.. over n_blocks
// blocks (a sliding window when window > 0, KvCache::plan_attend's rule); the
// caller adds tiles and codecs.
inline AttendInput causal_input(const KvShape& shape, int block_tokens, int n_blocks, int first_pos, int n,
                                const float* q, float* out, int window) {
  AttendInput in;
  in.shape = shape;
  in.block_tokens = block_tokens;
  in.n_blocks = n_blocks;
  in.first_pos = first_pos;
  if (window > 0) in.visible_from = first_pos + 1 - window;
  in.n = n;
  in.q = q;
  in.out = out;
  return in;
}

// The attention of one AttendInput as independent jobs (see AttendWork):
// exact path, one job per (query token, query head); otherwise one per (KV
// head, chunk of query tokens, key partition), partitions merged in finish().
class BlockAttend final : public AttendWork {
 public:
  // The input's arrays must stay valid until finish().
  void prepare(const AttendInput& in, AttendPath path);
  std::size_t jobs() const noexcept override;
  double job_cost() const noexcept override;
  void run(std::size_t job) override;
  void finish() override;

  struct Partial {
    float m, l;
  };

  const AttendInput& input() const noexcept { return in_; }
  const kernels::TileKernels* ops() const noexcept { return ops_; }
  // Decode's key partitions (split-K): partition_blocks() blocks each from
  // block first_block(); 1 when the keys are not split.
  int partitions() const noexcept { return parts_; }
  int first_block() const noexcept { return first_block_; }
  // At most 16 blocks and at most 512 keys (at least one block): pools with
  // larger blocks keep partitions of 512 keys, so 2 threads still get
  // several at depth 2048 (at 16 blocks of 128 keys they got one per head).
  static constexpr int kPartitionBlocks = 16, kPartitionTokens = 512;
  static constexpr int partition_blocks(int block_tokens) noexcept {
    const int by_tokens = kPartitionTokens / block_tokens;
    return by_tokens < 1 ? 1 : by_tokens < kPartitionBlocks ? by_tokens : kPartitionBlocks;
  }
  int partition_blocks() const noexcept { return partition_blocks(in_.block_tokens); }
  // Partitions [0, n) are computed elsewhere (SharedBlockReads: blocks that
  // other sessions' plans read too): jobs() leaves them out, and their softmax
  // pieces must be in partition_ml/partition_o before finish(). Until the next prepare().
  void give_partitions(int n) noexcept { given_ = n; }
  Partial* partition_ml(int p) noexcept { return ml_.data() + slots_ * static_cast<std::size_t>(p); }
  float* partition_o(int p) noexcept {
    return po_.data() + slots_ * static_cast<std::size_t>(p) * static_cast<std::size_t>(in_.shape.head_dim);
  }

 private:
  AttendInput in_;
  const kernels::TileKernels* ops_ = nullptr;  // null: the exact f32 path
  int chunks_ = 0, parts_ = 1, given_ = 0;
  int first_block_ = 0;  // the first block any query sees (a sliding window's start)
  std::size_t slots_ = 0;
  std::vector<Partial> ml_;  // [parts][n][n_heads] softmax pieces of split-K decode
  std::vector<float> po_;    // [parts][n][n_heads][head_dim]
};

// Queries [t0, t1) of KV head kv_head over blocks [b0, b1): the softmax
// pieces of one split-K partition, at slot t * n_heads + h of ml and o (as
// BlockAttend's jobs compute them: each query's bits do not depend on the
// others in the call).
void attend_partition(const AttendInput& in, const kernels::TileKernels& ops, int kv_head, int t0, int t1, int b0,
                      int b1, BlockAttend::Partial* ml, float* o);

// prepare + run on `pool` + finish: one input alone.
void attend_blocks(const AttendInput& in, AttendPath path, ThreadPool& pool);

}  // namespace qkvshare::kv
