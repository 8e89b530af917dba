#pragma once
// The RoPE rows that keys=pre attention reads (kernels::rope_table_row, the
// engine's angles) for positions [0, positions()), one table per model's
// frequencies in the process, shared by every cache that reads such blocks.
// A table never changes once made; growing makes a bigger one (doubling), and
// whoever holds the old one keeps it until it lets go.
#include <memory>

#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare::kv {

class RopeTable {
 public:
  // A table of at least `positions` rows for these frequencies (thread-safe).
  static std::shared_ptr<const RopeTable> at_least(const KvRope& rope, int positions);

  int positions() const noexcept { return positions_; }
  // [positions][2 * head_dim]: row p is the table row of position p, and of -p.
  const float* rows() const noexcept { return rows_.data(); }
  const float* inverse_rows() const noexcept { return inverse_.data(); }

  RopeTable(const KvRope& rope, int positions);

 private:
  int positions_ = 0;
  std::vector<float> rows_, inverse_;
};

}  // namespace qkvshare::kv
