#include "qkvshare/tiers/redis_tier.hpp"

#include <hiredis/hiredis.h>
#include <xxhash.h>

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>

#include "qkvshare/core/clock.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/tiers/context_io.hpp"
#include "le_bytes.hpp"

namespace qkvshare {

namespace {

constexpr char kManifestMagic[4] = {'Q', 'K', 'V', 'M'};

std::string hex(const void* data, std::size_t n) {
  static constexpr char d[] = "0123456789abcdef";
  std::string s;
  for (std::size_t i = 0; i < n; ++i) {
    const auto b = static_cast<const std::uint8_t*>(data)[i];
    s += d[b >> 4];
    s += d[b & 15];
  }
  return s;
}

struct Reply {
  redisReply* r = nullptr;
  ~Reply() {
    if (r) freeReplyObject(r);
  }
};

}  // namespace

struct RedisTier::Conn {
  redisContext* c = nullptr;
  ~Conn() {
    if (c) redisFree(c);
  }
};

RedisTier::RedisTier(RedisOptions options) : options_(std::move(options)) {
  if (options_.port <= 0 || options_.port > 65535)
    fail(ErrorCode::invalid_argument, "redis: port {} is not in [1, 65535]", options_.port);
  if (options_.timeout_ms <= 0 || options_.ttl_seconds <= 0)
    fail(ErrorCode::invalid_argument, "redis: timeout and TTL must be positive");
}

RedisTier::~RedisTier() = default;

RedisTier::Conn& RedisTier::conn() {
  if (conn_ && conn_->c && conn_->c->err == 0) return *conn_;
  conn_.reset();
  timeval tv{options_.timeout_ms / 1000, (options_.timeout_ms % 1000) * 1000};
  auto c = std::make_unique<Conn>();
  c->c = redisConnectWithTimeout(options_.host.c_str(), options_.port, tv);
  if (c->c == nullptr) fail(ErrorCode::out_of_memory, "redis: cannot allocate a connection");
  if (c->c->err != 0)
    fail(ErrorCode::io, "redis {}:{}: cannot connect: {}", options_.host, options_.port, c->c->errstr);
  if (redisSetTimeout(c->c, tv) != REDIS_OK)
    fail(ErrorCode::io, "redis {}:{}: cannot set the reply timeout", options_.host, options_.port);
  conn_ = std::move(c);
  return *conn_;
}

namespace {

// One reply of a pipelined or plain command; Error(io) when the connection
// failed or timed out (the connection is then dropped by the caller).
redisReply* take_reply(redisContext* c, const RedisOptions& o, std::string_view what) {
  void* r = nullptr;
  if (redisGetReply(c, &r) != REDIS_OK || r == nullptr)
    fail(ErrorCode::io, "redis {}:{}: {}: {}", o.host, o.port, what,
         c->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK)
             ? fmt::format("no reply within {} ms (server stalled)", o.timeout_ms)
             : std::string(c->errstr[0] ? c->errstr : "connection lost"));
  auto* reply = static_cast<redisReply*>(r);
  if (reply->type == REDIS_REPLY_ERROR) {
    const std::string msg(reply->str, reply->len);
    freeReplyObject(reply);
    fail(ErrorCode::io, "redis {}:{}: {}: server error: {}", o.host, o.port, what, msg);
  }
  return reply;
}

}  // namespace

PushResult RedisTier::push(SharePool& pool, const Descriptor& d, std::string_view agent, const std::string& name) {
  const auto t0 = std::chrono::steady_clock::now();
  if (name.empty() || name.size() > 200) fail(ErrorCode::invalid_argument, "redis: context name must be 1..200 bytes");
  pool.kv_pool_if_any();
  OpenedContext opened = pool.open(d, agent, true, static_cast<int>(d.token_count), false, GrantUse::copy);
  if (!opened.cache)
    fail(ErrorCode::bad_descriptor, "push: the KV of context {} cannot be used here ({})", d.context_id,
         opened.refused_detail);
  const ContextMeta meta = context_meta(*opened.cache, opened.tokens, opened.text, d.fingerprint);
  const BlockSource source = pooled_block_source(*opened.cache);
  std::vector<XXH128_hash_t> ids(meta.blocks.size());
  const BlockSource hashing = [&](std::size_t i, std::span<std::uint8_t> plain) {
    source(i, plain);
    ids[i] = XXH3_128bits(plain.data(), plain.size());
  };
  const BlockCipher* cipher = options_.cipher.get();
  const std::vector<std::uint8_t> bytes = encode_context(meta, hashing, cipher);
  const ContextReader reader(bytes, name);
  const std::string key_prefix = "qkv:blk:" + hex(&reader.meta().key_id, 8) + ":";

  // Manifest: the header and tables, then each block's content address.
  const std::size_t prefix = reader.meta().blocks.front().payload_offset;
  std::vector<std::uint8_t> manifest(kManifestMagic, kManifestMagic + 4);
  le::put(manifest, prefix, 8);
  manifest.insert(manifest.end(), bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(prefix));
  le::put(manifest, meta.blocks.size(), 4);
  std::vector<std::string> keys;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const ContextBlock& b = reader.meta().blocks[i];
    std::uint8_t entry[44];
    std::memcpy(entry, &ids[i].high64, 8);
    std::memcpy(entry + 8, &ids[i].low64, 8);
    const std::uint32_t fields[4] = {b.k.pack(), b.v.pack(), b.flags, b.fill};
    std::memcpy(entry + 16, fields, 16);
    std::memcpy(entry + 32, &b.checksum, 8);
    std::memcpy(entry + 40, &b.key_position, 4);
    // Keys stored before RoPE mean something else at another position (and seal to other bytes).
    const bool pre = (b.flags & (kBlockPreRopeK | kBlockRelativeK)) != 0;
    const XXH128_hash_t addr = XXH3_128bits(entry, pre ? sizeof entry : 40);
    std::uint8_t canon[16];
    for (int k = 0; k < 8; ++k) {
      canon[k] = static_cast<std::uint8_t>(addr.high64 >> (56 - 8 * k));
      canon[8 + k] = static_cast<std::uint8_t>(addr.low64 >> (56 - 8 * k));
    }
    manifest.insert(manifest.end(), canon, canon + 16);
    keys.push_back(key_prefix + hex(canon, 16));
  }

  PushResult result;
  result.blocks = static_cast<int>(keys.size());
  Conn& c = conn();
  try {
    // Blocks first (SET NX: a block already there is not sent again, only
    // its TTL refreshed), the manifest last: a reader never sees a manifest
    // whose blocks are not all stored.
    for (const std::string& k : keys) redisAppendCommand(c.c, "EXISTS %b", k.data(), k.size());
    std::vector<bool> present(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
      Reply r{take_reply(c.c, options_, "EXISTS")};
      present[i] = r.r->type == REDIS_REPLY_INTEGER && r.r->integer == 1;
    }
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const std::size_t len = reader.plain_bytes(i) + (cipher ? kContextSealOverhead : 0);
      const auto stored = reader.stored_block(i).first(len);
      if (present[i]) {
        redisAppendCommand(c.c, "EXPIRE %b %d", keys[i].data(), keys[i].size(), options_.ttl_seconds);
      } else {
        redisAppendCommand(c.c, "SET %b %b EX %d NX", keys[i].data(), keys[i].size(), stored.data(), stored.size(),
                           options_.ttl_seconds);
        result.bytes_sent += stored.size();
        ++result.blocks_stored;
      }
    }
    for (std::size_t i = 0; i < keys.size(); ++i) Reply r{take_reply(c.c, options_, "SET block")};
    const std::string mkey = "qkv:ctx:" + name;
    Reply r{static_cast<redisReply*>(redisCommand(c.c, "SET %b %b EX %d", mkey.data(), mkey.size(), manifest.data(),
                                                  manifest.size(), options_.ttl_seconds))};
    if (r.r == nullptr) fail(ErrorCode::io, "redis {}:{}: SET manifest: {}", options_.host, options_.port, c.c->errstr);
    result.bytes_sent += manifest.size();
  } catch (...) {
    conn_.reset();  // a failed connection is not reused
    throw;
  }
  result.ref.host = options_.host;
  result.ref.port = options_.port;
  result.ref.name = name;
  result.ref.tokens = static_cast<int>(opened.tokens.size());
  result.ref.fingerprint = d.fingerprint;
  result.ref.token_ids = opened.tokens;
  result.seconds = seconds_since(t0);
  return result;
}

std::vector<std::uint8_t> RedisTier::fetch(const std::string& name, std::uint64_t* received) {
  Conn& c = conn();
  try {
    const std::string mkey = "qkv:ctx:" + name;
    redisAppendCommand(c.c, "GET %b", mkey.data(), mkey.size());
    Reply m{take_reply(c.c, options_, "GET manifest")};
    if (m.r->type == REDIS_REPLY_NIL)
      fail(ErrorCode::bad_descriptor, "remote context '{}' is not in redis {}:{} (expired, evicted or never pushed)",
           name, options_.host, options_.port);
    const auto* p = reinterpret_cast<const std::uint8_t*>(m.r->str);
    const std::size_t n = m.r->len;
    const auto bad = [&](std::string_view why) {
      fail(ErrorCode::bad_descriptor, "remote context '{}': manifest {}", name, why);
    };
    if (n < 16 || std::memcmp(p, kManifestMagic, 4) != 0) bad("is not a QKVShare manifest");
    const std::uint64_t prefix = le::get(p + 4, 8);
    if (prefix < kContextHeaderBytes || prefix > n - 16) bad("prefix length is out of range");
    const std::uint32_t blocks = static_cast<std::uint32_t>(le::get(p + 12 + prefix, 4));
    if (n != 16 + prefix + std::size_t{16} * blocks) bad("length does not match its block count");
    // The header and tables are validated once the bytes are whole (ContextReader).
    std::vector<std::uint8_t> bytes(p + 12, p + 12 + prefix);
    std::uint64_t key_id = le::get(bytes.data() + 96, 8);
    const std::string key_prefix = "qkv:blk:" + hex(&key_id, 8) + ":";
    std::vector<std::string> keys;
    for (std::uint32_t i = 0; i < blocks; ++i) keys.push_back(key_prefix + hex(p + 16 + prefix + 16 * i, 16));
    for (const std::string& k : keys) redisAppendCommand(c.c, "GET %b", k.data(), k.size());
    std::uint64_t got = n;
    for (std::uint32_t i = 0; i < blocks; ++i) {
      Reply r{take_reply(c.c, options_, "GET block")};
      if (r.r->type != REDIS_REPLY_STRING) {
        for (std::uint32_t j = i + 1; j < blocks; ++j) Reply rest{take_reply(c.c, options_, "GET block")};
        fail(ErrorCode::bad_descriptor, "remote context '{}': block {} ({}) is missing (expired or evicted)", name,
             i, keys[i]);
      }
      bytes.insert(bytes.end(), r.r->str, r.r->str + r.r->len);
      bytes.resize((bytes.size() + kContextPayloadAlign - 1) / kContextPayloadAlign * kContextPayloadAlign, 0);
      got += r.r->len;
    }
    if (received) *received = got;
    return bytes;
  } catch (const Error& e) {
    if (e.code() == ErrorCode::io) conn_.reset();
    throw;
  }
}

long long RedisTier::ttl(const std::string& name) {
  Conn& c = conn();
  const std::string mkey = "qkv:ctx:" + name;
  redisAppendCommand(c.c, "TTL %b", mkey.data(), mkey.size());
  try {
    Reply r{take_reply(c.c, options_, "TTL")};
    return r.r->type == REDIS_REPLY_INTEGER ? r.r->integer : -2;
  } catch (...) {
    conn_.reset();
    throw;
  }
}

RemoteOpen RedisTier::open(SharePool& pool, Engine& engine, const ModelFingerprint& fingerprint, const RemoteRef& ref,
                           std::string_view agent, int capacity) {
  const auto t0 = std::chrono::steady_clock::now();
  RemoteOpen out;
  if (capacity <= 0) capacity = engine.model().config().context_length;
  try {
    if (ref.fingerprint.model != fingerprint.model)
      fail(ErrorCode::bad_descriptor, "remote context '{}' was made by model {}, this is {}", ref.name,
           ref.fingerprint.hex(), fingerprint.hex());
    const std::vector<std::uint8_t> bytes = fetch(ref.name, &out.bytes_received);
    const ContextReader reader(bytes, "remote context '" + ref.name + "'");
    if (reader.meta().tokens != ref.token_ids)
      fail(ErrorCode::bad_descriptor, "remote context '{}' holds other tokens than its reference", ref.name);
    const SealedContext sealed = import_sealed(pool, reader, "remote", &fingerprint, options_.cipher.get());
    const Descriptor d = pool.grant(sealed, "remote", agent);
    pool.release(sealed);
    HandoffOptions ho;
    ho.mode = HandoffMode::kv;
    ho.capacity = capacity;
    out.handoff = open_session(pool, engine, fingerprint, d, agent, ho);
    pool.release(d, agent);  // the session holds its blocks
  } catch (const Error& e) {
    if (e.code() != ErrorCode::io && e.code() != ErrorCode::bad_descriptor) throw;
    // Text fallback: the token ids from the reference, re-encoded here.
    out.problem = e.what();
    out.handoff = HandoffResult{};
    out.handoff.session = new_pooled_session(pool, engine, KvFormat::parse("f16"), capacity);
    engine.forward(*out.handoff.session, ref.token_ids);
    out.handoff.kv = false;
    out.handoff.detail = out.problem;
    out.handoff.prefill_tokens = static_cast<int>(ref.token_ids.size());
  }
  out.seconds = seconds_since(t0);
  out.handoff.seconds = out.seconds;
  return out;
}

std::string RemoteRef::json() const {
  nlohmann::json j;
  j["format"] = "qkvshare-remote-context/1";
  j["redis"] = {{"host", host}, {"port", port}};
  j["name"] = name;
  j["tokens"] = tokens;
  j["model_fingerprint"] = fingerprint.hex();
  j["tokenizer_fingerprint"] = fingerprint.tokenizer;
  j["token_ids"] = token_ids;
  return j.dump();
}

RemoteRef RemoteRef::parse(const std::string& text, const std::string& source) {
  try {
    const auto j = nlohmann::json::parse(text);
    if (j.at("format").get<std::string>() != "qkvshare-remote-context/1")
      fail(ErrorCode::bad_descriptor, "{}: not a remote context reference (format)", source);
    RemoteRef r;
    r.host = j.at("redis").at("host").get<std::string>();
    r.port = j.at("redis").at("port").get<int>();
    r.name = j.at("name").get<std::string>();
    r.tokens = j.at("tokens").get<int>();
    const std::string fp = j.at("model_fingerprint").get<std::string>();
    if (fp.size() != 32) fail(ErrorCode::bad_descriptor, "{}: model_fingerprint is not 32 hex digits", source);
    for (int i = 0; i < 16; ++i) r.fingerprint.model[static_cast<std::size_t>(i)] =
        static_cast<std::uint8_t>(std::stoi(fp.substr(static_cast<std::size_t>(2 * i), 2), nullptr, 16));
    r.fingerprint.tokenizer = j.at("tokenizer_fingerprint").get<std::uint64_t>();
    r.token_ids = j.at("token_ids").get<std::vector<TokenId>>();
    if (static_cast<int>(r.token_ids.size()) != r.tokens || r.tokens <= 0)
      fail(ErrorCode::bad_descriptor, "{}: {} token ids for {} tokens", source, r.token_ids.size(), r.tokens);
    return r;
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorCode::bad_descriptor, "{}: not a remote context reference: {}", source, e.what());
  } catch (const std::invalid_argument&) {
    fail(ErrorCode::bad_descriptor, "{}: model_fingerprint is not hex", source);
  }
}

}  // namespace qkvshare
