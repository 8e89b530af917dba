// The portable context format on real stories260K contexts: export and
// import in every KV format continue bit-identically in another pool,
// exports are deterministic, and every corruption, tampered byte, missing or
// wrong key is refused with a message naming what is wrong.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/mapped_file.hpp"
#include "qkvshare/tiers/context_io.hpp"
#include "qkvshare/tiers/crypto.hpp"
#include "share/share_test_util.hpp"
#include "synthetic_files.hpp"

namespace qkvshare {
namespace {

using testing::load_stories;

KeyCipher test_key(std::uint8_t seed) {
  std::array<std::uint8_t, KeyCipher::kKeyBytes> k{};
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<std::uint8_t>(seed + 7 * i);
  return KeyCipher(k);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

class ContextFile : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = load_stories();
    fp_ = model_fingerprint(*model_);
    engine_ = std::make_unique<Engine>(*model_, EngineOptions{1});
    a_ = SharePool::create_anonymous(testing::small_config());
    b_ = SharePool::create_anonymous(testing::small_config());
    b_->kv_pool(engine_->kv_shape());
    const Tokenizer& tok = model_->tokenizer();
    prompt_ = {tok.bos_id()};
    const auto body = tok.encode("Once upon a time there was a little dog named Max. He liked to run in the park "
                                 "and play with a red ball every day after school.");
    prompt_.insert(prompt_.end(), body.begin(), body.end());
    more_ = tok.encode(" One day");
  }

  // A producer session in pool A, sealed and granted to "B".
  Descriptor produce(const std::string& format, std::unique_ptr<Session>& producer) {
    producer = new_pooled_session(*a_, *engine_, KvFormat::parse(format), 512);
    engine_->forward(*producer, prompt_);
    const SealedContext sealed = seal_session(*a_, *engine_, fp_, *producer, "A");
    const Descriptor d = a_->grant(sealed, "A", "B");
    a_->release(sealed);
    return d;
  }

  std::vector<std::uint8_t> export_bytes(const Descriptor& d, const BlockCipher* cipher = nullptr) {
    std::vector<std::uint8_t> out;
    export_descriptor(*a_, d, "B", [&](std::span<const std::uint8_t> s) { out.insert(out.end(), s.begin(), s.end()); },
                      cipher);
    return out;
  }

  std::vector<float> continue_with(Session& s) {
    const auto l = engine_->forward(s, more_, true);
    std::vector<float> out(l.begin(), l.end());
    const auto d = engine_->forward(s, std::vector<TokenId>{42});
    out.insert(out.end(), d.begin(), d.end());
    return out;
  }

  std::unique_ptr<Model> model_;
  ModelFingerprint fp_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<SharePool> a_, b_;
  std::vector<TokenId> prompt_, more_;
};

TEST_F(ContextFile, ImportedContextContinuesBitIdenticallyInAnotherPoolForEveryFormat) {
  const KeyCipher key = test_key(1);
  for (const char* format : {"f32", "f16", "int8", "int4", "int3", "k8v4", "int2:window=32:sink=4", "int4:rot=kv",
                             "int4:keys=pre", "k8v4:rot=v:keys=pre", "int4:keys=block", "int2:outliers=0.02",
                             "int4:vgroup=64:outliers=0.01:params=8", "int4:tail=cold"}) {
    for (const BlockCipher* cipher : {static_cast<const BlockCipher*>(nullptr), static_cast<const BlockCipher*>(&key)}) {
      SCOPED_TRACE(std::string(format) + (cipher ? " encrypted" : " plain"));
      std::unique_ptr<Session> producer;
      const Descriptor d = produce(format, producer);
      const auto bytes = export_bytes(d, cipher);
      const ContextReader reader(bytes, "ctx");
      EXPECT_EQ(reader.encrypted(), cipher != nullptr);
      EXPECT_EQ(reader.meta().tokens, producer->tokens());
      if (KvFormat::parse(format).cold_tail) {  // the partly filled block travels coded
        EXPECT_LT(reader.meta().blocks.back().fill, 32u);
        EXPECT_EQ(reader.meta().blocks.back().k, KvFormat::parse(format).k);
      }
      const SealedContext sealed = import_sealed(*b_, reader, "A", &fp_, cipher);
      const Descriptor d2 = b_->grant(sealed, "A", "C");
      b_->release(sealed);
      HandoffResult r = open_session(*b_, *engine_, fp_, d2, "C", {HandoffMode::kv});
      ASSERT_TRUE(r.kv);
      EXPECT_EQ(r.session->tokens(), producer->tokens());
      HandoffResult mine = open_session(*a_, *engine_, fp_, d, "B", {HandoffMode::kv});
      const auto want = continue_with(*mine.session);
      const auto got = continue_with(*r.session);
      ASSERT_EQ(want.size(), got.size());
      EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
      if (cipher == nullptr) {  // deterministic: the imported context exports to the same bytes
        const auto ctx = b_->open(d2, "C", true, 512);
        std::vector<std::uint8_t> again;
        write_pooled_context(*ctx.cache, ctx.tokens, ctx.text, fp_,
                             [&](std::span<const std::uint8_t> s) { again.insert(again.end(), s.begin(), s.end()); });
        EXPECT_EQ(again, bytes);
      }
      r.session.reset();
      mine.session.reset();
      b_->release(d2, "C");
      a_->release(d, "B");
    }
  }
  EXPECT_EQ(a_->stats().contexts, 0);
  EXPECT_EQ(b_->stats().contexts, 0);
  EXPECT_EQ(b_->kv_pool_if_any()->counters().blocks_used, 0u);
}

TEST_F(ContextFile, EveryCorruptedHeaderOrTableByteIsRefused) {
  std::unique_ptr<Session> producer;
  const Descriptor d = produce("int4", producer);
  const auto bytes = export_bytes(d);
  const std::size_t payload = ContextReader(bytes, "ctx").meta().blocks.front().payload_offset;
  for (std::size_t i = 0; i < payload; ++i) {
    auto bad = bytes;
    bad[i] ^= 0x5a;
    bool refused = false;
    try {
      ContextReader r(bad, "ctx");
    } catch (const Error& e) {
      refused = e.code() == ErrorCode::bad_descriptor && std::string(e.what()).starts_with("ctx: ");
    }
    EXPECT_TRUE(refused) << "byte " << i;
  }
  EXPECT_NE(error_of([&] { ContextReader(std::span(bytes).first(bytes.size() - 1), "ctx"); }).find("truncated"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ContextReader(std::span(bytes).first(100), "ctx"); }).find("shorter than"),
            std::string::npos);
  auto bad = bytes;
  bad[3] = 'X';
  EXPECT_NE(error_of([&] { ContextReader(bad, "ctx"); }).find("magic"), std::string::npos);
  bad = bytes;
  bad[200] ^= 1;
  EXPECT_NE(error_of([&] { ContextReader(bad, "ctx"); }).find("tables checksum"), std::string::npos);
  a_->release(d, "B");
}

TEST_F(ContextFile, CorruptedPlainBlockAndTamperedEncryptedBlockAreNeverDecoded) {
  const KeyCipher key = test_key(1);
  std::unique_ptr<Session> producer;
  const Descriptor d = produce("int8", producer);
  for (const BlockCipher* cipher : {static_cast<const BlockCipher*>(nullptr), static_cast<const BlockCipher*>(&key)}) {
    auto bytes = export_bytes(d, cipher);
    const std::size_t at = ContextReader(bytes, "ctx").meta().blocks[1].payload_offset + 33;
    bytes[at] ^= 0x01;
    const ContextReader reader(bytes, "ctx");  // the tables are intact
    const std::uint32_t before = b_->kv_pool_if_any()->counters().blocks_used;
    const std::string e = error_of([&] { import_sealed(*b_, reader, "A", &fp_, cipher); });
    EXPECT_NE(e.find(cipher ? "ctx: block 1: authentication failed" : "ctx: block 1: checksum does not match"),
              std::string::npos)
        << e;
    EXPECT_EQ(b_->kv_pool_if_any()->counters().blocks_used, before);  // the blocks imported before were given back
    EXPECT_EQ(b_->stats().contexts, 0);
  }
  a_->release(d, "B");
}

TEST_F(ContextFile, MissingOrWrongKeyIsReportedAsSuch) {
  const KeyCipher key = test_key(1), other = test_key(2);
  EXPECT_NE(key.key_id(), other.key_id());
  std::unique_ptr<Session> producer;
  const Descriptor d = produce("int4", producer);
  const auto bytes = export_bytes(d, &key);
  const ContextReader reader(bytes, "ctx");
  EXPECT_NE(error_of([&] { import_sealed(*b_, reader, "A", &fp_, nullptr); }).find("give the key file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { import_sealed(*b_, reader, "A", &fp_, &other); }).find("wrong key"), std::string::npos);
  // A wrong key whose id was forged to match still cannot open a block.
  struct LyingKey final : BlockCipher {
    const KeyCipher& real;
    std::uint64_t id;
    LyingKey(const KeyCipher& r, std::uint64_t i) : real(r), id(i) {}
    std::uint64_t key_id() const noexcept override { return id; }
    std::size_t overhead() const noexcept override { return real.overhead(); }
    void seal(std::span<const std::uint8_t> p, std::span<const std::uint8_t> a, std::span<std::uint8_t> o) const override {
      real.seal(p, a, o);
    }
    void open(std::span<const std::uint8_t> s, std::span<const std::uint8_t> a, std::span<std::uint8_t> p,
              std::string_view w) const override {
      real.open(s, a, p, w);
    }
  } liar(other, key.key_id());
  EXPECT_NE(error_of([&] { import_sealed(*b_, reader, "A", &fp_, &liar); }).find("authentication failed"),
            std::string::npos);
  EXPECT_EQ(b_->kv_pool_if_any()->counters().blocks_used, 0u);
  a_->release(d, "B");
}

TEST_F(ContextFile, AnotherModelOrKvShapeIsRefused) {
  std::unique_ptr<Session> producer;
  const Descriptor d = produce("f16", producer);
  const auto bytes = export_bytes(d);
  const ContextReader reader(bytes, "ctx");
  ModelFingerprint other = fp_;
  other.model[0] ^= 1;
  EXPECT_NE(error_of([&] { import_sealed(*b_, reader, "A", &other); }).find("made by model"), std::string::npos);
  PoolConfig pc;
  pc.shape = testing::tiny_shape();
  pc.capacity_bytes = std::size_t{1} << 20;
  auto tiny = KvPool::create(pc);
  EXPECT_NE(error_of([&] { import_context(reader, tiny, 512); }).find("is not the pool's"), std::string::npos);
  a_->release(d, "B");
}

TEST(KeyFile, ParsesRawAndHexAndRefusesAnythingElse) {
  const std::string dir = testing::temp_dir();
  const auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
    return dir + "/" + name;
  };
  const std::string raw(32, '\x07');
  std::string hex;
  for (int i = 0; i < 32; ++i) hex += "07";
  EXPECT_EQ(KeyCipher::from_file(write("raw", raw)).key_id(), KeyCipher::from_file(write("hex", hex + "\n")).key_id());
  EXPECT_NE(error_of([&] { KeyCipher::from_file(write("short", "abc")); }).find("32 raw bytes or 64 hex digits"),
            std::string::npos);
  EXPECT_NE(error_of([&] { KeyCipher::from_file(write("bad", "zz" + hex.substr(2))); }).find("not a hex digit"),
            std::string::npos);
  EXPECT_NE(error_of([&] { KeyCipher::from_file(dir + "/absent"); }).find("cannot open key file"), std::string::npos);
  KeyCipher::generate_file(dir + "/gen");
  EXPECT_NE(KeyCipher::from_file(dir + "/gen").key_id(), 0u);
  EXPECT_NE(error_of([&] { KeyCipher::generate_file(dir + "/gen"); }).find("cannot create key file"),
            std::string::npos);
}

}  // namespace
}  // namespace qkvshare

namespace qkvshare {
namespace {

// Files exported by an earlier build (tests/data/contexts, also the
// big-endian test's input) still import, and open as the same tokens: the
// format is stable across builds.
TEST(ContextVectors, CommittedFilesImportAndOpen) {
  auto model = testing::load_stories();
  const ModelFingerprint fp = model_fingerprint(*model);
  Engine engine(*model, EngineOptions{1});
  auto pool = SharePool::create_anonymous(testing::small_config());
  // Version 1 files, a version 2 file of keys stored before RoPE (its blocks name their key positions),
  // and one of byte parameters with key outliers (int4:vgroup=8:koutliers=0.02:params=8).
  for (const char* name : {"f32", "f16", "k8v4", "int3", "int4_rot_kv", "int4_keys_pre", "int4_params8"}) {
    SCOPED_TRACE(name);
    const MappedFile file(testing::source_path(std::string("tests/data/contexts/") + name + ".qkvctx"));
    const ContextReader reader(file.bytes(), name);
    const bool pre = std::string(name) == "int4_keys_pre";
    EXPECT_EQ(reader.meta().format.key_rope, pre ? KeyRope::pre : KeyRope::post);
    EXPECT_EQ(reader.meta().blocks[1].key_position, pre ? 32 : 0);
    const SealedContext sealed = import_sealed(*pool, reader, "A", &fp);
    const Descriptor d = pool->grant(sealed, "A", "B");
    pool->release(sealed);
    HandoffResult r = open_session(*pool, engine, fp, d, "B", {HandoffMode::kv, true});
    ASSERT_TRUE(r.kv);
    EXPECT_EQ(r.session->tokens(), reader.meta().tokens);
    EXPECT_EQ(model->tokenizer().decode(r.session->tokens()), reader.meta().text);
    r.session.reset();
    pool->release(d, "B");
  }
  EXPECT_EQ(pool->kv_pool_if_any()->counters().blocks_used, 0u);
}

// Gemma 3's sliding-window layers (tiny-gemma3): a context whose early blocks
// kept the global layer alone exports as version 3 (the layers' windows named,
// those blocks' payloads a sixth of a whole one), imports into a pool of the
// same windows and continues bit-identically, exports again to the same bytes;
// a pool that cannot tell which layers such a block holds refuses it.
TEST(ContextFileWindowed, BlocksThatLeftTheWindowRoundTrip) {
  const auto model = Model::load(testing::synthetic_file("tiny-gemma3", GgmlType::Q8_0));
  const ModelFingerprint fp = model_fingerprint(*model);
  Engine engine(*model, EngineOptions{1});
  const KvShape shape = engine.kv_shape();
  KvShape dims = shape;
  dims.layer_window.clear();
  auto a = KvPool::create(PoolConfig{shape, 16, 16 << 20}), b = KvPool::create(PoolConfig{shape, 16, 16 << 20});
  std::vector<TokenId> ids, more;
  for (int i = 0; i < 90; ++i) ids.push_back((i * 53 + 7) % 500);
  for (int i = 0; i < 9; ++i) more.push_back((i * 29 + 3) % 500);
  const KvFormat f = KvFormat::parse("int4:window=16");
  Session producer(std::make_unique<PooledKvCache>(a, f, 256));
  engine.forward(producer, ids);
  const auto& pc = dynamic_cast<const PooledKvCache&>(producer.cache());
  ASSERT_EQ(pc.windowed_kept_from(), 80);  // 90 tokens, an 8-token window, blocks of 16
  std::vector<std::uint8_t> bytes;
  const ByteSink sink = [&](std::span<const std::uint8_t> s) { bytes.insert(bytes.end(), s.begin(), s.end()); };
  write_pooled_context(pc, producer.tokens(), "", fp, sink);
  const ContextReader reader(bytes, "windowed");
  EXPECT_EQ(bytes[8], 3);  // version
  EXPECT_EQ(reader.meta().shape, shape);
  int lean = 0;
  for (std::size_t i = 0; i < reader.meta().blocks.size(); ++i) {
    const bool freed = (reader.meta().blocks[i].flags & kBlockWindowFreed) != 0;
    lean += freed ? 1 : 0;
    const ContextBlock& blk = reader.meta().blocks[i];
    EXPECT_EQ(reader.plain_bytes(i) * (freed ? 6 : 1), block_plain_bytes(shape, 16, blk.k, blk.v)) << i;
  }
  EXPECT_EQ(lean, 5);

  auto copy = import_context(reader, b, 256);
  Session consumer(std::move(copy), ids);
  const auto want = engine.forward(producer, more, true);
  const std::vector<float> w(want.begin(), want.end());
  const auto got = engine.forward(consumer, more, true);
  ASSERT_EQ(w.size(), got.size());
  EXPECT_EQ(0, std::memcmp(w.data(), got.data(), w.size() * sizeof(float)));

  // The imported context, before it went on, exports to the same bytes.
  auto again_pool = KvPool::create(PoolConfig{shape, 16, 16 << 20});
  auto again = import_context(reader, again_pool, 256);
  std::vector<std::uint8_t> second;
  write_pooled_context(*again, ids, "", fp,
                       [&](std::span<const std::uint8_t> s) { second.insert(second.end(), s.begin(), s.end()); });
  EXPECT_EQ(second, bytes);

  auto plain = KvPool::create(PoolConfig{dims, 16, 16 << 20});
  const std::string why = error_of([&] { import_context(reader, plain, 256); });
  EXPECT_NE(why.find("sliding window"), std::string::npos) << why;
}

}  // namespace
}  // namespace qkvshare
