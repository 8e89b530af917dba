#include <algorithm>
#include <cmath>
#include <cstring>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/half.hpp"
#include "qkvshare/kernels/quant.hpp"
#include "quant_ref_internal.hpp"

namespace qkvshare::kernels {

namespace {

void dequant_q4_0(const BlockQ4_0* b, float* y, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>((b[i].qs[j] & 0x0f) - 8) * d;
      y[j + kQK / 2] = static_cast<float>((b[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequant_q4_1(const BlockQ4_1* b, float* y, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(b[i].d);
    const float m = fp16_to_fp32(b[i].m);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>(b[i].qs[j] & 0x0f) * d + m;
      y[j + kQK / 2] = static_cast<float>(b[i].qs[j] >> 4) * d + m;
    }
  }
}

void dequant_q8_0(const BlockQ8_0* b, float* y, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(b[i].qs[j]) * d;
  }
}

void dequant_q6_k(const BlockQ6_K* b, float* y, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d);
    const std::uint8_t* ql = b[i].ql;
    const std::uint8_t* qh = b[i].qh;
    const std::int8_t* sc = b[i].scales;
    for (int n = 0; n < kQK_K; n += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l + 0] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
      y += 128;
      ql += 64;
      qh += 32;
      sc += 8;
    }
  }
}

template <typename Block>
const Block* blocks(const std::uint8_t* p) {
  return reinterpret_cast<const Block*>(p);
}

}  // namespace

void dequantize_row_ref(GgmlType type, const std::uint8_t* src, float* dst, std::int64_t n) {
  const std::int64_t bs = type_traits(type).block_size;
  QKV_CHECK(n % bs == 0);
  switch (type) {
    case GgmlType::F32:
      std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
      return;
    case GgmlType::F16:
      for (std::int64_t i = 0; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = fp16_to_fp32(h);
      }
      return;
    case GgmlType::BF16:
      for (std::int64_t i = 0; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = bf16_to_fp32(h);
      }
      return;
    case GgmlType::Q4_0: dequant_q4_0(blocks<BlockQ4_0>(src), dst, n / bs); return;
    case GgmlType::Q4_1: dequant_q4_1(blocks<BlockQ4_1>(src), dst, n / bs); return;
    case GgmlType::Q8_0: dequant_q8_0(blocks<BlockQ8_0>(src), dst, n / bs); return;
    case GgmlType::Q6_K: dequant_q6_k(blocks<BlockQ6_K>(src), dst, n / bs); return;
    default:
      if (!detail::dequantize_more_ref(type, src, dst, n, /*min=*/false))
        fail(ErrorCode::unsupported, "no kernel for tensor type {}", type_name(type));
  }
}

void dequantize_row_min_ref(GgmlType type, const std::uint8_t* src, float* dst, std::int64_t n) {
  const std::int64_t bs = type_traits(type).block_size;
  QKV_CHECK(n % bs == 0);
  if (type == GgmlType::Q4_1) {
    const auto* b = blocks<BlockQ4_1>(src);
    for (std::int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(b[i / kQK].m);
    return;
  }
  if (detail::dequantize_more_ref(type, src, dst, n, /*min=*/true)) return;
  std::fill(dst, dst + n, 0.0f);
}

float dot_row_ref(GgmlType type, const std::uint8_t* row, const float* x, std::int64_t n) {
  const std::int64_t bs = type_traits(type).block_size;
  const std::size_t bytes = type_traits(type).type_size;
  float tmp[kQK_K];
  double sum = 0.0;
  for (std::int64_t i = 0; i < n; i += bs) {
    dequantize_row_ref(type, row + static_cast<std::size_t>(i / bs) * bytes, tmp, bs);
    for (std::int64_t j = 0; j < bs; ++j) sum += static_cast<double>(tmp[j]) * x[i + j];
  }
  return static_cast<float>(sum);
}

namespace {

void quant_q8_0(const float* x, BlockQ8_0* b, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, x += kQK) {
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[i].d = fp32_to_fp16(d);
    for (int j = 0; j < kQK; ++j) b[i].qs[j] = static_cast<std::int8_t>(std::lround(x[j] * id));
  }
}

void quant_q4_0(const float* x, BlockQ4_0* b, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, x += kQK) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kQK; ++j)
      if (std::fabs(x[j]) > amax) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[i].d = fp32_to_fp16(d);
    for (int j = 0; j < kQK / 2; ++j) {
      const int q0 = std::min(15, static_cast<int>(x[j] * id + 8.5f));
      const int q1 = std::min(15, static_cast<int>(x[j + kQK / 2] * id + 8.5f));
      b[i].qs[j] = static_cast<std::uint8_t>(q0 | (q1 << 4));
    }
  }
}

void quant_q4_1(const float* x, BlockQ4_1* b, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, x += kQK) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < kQK; ++j) {
      lo = std::min(lo, x[j]);
      hi = std::max(hi, x[j]);
    }
    const float d = (hi - lo) / 15.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[i].d = fp32_to_fp16(d);
    b[i].m = fp32_to_fp16(lo);
    for (int j = 0; j < kQK / 2; ++j) {
      const int q0 = std::min(15, static_cast<int>((x[j] - lo) * id + 0.5f));
      const int q1 = std::min(15, static_cast<int>((x[j + kQK / 2] - lo) * id + 0.5f));
      b[i].qs[j] = static_cast<std::uint8_t>(q0 | (q1 << 4));
    }
  }
}

// Q6_K with one scale per 16 values chosen from the block maximum; simpler
// than ggml's iterative search but produces valid blocks of the same layout.
void quant_q6_k(const float* x, BlockQ6_K* b, std::int64_t nb) {
  for (std::int64_t i = 0; i < nb; ++i, x += kQK_K) {
    float scales[16];
    float max_scale = 0.0f;
    for (int s = 0; s < 16; ++s) {
      float amax = 0.0f;
      for (int j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(x[16 * s + j]));
      scales[s] = amax / 31.0f;
      max_scale = std::max(max_scale, scales[s]);
    }
    const float d = max_scale / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[i].d = fp32_to_fp16(d);
    const float dd = fp16_to_fp32(b[i].d);
    std::int8_t q[kQK_K];
    for (int s = 0; s < 16; ++s) {
      const int sc = std::min(127, static_cast<int>(std::lround(scales[s] * id)));
      b[i].scales[s] = static_cast<std::int8_t>(sc);
      const float step = dd * static_cast<float>(sc);
      const float istep = step != 0.0f ? 1.0f / step : 0.0f;
      for (int j = 0; j < 16; ++j) {
        const int v = static_cast<int>(std::lround(x[16 * s + j] * istep));
        q[16 * s + j] = static_cast<std::int8_t>(std::clamp(v, -32, 31) + 32);
      }
    }
    std::memset(b[i].ql, 0, sizeof(b[i].ql));
    std::memset(b[i].qh, 0, sizeof(b[i].qh));
    for (int n = 0; n < 2; ++n) {
      std::uint8_t* ql = b[i].ql + 64 * n;
      std::uint8_t* qh = b[i].qh + 32 * n;
      const std::int8_t* qq = q + 128 * n;
      for (int l = 0; l < 32; ++l) {
        const int q1 = qq[l], q2 = qq[l + 32], q3 = qq[l + 64], q4 = qq[l + 96];
        ql[l] = static_cast<std::uint8_t>((q1 & 0xf) | ((q3 & 0xf) << 4));
        ql[l + 32] = static_cast<std::uint8_t>((q2 & 0xf) | ((q4 & 0xf) << 4));
        qh[l] = static_cast<std::uint8_t>((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
      }
    }
  }
}

}  // namespace

void quantize_row_ref(GgmlType type, const float* src, std::uint8_t* dst, std::int64_t n) {
  const std::int64_t bs = type_traits(type).block_size;
  QKV_CHECK(n % bs == 0);
  switch (type) {
    case GgmlType::F32: std::memcpy(dst, src, static_cast<std::size_t>(n) * 4); return;
    case GgmlType::F16:
      for (std::int64_t i = 0; i < n; ++i) {
        const std::uint16_t h = fp32_to_fp16(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case GgmlType::BF16:
      for (std::int64_t i = 0; i < n; ++i) {
        const std::uint16_t h = fp32_to_bf16(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      return;
    case GgmlType::Q8_0: quant_q8_0(src, reinterpret_cast<BlockQ8_0*>(dst), n / bs); return;
    case GgmlType::Q4_0: quant_q4_0(src, reinterpret_cast<BlockQ4_0*>(dst), n / bs); return;
    case GgmlType::Q4_1: quant_q4_1(src, reinterpret_cast<BlockQ4_1*>(dst), n / bs); return;
    case GgmlType::Q6_K: quant_q6_k(src, reinterpret_cast<BlockQ6_K*>(dst), n / bs); return;
    default:
      if (!detail::quantize_more_ref(type, src, dst, n))
        fail(ErrorCode::unsupported, "cannot quantize to {}", type_name(type));
  }
}

}  // namespace qkvshare::kernels
