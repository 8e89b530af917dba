// Segments at a position offset (splice): attention over a spliced context
// equals a fresh computation with the keys at their new positions, for both
// RoPE styles, every KV format and every attention ISA; and so does a sliding
// window (gemma3's local layers) over plain and spliced contexts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kv_test_util.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/ops.hpp"
#include "qkvshare/kernels/isa.hpp"
#include "qkvshare/kv/kv_kernels.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare {
namespace {

using testing::max_abs_diff;

const char* const kSpliceFormats[] = {"f32", "f16", "int8", "int8:kaxis=token", "k8v4", "int4", "int3", "int2",
                                "int2:window=20:sink=3", "int4:rot=kv", "int3:rot=k", "k4v2:vgroup=8",
                                "f32:keys=pre", "int4:keys=pre", "int2:window=20:sink=3:keys=pre:rot=v",
                                "f32:keys=block", "int4:keys=block", "k8v4:keys=block:rot=v"};

// Raw (pre-RoPE) rows of one token stream, every layer.
struct Stream {
  KvShape s;
  int n = 0;
  std::vector<std::vector<float>> q, k, v;  // [layer][n * dim]
};

Stream make_stream(const KvShape& s, int n, unsigned seed) {
  const testing::Pass p = testing::random_pass(s, n, seed);
  return Stream{s, n, p.q, p.k, p.v};
}

KvRope make_rope(int head_dim, kernels::RopeStyle style) {
  KvRope r;
  r.style = style;
  for (int i = 0; i < head_dim / 2; ++i) r.inv_freq.push_back(static_cast<float>(std::pow(10000.0, -2.0 * i / head_dim)));
  return r;
}

// Writes tokens [first, first + n) of a stream with keys and queries rotated
// at positions pos0.. (keys as projected for a cache that stores them before
// RoPE, as the engine does); returns the attention outputs (every layer).
std::vector<float> write_pass(KvCache& cache, const Stream& st, int first, int n, int pos0, const KvRope& rope,
                              ThreadPool& pool, std::vector<std::vector<float>>* queries = nullptr, int window = 0) {
  const KvShape& s = st.s;
  testing::Pass p;
  for (int l = 0; l < s.n_layers; ++l) {
    const auto* k0 = st.k[static_cast<std::size_t>(l)].data() + static_cast<std::ptrdiff_t>(first) * s.kv_dim();
    const auto* v0 = st.v[static_cast<std::size_t>(l)].data() + static_cast<std::ptrdiff_t>(first) * s.kv_dim();
    const auto* q0 = st.q[static_cast<std::size_t>(l)].data() + static_cast<std::ptrdiff_t>(first) * s.q_dim();
    std::vector<float> k(k0, k0 + static_cast<std::ptrdiff_t>(n) * s.kv_dim()), v(v0, v0 + k.size()),
        q(q0, q0 + static_cast<std::ptrdiff_t>(n) * s.q_dim());
    for (int t = 0; t < n; ++t) {
      if (!cache.keys_before_rope())
        kernels::rope(&k[static_cast<std::size_t>(t) * s.kv_dim()], s.n_kv_heads, s.head_dim, static_cast<float>(pos0 + t),
                      rope.freq(l).data(), rope.style);
      kernels::rope(&q[static_cast<std::size_t>(t) * s.q_dim()], s.n_heads, s.head_dim, static_cast<float>(pos0 + t),
                    rope.freq(l).data(), rope.style);
    }
    p.k.push_back(std::move(k));
    p.v.push_back(std::move(v));
    p.q.push_back(std::move(q));
  }
  if (queries != nullptr) *queries = p.q;
  if (cache.keys_before_rope()) cache.set_rope(rope);
  return testing::run_pass(cache, p, n, pool, window);
}

// Attention of `queries` (rotated, [n][q_dim] per layer, query t at logical
// index size0 + t) over the rows the cache holds now, in double: keys read
// back (decoded, Hadamard undone) and rotated by `offset_of(i)` to their
// logical positions. The fresh computation the segments must equal. With a
// window, query t sees only the last `window` tokens up to itself.
std::vector<float> reference(const PooledKvCache& c, const std::vector<std::vector<float>>& queries, int size0, int n,
                             const std::function<int(int)>& offset_of, const KvRope& rope, int window = 0) {
  const KvShape& s = c.shape();
  const int D = s.head_dim, N = c.size(), G = s.n_heads / s.n_kv_heads;
  std::vector<float> all;
  std::vector<float> kr(static_cast<std::size_t>(N) * D), vr(kr.size());
  for (int l = 0; l < s.n_layers; ++l) {
    std::vector<float> out(static_cast<std::size_t>(n) * s.q_dim());
    for (int h = 0; h < s.n_kv_heads; ++h) {
      c.read_rows(l, 0, h, 0, N, kr.data());
      c.read_rows(l, 1, h, 0, N, vr.data());
      for (int i = 0; i < N; ++i) {
        float* k = &kr[static_cast<std::size_t>(i) * D];
        if (c.format().rotate_k) kv::unrotate(k, D);
        if (c.format().rotate_v) kv::unrotate(&vr[static_cast<std::size_t>(i) * D], D);
        if (offset_of(i) != 0) kernels::rope(k, 1, D, static_cast<float>(offset_of(i)), rope.freq(l).data(), rope.style);
      }
      for (int t = 0; t < n; ++t)
        for (int g = 0; g < G; ++g) {
          const int qh = h * G + g, seen = size0 + t + 1, from = window > 0 ? std::max(0, seen - window) : 0;
          const float* q = &queries[static_cast<std::size_t>(l)][static_cast<std::size_t>(t) * s.q_dim() + qh * D];
          std::vector<double> w(static_cast<std::size_t>(seen), 0.0);
          double mx = -1e300, sum = 0;
          for (int j = from; j < seen; ++j) {
            double d = 0;
            for (int x = 0; x < D; ++x) d += static_cast<double>(q[x]) * kr[static_cast<std::size_t>(j) * D + x];
            w[static_cast<std::size_t>(j)] = d / std::sqrt(static_cast<double>(D));
            mx = std::max(mx, w[static_cast<std::size_t>(j)]);
          }
          for (int j = from; j < seen; ++j) sum += (w[static_cast<std::size_t>(j)] = std::exp(w[static_cast<std::size_t>(j)] - mx));
          for (int x = 0; x < D; ++x) {
            double o = 0;
            for (int j = from; j < seen; ++j) o += w[static_cast<std::size_t>(j)] * vr[static_cast<std::size_t>(j) * D + x];
            out[static_cast<std::size_t>(t) * s.q_dim() + qh * D + x] = static_cast<float>(o / sum);
          }
        }
    }
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

struct SpliceCase {
  KvShape shape;
  int block_tokens;
  int producer_tokens;  // > 16 blocks exercises the split-K decode partitions inside a segment
};

std::vector<AttendPath> every_path() {
  std::vector<AttendPath> paths{AttendPath::scalar};
  if (kernels::isa_available(kernels::Isa::avx2)) paths.push_back(AttendPath::avx2);
  if (kernels::isa_available(kernels::Isa::avx512)) paths.push_back(AttendPath::avx512);
  if (kernels::isa_available(kernels::Isa::neon)) paths.push_back(AttendPath::neon);
  if (kernels::isa_available(kernels::Isa::neon_dot)) paths.push_back(AttendPath::neon_dot);
  return paths;
}

// Consumer = [own prefix of M tokens][producer tokens [a, b) spliced][own tail
// written in passes]; the spliced segment starts and ends inside blocks.
TEST(KvSplice, SegmentAttentionEqualsFreshComputationAtNewPositions) {
  ThreadPool threads(2);
  const SpliceCase cases[] = {{{2, 6, 3, 16}, 8, 45}, {{1, 4, 2, 32}, 4, 90}};
  for (const bool codes : {false, true})
  for (const auto style : {kernels::RopeStyle::interleaved, kernels::RopeStyle::neox})
    for (const SpliceCase& cs : cases)
      for (const char* text : kSpliceFormats)
        for (const AttendPath path : every_path()) {
          const testing::CodesAttentionScope scope(codes);
          const KvShape& s = cs.shape;
          const KvFormat f = KvFormat::parse(text);
          const KvRope rope = make_rope(s.head_dim, style);
          auto pool = KvPool::create(PoolConfig{s, cs.block_tokens, KvPool::arena_bytes_for(s, cs.block_tokens, f, 256, 4)});
          const Stream prod = make_stream(s, cs.producer_tokens, 11), own = make_stream(s, 40, 12);
          const int M = 11, a = 5, b = cs.producer_tokens - 6, S = b - a;
          std::string what = std::string(text) + (style == kernels::RopeStyle::neox ? " neox" : " interleaved") +
                             " path " + std::to_string(static_cast<int>(path)) + " T=" + std::to_string(cs.block_tokens);
          PooledKvCache producer(pool, f, 256), consumer(pool, f, 256);
          consumer.set_attend_path(path);
          consumer.set_pass_precision(PassPrecision::stored);  // the reference reads the stored rows
          write_pass(producer, prod, 0, 20, 0, rope, threads);
          write_pass(producer, prod, 20, cs.producer_tokens - 20, 20, rope, threads);
          write_pass(consumer, own, 0, M, 0, rope, threads);
          consumer.splice(producer, a, b, rope);
          ASSERT_EQ(consumer.size(), M + S);
          const auto offset_of = [&](int i) { return i >= M && i < M + S ? M - a : 0; };
          // Fresh f32 computation of the same tokens at their new positions.
          PooledKvCache fresh(pool, KvFormat::parse("f32"), 256);
          fresh.set_attend_path(AttendPath::scalar);
          write_pass(fresh, own, 0, M, 0, rope, threads);
          {  // the spliced tokens, rotated at M.. directly
            Stream cut = prod;
            for (int l = 0; l < s.n_layers; ++l) {
              auto slice = [&](std::vector<float>& x, int dim) {
                x.erase(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(a) * dim);
              };
              slice(cut.k[static_cast<std::size_t>(l)], s.kv_dim());
              slice(cut.v[static_cast<std::size_t>(l)], s.kv_dim());
              slice(cut.q[static_cast<std::size_t>(l)], s.q_dim());
            }
            write_pass(fresh, cut, 0, S, M, rope, threads);
          }
          int first = M;
          for (int n : {5, 1, 9, 1}) {
            const int size0 = consumer.size();
            std::vector<std::vector<float>> queries;
            const auto got = write_pass(consumer, own, first, n, size0, rope, threads, &queries);
            const auto want = write_pass(fresh, own, first, n, size0, rope, threads);
            const auto ref = reference(consumer, queries, size0, n, offset_of, rope);
            // The segment math against a double computation over the same stored rows.
            ASSERT_LE(max_abs_diff(got, ref), testing::attention_tolerance(f)) << what << " n=" << n << " codes " << codes;
            // f32 rows are the fresh ones: only float rounding of the rotations apart.
            if (f.k.type == KvType::f32 && f.v.type == KvType::f32) {
              ASSERT_LE(max_abs_diff(got, want), 2e-5f) << what << " n=" << n;
            }
            first += n;
          }
          EXPECT_EQ(producer.size(), cs.producer_tokens);  // the producer's blocks are untouched
        }
}

// A sliding window over a plain context and over a spliced one, whose window
// start falls before, inside and after the spliced segment as the tail grows;
// 4-token blocks and a 90-token context exercise the decode partitions. The
// two-layer shape rotates its layers with different frequencies (gemma3's
// local and global RoPE), so keys=pre|block and the segment's query rotation
// must take each layer's own.
TEST(KvWindow, WindowedAttentionEqualsFreshComputation) {
  ThreadPool threads(2);
  const SpliceCase cases[] = {{{2, 6, 3, 16}, 8, 45}, {{1, 4, 2, 32}, 4, 90}};
  for (const bool codes : {false, true})
    for (const SpliceCase& cs : cases)
      for (const int window : {1, 6, 19, 70})
        for (const char* text : kSpliceFormats)
          for (const AttendPath path : every_path()) {
            const testing::CodesAttentionScope scope(codes);
            const KvShape& s = cs.shape;
            const KvFormat f = KvFormat::parse(text);
            KvRope r = make_rope(s.head_dim, kernels::RopeStyle::neox);
            if (s.n_layers == 2) {
              r.local_inv_freq = make_rope(s.head_dim, kernels::RopeStyle::neox).inv_freq;
              for (float& w : r.inv_freq) w *= 0.01f;  // global frequencies a hundredth of the local ones
              r.local_layers = {1, 0};
            }
            auto pool = KvPool::create(PoolConfig{s, cs.block_tokens, KvPool::arena_bytes_for(s, cs.block_tokens, f, 256, 4)});
            const Stream prod = make_stream(s, cs.producer_tokens, 21), own = make_stream(s, 60, 22);
            const std::string what = std::string(text) + " window " + std::to_string(window) + " path " +
                                     std::to_string(static_cast<int>(path)) + " T=" + std::to_string(cs.block_tokens) +
                                     (codes ? " on codes" : " decoded");
            PooledKvCache producer(pool, f, 256), consumer(pool, f, 256);
            for (PooledKvCache* c : {&producer, &consumer}) {
              c->set_attend_path(path);
              c->set_pass_precision(PassPrecision::stored);  // the reference reads the stored rows
            }
            // The producer alone: a plain windowed context, prefill then decode.
            int first = 0;
            for (int n : {20, 1, cs.producer_tokens - 22, 1}) {
              std::vector<std::vector<float>> queries;
              const int size0 = producer.size();
              const auto got = write_pass(producer, prod, first, n, size0, r, threads, &queries, window);
              const auto ref = reference(producer, queries, size0, n, [](int) { return 0; }, r, window);
              ASSERT_LE(max_abs_diff(got, ref), testing::attention_tolerance(f)) << what << " plain n=" << n;
              first += n;
            }
            // [own 11 tokens][producer tokens 5..prod-6][own tail]: the window slides over the segment.
            const int M = 11, a = 5, b = cs.producer_tokens - 6, S = b - a;
            write_pass(consumer, own, 0, M, 0, r, threads, nullptr, window);
            consumer.splice(producer, a, b, r);
            const auto offset_of = [&](int i) { return i >= M && i < M + S ? M - a : 0; };
            first = M;
            for (int n : {5, 1, 9, 1, 20, 1}) {
              std::vector<std::vector<float>> queries;
              const int size0 = consumer.size();
              const auto got = write_pass(consumer, own, first, n, size0, r, threads, &queries, window);
              const auto ref = reference(consumer, queries, size0, n, offset_of, r, window);
              ASSERT_LE(max_abs_diff(got, ref), testing::attention_tolerance(f)) << what << " spliced n=" << n;
              first += n;
            }
          }
}

// Splicing from a context that is itself spliced (a chain of handoffs), the
// tail handed on alone, and every block back in the pool at the end.
TEST(KvSplice, ChainsTailsAndReleasesEveryBlock) {
  ThreadPool threads(2);
  const KvShape s{1, 4, 2, 16};
  const KvRope rope = make_rope(16, kernels::RopeStyle::neox);
  for (const char* text : {"int4", "int4:keys=pre", "int4:keys=block"}) {
  const KvFormat f = KvFormat::parse(text);
  auto pool = KvPool::create(PoolConfig{s, 8, KvPool::arena_bytes_for(s, 8, f, 200, 8)});
  const Stream st = make_stream(s, 120, 3);
  {
    PooledKvCache p(pool, f, 200), w(pool, f, 200), r(pool, f, 200);
    write_pass(p, st, 0, 30, 0, rope, threads);
    write_pass(w, st, 30, 7, 0, rope, threads);
    w.splice(p, 10, 27, rope);  // w = [7 own][17 of p]
    write_pass(w, st, 40, 12, 24, rope, threads);
    EXPECT_EQ(w.tail_begin(), 24);
    ASSERT_EQ(w.segments().size(), 3u);
    // The tail alone: keys at positions [24, 36).
    auto tail = w.tail_context();
    EXPECT_EQ(tail->size(), 12);
    EXPECT_EQ(tail->segments()[0].position_offset, -24);
    write_pass(r, st, 60, 5, 0, rope, threads);
    r.splice(w, 2, 30, rope);  // spans w's own head, p's segment and w's tail
    r.splice(*tail, 0, 12, rope);
    ASSERT_EQ(r.size(), 5 + 28 + 12);
    std::vector<std::vector<float>> queries;
    const int size0 = r.size();
    const auto got = write_pass(r, st, 80, 3, size0, rope, threads, &queries);
    // Offsets: r's [5, 10) <- w's own [2, 7) at +3; [10, 27) <- p [10, 27) at 0; [27, 33) <- w's tail [24, 30) at +3;
    // [33, 45) <- tail tokens at positions 24.. at +9.
    const auto offset_of = [](int i) { return i < 5 ? 0 : i < 10 ? 3 : i < 27 ? 0 : i < 33 ? 3 : i < 45 ? 9 : 0; };
    const auto ref = reference(r, queries, size0, 3, offset_of, rope);
    EXPECT_LE(max_abs_diff(got, ref), testing::attention_tolerance(f)) << text;
    EXPECT_GT(pool->counters().blocks_used, 0u);
  }
  EXPECT_EQ(pool->counters().blocks_used, 0u);
  }
}

// keys=pre stores keys as projected and rotates each row to the position it
// was computed at when it is read: in f32 the keys read back and the
// attention are the post-RoPE ones, on every path and with the pass's own
// copies; per-channel int4 codes keep a channel's constant part in its
// minimum before RoPE, where after RoPE it is a sinusoid over the positions
// that widens every channel's range (KVQuant's reason for pre-RoPE keys).
TEST(KvSplice, PreRopeKeysAttendAsTheirRotatedSelves) {
  ThreadPool threads(2);
  const KvShape s{2, 6, 3, 16};
  for (const auto style : {kernels::RopeStyle::interleaved, kernels::RopeStyle::neox})
    for (const AttendPath path : every_path()) {
      const KvRope rope = make_rope(s.head_dim, style);
      auto pool = KvPool::create(PoolConfig{s, 8, 1 << 23});
      Stream st = make_stream(s, 120, 5);
      for (auto& k : st.k)  // channels with a constant part, as real keys have: RoPE turns it into a sinusoid
        for (std::size_t i = 0; i < k.size(); ++i) k[i] += 3.0f * std::sin(static_cast<float>(i % 16));
      PooledKvCache post(pool, KvFormat::parse("f32"), 256), pre(pool, KvFormat::parse("f32:keys=pre"), 256),
          rel(pool, KvFormat::parse("f32:keys=block"), 256);
      PooledKvCache q4post(pool, KvFormat::parse("int4"), 256), q4pre(pool, KvFormat::parse("int4:keys=pre"), 256);
      for (PooledKvCache* c : {&post, &pre, &rel, &q4post, &q4pre}) c->set_attend_path(path);
      int first = 0;
      for (int n : {5, 20, 1, 1, 40, 1, 9}) {
        const auto a = write_pass(post, st, first, n, first, rope, threads);
        const auto b = write_pass(pre, st, first, n, first, rope, threads);
        ASSERT_LE(max_abs_diff(a, b), 1e-5f) << "path " << static_cast<int>(path) << " n=" << n;
        // keys=block: rows turned by their offset in the block, queries back by the block's start.
        const auto r = write_pass(rel, st, first, n, first, rope, threads);
        ASSERT_LE(max_abs_diff(a, r), 1e-5f) << "keys=block path " << static_cast<int>(path) << " n=" << n;
        write_pass(q4post, st, first, n, first, rope, threads);
        write_pass(q4pre, st, first, n, first, rope, threads);
        first += n;
      }
      std::vector<float> ka(static_cast<std::size_t>(first) * s.head_dim), kb(ka.size());
      post.read_rows(1, 0, 2, 0, first, ka.data());
      pre.read_rows(1, 0, 2, 0, first, kb.data());
      std::vector<float> kr(ka.size());
      rel.read_rows(1, 0, 2, 0, first, kr.data());
      for (std::size_t i = 0; i < ka.size(); ++i) {
        ASSERT_NEAR(ka[i], kb[i], 1e-5f * (1.0f + std::abs(ka[i])));
        ASSERT_NEAR(ka[i], kr[i], 1e-5f * (1.0f + std::abs(ka[i])));
      }
      EXPECT_EQ(pool->info(rel.segments()[0].blocks[2]).flags, kBlockRelativeK);
      EXPECT_EQ(pool->info(rel.segments()[0].blocks[2]).key_position, 16);
      std::vector<float> kc(ka.size()), kd(ka.size());
      q4post.read_rows(1, 0, 2, 0, first, kc.data());
      q4pre.read_rows(1, 0, 2, 0, first, kd.data());
      double err_post = 0, err_pre = 0;
      for (std::size_t i = 0; i < ka.size(); ++i) {
        err_post += (kc[i] - ka[i]) * (kc[i] - ka[i]);
        err_pre += (kd[i] - ka[i]) * (kd[i] - ka[i]);
      }
      EXPECT_LT(err_pre, 0.8 * err_post) << "path " << static_cast<int>(path);
      for (const BlockRef b : pre.segments()[0].blocks) EXPECT_EQ(pool->info(b).flags, kBlockPreRopeK);
      EXPECT_EQ(pool->info(pre.segments()[0].blocks[3]).key_position, 24);
      // Keys before and after RoPE do not mix in one context.
      EXPECT_THROW(post.splice(pre, 0, 10, rope), Error);
    }
}

TEST(KvSplice, BadSplicesAreRefused) {
  ThreadPool threads(1);
  const KvShape s{1, 2, 1, 16};
  const KvRope rope = make_rope(16, kernels::RopeStyle::interleaved);
  auto pool = KvPool::create(PoolConfig{s, 8, 1 << 20});
  auto other = KvPool::create(PoolConfig{s, 8, 1 << 20});
  const Stream st = make_stream(s, 40, 5);
  PooledKvCache p(pool, KvFormat::parse("int8"), 64), c(pool, KvFormat::parse("int8"), 20);
  PooledKvCache rotated(pool, KvFormat::parse("int8:rot=k"), 64), elsewhere(other, KvFormat::parse("int8"), 64);
  write_pass(p, st, 0, 30, 0, rope, threads);
  write_pass(rotated, st, 0, 10, 0, rope, threads);
  write_pass(elsewhere, st, 0, 10, 0, rope, threads);
  const auto code = [&](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::internal;
  };
  EXPECT_EQ(code([&] { c.splice(p, 5, 5, rope); }), ErrorCode::invalid_argument);
  EXPECT_EQ(code([&] { c.splice(p, -1, 5, rope); }), ErrorCode::invalid_argument);
  EXPECT_EQ(code([&] { c.splice(p, 0, 31, rope); }), ErrorCode::invalid_argument);
  EXPECT_EQ(code([&] { c.splice(p, 0, 25, rope); }), ErrorCode::context_full);
  EXPECT_EQ(code([&] { c.splice(rotated, 0, 5, rope); }), ErrorCode::invalid_argument);
  EXPECT_EQ(code([&] { c.splice(elsewhere, 0, 5, rope); }), ErrorCode::invalid_argument);
  EXPECT_EQ(code([&] { c.splice(p, 0, 5, KvRope{}); }), ErrorCode::invalid_argument);
  EXPECT_EQ(c.size(), 0);  // nothing happened
}

}  // namespace
}  // namespace qkvshare
