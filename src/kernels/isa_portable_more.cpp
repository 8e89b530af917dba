// Portable kernels of Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, IQ4_NL and IQ4_XS
// weights: the same arithmetic as the SIMD levels (8-bit activations, exact
// integer dots per group, f32 scaling), written once for all types. Each
// 32-value step of a row is decoded into signed codes q and, per half of 16,
// a scale d and a minimum m (value = d q + m); a row is decoded once and then
// multiplied with every token. Q4_K and Q5_K take the super-block activations
// instead (kernel_table.hpp ActQ8::dk) and sum a super-block in integers.
#include <cstring>
#include <vector>

#include "kernel_table.hpp"
#include "kquant_scales.hpp"
#include "qkvshare/core/half.hpp"
#include "qkvshare/kernels/quant.hpp"

namespace qkvshare::kernels::detail::portable {

namespace {

struct Step {
  std::int8_t q[32];
  float d[2];
  float m[2];
};

template <class Block>
const Block* block(const std::uint8_t* row, std::int64_t i) {
  return reinterpret_cast<const Block*>(row) + i;
}

void q5_codes(const std::uint8_t* qs, const std::uint8_t* qh, int offset, Step& o) {
  std::uint32_t h;
  std::memcpy(&h, qh, 4);
  for (int j = 0; j < 16; ++j) {
    o.q[j] = static_cast<std::int8_t>(((qs[j] & 0x0f) | (((h >> j) & 1u) << 4)) - offset);
    o.q[j + 16] = static_cast<std::int8_t>(((qs[j] >> 4) | (((h >> (j + 16)) & 1u) << 4)) - offset);
  }
}

void set(Step& o, float d0, float d1, float m0, float m1) {
  o.d[0] = d0;
  o.d[1] = d1;
  o.m[0] = m0;
  o.m[1] = m1;
}

void step_q5_0(const std::uint8_t* row, std::int64_t s, Step& o) {
  const BlockQ5_0* b = block<BlockQ5_0>(row, s);
  q5_codes(b->qs, b->qh, 16, o);
  const float d = fp16_to_fp32(b->d);
  set(o, d, d, 0.0f, 0.0f);
}

void step_q5_1(const std::uint8_t* row, std::int64_t s, Step& o) {
  const BlockQ5_1* b = block<BlockQ5_1>(row, s);
  q5_codes(b->qs, b->qh, 0, o);
  const float d = fp16_to_fp32(b->d), m = fp16_to_fp32(b->m);
  set(o, d, d, m, m);
}

// Q4_K / Q5_K: a super-block of unsigned codes with its integer sub-block
// scales and its minimums' f32 factors.
struct SuperStep {
  std::uint8_t u[kQK_K];
  int sc[8];
  float d;
  float mins[8];  // -dmin * m_j
};

template <class Block, bool kFive>
void super_step_k45(const std::uint8_t* row, std::int64_t s, SuperStep& o) {
  const Block* b = block<Block>(row, s);
  for (int j = 0; j < 8; ++j) {
    for (int l = 0; l < 32; ++l) {
      int q = (b->qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f;
      if constexpr (kFive) q |= ((b->qh[l] >> j) & 1) << 4;
      o.u[32 * j + l] = static_cast<std::uint8_t>(q);
    }
    int m;
    scale_min_k4(j, b->scales, o.sc[j], m);
    o.mins[j] = -fp16_to_fp32(b->dmin) * static_cast<float>(m);
  }
  o.d = fp16_to_fp32(b->d);
}

// With the super-block activations (ActQ8::dk), as the SIMD levels do it:
// per super-block the integer sum over sub-blocks j of sc_j * sum u x, one
// f32 product with d * dk, and the minimums' part from the blocks' sums s_j.
template <class Block, bool kFive>
void gemm_k45(const GemmArgs& a) {
  const std::int64_t n_super = a.cols / kQK_K;
  thread_local std::vector<SuperStep> steps;
  steps.resize(static_cast<std::size_t>(n_super));
  for (std::int64_t r = 0; r < a.n_rows; ++r) {
    const std::uint8_t* row = a.w + static_cast<std::size_t>(r) * a.row_bytes;
    for (std::int64_t s = 0; s < n_super; ++s) super_step_k45<Block, kFive>(row, s, steps[static_cast<std::size_t>(s)]);
    for (std::int64_t t = 0; t < a.n_tokens; ++t) {
      float sum = 0.0f;
      for (std::int64_t s = 0; s < n_super; ++s) {
        const SuperStep& w = steps[static_cast<std::size_t>(s)];
        const std::int64_t sb = t * n_super + s;
        const std::int8_t* x = a.act.qs + kQK_K * sb;
        std::int32_t isum = 0;
        for (int j = 0; j < 8; ++j) {
          std::int32_t sq = 0;
          for (int l = 32 * j; l < 32 * j + 32; ++l) sq += w.u[l] * x[l];
          isum += w.sc[j] * sq;
        }
        sum += w.d * a.act.dk[sb] * static_cast<float>(isum);
        for (int j = 0; j < 8; ++j) sum += w.mins[j] * a.act.s[8 * sb + j];
      }
      a.y[t * a.ldy + r] = sum;
    }
  }
}

void step_q2_k(const std::uint8_t* row, std::int64_t s, Step& o) {
  const BlockQ2_K* b = block<BlockQ2_K>(row, s / 8);
  const int k = static_cast<int>(s % 8);
  for (int l = 0; l < 32; ++l) o.q[l] = static_cast<std::int8_t>((b->qs[32 * (k / 4) + l] >> (2 * (k % 4))) & 3);
  const float d = fp16_to_fp32(b->d), dmin = fp16_to_fp32(b->dmin);
  const int s0 = b->scales[2 * k], s1 = b->scales[2 * k + 1];
  set(o, d * static_cast<float>(s0 & 0x0f), d * static_cast<float>(s1 & 0x0f), -dmin * static_cast<float>(s0 >> 4),
      -dmin * static_cast<float>(s1 >> 4));
}

void step_q3_k(const std::uint8_t* row, std::int64_t s, Step& o) {
  const BlockQ3_K* b = block<BlockQ3_K>(row, s / 8);
  const int k = static_cast<int>(s % 8);
  for (int l = 0; l < 32; ++l) {
    const int lo = (b->qs[32 * (k / 4) + l] >> (2 * (k % 4))) & 3;
    const int hi = (b->hmask[l] >> k) & 1;
    o.q[l] = static_cast<std::int8_t>((lo | (hi << 2)) - 4);
  }
  const float d = fp16_to_fp32(b->d);
  set(o, d * static_cast<float>(scale_q3_k(2 * k, b->scales)), d * static_cast<float>(scale_q3_k(2 * k + 1, b->scales)),
      0.0f, 0.0f);
}

void iq4_codes(const std::uint8_t* qs, Step& o) {
  for (int j = 0; j < 16; ++j) {
    o.q[j] = kIq4Values[qs[j] & 0x0f];
    o.q[j + 16] = kIq4Values[qs[j] >> 4];
  }
}

void step_iq4_nl(const std::uint8_t* row, std::int64_t s, Step& o) {
  const BlockIQ4_NL* b = block<BlockIQ4_NL>(row, s);
  iq4_codes(b->qs, o);
  const float d = fp16_to_fp32(b->d);
  set(o, d, d, 0.0f, 0.0f);
}

void step_iq4_xs(const std::uint8_t* row, std::int64_t s, Step& o) {
  const BlockIQ4_XS* b = block<BlockIQ4_XS>(row, s / 8);
  const int j = static_cast<int>(s % 8);
  iq4_codes(b->qs + 16 * j, o);
  const float d = fp16_to_fp32(b->d) * static_cast<float>(scale_iq4_xs(j, b->scales_h, b->scales_l));
  set(o, d, d, 0.0f, 0.0f);
}

using StepFn = void (*)(const std::uint8_t*, std::int64_t, Step&);

template <StepFn Decode>
void gemm_steps(const GemmArgs& a) {
  const std::int64_t n_steps = a.cols / 32;
  thread_local std::vector<Step> steps;
  steps.resize(static_cast<std::size_t>(n_steps));
  for (std::int64_t r = 0; r < a.n_rows; ++r) {
    const std::uint8_t* row = a.w + static_cast<std::size_t>(r) * a.row_bytes;
    for (std::int64_t s = 0; s < n_steps; ++s) Decode(row, s, steps[static_cast<std::size_t>(s)]);
    for (std::int64_t t = 0; t < a.n_tokens; ++t) {
      float sum = 0.0f;
      for (std::int64_t s = 0; s < n_steps; ++s) {
        const Step& w = steps[static_cast<std::size_t>(s)];
        const std::int64_t blk = t * n_steps + s;
        const std::int8_t* x = a.act.qs + 32 * blk;
        const float dx = a.act.d[blk];
        for (int h = 0; h < 2; ++h) {
          int sq = 0, sx = 0;
          for (int j = 16 * h; j < 16 * h + 16; ++j) {
            sq += w.q[j] * x[j];
            sx += x[j];
          }
          sum += w.d[h] * dx * static_cast<float>(sq) + w.m[h] * dx * static_cast<float>(sx);
        }
      }
      a.y[t * a.ldy + r] = sum;
    }
  }
}

}  // namespace

void gemm_q5_0(const GemmArgs& a) { gemm_steps<step_q5_0>(a); }
void gemm_q5_1(const GemmArgs& a) { gemm_steps<step_q5_1>(a); }
void gemm_q2_k(const GemmArgs& a) { gemm_steps<step_q2_k>(a); }
void gemm_q3_k(const GemmArgs& a) { gemm_steps<step_q3_k>(a); }
void gemm_q4_k(const GemmArgs& a) { gemm_k45<BlockQ4_K, false>(a); }
void gemm_q5_k(const GemmArgs& a) { gemm_k45<BlockQ5_K, true>(a); }
void gemm_iq4_nl(const GemmArgs& a) { gemm_steps<step_iq4_nl>(a); }
void gemm_iq4_xs(const GemmArgs& a) { gemm_steps<step_iq4_xs>(a); }

}  // namespace qkvshare::kernels::detail::portable
