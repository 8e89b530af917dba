// The remote tier against a real redis-server started by the test on a free
// 127.0.0.1 port: round trips (plain and encrypted), content addressing (a
// block stored once), TTL, two "devices" (two processes with their own pools
// and model loads), and every failure ending in a clear reason plus the text
// fallback within the timeout: server down, server stalled mid-transfer,
// missing key, tampered block, wrong key.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>

#include "qkvshare/core/error.hpp"
#include "qkvshare/tiers/crypto.hpp"
#include "qkvshare/tiers/redis_tier.hpp"
#include "share/share_test_util.hpp"

namespace qkvshare {
namespace {

using Clock = std::chrono::steady_clock;

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    return -1;
  const int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

// A private redis-server for one test; killed at scope exit.
struct RedisServer {
  pid_t pid = -1;
  int port = 0;
  RedisServer() {
    port = free_port();
    pid = ::fork();
    if (pid == 0) {
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 1);
      ::dup2(null, 2);
      const std::string p = std::to_string(port);
      ::execlp("redis-server", "redis-server", "--port", p.c_str(), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--loglevel", "warning", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 500; ++i) {
      if (ping()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ~RedisServer() { kill(); }
  bool ping() const {
    timeval tv{0, 200000};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port, tv);
    bool ok = false;
    if (c && !c->err) {
      auto* r = static_cast<redisReply*>(redisCommand(c, "PING"));
      ok = r && r->type == REDIS_REPLY_STATUS;
      if (r) freeReplyObject(r);
    }
    if (c) redisFree(c);
    return ok;
  }
  void kill() {
    if (pid > 0) {
      ::kill(pid, SIGCONT);
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      pid = -1;
    }
  }
  // Runs one command (tests only: SETRANGE, KEYS).
  redisReply* command(const char* fmt, const std::string& a, const std::string& b = "") const {
    timeval tv{1, 0};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port, tv);
    auto* r = static_cast<redisReply*>(redisCommand(c, fmt, a.c_str(), b.c_str()));
    redisFree(c);
    return r;
  }
};

std::shared_ptr<KeyCipher> key(std::uint8_t seed) {
  std::array<std::uint8_t, KeyCipher::kKeyBytes> k{};
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<std::uint8_t>(seed * 11 + i);
  return std::make_shared<KeyCipher>(k);
}

// One "device": its own model load, engine and pool.
struct Device {
  std::unique_ptr<Model> model = testing::load_stories();
  ModelFingerprint fp = model_fingerprint(*model);
  Engine engine{*model, EngineOptions{1}};
  std::shared_ptr<SharePool> pool = SharePool::create_anonymous(testing::small_config());

  Descriptor produce(const std::string& format, int words, std::unique_ptr<Session>& s) {
    s = new_pooled_session(*pool, engine, KvFormat::parse(format), 512);
    std::string text;
    for (int i = 0; i < words; ++i) text += "the little dog ran to the park and ";
    std::vector<TokenId> ids{model->tokenizer().bos_id()};
    const auto body = model->tokenizer().encode(text);
    ids.insert(ids.end(), body.begin(), body.end());
    engine.forward(*s, ids);
    const SealedContext sealed = seal_session(*pool, engine, fp, *s, "A");
    const Descriptor d = pool->grant(sealed, "A", "B");
    pool->release(sealed);
    return d;
  }
  std::vector<float> next(Session& s) {
    const auto l = engine.forward(s, std::vector<TokenId>{11, 12, 13}, true);
    return {l.begin(), l.end()};
  }
};

RedisOptions options(const RedisServer& server, std::shared_ptr<KeyCipher> cipher, int timeout_ms = 2000) {
  RedisOptions o;
  o.port = server.port;
  o.cipher = std::move(cipher);
  o.timeout_ms = timeout_ms;
  o.ttl_seconds = 600;
  return o;
}

TEST(RedisTier, RoundTripsStoreEachBlockOnceAndKeepTheTtl) {
  RedisServer server;
  ASSERT_TRUE(server.ping()) << "redis-server did not start (install redis-server: scripts/install_deps.sh)";
  Device dev;
  for (const auto& cipher : {std::shared_ptr<KeyCipher>(), key(1)}) {
    RedisTier tier(options(server, cipher));
    std::unique_ptr<Session> producer;
    const Descriptor d = dev.produce("int4", 20, producer);
    const PushResult p1 = tier.push(*dev.pool, d, "B", "ctx1");
    EXPECT_EQ(p1.blocks_stored, p1.blocks);
    const PushResult p2 = tier.push(*dev.pool, d, "B", "ctx2");  // the same blocks under another name
    EXPECT_EQ(p2.blocks_stored, 0);
    EXPECT_LT(p2.bytes_sent, p1.bytes_sent / 4);
    const long long ttl = tier.ttl("ctx1");
    EXPECT_GT(ttl, 500);
    EXPECT_LE(ttl, 600);
    EXPECT_EQ(tier.ttl("absent"), -2);
    auto fork = std::make_unique<Session>(dynamic_cast<const PooledKvCache&>(producer->cache()).fork(),
                                          producer->tokens());
    const auto want = dev.next(*fork);
    const RemoteRef ref = RemoteRef::parse(p2.ref.json(), "ref.json");
    RemoteOpen o = tier.open(*dev.pool, dev.engine, dev.fp, ref, "C", 512);
    ASSERT_TRUE(o.handoff.kv) << o.problem;
    EXPECT_EQ(o.handoff.session->tokens(), producer->tokens());
    const auto got = dev.next(*o.handoff.session);
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
    o.handoff.session.reset();
    dev.pool->release(d, "B");
  }
}

TEST(RedisTier, TwoDevicesShareOneRedis) {
  RedisServer server;
  ASSERT_TRUE(server.ping());
  const std::string dir = testing::temp_dir();
  const auto cipher = key(3);
  // Device 1: produce, push, write the reference and the logits it expects.
  const pid_t producer = testing::spawn([&] {
    Device dev;
    std::unique_ptr<Session> s;
    const Descriptor d = dev.produce("k8v4", 30, s);
    RedisTier tier(options(server, cipher));
    const PushResult p = tier.push(*dev.pool, d, "B", "shared");
    std::ofstream(dir + "/ref.json") << p.ref.json();
    auto fork = std::make_unique<Session>(dynamic_cast<const PooledKvCache&>(s->cache()).fork(), s->tokens());
    const auto want = dev.next(*fork);
    std::ofstream(dir + "/want.bin", std::ios::binary)
        .write(reinterpret_cast<const char*>(want.data()), static_cast<std::streamsize>(want.size() * 4));
    return 0;
  });
  ASSERT_EQ(testing::wait_exit(producer), 0);
  // Device 2: another process, its own model load and pool.
  const pid_t consumer = testing::spawn([&] {
    Device dev;
    std::ifstream in(dir + "/ref.json");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    RedisTier tier(options(server, cipher));
    RemoteOpen o = tier.open(*dev.pool, dev.engine, dev.fp, RemoteRef::parse(text, "ref.json"), "C", 512);
    if (!o.handoff.kv) {
      std::fprintf(stderr, "fell back: %s\n", o.problem.c_str());
      return 10;
    }
    const auto got = dev.next(*o.handoff.session);
    std::vector<float> want(got.size());
    std::ifstream(dir + "/want.bin", std::ios::binary)
        .read(reinterpret_cast<char*>(want.data()), static_cast<std::streamsize>(want.size() * 4));
    return std::memcmp(want.data(), got.data(), want.size() * 4) == 0 ? 0 : 11;
  });
  EXPECT_EQ(testing::wait_exit(consumer), 0);
}

// Every failure: a reason naming what went wrong, and the consumer carries on
// from the reference's token ids (text fallback) with the same tokens.
TEST(RedisTier, FailuresFallBackToTextWithAReasonAndNeverHang) {
  RedisServer server;
  ASSERT_TRUE(server.ping());
  Device dev;
  RedisTier tier(options(server, key(1), 300));
  std::unique_ptr<Session> producer;
  const Descriptor d = dev.produce("int8", 20, producer);
  const PushResult p = tier.push(*dev.pool, d, "B", "ctx");
  const auto expect_fallback = [&](RedisTier& t, const RemoteRef& ref, const char* reason) {
    const auto t0 = Clock::now();
    RemoteOpen o = t.open(*dev.pool, dev.engine, dev.fp, ref, "C", 512);
    EXPECT_FALSE(o.handoff.kv) << reason;
    EXPECT_NE(o.problem.find(reason), std::string::npos) << o.problem;
    ASSERT_TRUE(o.handoff.session);
    EXPECT_EQ(o.handoff.session->tokens(), producer->tokens());
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 5.0);
  };
  RemoteRef missing = p.ref;
  missing.name = "never-pushed";
  expect_fallback(tier, missing, "is not in redis");

  RedisTier wrong(options(server, key(2), 300));
  expect_fallback(wrong, p.ref, "wrong key");

  // Tamper with one stored block in Redis itself.
  redisReply* keys = server.command("KEYS %s", "qkv:blk:*");
  ASSERT_TRUE(keys && keys->type == REDIS_REPLY_ARRAY && keys->elements > 0);
  const std::string block_key(keys->element[0]->str, keys->element[0]->len);
  freeReplyObject(keys);
  // Flip a byte rather than write a fixed one: the ciphertext is random (a
  // fresh nonce per push), so a fixed byte matches what is stored 1 time in 256.
  redisReply* byte = server.command("GETRANGE %s 100 100", block_key);
  ASSERT_TRUE(byte && byte->type == REDIS_REPLY_STRING && byte->len == 1);
  const auto stored = static_cast<unsigned char>(byte->str[0]);
  freeReplyObject(byte);
  // Never 0: the helper passes a C string.
  const std::string flipped(1, static_cast<char>(stored == 0x5a ? 0x01 : stored ^ 0x5a));
  freeReplyObject(server.command("SETRANGE %s 100 %s", block_key, flipped));
  expect_fallback(tier, p.ref, "authentication failed");

  // Stalled mid-transfer (SIGSTOP): the reply timeout ends the wait.
  ::kill(server.pid, SIGSTOP);
  expect_fallback(tier, p.ref, "no reply within 300 ms");
  ::kill(server.pid, SIGCONT);

  // Down.
  server.kill();
  expect_fallback(tier, p.ref, "cannot connect");
  EXPECT_THROW(tier.push(*dev.pool, d, "B", "again"), Error);
  dev.pool->release(d, "B");
}

TEST(RemoteRef, BadReferencesAreRefusedByName) {
  for (const char* text : {"", "{}", R"({"format":"other"})",
                           R"({"format":"qkvshare-remote-context/1","redis":{"host":"h","port":1},"name":"n","tokens":2,)"
                           R"("model_fingerprint":"00","tokenizer_fingerprint":1,"token_ids":[1,2]})"}) {
    try {
      RemoteRef::parse(text, "ref.json");
      ADD_FAILURE() << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::bad_descriptor);
      EXPECT_NE(std::string(e.what()).find("ref.json"), std::string::npos);
    }
  }
}

}  // namespace
}  // namespace qkvshare
