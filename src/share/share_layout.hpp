#pragma once
// The byte layout of a shared region (docs/handoff.md "Shared region"):
//
//   [ShareHeader, 4 KiB: magic, version, geometry, pool id, MAC secret,
//    counters, the registry's robust mutex]
//   [ProcessSlot x max_processes]          who is attached (pid + start time)
//   [ContextRecord x max_contexts]         sealed contexts
//   [GrantSlot x max_grants]               descriptors issued
//   [record data x max_contexts]           block table, segment table, token ids, text
//   --- formatted by the first model that uses the region ---
//   [ledger: max_processes x ledger_blocks x u32]   references each process holds
//   [KvPool arena]                                   (kv/kv_pool.hpp; unchanged)
//
// Offsets, never pointers. Everything but the atomics and the heartbeat is
// changed only under the registry mutex.
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "qkvshare/share/descriptor.hpp"
#include "qkvshare/share/shm_region.hpp"

namespace qkvshare::share_detail {

inline constexpr char kShareMagic[8] = {'Q', 'K', 'V', 'S', 'H', 'A', 'R', 'E'};
inline constexpr std::uint32_t kShareVersion = 5;  // 2: grants record their holder process; 3: segment tables;
                                                   // 4: block checksums kept in the KV pool, not here;
                                                   // 5: grants record their opener and last use (leases)
inline constexpr std::size_t kShareHeaderBytes = 4096;
inline constexpr std::uint32_t kNone = 0xffffffffu;
inline constexpr std::size_t kSecretBytes = 32;
inline constexpr std::size_t kTextBytesPerToken = 8;

enum CounterIndex : std::size_t {
  kSeals, kGrants, kOpensKv, kOpensText, kFallbackModel, kFallbackFormat, kFallbackChecksum, kFallbackShape,
  kTextRequested, kReleases, kRevokes, kRejected, kProcessesReaped, kReferencesReaped, kGrantsReaped, kCounterCount
};

struct ShareHeader {
  char magic[8];
  std::uint32_t version, header_bytes;
  std::uint64_t region_bytes;
  std::uint64_t pool_id;
  std::uint8_t secret[kSecretBytes];
  std::uint32_t max_processes, max_contexts, max_grants, max_tokens, block_tokens, reap_interval_ms, lease_ms;
  std::uint64_t processes_offset, records_offset, grants_offset, data_offset, data_stride, dynamic_offset;
  // Written once, under the mutex, by the first model (kv_state 0 -> 1).
  std::atomic<std::uint32_t> kv_state;
  std::uint32_t ledger_blocks;
  std::uint64_t ledger_offset, pool_offset, pool_bytes;
  std::uint64_t next_context_id;
  std::atomic<std::uint64_t> last_reap_ns;
  std::atomic<std::uint32_t> ready;  // stored last by the creator
  std::atomic<std::uint64_t> counters[kCounterCount];
  alignas(64) std::byte mutex[RobustMutex::kBytes];
};
static_assert(sizeof(ShareHeader) <= kShareHeaderBytes);

enum ProcessState : std::uint32_t { kProcFree = 0, kProcLive = 1, kProcExited = 2 };

struct ProcessSlot {
  std::atomic<std::uint32_t> state;
  std::uint32_t pid;
  std::uint64_t start_ticks;  // /proc/PID/stat field 22: tells a reused pid apart
  std::atomic<std::uint64_t> heartbeat_ns;
  std::uint64_t registered_unix_ns;
  std::uint8_t pad[32];
};
static_assert(sizeof(ProcessSlot) == 64);

enum RecordState : std::uint32_t { kRecFree = 0, kRecSealing = 1, kRecSealed = 2, kRecReleasing = 3 };

struct ContextRecord {
  std::uint32_t generation;   // moves on when the record is freed: old descriptors go stale
  std::uint32_t state;
  std::uint32_t owner_slot;   // process holding the producer's claim, or kNone
  std::uint32_t grants;       // live grants naming this record
  std::uint32_t retained;     // table entries whose block reference the record holds
  std::uint32_t token_count, block_count, block_tokens;
  std::uint32_t k_codec, v_codec, window, sink, format_flags, text_bytes;
  std::uint64_t context_id;
  std::uint8_t model_fp[16];
  std::uint64_t tokenizer_fp;
  std::uint64_t blocks_checksum, table_checksum, tokens_checksum, text_checksum;
  std::uint64_t created_unix_ns;
  char producer[32];
  std::uint32_t position_begin;  // where the first token's key was rotated (a spliced context's tail)
  std::uint32_t lo_k_codec, lo_v_codec, top_millionths;  // mixed precision (Descriptor's fields); 0 otherwise
  std::uint32_t segment_count;  // entries of the record's segment table
  std::uint32_t position_gap;   // positions dropped with their neighbours' kept (PooledKvCache::position_gap)
  std::uint64_t codebook_id;    // a pq format's KvCodebook::id() (Descriptor's field); 0 otherwise
};
static_assert(sizeof(ContextRecord) == 192);

enum GrantState : std::uint32_t { kGrantFree = 0, kGrantLive = 1 };

// A grant is in the custody of the process that issued it until a process
// opens it to hold it (GrantUse::hold): then it is the opener's. A clean exit
// of the holder hands it to whoever carries the descriptor (kNone); a crash
// voids it: an issuer's grant may never have been seen by anyone, and an
// opener's would otherwise wait for an orchestrator that may never come.
struct GrantSlot {
  std::uint32_t generation;
  std::uint32_t state;
  std::uint32_t record_slot, record_generation;
  char grantee[32];
  std::uint32_t holder_slot;
  std::uint32_t opened;                   // 1 once opened to hold: holder_slot is its opener
  std::atomic<std::uint64_t> touched_ns;  // the holder's last use (monotonic): its lease runs from here
};
static_assert(sizeof(GrantSlot) == 64);

struct TableEntry {
  std::uint32_t index, generation;
};

// A run of the block table as a KvSegment: table entries [table_begin,
// table_begin + blocks), `tokens` tokens from row `first_row`, moved by
// `position_offset` positions from where its keys were rotated.
struct SegmentEntry {
  std::uint32_t table_begin, blocks, first_row, tokens;
  std::int32_t position_offset;
  std::uint32_t pad;
};
static_assert(sizeof(SegmentEntry) == 24);
// Segments of one sealed context (a spliced context has two per splice, an
// evicted one one per kept run of blocks); each may start and end inside a
// block, hence two table entries more per segment than whole blocks.
inline constexpr std::uint32_t kMaxRecordSegments = kMaxContextSegments;


// Geometry that follows from the configuration alone.
struct Layout {
  std::uint64_t processes = 0, records = 0, grants = 0, data = 0, data_stride = 0, dynamic = 0;
  std::uint32_t max_blocks = 0;
  std::uint64_t table_bytes = 0, segment_bytes = 0, token_bytes = 0, text_bytes = 0;
};

inline std::uint64_t round_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) / a * a; }

inline Layout layout_for(std::uint32_t processes, std::uint32_t contexts, std::uint32_t grants, std::uint32_t tokens,
                         std::uint32_t block_tokens) {
  Layout l;
  l.max_blocks = (tokens + block_tokens - 1) / block_tokens + 2 * kMaxRecordSegments;
  l.table_bytes = round_up(std::uint64_t{l.max_blocks} * sizeof(TableEntry), 64);
  l.segment_bytes = round_up(std::uint64_t{kMaxRecordSegments} * sizeof(SegmentEntry), 64);
  l.token_bytes = round_up(std::uint64_t{tokens} * 4, 64);
  l.text_bytes = round_up(std::uint64_t{tokens} * kTextBytesPerToken, 64);
  l.processes = kShareHeaderBytes;
  l.records = round_up(l.processes + std::uint64_t{processes} * sizeof(ProcessSlot), 64);
  l.grants = round_up(l.records + std::uint64_t{contexts} * sizeof(ContextRecord), 64);
  l.data = round_up(l.grants + std::uint64_t{grants} * sizeof(GrantSlot), 64);
  l.data_stride = l.table_bytes + l.segment_bytes + l.token_bytes + l.text_bytes;
  l.dynamic = round_up(l.data + std::uint64_t{contexts} * l.data_stride, 4096);
  return l;
}

}  // namespace qkvshare::share_detail
