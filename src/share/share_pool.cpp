// SharePool: creating, validating and attaching regions, the KV arena, stats.
#include "qkvshare/share/share_pool.hpp"

#include <sys/random.h>

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

#include "qkvshare/core/error.hpp"
#include "share_impl.hpp"

namespace qkvshare {

using namespace share_detail;

namespace {

void check_config(const ShareConfig& c) {
  const auto in = [](int v, int lo, int hi) { return v >= lo && v <= hi; };
  if (!in(c.max_processes, 1, 4096) || !in(c.max_contexts, 1, 65536) || !in(c.max_grants, 1, 1 << 20) ||
      !in(c.max_tokens, 1, 1 << 24) || !in(c.reap_interval_ms, 1, 3600000) || !in(c.lease_ms, 1, 86400000))
    fail(ErrorCode::invalid_argument,
         "share pool limits out of range: {} processes [1, 4096], {} contexts [1, 65536], {} grants [1, 2^20], "
         "{} tokens per context [1, 2^24], reap interval {} ms [1, 3600000], lease {} ms [1, 86400000]",
         c.max_processes, c.max_contexts, c.max_grants, c.max_tokens, c.reap_interval_ms, c.lease_ms);
  if (c.block_tokens <= 0 || c.block_tokens > 4096 || (c.block_tokens & (c.block_tokens - 1)) != 0)
    fail(ErrorCode::invalid_argument, "share pool: block size {} is not a power of two in [1, 4096]", c.block_tokens);
}

Layout layout_of(const ShareConfig& c) {
  return layout_for(static_cast<std::uint32_t>(c.max_processes), static_cast<std::uint32_t>(c.max_contexts),
                    static_cast<std::uint32_t>(c.max_grants), static_cast<std::uint32_t>(c.max_tokens),
                    static_cast<std::uint32_t>(c.block_tokens));
}

void random_bytes(void* out, std::size_t n) {
  auto* p = static_cast<std::uint8_t*>(out);
  while (n > 0) {
    const ssize_t got = ::getrandom(p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      fail(ErrorCode::io, "getrandom failed: {}", std::strerror(errno));
    }
    p += got;
    n -= static_cast<std::size_t>(got);
  }
}

void format_region(ShmRegion& region, const ShareConfig& c, const Layout& l) {
  if (region.size() < l.dynamic + (std::size_t{1} << 16))
    fail(ErrorCode::invalid_argument,
         "share pool of {} bytes is too small: the registry for {} contexts of {} tokens takes {} bytes, "
         "leaving no room for KV",
         region.size(), c.max_contexts, c.max_tokens, l.dynamic);
  auto* h = new (region.data()) ShareHeader{};
  std::memcpy(h->magic, kShareMagic, sizeof kShareMagic);
  h->version = kShareVersion;
  h->header_bytes = kShareHeaderBytes;
  h->region_bytes = region.size();
  random_bytes(&h->pool_id, sizeof h->pool_id);
  random_bytes(h->secret, sizeof h->secret);
  h->max_processes = static_cast<std::uint32_t>(c.max_processes);
  h->max_contexts = static_cast<std::uint32_t>(c.max_contexts);
  h->max_grants = static_cast<std::uint32_t>(c.max_grants);
  h->max_tokens = static_cast<std::uint32_t>(c.max_tokens);
  h->block_tokens = static_cast<std::uint32_t>(c.block_tokens);
  h->reap_interval_ms = static_cast<std::uint32_t>(c.reap_interval_ms);
  h->lease_ms = static_cast<std::uint32_t>(c.lease_ms);
  h->processes_offset = l.processes;
  h->records_offset = l.records;
  h->grants_offset = l.grants;
  h->data_offset = l.data;
  h->data_stride = l.data_stride;
  h->dynamic_offset = l.dynamic;
  h->next_context_id = 1;
  RobustMutex::init(h->mutex);
  h->ready.store(1, std::memory_order_release);
}

// Every field of a region another process formatted is input (rule 5).
Layout validate_region(const ShmRegion& region) {
  const std::string& name = region.name().empty() ? std::string("(anonymous)") : region.name();
  if (region.size() < kShareHeaderBytes) fail(ErrorCode::io, "pool '{}': {} bytes, no header", name, region.size());
  const auto& h = *reinterpret_cast<const ShareHeader*>(region.data());
  if (std::memcmp(h.magic, kShareMagic, sizeof kShareMagic) != 0)
    fail(ErrorCode::io, "pool '{}': not a QKVShare pool (bad magic)", name);
  if (h.version != kShareVersion || h.header_bytes != kShareHeaderBytes)
    fail(ErrorCode::io, "pool '{}': version {} is not supported (this build uses {})", name, h.version, kShareVersion);
  if (h.region_bytes != region.size())
    fail(ErrorCode::io, "pool '{}': header says {} bytes, the mapping has {}", name, h.region_bytes, region.size());
  ShareConfig c;
  c.max_processes = static_cast<int>(std::min<std::uint32_t>(h.max_processes, 1u << 30));
  c.max_contexts = static_cast<int>(std::min<std::uint32_t>(h.max_contexts, 1u << 30));
  c.max_grants = static_cast<int>(std::min<std::uint32_t>(h.max_grants, 1u << 30));
  c.max_tokens = static_cast<int>(std::min<std::uint32_t>(h.max_tokens, 1u << 30));
  c.block_tokens = static_cast<int>(std::min<std::uint32_t>(h.block_tokens, 1u << 30));
  c.reap_interval_ms = static_cast<int>(std::min<std::uint32_t>(h.reap_interval_ms, 1u << 30));
  c.lease_ms = static_cast<int>(std::min<std::uint32_t>(h.lease_ms, 1u << 30));
  check_config(c);
  const Layout l = layout_of(c);
  if (h.processes_offset != l.processes || h.records_offset != l.records || h.grants_offset != l.grants ||
      h.data_offset != l.data || h.data_stride != l.data_stride || h.dynamic_offset != l.dynamic ||
      l.dynamic > region.size())
    fail(ErrorCode::io, "pool '{}': registry geometry is inconsistent", name);
  if (h.kv_state.load(std::memory_order_acquire) != 0) {
    const std::uint64_t nb = h.ledger_blocks;
    const std::uint64_t pool = round_up(l.dynamic + std::uint64_t{h.max_processes} * nb * 4, 4096);
    if (nb == 0 || nb > (1u << 28) || h.ledger_offset != l.dynamic ||
        h.pool_offset != pool || pool >= region.size() || h.pool_bytes != region.size() - pool)
      fail(ErrorCode::io, "pool '{}': KV arena geometry is inconsistent", name);
  }
  return l;
}

std::shared_ptr<SharePool> make_pool(std::shared_ptr<ShmRegion> region, std::unique_ptr<SharePool::Impl> impl) {
  const Layout l = validate_region(*region);
  impl->name = region->name().empty() ? "(anonymous)" : region->name();
  impl->reg = std::make_shared<Registry>(std::move(region), l);
  impl->reg->register_process();
  {
    RegistryLock lock(*impl->reg);
    impl->reg->reap_locked();
  }
  return std::shared_ptr<SharePool>(new SharePool(std::move(impl)));
}

}  // namespace

SharePool::SharePool(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SharePool::~SharePool() = default;

std::shared_ptr<SharePool> SharePool::create(const std::string& name, const ShareConfig& config) {
  check_config(config);
  auto region = ShmRegion::create(name, config.bytes);
  try {
    format_region(*region, config, layout_of(config));
    return make_pool(region, std::make_unique<Impl>());
  } catch (...) {
    ShmRegion::unlink(name);
    throw;
  }
}

bool SharePool::unlink_if_same(const std::string& name, std::uint64_t pool_id) noexcept {
  try {
    const auto region = ShmRegion::open(name);
    if (region->size() < sizeof(ShareHeader)) return false;
    const auto& h = *reinterpret_cast<const ShareHeader*>(region->data());
    if (std::memcmp(h.magic, kShareMagic, sizeof kShareMagic) != 0 || h.pool_id != pool_id) return false;
    return ShmRegion::unlink(name);
  } catch (const Error&) {
    return false;  // gone already, or not ours to judge
  }
}

std::shared_ptr<SharePool> SharePool::create_anonymous(const ShareConfig& config) {
  check_config(config);
  auto region = ShmRegion::anonymous(config.bytes);
  format_region(*region, config, layout_of(config));
  return make_pool(std::move(region), std::make_unique<Impl>());
}

std::shared_ptr<SharePool> SharePool::attach(const std::string& name) {
  // A pool being created is sized and formatted right after its name
  // appears: wait a little for it instead of failing.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (;;) {
    std::shared_ptr<ShmRegion> region;
    try {
      region = ShmRegion::open(name);
    } catch (const Error& e) {
      if (std::strstr(e.what(), "is empty") == nullptr || std::chrono::steady_clock::now() > deadline) throw;
    }
    if (region && region->size() >= kShareHeaderBytes &&
        reinterpret_cast<const ShareHeader*>(region->data())->ready.load(std::memory_order_acquire) == 1)
      return attach_region(std::move(region));
    if (std::chrono::steady_clock::now() > deadline)
      fail(ErrorCode::io, "pool '{}' was never initialised (its creator died?); remove /dev/shm/qkvshare.{}", name, name);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::shared_ptr<SharePool> SharePool::attach_region(std::shared_ptr<ShmRegion> region) {
  return make_pool(std::move(region), std::make_unique<Impl>());
}

const std::shared_ptr<ShmRegion>& SharePool::region() const noexcept { return impl_->reg->region(); }
std::uint64_t SharePool::pool_id() const noexcept { return impl_->h().pool_id; }
int SharePool::max_tokens() const noexcept { return static_cast<int>(impl_->h().max_tokens); }

namespace {

// A pool formatted without windows (by an import, which names none) serves a
// windowed model too: it never frees windowed layers. One formatted with
// windows serves only the same windows, as its blocks may lack those layers.
bool same_shape(const KvShape& have, const KvShape& want) {
  return have.same_dims(want) && (have.layer_window.empty() || have.layer_window == want.layer_window);
}

// Lays out [ledger][KvPool arena] in the dynamic part. The
// ledger's size depends on the pool's block count, which depends on the
// arena's size: format once over everything to learn the count, then again
// in what the ledger leaves (which can only hold fewer blocks).
void format_kv_locked(Registry& reg, const KvShape& shape) {
  ShareHeader& h = reg.header();
  ShmRegion& region = *reg.region();
  const std::uint64_t dyn = h.dynamic_offset, size = region.size();
  const PoolConfig config{shape, static_cast<int>(h.block_tokens), 0};
  std::uint64_t nb = 0;
  {
    auto probe = KvPool::create(config, std::make_unique<SubArena>(nullptr, region.data() + dyn, size - dyn));
    nb = probe->counters().blocks_total;
  }
  const std::uint64_t pool_offset = round_up(dyn + std::uint64_t{h.max_processes} * nb * 4, 4096);
  if (pool_offset + 4096 >= size)
    fail(ErrorCode::out_of_memory, "pool '{}' of {} bytes has no room for KV after its ledgers", region.name(), size);
  auto lock = std::make_unique<RobustPoolLock>();
  RobustPoolLock* raw = lock.get();
  auto pool = KvPool::create(config, std::make_unique<SubArena>(nullptr, region.data() + pool_offset, size - pool_offset),
                             std::move(lock));
  RobustMutex::init(pool->lock_area());
  raw->bind(pool->lock_area(), [p = pool.get()] { p->rebuild_free_lists(); });
  QKV_CHECK(pool->counters().blocks_total <= nb);
  std::memset(region.data() + dyn, 0, pool_offset - dyn);
  h.ledger_blocks = static_cast<std::uint32_t>(nb);
  h.ledger_offset = dyn;
  h.pool_offset = pool_offset;
  h.pool_bytes = size - pool_offset;
  h.kv_state.store(1, std::memory_order_release);
}

}  // namespace

std::shared_ptr<KvPool> SharePool::kv_pool(const KvShape& shape) {
  std::lock_guard guard(impl_->kv_mutex);
  if (!impl_->kv) {
    Registry& reg = *impl_->reg;
    RegistryLock lock(reg);
    if (impl_->h().kv_state.load(std::memory_order_acquire) == 0) format_kv_locked(reg, shape);
    reg.bind_ledger();
    const ShareHeader& h = impl_->h();
    auto plock = std::make_unique<RobustPoolLock>();
    RobustPoolLock* raw = plock.get();
    // The arena keeps the registry (this process's ledger) alive as long as
    // the pool, i.e. as long as any session of this process.
    auto pool = KvPool::attach(
        std::make_unique<SubArena>(impl_->reg, reg.region()->data() + h.pool_offset, h.pool_bytes), std::move(plock));
    raw->bind(pool->lock_area(), [p = pool.get()] { p->rebuild_free_lists(); });
    pool->set_ledger(impl_->reg.get());
    reg.set_pool(pool);
    impl_->kv = std::move(pool);
  }
  const KvShape& have = impl_->kv->shape();
  if (shape.n_layers != 0 && !same_shape(have, shape))
    fail(ErrorCode::invalid_argument,
         "pool '{}' holds KV for {} layers, {} heads, {} KV heads of {} dims (largest window {}); this model has {}, "
         "{}, {}, {} ({})",
         impl_->name, have.n_layers, have.n_heads, have.n_kv_heads, have.head_dim, have.max_window(), shape.n_layers,
         shape.n_heads, shape.n_kv_heads, shape.head_dim,
         have.layer_window == shape.layer_window ? "same" : "other sliding windows");
  return impl_->kv;
}

std::shared_ptr<KvPool> SharePool::kv_pool_if_any() {
  if (impl_->h().kv_state.load(std::memory_order_acquire) == 0) return nullptr;
  return kv_pool(KvShape{});
}

void SharePool::Impl::maybe_reap() {
  ShareHeader& hd = h();
  const std::uint64_t now = monotonic_ns();
  reg->process(reg->slot()).heartbeat_ns.store(now, std::memory_order_relaxed);
  std::uint64_t last = hd.last_reap_ns.load(std::memory_order_relaxed);
  if (now - last < std::uint64_t{hd.reap_interval_ms} * 1000000u) return;
  if (!hd.last_reap_ns.compare_exchange_strong(last, now, std::memory_order_relaxed)) return;
  RegistryLock lock(*reg);
  reg->reap_locked();
}

int SharePool::reap() {
  RegistryLock lock(*impl_->reg);
  return impl_->reg->reap_locked();
}

void SharePool::count(FallbackReason reason) noexcept {
  Registry& r = *impl_->reg;
  r.bump(kOpensText);
  switch (reason) {
    case FallbackReason::model: r.bump(kFallbackModel); break;
    case FallbackReason::format: r.bump(kFallbackFormat); break;
    case FallbackReason::checksum: r.bump(kFallbackChecksum); break;
    case FallbackReason::shape: r.bump(kFallbackShape); break;
    case FallbackReason::requested: r.bump(kTextRequested); break;
    case FallbackReason::none: break;
  }
}

std::string_view to_string(FallbackReason reason) noexcept {
  switch (reason) {
    case FallbackReason::none: return "none";
    case FallbackReason::model: return "model fingerprint differs";
    case FallbackReason::format: return "unknown KV format";
    case FallbackReason::checksum: return "checksum mismatch";
    case FallbackReason::shape: return "pool KV shape differs from the model";
    case FallbackReason::requested: return "text mode requested";
  }
  return "unknown";
}

ShareStats SharePool::stats() {
  auto pool = kv_pool_if_any();
  Registry& reg = *impl_->reg;
  const ShareHeader& h = impl_->h();
  ShareStats s;
  s.name = impl_->name;
  s.pool_id = h.pool_id;
  s.region_bytes = reg.region()->size();
  s.max_processes = static_cast<int>(h.max_processes);
  s.max_contexts = static_cast<int>(h.max_contexts);
  s.max_grants = static_cast<int>(h.max_grants);
  s.max_tokens = static_cast<int>(h.max_tokens);
  s.block_tokens = static_cast<int>(h.block_tokens);
  if (pool) {
    s.kv_formatted = true;
    s.shape = pool->shape();
    s.kv = pool->counters();
  }
  {
    RegistryLock lock(reg);
    for (std::uint32_t i = 0; i < h.max_processes; ++i) s.processes += reg.process(i).state.load() != kProcFree;
    for (std::uint32_t i = 0; i < h.max_contexts; ++i) s.contexts += reg.record(i).state == kRecSealed;
    for (std::uint32_t i = 0; i < h.max_grants; ++i) s.grants += reg.grant(i).state == kGrantLive;
  }
  s.lease_ms = static_cast<int>(h.lease_ms);
  for (const GrantInfo& g : grants()) {
    s.grants_held += g.state == GrantStatus::held;
    s.grants_idle += g.state == GrantStatus::idle;
  }
  const auto c = [&](CounterIndex i) { return h.counters[i].load(std::memory_order_relaxed); };
  s.counters = ShareCounters{c(kSeals),          c(kGrants),           c(kOpensKv),          c(kOpensText),
                             c(kFallbackModel),  c(kFallbackFormat),   c(kFallbackChecksum), c(kFallbackShape),
                             c(kTextRequested),  c(kReleases),         c(kRevokes),          c(kRejected),
                             c(kProcessesReaped), c(kReferencesReaped), c(kGrantsReaped)};
  return s;
}

std::string ShareStats::json() const {
  nlohmann::json j;
  j["name"] = name;
  j["pool_id"] = fmt::format("{:016x}", pool_id);
  j["region_bytes"] = region_bytes;
  j["limits"] = {{"processes", max_processes}, {"contexts", max_contexts}, {"grants", max_grants},
                 {"tokens_per_context", max_tokens}, {"block_tokens", block_tokens}};
  j["live"] = {{"processes", processes}, {"contexts", contexts}, {"grants", grants},
               {"grants_held", grants_held}, {"grants_idle", grants_idle}};
  j["lease_ms"] = lease_ms;
  if (kv_formatted) {
    j["kv"] = {{"shape", {{"layers", shape.n_layers}, {"heads", shape.n_heads}, {"kv_heads", shape.n_kv_heads},
                          {"head_dim", shape.head_dim}}},
               {"blocks_total", kv.blocks_total}, {"blocks_used", kv.blocks_used}, {"blocks_free", kv.blocks_free},
               {"pages_total", kv.pages_total}, {"pages_free", kv.pages_free}, {"page_bytes", kv.page_bytes},
               {"bytes_used", kv.bytes_used}, {"allocations", kv.allocations}, {"frees", kv.frees}};
  } else {
    j["kv"] = nullptr;
  }
  const ShareCounters& c = counters;
  j["counters"] = {{"seals", c.seals}, {"grants", c.grants}, {"opens_kv", c.opens_kv}, {"opens_text", c.opens_text},
                   {"fallback_model", c.fallback_model}, {"fallback_format", c.fallback_format},
                   {"fallback_checksum", c.fallback_checksum}, {"fallback_shape", c.fallback_shape},
                   {"text_requested", c.text_requested}, {"releases", c.releases}, {"revokes", c.revokes},
                   {"rejected", c.rejected}, {"processes_reaped", c.processes_reaped},
                   {"references_reaped", c.references_reaped}, {"grants_reaped", c.grants_reaped}};
  return j.dump(2);
}

}  // namespace qkvshare
