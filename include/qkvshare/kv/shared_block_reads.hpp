#pragma once
// Sessions forked from one context (W2's fan-out, a server's requests on one
// prefix) hold the same pool blocks for that prefix, and each decode step of
// each session used to read all of them through its own attention: B sessions,
// B reads of the prefix per layer. SharedBlockReads finds, among one layer's
// plans, the ones that read the same full blocks before their queries and
// reads those blocks once for all of their queries (every query head of every
// session against each decoded tile), leaving each plan the rest. The pieces
// are the ones each plan would have computed (per-query arithmetic, merged in
// the plan's own order), so a session's results keep their bits whatever the
// batch. As Hydragen's / FlashInfer's cascade attention do for a shared prefix.
#include <memory>
#include <vector>

#include "qkvshare/kv/kv_cache.hpp"

namespace qkvshare::kv {

class SharedBlockReads {
 public:
  SharedBlockReads();
  ~SharedBlockReads();
  SharedBlockReads(const SharedBlockReads&) = delete;
  SharedBlockReads& operator=(const SharedBlockReads&) = delete;

  // After plan_attend of every cache for one layer: groups the plans that
  // share blocks, puts one work per group before them in `works` and takes
  // those blocks out of the plans. The groups live until the next share().
  // Returns the number of groups (0: nothing shared, `works` unchanged).
  int share(std::vector<AttendWork*>& works);

 private:
  class Group;
  std::vector<std::unique_ptr<Group>> groups_;
  std::size_t used_ = 0;
};

// Whether the engine shares block reads between the sessions of a batch (the
// default) or lets each session read every block itself (the earlier
// behaviour, kept to measure one against the other). Process-wide.
void set_shared_block_reads(bool on) noexcept;
bool shared_block_reads() noexcept;

}  // namespace qkvshare::kv
