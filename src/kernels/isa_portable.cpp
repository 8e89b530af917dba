// Portable kernels: plain C++ for any CPU, and the fallback of every SIMD
// level. They do the same arithmetic as the SIMD levels (8-bit activations
// for quantized weights, f32 activations otherwise), so the two differ only in
// float summation order; the scalar references in quant_ref.cpp stay the
// exact oracle (docs/design.md rule 3).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernel_table.hpp"
#include "qkvshare/core/half.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"
#include "qkvshare/kernels/ops.hpp"
#include "qkvshare/kernels/quant.hpp"

namespace qkvshare::kernels::detail {

namespace {

void quantize_act(const float* x, std::int64_t n, std::int32_t bias_mult, const ActQ8Out& o) {
  for (std::int64_t b = 0; b < n / kQK; ++b) {
    const float* xb = x + kQK * b;
    float amax = 0.0f;
    // std::max keeps amax when |x| is NaN, as maxps(|x|, amax) does in the SIMD levels.
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(xb[j]));
    float db = amax / 127.0f;
    float id = 1.0f / db;
    if (!(amax >= kActFlush)) db = id = 0.0f;
    o.d[b] = db;
    int block_sum = 0;
    for (int g = 0; g < kQK / 4; ++g) {
      int sum = 0;
      for (int j = 0; j < 4; ++j) {
        // Clamp before rounding so that no input (inf, NaN) makes the int conversion undefined.
        const float v = std::fmin(std::fmax(xb[4 * g + j] * id, -127.0f), 127.0f);
        const int q = static_cast<int>(std::nearbyint(v));
        o.qs[kQK * b + 4 * g + j] = static_cast<std::int8_t>(q);
        sum += q;
      }
      o.dl[8 * b + g] = db;
      o.bias[8 * b + g] = bias_mult * sum;
      o.xs[8 * b + g] = db * static_cast<float>(sum);
      block_sum += sum;
    }
    o.bsum[b] = bias_mult * block_sum;
    o.s[b] = db * static_cast<float>(block_sum);
  }
}

// Runs dot(row, t) for every row and token of the range.
template <class Dot>
void each_row_token(const GemmArgs& a, Dot dot) {
  for (std::int64_t r = 0; r < a.n_rows; ++r) {
    const std::uint8_t* row = a.w + static_cast<std::size_t>(r) * a.row_bytes;
    for (std::int64_t t = 0; t < a.n_tokens; ++t) a.y[t * a.ldy + r] = dot(row, t);
  }
}

void gemm_f32(const GemmArgs& a) {
  each_row_token(a, [&](const std::uint8_t* row, std::int64_t t) {
    return dot_f32(reinterpret_cast<const float*>(row), a.x + t * a.cols, a.cols);
  });
}

template <float (*Convert)(std::uint16_t) noexcept>
void gemm_half(const GemmArgs& a) {
  each_row_token(a, [&](const std::uint8_t* row, std::int64_t t) {
    const float* x = a.x + t * a.cols;
    float sum = 0.0f;
    for (std::int64_t i = 0; i < a.cols; ++i) {
      std::uint16_t h;
      std::memcpy(&h, row + 2 * i, 2);
      sum += Convert(h) * x[i];
    }
    return sum;
  });
}

// The activation block b of token t.
const std::int8_t* act_q(const ActQ8& act, std::int64_t t, std::int64_t b) { return act.qs + t * act.cols + kQK * b; }
float act_d(const ActQ8& act, std::int64_t t, std::int64_t b) { return act.d[t * (act.cols / kQK) + b]; }

void gemm_q8_0(const GemmArgs& a) {
  each_row_token(a, [&](const std::uint8_t* row, std::int64_t t) {
    const auto* w = reinterpret_cast<const BlockQ8_0*>(row);
    float sum = 0.0f;
    for (std::int64_t b = 0; b < a.cols / kQK; ++b) {
      const std::int8_t* x = act_q(a.act, t, b);
      int s = 0;
      for (int j = 0; j < kQK; ++j) s += w[b].qs[j] * x[j];
      sum += fp16_to_fp32(w[b].d) * act_d(a.act, t, b) * static_cast<float>(s);
    }
    return sum;
  });
}

void gemm_q4_0(const GemmArgs& a) {
  each_row_token(a, [&](const std::uint8_t* row, std::int64_t t) {
    const auto* w = reinterpret_cast<const BlockQ4_0*>(row);
    float sum = 0.0f;
    for (std::int64_t b = 0; b < a.cols / kQK; ++b) {
      const std::int8_t* x = act_q(a.act, t, b);
      int s = 0;
      for (int j = 0; j < kQK / 2; ++j)
        s += ((w[b].qs[j] & 0x0f) - 8) * x[j] + ((w[b].qs[j] >> 4) - 8) * x[j + kQK / 2];
      sum += fp16_to_fp32(w[b].d) * act_d(a.act, t, b) * static_cast<float>(s);
    }
    return sum;
  });
}

void gemm_q4_1(const GemmArgs& a) {
  each_row_token(a, [&](const std::uint8_t* row, std::int64_t t) {
    const auto* w = reinterpret_cast<const BlockQ4_1*>(row);
    float sum = 0.0f;
    for (std::int64_t b = 0; b < a.cols / kQK; ++b) {
      const std::int8_t* x = act_q(a.act, t, b);
      int s = 0, sx = 0;
      for (int j = 0; j < kQK / 2; ++j) {
        s += (w[b].qs[j] & 0x0f) * x[j] + (w[b].qs[j] >> 4) * x[j + kQK / 2];
        sx += x[j] + x[j + kQK / 2];
      }
      const float dx = act_d(a.act, t, b);
      sum += fp16_to_fp32(w[b].d) * dx * static_cast<float>(s) + fp16_to_fp32(w[b].m) * dx * static_cast<float>(sx);
    }
    return sum;
  });
}

void gemm_q6_k(const GemmArgs& a) {
  each_row_token(a, [&](const std::uint8_t* row, std::int64_t t) {
    const auto* w = reinterpret_cast<const BlockQ6_K*>(row);
    float sum = 0.0f;
    for (std::int64_t sb = 0; sb < a.cols / kQK_K; ++sb) {
      std::int8_t q[kQK_K];  // the 6-bit codes minus 32, in element order
      const std::uint8_t* ql = w[sb].ql;
      const std::uint8_t* qh = w[sb].qh;
      for (int n = 0; n < kQK_K; n += 128, ql += 64, qh += 32)
        for (int l = 0; l < 32; ++l) {
          q[n + l] = static_cast<std::int8_t>(((ql[l] & 0xf) | ((qh[l] & 3) << 4)) - 32);
          q[n + l + 32] = static_cast<std::int8_t>(((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32);
          q[n + l + 64] = static_cast<std::int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          q[n + l + 96] = static_cast<std::int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      // The super-block activations: the whole super-block summed in integers.
      const std::int64_t j = t * (a.cols / kQK_K) + sb;
      const std::int8_t* x = a.act.qs + kQK_K * j;
      std::int32_t isum = 0;
      for (int g = 0; g < kQK_K / 16; ++g) {
        std::int32_t s = 0;
        for (int i = 16 * g; i < 16 * g + 16; ++i) s += q[i] * x[i];
        isum += w[sb].scales[g] * s;
      }
      sum += fp16_to_fp32(w[sb].d) * a.act.dk[j] * static_cast<float>(isum);
    }
    return sum;
  });
}

constexpr KernelTable kPortable{
    .gemm_f32 = gemm_f32,
    .gemm_f16 = gemm_half<fp16_to_fp32>,
    .gemm_bf16 = gemm_half<bf16_to_fp32>,
    .gemm_q8_0 = gemm_q8_0,
    .gemm_q4_0 = gemm_q4_0,
    .gemm_q4_1 = gemm_q4_1,
    .gemm_q6_k = gemm_q6_k,
    .gemm_q5_0 = portable::gemm_q5_0,
    .gemm_q5_1 = portable::gemm_q5_1,
    .gemm_q2_k = portable::gemm_q2_k,
    .gemm_q3_k = portable::gemm_q3_k,
    .gemm_q4_k = portable::gemm_q4_k,
    .gemm_q5_k = portable::gemm_q5_k,
    .gemm_iq4_nl = portable::gemm_iq4_nl,
    .gemm_iq4_xs = portable::gemm_iq4_xs,
    .quantize_act = quantize_act,
    .silu_mul = silu_mul_ref,
    .gelu_mul = gelu_mul_ref,
    .tiles = {decode_tile_ref, scores_ref, weighted_sum_ref, exp_sum_ref, query_codes_ref, code_scores_ref, code_sum_ref,
               rope_rows_ref, fit_ranges_ref, encode_f16_ref, max_ref},
};

}  // namespace

const KernelTable& portable_table() noexcept { return kPortable; }

void quantize_act_k(const float* x, std::int64_t n, const ActQ8Out& o) {
  // Round half to even by adding and removing 1.5 * 2^23 (|v| <= 127): the
  // bits of nearbyint, but plain float arithmetic that vectorizes.
  constexpr float kRound = 12582912.0f;
  for (std::int64_t j = 0; j < n / kQK_K; ++j) {
    const float* xj = x + kQK_K * j;
    float amax = 0.0f;
    for (int i = 0; i < kQK_K; ++i) amax = std::max(amax, std::fabs(xj[i]));
    float dk = amax / 127.0f;
    float id = 1.0f / dk;
    if (!(amax >= kActFlush)) dk = id = 0.0f;
    o.dk[j] = dk;
    for (int g = 0; g < kQK_K / 16; ++g) {
      int sum = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) {
        const float v = std::min(127.0f, std::max(-127.0f, xj[i] * id));  // NaN: -127, never undefined
        const int q = static_cast<int>((v + kRound) - kRound);
        o.qs[kQK_K * j + i] = static_cast<std::int8_t>(q);
        sum += q;
      }
      o.g16[16 * j + g] = sum;
    }
    for (int b = 0; b < kQK_K / kQK; ++b) {
      const int sum = o.g16[16 * j + 2 * b] + o.g16[16 * j + 2 * b + 1];
      o.bsum[8 * j + b] = sum;
      o.s[8 * j + b] = dk * static_cast<float>(sum);
    }
  }
}

}  // namespace qkvshare::kernels::detail
