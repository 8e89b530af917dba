// Leases: how recently the holder of an opened grant used it, and the
// listing of grants by holder and lease state (docs/handoff.md "Leases").
#include <cstring>

#include "share_impl.hpp"

namespace qkvshare {

using namespace share_detail;

namespace {

// Renews one grant's lease from an opened cache's commits. Rate limited to
// eight renewals per lease, so a decode step pays one clock read; the
// registry it keeps alive keeps the region mapped as long as the cache.
class LeaseRenewal final : public CommitHook {
 public:
  LeaseRenewal(std::shared_ptr<Registry> reg, std::uint32_t slot, std::uint32_t generation, std::uint64_t every_ns)
      : reg_(std::move(reg)), slot_(slot), generation_(generation), every_ns_(every_ns) {}

  void committed() noexcept override {
    const std::uint64_t now = monotonic_ns();
    std::uint64_t last = last_ns_.load(std::memory_order_relaxed);
    if (now - last < every_ns_ || !last_ns_.compare_exchange_strong(last, now, std::memory_order_relaxed)) return;
    // Under the registry mutex, which every change of a grant slot holds: a
    // grant that ended (its slot maybe reused) since the open renews nothing.
    try {
      RegistryLock lock(*reg_);
      GrantSlot& g = reg_->grant(slot_);
      if (g.generation == generation_ && g.state == kGrantLive) g.touched_ns.store(now, std::memory_order_relaxed);
    } catch (...) {  // a lease not renewed only makes the context a victim sooner
    }
  }

 private:
  std::shared_ptr<Registry> reg_;
  std::uint32_t slot_, generation_;
  std::uint64_t every_ns_;
  std::atomic<std::uint64_t> last_ns_{0};
};

}  // namespace

std::shared_ptr<CommitHook> SharePool::Impl::lease_renewal(const Descriptor& d) const {
  const std::uint64_t lease_ns = std::uint64_t{h().lease_ms} * 1000000u;
  return std::make_shared<LeaseRenewal>(reg, d.grant_slot, d.grant_generation, lease_ns / 8);
}

std::string_view to_string(GrantStatus state) noexcept {
  switch (state) {
    case GrantStatus::issued: return "issued";
    case GrantStatus::held: return "held";
    case GrantStatus::idle: return "idle";
    case GrantStatus::delivered: return "delivered";
  }
  return "unknown";
}

int SharePool::lease_ms() const noexcept { return static_cast<int>(impl_->h().lease_ms); }

void SharePool::touch(const Descriptor& d) noexcept {
  if (d.pool_id != impl_->h().pool_id || d.grant_slot >= impl_->h().max_grants) return;
  try {
    RegistryLock lock(*impl_->reg);
    GrantSlot& g = impl_->reg->grant(d.grant_slot);
    if (g.generation == d.grant_generation && g.state == kGrantLive)
      g.touched_ns.store(monotonic_ns(), std::memory_order_relaxed);
  } catch (...) {  // as in LeaseRenewal: the lease simply runs on
  }
}

std::vector<GrantInfo> SharePool::grants() {
  Registry& reg = *impl_->reg;
  const ShareHeader& hd = impl_->h();
  const std::uint64_t lease_ns = std::uint64_t{hd.lease_ms} * 1000000u;
  std::vector<GrantInfo> out;
  RegistryLock lock(reg);
  const std::uint64_t now = monotonic_ns();
  for (std::uint32_t i = 0; i < hd.max_grants; ++i) {
    const GrantSlot& g = reg.grant(i);
    if (g.state != kGrantLive || g.record_slot >= hd.max_contexts) continue;
    const ContextRecord& rec = reg.record(g.record_slot);
    GrantInfo info;
    info.slot = i;
    info.generation = g.generation;
    info.context_id = rec.generation == g.record_generation ? rec.context_id : 0;
    info.producer = std::string(rec.producer, strnlen(rec.producer, sizeof rec.producer));
    info.grantee = std::string(g.grantee, strnlen(g.grantee, sizeof g.grantee));
    const std::uint64_t touched = g.touched_ns.load(std::memory_order_relaxed);
    const std::uint64_t idle = now > touched ? now - touched : 0;
    info.idle_ms = idle / 1000000u;
    const bool has_holder = g.holder_slot < hd.max_processes;
    const bool alive = has_holder && reg.alive(g.holder_slot);
    if (alive) info.holder_pid = static_cast<int>(reg.process(g.holder_slot).pid);
    if (g.opened == 0)
      info.state = GrantStatus::issued;
    else if (!alive)
      info.state = GrantStatus::delivered;
    else
      info.state = idle > lease_ns ? GrantStatus::idle : GrantStatus::held;
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace qkvshare
