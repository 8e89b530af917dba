// The server's context store with tiers (--spill-dir, --demote, --key):
// evicted contexts are demoted, spilled and restored with the same KV, a
// failing disk drops the context and the store keeps serving, and no spill
// file outlives its context or the store.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>

#include "qkvshare/model/model.hpp"
#include "qkvshare/server/api.hpp"
#include "qkvshare/server/context_store.hpp"
#include "qkvshare/share/handoff.hpp"
#include "qkvshare/tiers/crypto.hpp"
#include "test_paths.hpp"

using namespace qkvshare;
using namespace qkvshare::server;
namespace fs = std::filesystem;

namespace {

constexpr int kSrvTierCapacity = 256;

struct SrvTierWorld {
  std::unique_ptr<Model> model;
  std::unique_ptr<Engine> engine;
  std::shared_ptr<SharePool> pool;

  SrvTierWorld() {
    model = Model::load(qkvshare::testing::shared_path("models/stories260K.bin"), qkvshare::testing::shared_path("models/tok512.bin"));
    EngineOptions eo;
    eo.n_threads = 1;
    engine = std::make_unique<Engine>(*model, eo);
    ShareConfig cfg;
    cfg.bytes = std::size_t{32} << 20;
    cfg.max_tokens = kSrvTierCapacity;
    pool = SharePool::create_anonymous(cfg);
  }
};

TokenId srvtier_argmax(std::span<const float> logits) {
  return static_cast<TokenId>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// Feeds `feed`, then decodes `n` tokens greedily (each fed back).
std::vector<TokenId> srvtier_greedy(Engine& engine, Session& s, const std::vector<TokenId>& feed, int n) {
  std::vector<TokenId> out;
  std::span<const float> logits = engine.forward(s, feed);
  for (int i = 0; i < n; ++i) {
    const TokenId t = srvtier_argmax(logits);
    out.push_back(t);
    const TokenId one[1] = {t};
    logits = engine.forward(s, one);
  }
  return out;
}

const std::vector<TokenId> kSrvTierPrompt = {1, 403, 261, 378, 274, 290, 379, 263, 326, 363, 283, 468, 296, 271, 263, 294};
const std::vector<TokenId> kSrvTierNext = {268, 272, 302};

// A context of the prompt and 40 greedy tokens, added to `store`.
std::uint64_t srvtier_add(SrvTierWorld& w, ContextStore& store, const KvFormat& f) {
  auto s = new_pooled_session(*w.pool, *w.engine, f, kSrvTierCapacity);
  srvtier_greedy(*w.engine, *s, kSrvTierPrompt, 40);
  return store.add("default", *s, {}, true).id;
}

// What a request continuing context `id` with kSrvTierNext decodes.
std::vector<TokenId> srvtier_continue(SrvTierWorld& w, ContextStore& store, std::uint64_t id) {
  const int n = static_cast<int>(store.tokens(id).size());
  auto s = store.open_prefix(id, "default", n, kSrvTierCapacity);
  EXPECT_TRUE(s != nullptr);
  if (!s) return {};
  EXPECT_EQ(s->n_past(), n);
  return srvtier_greedy(*w.engine, *s, kSrvTierNext, 24);
}

// Nothing stays in RAM at rest: every context over the budget goes to a fresh spill folder.
StoreOptions srvtier_spill_all() {
  StoreOptions o;
  o.budget_bytes = 1;
  o.spill_dir = qkvshare::testing::temp_dir() + "/spill";
  return o;
}

std::string srvtier_tier(ContextStore& store, std::uint64_t id) {
  return store.describe("default", id).at("tier").get<std::string>();
}

}  // namespace

TEST(ServerStoreTiers, SpilledContextIsRestoredWithTheSameTokens) {
  SrvTierWorld w;
  for (const char* kv : {"f16", "int8", "int4"}) {
    for (const bool encrypted : {false, true}) {
      SCOPED_TRACE(std::string(kv) + (encrypted ? " encrypted" : ""));
      const KvFormat f = KvFormat::parse(kv);
      std::vector<TokenId> want;
      {
        ContextStore plain(w.pool, *w.engine, StoreOptions{});
        want = srvtier_continue(w, plain, srvtier_add(w, plain, f));
      }
      StoreOptions o = srvtier_spill_all();
      if (encrypted) {
        std::array<std::uint8_t, KeyCipher::kKeyBytes> key{};
        key[3] = 7;
        o.cipher = std::make_shared<KeyCipher>(key);
      }
      ContextStore store(w.pool, *w.engine, o);
      const std::uint64_t id = srvtier_add(w, store, f);
      const std::vector<TokenId> tokens = store.tokens(id);
      const std::size_t used = w.pool->stats().kv.bytes_used;
      EXPECT_EQ(store.evict_over_budget(), 1);
      EXPECT_LT(w.pool->stats().kv.bytes_used, used);
      EXPECT_EQ(srvtier_tier(store, id), "disk");
      EXPECT_TRUE(store.describe("default", id).at("handle").is_null());
      const std::string file = o.spill_dir + "/" + ContextStore::name_of(id) + ".qkvctx";
      EXPECT_TRUE(fs::exists(file));
      StoreTierStats t = store.tier_stats();
      EXPECT_EQ(t.spills, 1u);
      EXPECT_EQ(t.contexts_on_disk, 1u);
      EXPECT_EQ(t.bytes_on_disk, fs::file_size(file));
      // The ctx- id still names it: a request restores it and continues as if it had never left.
      EXPECT_EQ(store.resolve("default", ContextStore::name_of(id), "context"), id);
      EXPECT_EQ(srvtier_continue(w, store, id), want);
      EXPECT_EQ(store.tokens(id), tokens);
      EXPECT_EQ(srvtier_tier(store, id), "ram");
      EXPECT_EQ(store.tier_stats().restores, 1u);
      // Evicted again, it goes without a second write (the file still holds it).
      EXPECT_EQ(store.evict_over_budget(), 1);
      t = store.tier_stats();
      EXPECT_EQ(t.spills, 2u);
      EXPECT_EQ(t.bytes_spilled, t.bytes_on_disk);
      EXPECT_EQ(srvtier_continue(w, store, id), want);
      // Automatic reuse finds it by its tokens while it is on disk.
      EXPECT_EQ(store.evict_over_budget(), 1);
      std::vector<TokenId> prompt = tokens;
      prompt.push_back(5);
      EXPECT_EQ(store.lookup("default", f, prompt).context_id, id);
      EXPECT_EQ(srvtier_continue(w, store, id), want);
    }
  }
}

TEST(ServerStoreTiers, DemotesFirstThenSpillsTheDemotedContext) {
  SrvTierWorld w;
  StoreOptions o = srvtier_spill_all();
  o.demote = KvFormat::parse("int4");
  ContextStore store(w.pool, *w.engine, o);
  const std::uint64_t id = srvtier_add(w, store, KvFormat::parse("int8"));
  const std::size_t before = store.describe("default", id).at("kv_bytes").get<std::size_t>();
  ASSERT_TRUE(store.evict_one());
  nlohmann::json d = store.describe("default", id);
  EXPECT_EQ(d.at("tier"), "ram");
  EXPECT_EQ(d.at("format"), "int4");
  EXPECT_LT(d.at("kv_bytes").get<std::size_t>(), before);
  EXPECT_EQ(d.at("demoted").at("from"), "int8");
  const double k = d.at("demoted").at("k_rel_rms").get<double>();
  EXPECT_GT(k, 0.0);
  EXPECT_LT(k, 0.5);
  EXPECT_EQ(store.tier_stats().demotions, 1u);
  EXPECT_EQ(store.format(id).to_string(), "int4");
  const std::vector<TokenId> demoted = srvtier_continue(w, store, id);
  // Demoted once only: the next eviction spills it, and it comes back as demoted.
  ASSERT_TRUE(store.evict_one());
  EXPECT_EQ(srvtier_tier(store, id), "disk");
  EXPECT_EQ(store.tier_stats().demotions, 1u);
  EXPECT_EQ(store.tier_stats().spills, 1u);
  EXPECT_EQ(srvtier_continue(w, store, id), demoted);
  // Automatic reuse finds it under its new format.
  EXPECT_EQ(store.lookup("default", KvFormat::parse("int4"), store.tokens(id)).context_id, id);
}

TEST(ServerStoreTiers, AFailingDiskDropsTheContextAndTheStoreKeepsServing) {
  SrvTierWorld w;
  StoreOptions o = srvtier_spill_all();
  ContextStore store(w.pool, *w.engine, o);
  // The folder turns into a file: every write into it fails, even as root.
  fs::remove_all(o.spill_dir);
  std::ofstream(o.spill_dir) << "not a folder";
  const KvFormat f = KvFormat::parse("int8");
  const std::uint64_t id = srvtier_add(w, store, f);
  EXPECT_EQ(store.evict_over_budget(), 1);
  EXPECT_EQ(store.tier_stats().spill_failures, 1u);
  EXPECT_EQ(store.tier_stats().spills, 0u);
  EXPECT_TRUE(store.list("default").at("data").empty());
  try {
    store.resolve("default", ContextStore::name_of(id), "context");
    ADD_FAILURE() << "a dropped context resolved";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 404);
  }
  const std::uint64_t again = srvtier_add(w, store, f);
  EXPECT_EQ(store.list("default").at("data").size(), 1u);
  EXPECT_FALSE(srvtier_continue(w, store, again).empty());
}

TEST(ServerStoreTiers, ATamperedSpillFileIsRefusedNotDecoded) {
  SrvTierWorld w;
  StoreOptions o = srvtier_spill_all();
  ContextStore store(w.pool, *w.engine, o);
  const std::uint64_t id = srvtier_add(w, store, KvFormat::parse("int8"));
  EXPECT_EQ(store.evict_over_budget(), 1);
  const std::string file = o.spill_dir + "/" + ContextStore::name_of(id) + ".qkvctx";
  {
    std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
    // Flip the byte rather than write a fixed one, which may already be there.
    const auto at = static_cast<std::streamoff>(fs::file_size(file) - 100);
    io.seekg(at);
    const int byte = io.get();
    io.seekp(at);
    io.put(static_cast<char>(byte ^ 0x5a));
  }
  try {
    store.open_prefix(id, "default", 10, kSrvTierCapacity);
    ADD_FAILURE() << "a tampered file was restored";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 404);
  }
  EXPECT_EQ(store.tier_stats().restore_failures, 1u);
  EXPECT_FALSE(fs::exists(file));
  EXPECT_TRUE(store.list("default").at("data").empty());
}

TEST(ServerStoreTiers, SpillFilesGoWithTheirContextAndTheStore) {
  SrvTierWorld w;
  StoreOptions o = srvtier_spill_all();
  const KvFormat f = KvFormat::parse("int8");
  {
    ContextStore store(w.pool, *w.engine, o);
    const std::uint64_t a = srvtier_add(w, store, f);
    const std::uint64_t b = srvtier_add(w, store, f);
    EXPECT_EQ(store.evict_over_budget(), 2);
    const std::string fa = o.spill_dir + "/" + ContextStore::name_of(a) + ".qkvctx";
    const std::string fb = o.spill_dir + "/" + ContextStore::name_of(b) + ".qkvctx";
    ASSERT_TRUE(fs::exists(fa));
    ASSERT_TRUE(fs::exists(fb));
    store.release("default", a);
    EXPECT_FALSE(fs::exists(fa));
    EXPECT_EQ(store.tier_stats().contexts_on_disk, 1u);
  }
  for (const auto& entry : fs::directory_iterator(o.spill_dir))  // only the folder's lock file stays
    EXPECT_NE(entry.path().extension(), ".qkvctx") << entry.path();
  EXPECT_EQ(w.pool->stats().kv.bytes_used, 0u);
}

TEST(ServerStoreTiers, OneServerAFolderAndAKilledServersFilesAreCleared) {
  SrvTierWorld w;
  StoreOptions o;
  o.spill_dir = qkvshare::testing::temp_dir() + "/spill";
  fs::create_directories(o.spill_dir);
  // What a server killed with contexts on disk leaves behind; another file is not the store's.
  const std::string stale = o.spill_dir + "/" + ContextStore::name_of(7) + ".qkvctx";
  std::ofstream(stale) << "left by a killed server";
  std::ofstream(o.spill_dir + "/notes.txt") << "someone else's";
  {
    ContextStore store(w.pool, *w.engine, o);
    EXPECT_FALSE(fs::exists(stale));
    EXPECT_TRUE(fs::exists(o.spill_dir + "/notes.txt"));
    try {
      ContextStore second(w.pool, *w.engine, o);
      ADD_FAILURE() << "a second store took a folder in use";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("another qkvshare serve is using this folder"), std::string::npos) << e.what();
    }
  }
  ContextStore after(w.pool, *w.engine, o);  // the folder is free again once its server stops
}
