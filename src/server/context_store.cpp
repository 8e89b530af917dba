#include "qkvshare/server/context_store.hpp"

#include <charconv>
#include <set>

#include "qkvshare/server/api.hpp"
#include "qkvshare/share/fingerprint.hpp"
#include "qkvshare/share/handoff.hpp"

namespace qkvshare::server {

namespace {

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string handle_of(const Descriptor& d) {
  const DescriptorBytes b = d.encode();
  return encode_handle(std::vector<std::uint8_t>(b.begin(), b.end()));
}

[[noreturn]] void not_found(const std::string& param, const std::string& message) {
  throw ApiError(404, "not_found_error", param, message);
}

// Seal/grant fail with out_of_memory when the registry is full; evicting a
// cached context frees a record and its grants, so retry after each one.
template <typename F>
auto with_eviction(F&& f, const std::function<bool()>& evict) {
  for (;;) {
    try {
      return f();
    } catch (const Error& e) {
      if (e.code() != ErrorCode::out_of_memory || !evict()) throw;
    }
  }
}

}  // namespace

ContextStore::ContextStore(std::shared_ptr<SharePool> pool, Engine& engine, StoreOptions options)
    : pool_(std::move(pool)), engine_(engine), options_(options), fingerprint_(model_fingerprint(engine.model())),
      index_(pool_->kv_pool(engine.kv_shape())->block_tokens()) {
  if (options_.budget_bytes == 0) options_.budget_bytes = pool_->kv_pool(engine.kv_shape())->counters().arena_bytes / 4 * 3;
  if (!options_.spill_dir.empty()) {
    disk_ = std::make_unique<DiskTier>(options_.spill_dir, options_.cipher);
    claim_spill_dir();
  }
}

ContextStore::~ContextStore() {
  release_all();
  release_spill_dir();
}

void ContextStore::release_all() {
  std::lock_guard lock(mu_);
  while (!entries_.empty()) drop_locked(entries_.begin()->first);
}

std::string ContextStore::name_of(std::uint64_t id) { return fmt::format("ctx-{:016x}", id); }

std::string ContextStore::partition(const std::string& tenant, const KvFormat& format) const {
  return tenant + "\n" + format.to_string();
}

SealedInfo ContextStore::add(const std::string& owner, const Session& session,
                             const std::vector<std::string>& grant_to, bool index, std::optional<TokenId> pending) {
  const auto* cache = dynamic_cast<const PooledKvCache*>(&session.cache());
  QKV_CHECK(cache != nullptr);
  std::lock_guard lock(mu_);
  return add_locked(owner, *cache, session.tokens(), grant_to, index, pending);
}

SealedInfo ContextStore::add_locked(const std::string& owner, const PooledKvCache& cache, std::span<const TokenId> tokens,
                                    const std::vector<std::string>& grant_to, bool index,
                                    std::optional<TokenId> pending) {
  const auto evict = [this] { return evict_one_locked(); };
  const std::string text = engine_.model().tokenizer().decode(tokens);
  const SealedContext sealed =
      with_eviction([&] { return pool_->seal(cache, tokens, text, fingerprint_, owner); }, evict);
  Entry e;
  e.owner = owner;
  e.sealed = sealed;
  e.tokens.assign(tokens.begin(), tokens.end());
  e.pending = pending;
  // The cache's own format, not the request's: a context demoted while a
  // request opened it is continued (and stored) in its new format.
  const KvFormat format = cache.format();
  e.format = format;
  e.bytes = cache.kv_bytes();
  for (const KvSegment& s : cache.segments()) {
    e.blocks += static_cast<int>(s.blocks.size());
    for (const BlockRef& b : s.blocks) e.block_index.push_back(b.index);
  }
  e.created_ms = now_ms();
  e.last_used = ++clock_;
  try {
    e.own = with_eviction([&] { return pool_->grant(sealed, owner, owner); }, evict);
    for (const std::string& g : grant_to)
      if (g != owner) e.grants[g] = with_eviction([&] { return pool_->grant(sealed, owner, g); }, evict);
  } catch (...) {
    pool_->revoke(sealed);
    throw;
  }
  SealedInfo info{sealed.context_id, name_of(sealed.context_id), handle_of(e.own), sealed.tokens, format.to_string(), {}};
  for (const auto& [agent, d] : e.grants) info.grants.emplace_back(agent, handle_of(d));
  e.indexed = index && options_.auto_reuse;
  if (e.indexed) index_.insert(sealed.context_id, partition(owner, format), e.tokens);
  entries_.emplace(sealed.context_id, std::move(e));
  return info;
}

ContextStore::Entry& ContextStore::visible(const std::string& tenant, std::uint64_t id, const std::string& param) {
  const auto it = entries_.find(id);
  if (it == entries_.end() || (it->second.owner != tenant && !it->second.grants.count(tenant)))
    not_found(param, fmt::format("context {} does not exist for this API key (it was released, evicted, or never "
                                     "granted to tenant '{}')", name_of(id), tenant));
  it->second.last_used = ++clock_;
  return it->second;
}

std::uint64_t ContextStore::resolve(const std::string& tenant, const std::string& ref, const std::string& param) {
  if (ref.rfind("ctx-", 0) == 0) {
    std::uint64_t id = 0;
    const char* b = ref.data() + 4;
    const char* end = ref.data() + ref.size();
    const auto [p, ec] = std::from_chars(b, end, id, 16);
    if (ec != std::errc() || p != end || ref.size() != 20)
      bad_request(param, fmt::format("'{}': {} is not a context id (ctx- and 16 hex digits)", param, quote_input(ref)));
    std::lock_guard lock(mu_);
    visible(tenant, id, param);
    return id;
  }
  const std::vector<std::uint8_t> bytes = decode_handle(ref, param);
  Descriptor d;
  try {
    d = Descriptor::decode(bytes, param);
  } catch (const Error& e) {
    bad_request(param, e.what());
  }
  if (d.grantee != tenant)
    not_found(param, fmt::format("'{}': this handle was granted to {}, not to tenant '{}'", param, quote_input(d.grantee), tenant));
  const DescriptorStatus st = pool_->check(d);
  if (!st.pool_matches || !st.capability_valid || !st.live)
    not_found(param, fmt::format("'{}': the handle is not valid here: {}", param, st.problem));
  std::lock_guard lock(mu_);
  // A context restored from disk keeps its store id but has a new pool id.
  for (const auto& [id, e] : entries_)
    if (!e.on_disk && e.sealed.context_id == d.context_id) {
      visible(tenant, id, param);
      return id;
    }
  // Made by another process on this pool (e.g. `qkvshare generate --publish
  // --grant TENANT`): take it over as this tenant's context, on its blocks.
  OpenedContext oc = pool_->open(d, tenant, /*want_kv=*/true, engine_.model().config().context_length);
  if (!oc.cache)
    not_found(param, fmt::format("'{}': context {} cannot be used on its KV here: {}", param, d.context_id, oc.refused_detail));
  oc.cache->set_rope(engine_.rope());
  const SealedInfo info = add_locked(tenant, *oc.cache, oc.tokens, {}, true);
  pool_->release(d, tenant);  // the grantee is done with the foreign descriptor
  return info.id;
}

std::vector<TokenId> ContextStore::tokens(std::uint64_t id) {
  std::lock_guard lock(mu_);
  const auto it = entries_.find(id);
  if (it == entries_.end()) not_found("qkvshare.context", fmt::format("context {} was released or evicted", name_of(id)));
  return it->second.tokens;
}

std::vector<TokenId> ContextStore::transcript(std::uint64_t id) {
  std::lock_guard lock(mu_);
  const auto it = entries_.find(id);
  if (it == entries_.end()) not_found("qkvshare.context", fmt::format("context {} was released or evicted", name_of(id)));
  std::vector<TokenId> out = it->second.tokens;
  if (it->second.pending) out.push_back(*it->second.pending);
  return out;
}

KvFormat ContextStore::format(std::uint64_t id) {
  std::lock_guard lock(mu_);
  const auto it = entries_.find(id);
  if (it == entries_.end()) not_found("qkvshare.context", fmt::format("context {} was released or evicted", name_of(id)));
  return it->second.format;
}

ReuseIndex::Match ContextStore::lookup(const std::string& tenant, const KvFormat& format, std::span<const TokenId> prompt) {
  std::lock_guard lock(mu_);
  if (!options_.auto_reuse) return {};
  return index_.longest_prefix(partition(tenant, format), prompt);
}

std::vector<ReuseIndex::Span> ContextStore::find_spans(const std::string& tenant, const KvFormat& format,
                                                       std::span<const TokenId> prompt, int from, int end,
                                                       int min_tokens) {
  std::lock_guard lock(mu_);
  if (!options_.auto_reuse) return {};
  return index_.spans(partition(tenant, format), prompt, from, end, min_tokens);
}

std::unique_ptr<Session> ContextStore::open_prefix(std::uint64_t id, const std::string& tenant, int tokens, int capacity) {
  std::lock_guard lock(mu_);
  Entry& e = visible(tenant, id);
  ensure_resident_locked(id, e);
  OpenedContext oc = pool_->open(e.own, e.owner, /*want_kv=*/true, capacity);
  if (!oc.cache)
    fail(ErrorCode::bad_descriptor, "context {}: its KV cannot be used: {}", name_of(id), oc.refused_detail);
  oc.cache->set_rope(engine_.rope());  // a context of several segments (made elsewhere) reads them moved
  const int n = static_cast<int>(e.tokens.size());
  tokens = std::min(tokens, n);
  if (tokens == n) return std::make_unique<Session>(std::move(oc.cache), std::move(oc.tokens));
  // A prefix whose next position is not its length (tokens dropped before it, made elsewhere): recompute.
  if (oc.cache->position_gap() != 0) return nullptr;
  return cut_segments(*oc.cache, e, tokens, capacity);
}

// A prefix of a context: the segments before the cut whole, the one across it
// shortened (a frozen segment reads any range of its blocks). A cut that
// leaves the last kept segment writable inside a quantized block (only
// row-coded blocks can be cut there) falls back to that block's start, and
// the rest is recomputed.
std::unique_ptr<Session> ContextStore::cut_segments(const PooledKvCache& cache, const Entry& e, int tokens,
                                                    int capacity) {
  const auto kv = pool_->kv_pool(engine_.kv_shape());
  const int T = kv->block_tokens();
  for (int attempt = 0; attempt < 2 && tokens > 0; ++attempt) {
    std::vector<KvSegment> segs;
    int acc = 0;
    for (const KvSegment& s : cache.segments()) {
      if (acc >= tokens) break;
      if (s.tokens == 0) continue;
      const int keep = std::min(s.tokens, tokens - acc);
      KvSegment k{s.position_offset, {}, s.first_row, keep};
      k.blocks.assign(s.blocks.begin(), s.blocks.begin() + (s.first_row + keep + T - 1) / T);
      segs.push_back(std::move(k));
      acc += keep;
    }
    const int last_start = acc - segs.back().tokens;
    try {
      auto cut = PooledKvCache::adopt(kv, e.format, capacity, std::move(segs), tokens);
      cut->set_rope(engine_.rope());
      return std::make_unique<Session>(std::move(cut), std::vector<TokenId>(e.tokens.begin(), e.tokens.begin() + tokens));
    } catch (const Error& err) {
      if (err.code() != ErrorCode::invalid_argument) throw;
      tokens = last_start + (tokens - last_start) / T * T;
    }
  }
  return nullptr;
}

void ContextStore::release(const std::string& tenant, std::uint64_t id) {
  std::lock_guard lock(mu_);
  Entry& e = visible(tenant, id);
  if (e.owner == tenant) {
    drop_locked(id);
    return;
  }
  if (!e.on_disk) pool_->release(e.grants.at(tenant), tenant);
  e.grants.erase(tenant);
}

SealedInfo ContextStore::fork(const std::string& tenant, std::uint64_t id, const std::vector<std::string>& grant_to) {
  std::lock_guard lock(mu_);
  Entry& e = visible(tenant, id);
  ensure_resident_locked(id, e);
  OpenedContext oc = pool_->open(e.own, e.owner, /*want_kv=*/true, engine_.model().config().context_length);
  if (!oc.cache) fail(ErrorCode::bad_descriptor, "context {}: its KV cannot be used: {}", name_of(id), oc.refused_detail);
  oc.cache->set_rope(engine_.rope());
  const std::vector<TokenId> toks = e.tokens;
  return add_locked(tenant, *oc.cache, toks, grant_to, true, e.pending);
}

nlohmann::json ContextStore::describe(const std::string& tenant, std::uint64_t id) {
  std::lock_guard lock(mu_);
  Entry& e = visible(tenant, id);
  nlohmann::json grants = nlohmann::json::array();
  for (const auto& [agent, d] : e.grants) grants.push_back(agent);
  const Descriptor& d = e.owner == tenant ? e.own : e.grants.at(tenant);
  nlohmann::json out = {{"id", name_of(id)},
          {"object", "qkvshare.context"},
          {"owner", e.owner},
          {"tokens", e.tokens.size()},
          {"format", e.format.to_string()},
          {"blocks", e.blocks},
          {"kv_bytes", e.bytes},
          {"created", e.created_ms / 1000},
          {"granted_to", grants},
          {"tier", e.on_disk ? "disk" : "ram"}};
  // A spilled context's descriptors were revoked; it gets new ones when it is restored.
  out["handle"] = e.on_disk ? nlohmann::json(nullptr) : nlohmann::json(handle_of(d));
  out["descriptor"] = e.on_disk ? nlohmann::json(nullptr) : nlohmann::json::parse(d.json());
  if (e.demoted_from)
    out["demoted"] = {{"from", e.demoted_from->to_string()}, {"k_rel_rms", e.k_rel_rms}, {"v_rel_rms", e.v_rel_rms}};
  return out;
}

nlohmann::json ContextStore::list(const std::string& tenant) {
  std::lock_guard lock(mu_);
  nlohmann::json data = nlohmann::json::array();
  for (const auto& [id, e] : entries_) {
    if (e.owner != tenant && !e.grants.count(tenant)) continue;
    data.push_back({{"id", name_of(id)},
                    {"object", "qkvshare.context"},
                    {"owner", e.owner},
                    {"tokens", e.tokens.size()},
                    {"format", e.format.to_string()},
                    {"tier", e.on_disk ? "disk" : "ram"},
                    {"created", e.created_ms / 1000}});
  }
  return {{"object", "list"}, {"data", data}};
}

void ContextStore::drop_locked(std::uint64_t id) {
  const auto it = entries_.find(id);
  if (it == entries_.end()) return;
  index_.erase(id);
  if (!it->second.on_disk) {
    try {
      pool_->revoke(it->second.sealed);
    } catch (const Error&) {
      // Already gone from the pool (revoked by its producer elsewhere): nothing to give back.
    }
  }
  forget_file_locked(id, it->second);
  entries_.erase(it);
}

bool ContextStore::evict_one_locked() {
  // Spilled contexts hold no pool memory: only those in RAM can give some back.
  auto victim = entries_.end();
  for (auto it = entries_.begin(); it != entries_.end(); ++it)
    if (!it->second.on_disk && (victim == entries_.end() || it->second.last_used < victim->second.last_used)) victim = it;
  if (victim == entries_.end()) return false;
  const std::uint64_t id = victim->first;
  Entry& e = victim->second;
  // Demotion keeps the context in RAM at fewer bits; it is tried once per context.
  if (options_.demote && !e.demote_tried && demote_locked(id, e)) return true;
  if (!disk_ || !spill_locked(id, e)) drop_locked(id);
  ++evictions_;
  return true;
}

bool ContextStore::evict_one() {
  std::lock_guard lock(mu_);
  return evict_one_locked();
}

int ContextStore::evict_over_budget() {
  std::lock_guard lock(mu_);
  int n = 0;
  const auto kv = pool_->kv_pool(engine_.kv_shape());
  while (kv->counters().bytes_used > options_.budget_bytes && evict_one_locked()) ++n;
  return n;
}

std::map<std::string, ContextStore::FormatStats> ContextStore::stats() {
  std::lock_guard lock(mu_);
  std::map<std::string, FormatStats> out;
  std::map<std::string, std::set<std::uint32_t>> distinct;
  std::map<std::string, double> block_bytes;  // one block of the format (all its blocks are alike)
  for (const auto& [id, e] : entries_) {
    if (e.on_disk) continue;  // its bytes are on disk (tier_stats)
    const std::string f = e.format.to_string();
    FormatStats& s = out[f];
    ++s.contexts;
    s.tokens += static_cast<long long>(e.tokens.size());
    distinct[f].insert(e.block_index.begin(), e.block_index.end());
    if (e.blocks > 0) block_bytes[f] = static_cast<double>(e.bytes) / e.blocks;
  }
  for (auto& [f, s] : out) {
    s.blocks = static_cast<long long>(distinct[f].size());
    s.bytes = static_cast<std::size_t>(block_bytes[f] * static_cast<double>(s.blocks) + 0.5);
  }
  return out;
}

}  // namespace qkvshare::server
