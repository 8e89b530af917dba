#include "qkvshare/kv/shared_block_reads.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "kv_attention.hpp"

namespace qkvshare::kv {

namespace {

constexpr int kGroupChunk = 16;  // stacked queries per job, as BlockAttend's chunks

std::atomic<bool> g_shared_reads{true};

// A plan whose leading partitions can be read with others': a decode step's
// split-K plan of a plain causal input (no segment, no window cut, keys after
// RoPE), whose partitions start at block 0.
bool shareable(const BlockAttend& b) {
  const AttendInput& in = b.input();
  return b.ops() != nullptr && b.partitions() > 1 && b.first_block() == 0 && in.key_lo == 0 && in.key_end < 0 &&
         in.causal && in.out_ml == nullptr && in.k_positions == nullptr && in.visible_from + in.n - 1 <= 0;
}

// Partitions made of blocks that lie wholly before the plan's first query
// (full, committed, seen whole by every query).
int whole_partitions(const BlockAttend& b) {
  const AttendInput& in = b.input();
  return std::min(b.partitions(), in.first_pos / in.block_tokens / b.partition_blocks());
}

bool same_reader(const AttendInput& a, const AttendInput& b) {
  return a.shape.head_dim == b.shape.head_dim && a.shape.n_heads == b.shape.n_heads &&
         a.shape.n_kv_heads == b.shape.n_kv_heads && a.block_tokens == b.block_tokens && a.rotate_k == b.rotate_k &&
         a.rotate_v == b.rotate_v && a.book == b.book && a.layer == b.layer;
}

// Leading partitions of `a` and `b` (up to `limit`) that are the same blocks:
// the same tiles (one pool, one block) with the same codecs.
int same_partitions(const AttendInput& a, const AttendInput& b, int limit) {
  const int H = a.shape.n_kv_heads, part = BlockAttend::partition_blocks(a.block_tokens);
  for (int p = 0; p < limit; ++p)
    for (int blk = p * part; blk < (p + 1) * part; ++blk) {
      if (!(a.k_codecs[blk] == b.k_codecs[blk]) || !(a.v_codecs[blk] == b.v_codecs[blk])) return p;
      for (int h = 0; h < H; ++h) {
        const std::size_t i = static_cast<std::size_t>(blk) * H + h;
        if (a.k_tiles[i] != b.k_tiles[i] || a.v_tiles[i] != b.v_tiles[i]) return p;
      }
    }
  return limit;
}

}  // namespace

// The shared partitions of a group of plans, read once for the queries of all
// of them stacked (every query sees every row: they lie before all queries).
class SharedBlockReads::Group final : public AttendWork {
 public:
  void prepare(const std::vector<BlockAttend*>& members, int parts) {
    members_ = members;
    parts_ = parts;
    const AttendInput& lead = members.front()->input();
    const int qd = lead.shape.q_dim();
    rows_.assign(1, 0);
    for (const BlockAttend* m : members) rows_.push_back(rows_.back() + m->input().n);
    const int n = rows_.back();
    q_.resize(static_cast<std::size_t>(n) * qd);
    for (std::size_t i = 0; i < members.size(); ++i)
      std::memcpy(&q_[static_cast<std::size_t>(rows_[i]) * qd], members[i]->input().q,
                  sizeof(float) * static_cast<std::size_t>(members[i]->input().n) * qd);
    in_ = lead;  // the leader's tile and codec arrays: the same blocks as every member's up to here
    in_.n_blocks = parts * BlockAttend::partition_blocks(lead.block_tokens);
    in_.first_pos = 0;
    in_.n = n;
    in_.q = q_.data();
    in_.out = nullptr;
    in_.causal = false;
    in_.key_end = in_.n_blocks * in_.block_tokens;
    ops_ = members.front()->ops();
    chunks_ = (n + kGroupChunk - 1) / kGroupChunk;
    slots_ = static_cast<std::size_t>(n) * static_cast<std::size_t>(lead.shape.n_heads);
    ml_.resize(slots_ * static_cast<std::size_t>(parts));
    o_.resize(ml_.size() * static_cast<std::size_t>(lead.shape.head_dim));
    for (BlockAttend* m : members) m->give_partitions(parts);
  }

  std::size_t jobs() const noexcept override {
    return static_cast<std::size_t>(in_.shape.n_kv_heads) * static_cast<std::size_t>(chunks_) *
           static_cast<std::size_t>(parts_);
  }
  double job_cost() const noexcept override {
    const int group = in_.shape.n_heads / in_.shape.n_kv_heads;
    return static_cast<double>(std::min(in_.n, kGroupChunk) * group) * BlockAttend::partition_blocks(in_.block_tokens) * in_.block_tokens *
           in_.shape.head_dim;
  }
  void run(std::size_t job) override {
    const auto parts = static_cast<std::size_t>(parts_), chunks = static_cast<std::size_t>(chunks_);
    const int p = static_cast<int>(job % parts);
    const int c = static_cast<int>(job / parts % chunks);
    const int h = static_cast<int>(job / parts / chunks);
    const int t0 = c * kGroupChunk, t1 = std::min(in_.n, t0 + kGroupChunk);
    const std::size_t at = slots_ * static_cast<std::size_t>(p);
    const int part = BlockAttend::partition_blocks(in_.block_tokens);
    attend_partition(in_, *ops_, h, t0, t1, p * part, (p + 1) * part, ml_.data() + at,
                     o_.data() + at * static_cast<std::size_t>(in_.shape.head_dim));
  }
  // Hands each member its queries' pieces; runs before the members' own
  // finish() (share() puts the group first), which merges them.
  void finish() override {
    const std::size_t H = static_cast<std::size_t>(in_.shape.n_heads), D = static_cast<std::size_t>(in_.shape.head_dim);
    for (std::size_t i = 0; i < members_.size(); ++i) {
      const std::size_t first = static_cast<std::size_t>(rows_[i]) * H;
      const std::size_t count = static_cast<std::size_t>(rows_[i + 1] - rows_[i]) * H;
      for (int p = 0; p < parts_; ++p) {
        const std::size_t at = slots_ * static_cast<std::size_t>(p) + first;
        std::copy_n(ml_.data() + at, count, members_[i]->partition_ml(p));
        std::copy_n(o_.data() + at * D, count * D, members_[i]->partition_o(p));
      }
    }
  }

 private:
  std::vector<BlockAttend*> members_;
  std::vector<int> rows_;  // member i's queries are rows [rows_[i], rows_[i + 1])
  AttendInput in_;
  const kernels::TileKernels* ops_ = nullptr;
  int parts_ = 0, chunks_ = 0;
  std::size_t slots_ = 0;
  std::vector<float> q_;
  std::vector<BlockAttend::Partial> ml_;
  std::vector<float> o_;
};

SharedBlockReads::SharedBlockReads() = default;
SharedBlockReads::~SharedBlockReads() = default;

int SharedBlockReads::share(std::vector<AttendWork*>& works) {
  used_ = 0;
  if (!shared_block_reads() || works.size() < 2) return 0;
  std::vector<BlockAttend*> open;  // plans not yet in a group
  for (AttendWork* w : works) {
    auto* b = dynamic_cast<BlockAttend*>(w);
    if (b != nullptr && shareable(*b) && whole_partitions(*b) > 0) open.push_back(b);
  }
  std::vector<AttendWork*> groups;
  while (open.size() >= 2) {
    // The first open plan leads; the others that start with its blocks join,
    // and the group shares the partitions that all of them have in common.
    BlockAttend* lead = open.front();
    std::vector<BlockAttend*> members{lead}, rest;
    int parts = whole_partitions(*lead);
    for (std::size_t i = 1; i < open.size(); ++i) {
      BlockAttend* b = open[i];
      const int same = same_reader(lead->input(), b->input())
                           ? same_partitions(lead->input(), b->input(), std::min(parts, whole_partitions(*b)))
                           : 0;
      if (same > 0 && b->ops() == lead->ops()) {
        members.push_back(b);
        parts = same;
      } else {
        rest.push_back(b);
      }
    }
    open = std::move(rest);
    if (members.size() < 2) continue;
    if (used_ == groups_.size()) groups_.push_back(std::make_unique<Group>());
    Group& g = *groups_[used_++];
    g.prepare(members, parts);
    groups.push_back(&g);
  }
  works.insert(works.begin(), groups.begin(), groups.end());
  return static_cast<int>(groups.size());
}

void set_shared_block_reads(bool on) noexcept { g_shared_reads.store(on, std::memory_order_relaxed); }
bool shared_block_reads() noexcept { return g_shared_reads.load(std::memory_order_relaxed); }

}  // namespace qkvshare::kv
