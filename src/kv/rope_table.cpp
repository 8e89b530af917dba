#include "rope_table.hpp"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "qkvshare/kernels/kv_tiles.hpp"

namespace qkvshare::kv {

RopeTable::RopeTable(const KvRope& rope, int positions) : positions_(positions) {
  const int head_dim = static_cast<int>(rope.inv_freq.size()) * 2;
  const std::size_t per = 2 * static_cast<std::size_t>(head_dim);
  rows_.resize(static_cast<std::size_t>(positions) * per);
  inverse_.resize(rows_.size());
  for (int p = 0; p < positions; ++p) {
    kernels::rope_table_row(static_cast<float>(p), rope.inv_freq.data(), head_dim, rope.style,
                            &rows_[static_cast<std::size_t>(p) * per]);
    kernels::rope_table_row(-static_cast<float>(p), rope.inv_freq.data(), head_dim, rope.style,
                            &inverse_[static_cast<std::size_t>(p) * per]);
  }
}

std::shared_ptr<const RopeTable> RopeTable::at_least(const KvRope& rope, int positions) {
  using Key = std::tuple<int, std::vector<float>>;
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<const RopeTable>> tables;
  const std::lock_guard lock(mu);
  std::shared_ptr<const RopeTable>& t = tables[Key{static_cast<int>(rope.style), rope.inv_freq}];
  if (!t || t->positions() < positions)
    t = std::make_shared<const RopeTable>(rope, std::max(positions, t ? 2 * t->positions() : 1024));
  return t;
}

}  // namespace qkvshare::kv
