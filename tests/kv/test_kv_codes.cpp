// Attention on codes (kernels/kv_tiles.hpp "Attention on codes"): every level
// against the scalar reference, and the reference against the decoded-tile
// path it replaces, on random and edge tiles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "qkvshare/kv/kv_kernels.hpp"

namespace qkvshare {
namespace {

enum class Rows { normal, outliers, equal, zeros };

std::vector<float> rows_of(Rows kind, int tokens, int dim, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(tokens) * dim);
  for (int j = 0; j < tokens; ++j)
    for (int c = 0; c < dim; ++c) {
      float v = n(rng);
      if (kind == Rows::outliers) v = v * (c % 17 == 3 ? 20.0f : 1.0f) + (c == 5 ? 4.0f : 0.0f);
      if (kind == Rows::equal) v = 0.75f;
      if (kind == Rows::zeros) v = 0.0f;
      x[static_cast<std::size_t>(j) * dim + c] = v;
    }
  return x;
}

std::vector<kernels::Isa> levels() {
  std::vector<kernels::Isa> out;
  for (kernels::Isa isa : kernels::kAllIsas)
    if (kernels::isa_available(isa)) out.push_back(isa);
  return out;
}

struct Tile {
  kernels::TileCodes codes;
  std::vector<std::byte> bytes;
  std::vector<float> decoded;  // the reference decode: what the float path would read
};

Tile make_tile(const KvCodec& codec, int tokens, int dim, Rows kind, unsigned seed) {
  const TileLayout l = tile_layout(codec, tokens, dim);
  Tile t{kv::tile_codes(codec, l), std::vector<std::byte>(l.bytes), {}};
  const auto x = rows_of(kind, tokens, dim, seed);
  kv::encode_tile(codec, l, x.data(), t.bytes.data());
  t.decoded.resize(x.size());
  kv::decode_tile_scalar(codec, l, t.bytes.data(), tokens, t.decoded.data());
  return t;
}

const int kDims[] = {16, 32, 48, 64, 128};
const int kTokens[] = {1, 8, 13, 32, 64};
const KvType kTypes[] = {KvType::q8, KvType::q4, KvType::q3, KvType::q2};
const Rows kKinds[] = {Rows::normal, Rows::outliers, Rows::equal, Rows::zeros};

TEST(KvCodes, KeyScoresMatchTheReferenceOnEveryLevel) {
  const kernels::TileKernels& ref = kernels::tile_kernels(kernels::Isa::portable);
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  int checked = 0;
  for (const bool byte_params : {false, true})  // f16 or one-byte (scale, min) pairs
  for (KvType type : kTypes)
    for (int dim : kDims)
      for (int tokens : kTokens)
        for (Rows kind : kKinds) {
          const Tile t = make_tile({type, KvAxis::channel, 0, 0, byte_params}, tokens, dim, kind, 3);
          ASSERT_TRUE(kernels::codes_keys_ok(t.codes));
          const int nq = 5;
          std::vector<float> q(static_cast<std::size_t>(nq) * dim);
          for (auto& v : q) v = n(rng);
          std::fill(q.begin() + dim, q.begin() + 2 * dim, 0.0f);  // a zero query
          const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
          std::vector<std::int16_t> qc_ref(q.size());
          std::vector<float> ab_ref(2 * nq);
          ref.query_codes(t.codes, t.bytes.data(), q.data(), nq, scale, qc_ref.data(), ab_ref.data());
          const int lo = tokens > 4 ? 3 : 0, hi = tokens > 4 ? tokens - 1 : tokens;
          const std::size_t stride = static_cast<std::size_t>(tokens) + 3;
          std::vector<float> s_ref(nq * stride, -7.0f);
          ref.code_scores(t.codes, t.bytes.data(), lo, hi, qc_ref.data(), ab_ref.data(), nq, s_ref.data(), stride);
          // The reference against the float path on decoded rows: the query
          // rounding costs far less than the codes' own error.
          for (int i = 0; i < nq; ++i) {
            std::vector<float> s_float(static_cast<std::size_t>(tokens));
            ref.scores(&q[static_cast<std::size_t>(i) * dim], t.decoded.data(), tokens, dim, scale, s_float.data());
            double qn = 0, kn = 0;
            for (int c = 0; c < dim; ++c) qn += q[static_cast<std::size_t>(i) * dim + c] * q[static_cast<std::size_t>(i) * dim + c];
            for (float v : t.decoded) kn = std::max(kn, static_cast<double>(std::abs(v)));
            double bound = 2e-3 * std::sqrt(qn) * kn * std::sqrt(static_cast<double>(dim)) * scale + 1e-5;
            if (byte_params) {
              // The grid may move a channel's scale below what its range needs
              // (when that codes the channel with less error), so more codes sit
              // at the ends: the bound of the query's rounding itself, half its
              // step (largest |q_c * scale_c| / query_code_max) per channel times
              // the largest centred code.
              double qs_max = 0.0;
              for (int c = 0; c < dim; ++c) {
                float sc = 0.0f, mn = 0.0f;
                kernels::tile_param_ref(t.codes, t.bytes.data(), c, sc, mn);
                qs_max = std::max(qs_max, std::abs(static_cast<double>(q[static_cast<std::size_t>(i) * dim + c]) * sc));
              }
              bound = std::max(bound, scale * 0.5 * qs_max / kernels::query_code_max(t.codes.bits, dim) * dim *
                                          (1 << (t.codes.bits - 1)) + 1e-5);
            }
            for (int j = lo; j < hi; ++j)
              ASSERT_NEAR(s_ref[i * stride + j], s_float[static_cast<std::size_t>(j)], bound)
                  << "bits " << KvCodec{type, KvAxis::token, 0}.bits() << " byte params " << byte_params << " dim " << dim
                  << " tokens " << tokens << " q " << i << " row " << j;
            for (int j = 0; j < lo; ++j) ASSERT_EQ(s_ref[i * stride + j], -7.0f) << "a row before lo was written";
          }
          for (kernels::Isa isa : levels()) {
            const kernels::TileKernels& k = kernels::tile_kernels(isa);
            std::vector<std::int16_t> qc(q.size());
            std::vector<float> ab(2 * nq);
            k.query_codes(t.codes, t.bytes.data(), q.data(), nq, scale, qc.data(), ab.data());
            ASSERT_EQ(qc, qc_ref) << kernels::isa_name(isa) << " dim " << dim;
            for (int i = 0; i < nq; ++i) {
              ASSERT_EQ(ab[2 * i], ab_ref[2 * i]) << kernels::isa_name(isa);
              ASSERT_NEAR(ab[2 * i + 1], ab_ref[2 * i + 1], 1e-5f * (1.0f + std::abs(ab_ref[2 * i + 1]))) << kernels::isa_name(isa);
            }
            // Scores from the same prepared queries: integer sums, the same bits.
            std::vector<float> s(nq * stride, -7.0f);
            k.code_scores(t.codes, t.bytes.data(), lo, hi, qc_ref.data(), ab_ref.data(), nq, s.data(), stride);
            ASSERT_EQ(s, s_ref) << kernels::isa_name(isa) << " bits " << static_cast<int>(type) << " dim " << dim
                                << " tokens " << tokens;
            ++checked;
          }
        }
  EXPECT_GT(checked, 0);
}

TEST(KvCodes, ValueSumsMatchTheReferenceOnEveryLevel) {
  const kernels::TileKernels& ref = kernels::tile_kernels(kernels::Isa::portable);
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (const bool byte_params : {false, true})
  for (KvType type : kTypes)
    for (int dim : kDims)
      for (int group : {16, 32, 64})
        for (int tokens : kTokens)
          for (Rows kind : kKinds)
            for (const int nq : {1, 3, 6}) {  // the levels sum up to four queries together
              if (dim % group != 0) continue;
              const Tile t = make_tile({type, KvAxis::token, static_cast<std::uint16_t>(group), 0, byte_params}, tokens, dim,
                                       kind, 5);
              ASSERT_TRUE(kernels::codes_values_ok(t.codes));
              const std::size_t stride = static_cast<std::size_t>(tokens) + 1;
              std::vector<float> p(nq * stride);
              for (auto& v : p) v = u(rng) * u(rng);
              p[0] = 1.0f;  // one weight far above the rest
              const int lo = tokens > 4 ? 1 : 0, hi = tokens > 4 ? tokens - 2 : tokens;
              std::vector<float> o_ref(static_cast<std::size_t>(nq) * dim, 0.5f);
              ref.code_sum(t.codes, t.bytes.data(), lo, hi, p.data(), stride, nq, o_ref.data());
              for (int i = 0; i < nq; ++i) {
                std::vector<float> o_float(static_cast<std::size_t>(dim), 0.5f);
                if (hi > lo)
                  ref.weighted_sum(o_float.data(), &p[i * stride + lo], t.decoded.data() + static_cast<std::size_t>(lo) * dim,
                                   hi - lo, dim);
                double vmax = 0, psum = 0;
                for (float v : t.decoded) vmax = std::max(vmax, static_cast<double>(std::abs(v)));
                for (int j = lo; j < hi; ++j) psum += p[i * stride + j];
                // 16-bit weights; 7-bit over 4- and 2-bit values (each weight within 1/254 of the window's largest).
                const bool byte_weights = kernels::byte_value_weights(KvCodec{type, KvAxis::token, 0}.bits());
                // Byte parameters: a series' scale may exceed its f16 one (the grid rounds the
                // min down by up to a step and the scale up by up to 1/16), and the weights'
                // rounding error grows with the scales.
                const double bound = (byte_weights ? 6e-3 : 1e-3) * (byte_params ? 1.25 : 1.0) * vmax * psum + 1e-5;
                for (int c = 0; c < dim; ++c)
                  ASSERT_NEAR(o_ref[static_cast<std::size_t>(i) * dim + c], o_float[static_cast<std::size_t>(c)], bound)
                      << "bits " << KvCodec{type, KvAxis::token, 0}.bits() << " dim " << dim << " group " << group << " tokens " << tokens;
              }
              // The levels differ from the reference only in the order of the
              // minimums' float sum: a bound relative to the terms' size.
              double vmax = 1.0;
              for (float v : t.decoded) vmax = std::max(vmax, static_cast<double>(std::abs(v)));
              const float tol = static_cast<float>(1e-5 * vmax * static_cast<double>(tokens));
              for (kernels::Isa isa : levels()) {
                std::vector<float> o(static_cast<std::size_t>(nq) * dim, 0.5f);
                kernels::tile_kernels(isa).code_sum(t.codes, t.bytes.data(), lo, hi, p.data(), stride, nq, o.data());
                for (std::size_t c = 0; c < o.size(); ++c)
                  ASSERT_NEAR(o[c], o_ref[c], tol)
                      << kernels::isa_name(isa) << " bits " << static_cast<int>(type) << " dim " << dim << " group " << group
                      << " tokens " << tokens << " queries " << nq;
                // Each query's sums are its own: the same bits one query at a time.
                for (int i = 0; i < nq; ++i) {
                  std::vector<float> one(static_cast<std::size_t>(dim), 0.5f);
                  kernels::tile_kernels(isa).code_sum(t.codes, t.bytes.data(), lo, hi, &p[i * stride], stride, 1, one.data());
                  ASSERT_EQ(0, std::memcmp(one.data(), &o[static_cast<std::size_t>(i) * dim], sizeof(float) * one.size()))
                      << kernels::isa_name(isa) << " query " << i << " of " << nq;
                }
              }
            }
}

}  // namespace
}  // namespace qkvshare
