// The disk tier on stories260K contexts: spill and restore in every format
// (plain and encrypted) continue bit-identically; a spill the disk refuses
// leaves the context in RAM and says why; kill -9 in the middle of a spill
// leaves no context file and, after the reaper, no block held.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "qkvshare/core/error.hpp"
#include "qkvshare/tiers/crypto.hpp"
#include "qkvshare/tiers/disk_tier.hpp"
#include "share/share_test_util.hpp"

namespace qkvshare {
namespace {

namespace fs = std::filesystem;

std::shared_ptr<KeyCipher> test_key() {
  std::array<std::uint8_t, KeyCipher::kKeyBytes> k{};
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<std::uint8_t>(3 * i + 1);
  return std::make_shared<KeyCipher>(k);
}

int files_in(const std::string& dir) {
  int n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++n;
  return n;
}

class DiskTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::load_stories();
    fp_ = model_fingerprint(*model_);
    engine_ = std::make_unique<Engine>(*model_, EngineOptions{1});
    pool_ = SharePool::create_anonymous(testing::small_config());
    dir_ = testing::temp_dir();
    const Tokenizer& tok = model_->tokenizer();
    prompt_ = {tok.bos_id()};
    std::string text;
    for (int i = 0; i < 12; ++i) text += "Once upon a time there was a little dog named Max who liked to run. ";
    const auto body = tok.encode(text);
    prompt_.insert(prompt_.end(), body.begin(), body.end());
  }

  Descriptor produce(const std::string& format, std::unique_ptr<Session>& producer) {
    producer = new_pooled_session(*pool_, *engine_, KvFormat::parse(format), 512);
    engine_->forward(*producer, prompt_);
    const SealedContext sealed = seal_session(*pool_, *engine_, fp_, *producer, "A");
    const Descriptor d = pool_->grant(sealed, "A", "B");
    pool_->release(sealed);
    return d;
  }

  std::vector<float> continue_with(Session& s) {
    const auto l = engine_->forward(s, std::vector<TokenId>{5, 77, 301}, true);
    return {l.begin(), l.end()};
  }
  std::uint32_t blocks_used() { return pool_->kv_pool_if_any()->counters().blocks_used; }

  std::unique_ptr<Model> model_;
  ModelFingerprint fp_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<SharePool> pool_;
  std::string dir_;
  std::vector<TokenId> prompt_;
};

TEST_F(DiskTierTest, SpilledContextRestoresExactlyInEveryFormat) {
  for (const bool encrypt : {false, true}) {
    const DiskTier disk(dir_, encrypt ? test_key() : nullptr);
    for (const char* format : {"f32", "f16", "int8", "int4", "int3", "int2", "k8v4:kaxis=token", "int4:rot=kv:window=64",
                               "int4:keys=pre"}) {
      SCOPED_TRACE(std::string(format) + (encrypt ? " encrypted" : ""));
      std::unique_ptr<Session> producer;
      const Descriptor d = produce(format, producer);
      auto reference = std::make_unique<Session>(dynamic_cast<const PooledKvCache&>(producer->cache()).fork(),
                                                 producer->tokens());
      producer.reset();
      const SpillResult s = disk.spill(*pool_, d, "B", "ctx");
      EXPECT_GT(s.file_bytes, s.kv_bytes / 2);
      pool_->revoke(d, "A");  // out of RAM: only the reference fork holds blocks now
      const RestoreResult r = disk.restore(*pool_, "ctx", "A", &fp_);
      const Descriptor d2 = pool_->grant(r.sealed, "A", "B");
      pool_->release(r.sealed);
      HandoffResult h = open_session(*pool_, *engine_, fp_, d2, "B", {HandoffMode::kv, true});
      ASSERT_TRUE(h.kv);
      const auto want = continue_with(*reference);
      const auto got = continue_with(*h.session);
      ASSERT_EQ(want.size(), got.size());
      EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
      h.session.reset();
      reference.reset();
      pool_->release(d2, "B");
      disk.remove("ctx");
    }
  }
  EXPECT_EQ(blocks_used(), 0u);
  EXPECT_EQ(files_in(dir_), 0);
}

TEST_F(DiskTierTest, RestoringATamperedOrForeignFileFailsAndLeavesThePoolAsItWas) {
  const DiskTier disk(dir_, test_key());
  std::unique_ptr<Session> producer;
  const Descriptor d = produce("int8", producer);
  producer.reset();
  disk.spill(*pool_, d, "B", "ctx");
  const std::uint32_t before = blocks_used();
  {
    // Flip bits of a byte (writing a fixed value left the file as it was when the random
    // ciphertext already held it: a 1-in-256 flake).
    std::fstream f(disk.path_of("ctx"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-100, std::ios::end);
    const int byte = f.get();
    f.seekp(-100, std::ios::end);
    f.put(static_cast<char>(byte ^ 0x55));
  }
  try {
    disk.restore(*pool_, "ctx", "A", &fp_);
    ADD_FAILURE() << "a tampered block was restored";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("authentication failed"), std::string::npos) << e.what();
  }
  const DiskTier plain(dir_);
  try {
    plain.restore(*pool_, "ctx", "A", &fp_);
    ADD_FAILURE() << "an encrypted file was restored without its key";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("give the key file"), std::string::npos) << e.what();
  }
  try {
    disk.restore(*pool_, "absent", "A", &fp_);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io);
    EXPECT_NE(std::string(e.what()).find("absent.qkvctx"), std::string::npos) << e.what();
  }
  EXPECT_EQ(blocks_used(), before);
  pool_->release(d, "B");
}

TEST_F(DiskTierTest, FailedSpillLeavesTheContextInRamAndSaysWhy) {
  std::unique_ptr<Session> producer;
  const Descriptor d = produce("f16", producer);
  producer.reset();
  const std::uint32_t before = blocks_used();
  // A file size limit makes write() fail with EFBIG part-way, as a full disk
  // would with ENOSPC; in a child, so the limit stays there.
  const pid_t pid = testing::spawn([&] {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{64 * 1024, 64 * 1024};
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return 10;
    auto mine = SharePool::attach_region(pool_->region());
    const DiskTier disk(dir_);
    try {
      disk.spill(*mine, d, "B", "ctx");
      return 11;
    } catch (const Error& e) {
      const std::string what = e.what();
      if (e.code() != ErrorCode::io || what.find("ctx.qkvctx") == std::string::npos ||
          what.find("File too large") == std::string::npos) {
        std::fprintf(stderr, "unexpected error: %s\n", what.c_str());
        return 12;
      }
    }
    return fs::exists(disk.path_of("ctx")) ? 13 : 0;
  });
  EXPECT_EQ(testing::wait_exit(pid), 0);
  EXPECT_EQ(files_in(dir_), 0);  // neither the context file nor a part of it
  pool_->reap();
  EXPECT_EQ(blocks_used(), before);
  HandoffResult h = open_session(*pool_, *engine_, fp_, d, "B", {HandoffMode::kv, true});
  EXPECT_TRUE(h.kv);  // still in RAM, intact
  h.session.reset();
  pool_->release(d, "B");
}

// Slows every block down so that the parent can kill the child mid-spill.
struct SlowCipher final : BlockCipher {
  std::shared_ptr<KeyCipher> real = test_key();
  std::uint64_t key_id() const noexcept override { return real->key_id(); }
  std::size_t overhead() const noexcept override { return real->overhead(); }
  void seal(std::span<const std::uint8_t> p, std::span<const std::uint8_t> a, std::span<std::uint8_t> o) const override {
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
    real->seal(p, a, o);
  }
  void open(std::span<const std::uint8_t> s, std::span<const std::uint8_t> a, std::span<std::uint8_t> p,
            std::string_view w) const override {
    real->open(s, a, p, w);
  }
};

TEST_F(DiskTierTest, KillDuringSpillLeavesNoCorruptContextAndNoLeakedBlock) {
  std::unique_ptr<Session> producer;
  const Descriptor d = produce("f32", producer);
  producer.reset();
  const std::uint32_t before = blocks_used();
  const pid_t pid = testing::spawn([&] {
    auto mine = SharePool::attach_region(pool_->region());
    const DiskTier disk(dir_, std::make_shared<SlowCipher>());
    disk.spill(*mine, d, "B", "ctx");
    return 0;
  });
  // Wait until the child is writing payloads (its part file grows), then kill it.
  const std::string part = dir_ + "/ctx.qkvctx.part." + std::to_string(pid);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline && (!fs::exists(part) || fs::file_size(part) < 4096))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(fs::exists(part)) << "the child never started writing";
  ::kill(pid, SIGKILL);
  EXPECT_EQ(testing::wait_exit(pid), 128 + SIGKILL);
  EXPECT_FALSE(fs::exists(dir_ + "/ctx.qkvctx"));  // no context file that could be read half-written
  EXPECT_EQ(pool_->reap(), 1);                    // the child's open of the context is given back
  EXPECT_EQ(blocks_used(), before);
  const DiskTier again(dir_);                     // a new tier removes the dead process's part
  EXPECT_EQ(files_in(dir_), 0);
  HandoffResult h = open_session(*pool_, *engine_, fp_, d, "B", {HandoffMode::kv, true});
  EXPECT_TRUE(h.kv);
  h.session.reset();
  pool_->release(d, "B");
}

}  // namespace
}  // namespace qkvshare
