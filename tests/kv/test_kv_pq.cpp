// Product-quantized KV (the pqN formats): codebook training, its file and the
// errors of bad files, the encoder, the lookup-table attention kernels of every
// level against the scalar reference and the decoded rows, and the formats
// under the real forward pass (stories260K, a codebook learned on its rows).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "kv_test_util.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/engine.hpp"
#include "qkvshare/kernels/kv_pq.hpp"
#include "qkvshare/kv/dense_kv_cache.hpp"
#include "qkvshare/kv/kv_codebook.hpp"
#include "qkvshare/kv/kv_kernels.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

constexpr int C = KvCodebook::kCentroids;

KvCodebook::Header header(int layers, int heads, int dim, int sub) {
  KvCodebook::Header h = KvCodebook::Header::of(KvShape{layers, 2 * heads, heads, dim}, sub, 300);
  h.model[0] = 7;
  return h;
}

// Rows [layer][token][kv_dim] with an outlier channel, as random_pass makes them.
std::vector<float> rows(int layers, int tokens, int kvd, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(layers) * tokens * kvd);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = g(rng) * (i % static_cast<std::size_t>(kvd) == 1 ? 6.0f : 1.0f);
  return x;
}

KvCodebook trained(int sub, unsigned seed = 3, int threads = 1) {
  const auto h = header(2, 2, 16, sub);
  CodebookTraining how;
  how.iterations = 4;
  how.seed = seed;
  how.threads = threads;
  return train_codebook(h, rows(2, 300, 32, 1), rows(2, 300, 32, 2), 300, how);
}

std::string write_bytes(const std::string& name, const std::string& bytes) {
  const std::string path = testing::temp_dir() + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void expect_load_error(const std::string& path, const std::string& what) {
  try {
    KvCodebook::load(path);
    FAIL() << "loaded a bad codebook; expected: " << what;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(KvCodebook, TrainingIsDeterministicForASeedWhateverTheThreads) {
  const KvCodebook a = trained(4, 3, 1), b = trained(4, 3, 2), c = trained(4, 4, 1);
  EXPECT_EQ(a.id(), b.id());
  EXPECT_NE(a.id(), c.id());
  // Centroids are means of rows: finite, and not all the same.
  const float* t = a.table(0, 1, 1);
  EXPECT_TRUE(std::isfinite(t[0]));
  EXPECT_NE(t[0], t[4]);
}

TEST(KvCodebook, FileRoundTripsAndBadFilesAreNamed) {
  const KvCodebook a = trained(2);
  const std::string path = testing::temp_dir() + "/book.kvc";
  a.save(path);
  const KvCodebook b = KvCodebook::load(path);
  EXPECT_EQ(a.id(), b.id());
  EXPECT_EQ(0, std::memcmp(a.table(1, 1, 0), b.table(1, 1, 0), sizeof(float) * 16 * C));
  EXPECT_EQ(b.header().model, a.header().model);
  const std::string good = read_bytes(path);
  std::string corrupt = good;
  corrupt[corrupt.size() / 2] ^= 0x40;
  expect_load_error(write_bytes("corrupt.kvc", corrupt), "checksum mismatch");
  expect_load_error(write_bytes("short.kvc", good.substr(0, good.size() - 4)), "payload bytes");
  expect_load_error(write_bytes("tiny.kvc", good.substr(0, 20)), "truncated header");
  std::string magic = good;
  magic[0] = 'X';
  expect_load_error(write_bytes("magic.kvc", magic), "bad magic");
  std::string newer = good;
  newer[8] = 4;
  expect_load_error(write_bytes("newer.kvc", newer), "version 4 (this build reads 1 to 3)");
  std::string flags = good;
  flags[8 + 56] = 4;  // a flag this build does not know
  expect_load_error(write_bytes("flags.kvc", flags), "unknown flags 0x4");
  std::string sub = good;
  sub[8 + 16] = 5;  // sub-vectors of 5 channels
  expect_load_error(write_bytes("sub.kvc", sub), "sub-vectors of 5");
  try {
    KvCodebook::load(testing::temp_dir() + "/missing.kvc");
    FAIL() << "loaded a missing file";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io);
  }
}

TEST(KvCodebook, FormatsNameTheirBookAndRefuseMismatches) {
  const std::string path = testing::temp_dir() + "/fmt.kvc";
  trained(4).save(path);
  const KvFormat f = KvFormat::parse("pq2:book=" + path);
  EXPECT_TRUE(f.k.pq() && f.v.pq());
  EXPECT_EQ(f.k.bits(), 2);
  EXPECT_EQ(KvFormat::parse(f.to_string()), f);
  EXPECT_EQ(f.to_string(), "pq2:book=" + path);
  const KvFormat mixed = KvFormat::parse("k4vpq2:sink=32:book=" + path);
  EXPECT_EQ(mixed.to_string(), "k4vpq2:sink=32:book=" + path);
  EXPECT_EQ(KvFormat::parse(mixed.to_string()), mixed);
  EXPECT_EQ(KvCodec::unpack(f.k.pack()), f.k);
  const KvShape shape{2, 4, 2, 16};  // layers, heads, kv heads, head_dim
  EXPECT_NO_THROW(f.validate(shape, 32));
  // A pq row is one byte per 4 channels and nothing else: 2 bits per element.
  EXPECT_DOUBLE_EQ(f.cold_bits(32, 16), 2.0);
  const auto bad = [](const std::string& text, const std::string& what) {
    try {
      KvFormat::parse(text);
      FAIL() << text << " parsed";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  bad("pq2", "pq needs book=FILE");
  bad("int4:book=" + path, "book applies to pq formats only");
  bad("pq2:rot=k:book=" + path, "no rot");
  bad("pq3:book=" + path, "unknown name");
  bad("pq2:kgroup=8:book=" + path, "kgroup needs per-token integer codes");
  bad("pq2:book=" + testing::temp_dir() + "/none.kvc", "cannot open");
  try {
    KvFormat::parse("pq4:book=" + path).validate(shape, 32);  // a 4-channel book for 2-channel sub-vectors
    FAIL() << "pq4 took a pq2 book";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2-channel sub-vectors"), std::string::npos) << e.what();
  }
  EXPECT_THROW(f.validate(KvShape{3, 4, 2, 16}, 32), Error);  // another model's shape
}

// A codebook says whether its keys were learned before RoPE (file version 2);
// a format must store keys the same way to use it for keys. Version 1 files
// (keys after RoPE) still load.
TEST(KvCodebook, KeysBeforeRopeMustMatchTheFormat) {
  const KvShape shape{2, 4, 2, 16};
  KvCodebook::Header h = header(2, 2, 16, 4);
  h.keys = KeyRope::pre;
  CodebookTraining how;
  how.iterations = 2;
  const std::string pre = testing::temp_dir() + "/pre.kvc", post = testing::temp_dir() + "/post.kvc";
  train_codebook(h, rows(2, 300, 32, 1), rows(2, 300, 32, 2), 300, how).save(pre);
  trained(4).save(post);
  EXPECT_EQ(KvCodebook::load(pre).header().keys, KeyRope::pre);
  EXPECT_NO_THROW(KvFormat::parse("pq2:keys=pre:book=" + pre).validate(shape, 32));
  EXPECT_NO_THROW(KvFormat::parse("k4vpq2:book=" + pre).validate(shape, 32));  // its keys are not pq
  const auto refused = [&](const std::string& text, const std::string& what) {
    try {
      KvFormat::parse(text).validate(shape, 32);
      FAIL() << text << " validated";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused("pq2:book=" + pre, "learned on keys=pre rows; the format stores keys=post (keys=pre here");
  refused("pq2:keys=pre:book=" + post, "learned on keys=post rows; the format stores keys=pre");
  refused("pq2:keys=block:book=" + pre, "learned on keys=pre rows; the format stores keys=block");
  // The same tables in a version 1 file: no flags word, keys after RoPE.
  std::string v1 = read_bytes(post);
  v1.erase(8 + 56, 4);
  v1[8] = 1;
  const KvCodebook old = KvCodebook::load(write_bytes("v1.kvc", v1));
  EXPECT_EQ(old.header().keys, KeyRope::post);
  EXPECT_EQ(0, std::memcmp(old.table(0, 1, 1), KvCodebook::load(post).table(0, 1, 1), sizeof(float) * 4 * C));
}

// keys=block rows are relative to the pool's block size: a codebook records
// the size it was learned with (file version 3) and a pool of another size
// refuses it; a version 2 keys=block file, which does not record it, is
// refused with a way out.
TEST(KvCodebook, KeysRelativeToBlocksRecordTheBlockSize) {
  const KvShape shape{2, 4, 2, 16};
  KvCodebook::Header h = header(2, 2, 16, 4);
  h.keys = KeyRope::block;
  h.block_tokens = 16;
  CodebookTraining how;
  how.iterations = 2;
  const std::string path = testing::temp_dir() + "/block16.kvc";
  train_codebook(h, rows(2, 300, 32, 1), rows(2, 300, 32, 2), 300, how).save(path);
  EXPECT_EQ(KvCodebook::load(path).header().block_tokens, 16);
  EXPECT_NO_THROW(KvFormat::parse("pq2:keys=block:book=" + path).validate(shape, 16));
  const auto refused = [&](const std::string& file, int block_tokens, const std::string& what) {
    try {
      KvFormat::parse("pq2:keys=block:book=" + file).validate(shape, block_tokens);
      FAIL() << file << " validated for " << block_tokens << "-token blocks";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused(path, 32, "learned on keys relative to 16-token blocks; this pool's blocks hold 32 tokens "
                    "(calibrate --keys block --block-tokens 32)");
  std::string bytes = read_bytes(path);
  EXPECT_EQ(static_cast<unsigned char>(bytes[8 + 57]), 5u) << "bits 8-15: 1 + log2(16)";
  // As version 2 wrote it: no block size.
  std::string v2 = bytes;
  v2[8] = 2;
  v2[8 + 57] = 0;
  refused(write_bytes("block-v2.kvc", v2), 32, "does not record the block size its keys are relative to");
  // A block size on a codebook whose keys are not relative, and one out of range: named, not loaded.
  std::string post = read_bytes(path);
  post[8 + 56] = 0;
  expect_load_error(write_bytes("post-with-block.kvc", post), "a block size is recorded exactly for keys=block");
  std::string huge = bytes;
  huge[8 + 57] = 20;
  expect_load_error(write_bytes("huge-block.kvc", huge), "a block size is recorded exactly for keys=block");
  std::string v2_with_bits = bytes;
  v2_with_bits[8] = 2;
  expect_load_error(write_bytes("v2-with-bits.kvc", v2_with_bits), "unknown flags 0x502");
}

TEST(KvPq, EncoderStoresTheNearestCentroid) {
  const KvCodebook book = trained(4);
  const KvCodec codec{KvType::pq, KvAxis::token, 4};
  const TileLayout l = tile_layout(codec, 32, 16);
  EXPECT_EQ(l.row_bytes, 4u);
  const kv::CodebookSlice slice{book.table(0, 1, 0), book.table_t(0, 1, 0)};
  for (int kind = 0; kind < 3; ++kind) {  // random, zeros, all equal
    auto x = rows(1, 32, 16, 9);
    if (kind > 0) std::fill(x.begin(), x.end(), kind == 1 ? 0.0f : 2.5f);
    std::vector<std::byte> tile(l.bytes);
    kv::encode_tile(codec, l, x.data(), tile.data(), slice);
    std::vector<float> back(x.size());
    kv::decode_tile_scalar(codec, l, tile.data(), 32, back.data(), slice);
    for (int j = 0; j < 32; ++j)
      for (int s = 0; s < 4; ++s) {
        const float* xs = &x[static_cast<std::size_t>(j) * 16 + s * 4];
        const auto dist = [&](const float* c) {
          double d = 0;
          for (int e = 0; e < 4; ++e) d += (xs[e] - c[e]) * (xs[e] - c[e]);
          return d;
        };
        double best = 1e30;
        for (int c = 0; c < C; ++c) best = std::min(best, dist(slice.table + (s * C + c) * 4));
        EXPECT_NEAR(dist(&back[static_cast<std::size_t>(j) * 16 + s * 4]), best, 1e-4 * (1 + best));
      }
  }
}

// The LUT kernels on every level against float math over the decoded rows.
TEST(KvPq, LookupKernelsMatchTheDecodedRowsOnEveryLevel) {
  for (int sub : {2, 4, 8}) {
    const KvCodebook book = trained(sub);
    const KvCodec codec{KvType::pq, KvAxis::token, static_cast<std::uint16_t>(sub)};
    const TileLayout l = tile_layout(codec, 32, 16);
    const kv::CodebookSlice slice{book.table(1, 0, 1), book.table_t(1, 0, 1)};
    const auto x = rows(1, 32, 16, 11);
    std::vector<std::byte> tile(l.bytes);
    kv::encode_tile(codec, l, x.data(), tile.data(), slice);
    const kernels::TileCodes t = kv::tile_codes(codec, l, slice);
    std::vector<float> dec(x.size());
    kernels::decode_tile_ref(t, tile.data(), 32, dec.data());
    const int nq = 3;
    const auto q = rows(1, nq, 16, 12);
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    std::vector<float> p(static_cast<std::size_t>(nq) * 32);
    for (float& w : p) w = u(rng);
    for (kernels::Isa isa : kernels::kAllIsas) {
      if (!kernels::isa_available(isa)) continue;
      const kernels::TileKernels& k = kernels::tile_kernels(isa);
      std::vector<float> got(x.size());
      k.decode(t, tile.data(), 32, got.data());
      EXPECT_EQ(0, std::memcmp(got.data(), dec.data(), sizeof(float) * got.size())) << kernels::isa_name(isa);
      std::vector<float> lut(static_cast<std::size_t>(nq) * kernels::pq_table_floats(t)), s(static_cast<std::size_t>(nq) * 32);
      kernels::pq_lut(k, t, q.data(), nq, 0.25f, lut.data());
      kernels::pq_scores(t, tile.data(), 3, 29, lut.data(), nq, s.data(), 32);
      std::vector<float> hist(lut.size(), 0.0f), o(static_cast<std::size_t>(nq) * 16, 0.5f);
      kernels::pq_accumulate(t, tile.data(), 0, 32, p.data(), 32, nq, hist.data());
      kernels::pq_reduce(k, t, hist.data(), nq, o.data());
      for (int i = 0; i < nq; ++i) {
        for (int j = 3; j < 29; ++j) {
          double want = 0;
          for (int c = 0; c < 16; ++c) want += q[static_cast<std::size_t>(i) * 16 + c] * dec[static_cast<std::size_t>(j) * 16 + c];
          EXPECT_NEAR(s[static_cast<std::size_t>(i) * 32 + j], 0.25 * want, 1e-4) << kernels::isa_name(isa) << " sub " << sub;
        }
        for (int c = 0; c < 16; ++c) {
          double want = 0.5;
          for (int j = 0; j < 32; ++j) want += p[static_cast<std::size_t>(i) * 32 + j] * dec[static_cast<std::size_t>(j) * 16 + c];
          EXPECT_NEAR(o[static_cast<std::size_t>(i) * 16 + c], want, 1e-4 * (1 + std::abs(want))) << kernels::isa_name(isa);
        }
      }
    }
  }
}

// A pooled cache in a pq format: attention on the lookup tables equals
// attention over the decoded tiles, on every level, and the pool gets every block back.
TEST(KvPq, PooledAttentionOnTablesMatchesDecodedTiles) {
  testing::IsaGuard guard;
  const KvShape shape{2, 4, 2, 16};
  const std::string path = testing::temp_dir() + "/pooled.kvc";
  trained(4).save(path);
  const KvFormat f = KvFormat::parse("kpq2v16:book=" + path);  // f16 values: only the keys differ
  const KvFormat g = KvFormat::parse("pq2:book=" + path);
  for (kernels::Isa isa : kernels::kAllIsas) {
    if (!kernels::isa_available(isa)) continue;
    kernels::set_active_isa(isa);
    for (const KvFormat& fmt : {f, g}) {
      auto pool = KvPool::create(PoolConfig{shape, 32, 8 << 20});
      ThreadPool threads(2);
      std::vector<float> out[2];
      for (int on = 0; on < 2; ++on) {
        kv::set_pq_lookup_tables(on == 1);
        PooledKvCache cache(pool, fmt, 256);
        testing::run_pass(cache, testing::random_pass(shape, 100, 1), 100, threads);  // three cold pq blocks
        out[on] = testing::run_pass(cache, testing::random_pass(shape, 2, 2), 2, threads);
      }
      kv::set_pq_lookup_tables(false);
      ASSERT_EQ(out[0].size(), out[1].size());
      for (std::size_t i = 0; i < out[0].size(); ++i)
        EXPECT_NEAR(out[0][i], out[1][i], 2e-5f) << kernels::isa_name(isa) << " " << fmt.to_string();
      EXPECT_EQ(pool->counters().blocks_used, 0u);
    }
  }
}

// stories260K with a codebook learned on its own rows (another text than
// the one scored): pq formats track the f32 cache, closer with more bits.
TEST(KvPq, RealModelTracksF32CloserWithMoreBits) {
  auto model = Model::load(testing::shared_path("models/stories260K.bin"), testing::shared_path("models/tok512.bin"));
  std::ifstream in(testing::shared_path("data/tinystories-valid-sample.txt"));
  std::ostringstream text;
  text << in.rdbuf();
  const auto all = model->tokenizer().encode(text.str());
  ASSERT_GE(all.size(), 900u);
  Engine engine(*model, EngineOptions{2, 256});
  const KvShape shape = engine.kv_shape();
  const int n = 400;
  Session calib(std::make_unique<DenseKvCache>(shape, n));
  engine.forward(calib, std::span<const TokenId>(all.data() + 400, n));
  const auto& dense = static_cast<const DenseKvCache&>(calib.cache());
  const auto kvd = static_cast<std::size_t>(shape.kv_dim());
  std::vector<float> keys(static_cast<std::size_t>(shape.n_layers) * n * kvd), values(keys.size());
  for (int l = 0; l < shape.n_layers; ++l)
    for (int t = 0; t < n; ++t) {
      const std::size_t at = (static_cast<std::size_t>(l) * n + static_cast<std::size_t>(t)) * kvd;
      dense.read_row(l, t, &keys[at], &values[at]);
    }
  const std::span<const TokenId> scored(all.data(), 300);
  const auto logits_of = [&](Session& s) {
    std::vector<float> l;
    for (std::size_t at = 0; at < scored.size(); at += 100) {
      const auto part = engine.forward(s, scored.subspan(at, 100), true);
      l.insert(l.end(), part.begin(), part.end());
    }
    return l;
  };
  Session ref(std::make_unique<DenseKvCache>(shape, 512));
  const auto want = logits_of(ref);
  const int V = model->config().vocab_size;
  double kl_by_sub[9] = {};
  auto pool = KvPool::create(PoolConfig{shape, 32, 64 << 20});
  for (int sub : {2, 8}) {
    const KvCodebook::Header h = KvCodebook::Header::of(shape, sub, n);
    const std::string path = testing::temp_dir() + "/stories-" + std::to_string(sub) + ".kvc";
    train_codebook(h, keys, values, n, CodebookTraining{}).save(path);
    Session s(std::make_unique<PooledKvCache>(pool, KvFormat::parse(fmt::format("pq{}:book={}", 8 / sub, path)), 512));
    const auto got = logits_of(s);
    double kl = 0;
    for (std::size_t t = 100; t < scored.size(); ++t) {  // positions that read cold pq blocks of earlier passes
      const float* a = &want[t * V];
      const float* b = &got[t * V];
      double ma = a[0], mb = b[0], za = 0, zb = 0;
      for (int i = 0; i < V; ++i) ma = std::max<double>(ma, a[i]), mb = std::max<double>(mb, b[i]);
      for (int i = 0; i < V; ++i) za += std::exp(a[i] - ma), zb += std::exp(b[i] - mb);
      for (int i = 0; i < V; ++i) {
        const double pa = std::exp(a[i] - ma) / za;
        kl += pa * ((a[i] - ma - std::log(za)) - (b[i] - mb - std::log(zb)));
      }
    }
    kl_by_sub[sub] = kl / static_cast<double>(scored.size() - 100);
  }
  EXPECT_LT(kl_by_sub[2], kl_by_sub[8]);  // pq4 closer than pq1
  EXPECT_GT(kl_by_sub[2], 0.0);           // the pq rows are read: not the f32 logits
  EXPECT_LT(kl_by_sub[2], 0.5);
  EXPECT_EQ(pool->counters().blocks_used, 0u);
}

}  // namespace
}  // namespace qkvshare
