// Round-to-nearest quantizers of Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, IQ4_NL
// and IQ4_XS. Q5_0 / Q5_1 are ggml's reference schemes; the others pick each
// group's scale (and minimum) from its range, quantize those to the format's
// bits against a per-super-block scale, and round every value to the nearest
// code. Simpler than llama-quantize's searches (larger error), but they write
// valid blocks of the same layout: enough for tests and synthetic models.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "qkvshare/core/half.hpp"
#include "qkvshare/kernels/quant.hpp"
#include "quant_ref_internal.hpp"

namespace qkvshare::kernels::detail {

namespace {

float inv(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

// The value of largest magnitude, with its sign.
float signed_amax(const float* x, int n) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < n; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  return max;
}

void pack_q5(const int* q, std::uint8_t* qs, std::uint8_t* qh) {
  std::uint32_t h = 0;
  for (int j = 0; j < kQK / 2; ++j) {
    qs[j] = static_cast<std::uint8_t>((q[j] & 0x0f) | ((q[j + kQK / 2] & 0x0f) << 4));
    h |= static_cast<std::uint32_t>(q[j] >> 4) << j;
    h |= static_cast<std::uint32_t>(q[j + kQK / 2] >> 4) << (j + kQK / 2);
  }
  std::memcpy(qh, &h, 4);
}

void quant_q5_0(const float* x, BlockQ5_0* b, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, x += kQK) {
    const float d = signed_amax(x, kQK) / -16.0f;
    const float id = inv(d);
    int q[kQK];
    for (int j = 0; j < kQK; ++j) q[j] = std::min(31, static_cast<int>(x[j] * id + 16.5f));
    b[i].d = fp32_to_fp16(d);
    pack_q5(q, b[i].qs, b[i].qh);
  }
}

void quant_q5_1(const float* x, BlockQ5_1* b, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, x += kQK) {
    const float lo = *std::min_element(x, x + kQK), hi = *std::max_element(x, x + kQK);
    const float d = (hi - lo) / 31.0f;
    const float id = inv(d);
    int q[kQK];
    for (int j = 0; j < kQK; ++j) q[j] = std::min(31, static_cast<int>((x[j] - lo) * id + 0.5f));
    b[i].d = fp32_to_fp16(d);
    b[i].m = fp32_to_fp16(lo);
    pack_q5(q, b[i].qs, b[i].qh);
  }
}

// Group scales and mins of an asymmetric k-quant: x ~= d * sc_g * q - dmin * m_g
// with q in [0, qmax], sc_g and m_g in [0, smax]. Writes the integer sc / m and
// the stored f16 d / dmin; the codes are then rounded against the stored values.
struct AsymScales {
  int sc[16];
  int m[16];
  std::uint16_t d, dmin;
};

AsymScales asym_scales(const float* x, int groups, int group, int qmax, int smax) {
  float scale[16], mn[16], max_scale = 0.0f, max_min = 0.0f;
  for (int g = 0; g < groups; ++g) {
    const float* xg = x + group * g;
    const float lo = std::min(0.0f, *std::min_element(xg, xg + group));
    const float hi = *std::max_element(xg, xg + group);
    scale[g] = (hi - lo) / static_cast<float>(qmax);
    mn[g] = -lo;
    max_scale = std::max(max_scale, scale[g]);
    max_min = std::max(max_min, mn[g]);
  }
  AsymScales s{};
  s.d = fp32_to_fp16(max_scale / static_cast<float>(smax));
  s.dmin = fp32_to_fp16(max_min / static_cast<float>(smax));
  const float id = inv(fp16_to_fp32(s.d)), idmin = inv(fp16_to_fp32(s.dmin));
  for (int g = 0; g < groups; ++g) {
    // Round the scale up so that the group's maximum stays within qmax steps.
    s.sc[g] = std::clamp(static_cast<int>(std::ceil(scale[g] * id)), 0, smax);
    s.m[g] = std::clamp(static_cast<int>(std::lround(mn[g] * idmin)), 0, smax);
  }
  return s;
}

int asym_code(float x, float d, int sc, float dmin, int m, int qmax) {
  const float step = d * static_cast<float>(sc);
  const float v = (x + dmin * static_cast<float>(m)) * inv(step);
  return std::clamp(static_cast<int>(std::lround(v)), 0, qmax);
}

template <class Block, bool kFive>
void quant_k45(const float* x, Block* b, std::int64_t nb) {
  const int qmax = kFive ? 31 : 15;
  for (std::int64_t i = 0; i < nb; ++i, x += kQK_K) {
    const AsymScales s = asym_scales(x, 8, 32, qmax, 63);
    b[i].d = s.d;
    b[i].dmin = s.dmin;
    std::memset(b[i].scales, 0, sizeof(b[i].scales));
    for (int j = 0; j < 8; ++j) {  // inverse of scale_min_k4
      if (j < 4) {
        b[i].scales[j] = static_cast<std::uint8_t>(s.sc[j]);
        b[i].scales[j + 4] = static_cast<std::uint8_t>(s.m[j]);
      } else {
        b[i].scales[j + 4] = static_cast<std::uint8_t>((s.sc[j] & 0x0f) | ((s.m[j] & 0x0f) << 4));
        b[i].scales[j - 4] |= static_cast<std::uint8_t>((s.sc[j] >> 4) << 6);
        b[i].scales[j] |= static_cast<std::uint8_t>((s.m[j] >> 4) << 6);
      }
    }
    std::memset(b[i].qs, 0, sizeof(b[i].qs));
    if constexpr (kFive) std::memset(b[i].qh, 0, sizeof(b[i].qh));
    const float d = fp16_to_fp32(s.d), dmin = fp16_to_fp32(s.dmin);
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) {
        const int q = asym_code(x[32 * j + l], d, s.sc[j], dmin, s.m[j], qmax);
        b[i].qs[32 * (j / 2) + l] |= static_cast<std::uint8_t>((q & 0x0f) << (4 * (j % 2)));
        if constexpr (kFive) b[i].qh[l] |= static_cast<std::uint8_t>((q >> 4) << j);
      }
  }
}

void quant_q2_k(const float* x, BlockQ2_K* b, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, x += kQK_K) {
    const AsymScales s = asym_scales(x, 16, 16, 3, 15);
    b[i].d = s.d;
    b[i].dmin = s.dmin;
    for (int g = 0; g < 16; ++g) b[i].scales[g] = static_cast<std::uint8_t>(s.sc[g] | (s.m[g] << 4));
    std::memset(b[i].qs, 0, sizeof(b[i].qs));
    const float d = fp16_to_fp32(s.d), dmin = fp16_to_fp32(s.dmin);
    for (int k = 0; k < kQK_K; ++k) {
      const int q = asym_code(x[k], d, s.sc[k / 16], dmin, s.m[k / 16], 3);
      b[i].qs[32 * (k / 128) + k % 32] |= static_cast<std::uint8_t>(q << (2 * ((k / 32) % 4)));
    }
  }
}

// Symmetric: code c in [-4, 3] per group of 16, scale ls in [-32, 31] against d.
void quant_q3_k(const float* x, BlockQ3_K* b, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, x += kQK_K) {
    float scale[16], amax = 0.0f;
    for (int g = 0; g < 16; ++g) {
      scale[g] = signed_amax(x + 16 * g, 16) / -4.0f;
      amax = std::max(amax, std::fabs(scale[g]));
    }
    b[i].d = fp32_to_fp16(amax / 32.0f);
    const float d = fp16_to_fp32(b[i].d), id = inv(d);
    std::memset(b[i].scales, 0, sizeof(b[i].scales));
    std::memset(b[i].hmask, 0, sizeof(b[i].hmask));
    std::memset(b[i].qs, 0, sizeof(b[i].qs));
    for (int g = 0; g < 16; ++g) {
      const int ls = std::clamp(static_cast<int>(std::lround(scale[g] * id)), -32, 31);
      const int v = ls + 32;  // inverse of scale_q3_k
      b[i].scales[g % 8] |= static_cast<std::uint8_t>((v & 0x0f) << (4 * (g / 8)));
      b[i].scales[8 + g % 4] |= static_cast<std::uint8_t>((v >> 4) << (2 * (g / 4)));
      const float istep = inv(d * static_cast<float>(ls));
      for (int j = 0; j < 16; ++j) {
        const int k = 16 * g + j;
        const int u = std::clamp(static_cast<int>(std::lround(x[k] * istep)), -4, 3) + 4;
        b[i].qs[32 * (k / 128) + k % 32] |= static_cast<std::uint8_t>((u & 3) << (2 * ((k / 32) % 4)));
        b[i].hmask[k % 32] |= static_cast<std::uint8_t>((u >> 2) << (k / 32));
      }
    }
  }
}

int nearest_iq4(float v) {
  int best = 0;
  for (int c = 1; c < 16; ++c)
    if (std::fabs(v - kIq4Values[c]) < std::fabs(v - kIq4Values[best])) best = c;
  return best;
}

void quant_iq4_nl(const float* x, BlockIQ4_NL* b, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, x += kQK) {
    b[i].d = fp32_to_fp16(signed_amax(x, kQK) / -127.0f);
    const float id = inv(fp16_to_fp32(b[i].d));
    for (int j = 0; j < kQK / 2; ++j)
      b[i].qs[j] = static_cast<std::uint8_t>(nearest_iq4(x[j] * id) | (nearest_iq4(x[j + kQK / 2] * id) << 4));
  }
}

void quant_iq4_xs(const float* x, BlockIQ4_XS* b, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, x += kQK_K) {
    float scale[8], amax = 0.0f;
    for (int j = 0; j < 8; ++j) {
      scale[j] = signed_amax(x + 32 * j, 32) / -127.0f;
      amax = std::max(amax, std::fabs(scale[j]));
    }
    b[i].d = fp32_to_fp16(amax / 32.0f);
    const float d = fp16_to_fp32(b[i].d), id = inv(d);
    b[i].scales_h = 0;
    std::memset(b[i].scales_l, 0, sizeof(b[i].scales_l));
    for (int j = 0; j < 8; ++j) {
      const int ls = std::clamp(static_cast<int>(std::lround(scale[j] * id)), -32, 31);
      const int v = ls + 32;  // inverse of scale_iq4_xs
      b[i].scales_l[j / 2] |= static_cast<std::uint8_t>((v & 0x0f) << (4 * (j % 2)));
      b[i].scales_h = static_cast<std::uint16_t>(b[i].scales_h | ((v >> 4) << (2 * j)));
      const float istep = inv(d * static_cast<float>(ls));
      const float* xj = x + 32 * j;
      for (int l = 0; l < 16; ++l)
        b[i].qs[16 * j + l] =
            static_cast<std::uint8_t>(nearest_iq4(xj[l] * istep) | (nearest_iq4(xj[l + 16] * istep) << 4));
    }
  }
}

template <typename Block>
Block* as(std::uint8_t* p) {
  return reinterpret_cast<Block*>(p);
}

}  // namespace

bool quantize_more_ref(GgmlType type, const float* x, std::uint8_t* dst, std::int64_t n) {
  const std::int64_t nb = n / type_traits(type).block_size;
  switch (type) {
    case GgmlType::Q5_0: quant_q5_0(x, as<BlockQ5_0>(dst), nb); return true;
    case GgmlType::Q5_1: quant_q5_1(x, as<BlockQ5_1>(dst), nb); return true;
    case GgmlType::Q2_K: quant_q2_k(x, as<BlockQ2_K>(dst), nb); return true;
    case GgmlType::Q3_K: quant_q3_k(x, as<BlockQ3_K>(dst), nb); return true;
    case GgmlType::Q4_K: quant_k45<BlockQ4_K, false>(x, as<BlockQ4_K>(dst), nb); return true;
    case GgmlType::Q5_K: quant_k45<BlockQ5_K, true>(x, as<BlockQ5_K>(dst), nb); return true;
    case GgmlType::IQ4_NL: quant_iq4_nl(x, as<BlockIQ4_NL>(dst), nb); return true;
    case GgmlType::IQ4_XS: quant_iq4_xs(x, as<BlockIQ4_XS>(dst), nb); return true;
    default: return false;
  }
}

}  // namespace qkvshare::kernels::detail
