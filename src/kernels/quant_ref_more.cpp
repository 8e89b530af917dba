// Scalar dequantization of Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, IQ4_NL and
// IQ4_XS. Each follows ggml's dequantize_row_* (and so the PyPI gguf
// package's NumPy version) in the order of its f32 operations: d * scale is
// rounded first, then multiplied by the code, then the minimum subtracted.
// tests/reference/test_dequant_reference.py checks them bit for bit. The
// file is built with -ffp-contract=off so that no FMA fuses those steps.
#include <cstring>

#include "kquant_scales.hpp"
#include "qkvshare/core/half.hpp"
#include "qkvshare/kernels/quant.hpp"
#include "quant_ref_internal.hpp"

namespace qkvshare::kernels::detail {

namespace {

template <typename Block>
const Block* as(const std::uint8_t* p) {
  return reinterpret_cast<const Block*>(p);
}

// y[j] = scale * code + min for the 32 values of a Q5 block; the codes' 5th bits are in qh.
void q5_codes(const std::uint8_t* qs, const std::uint8_t* qh, int* code) {
  std::uint32_t h;
  std::memcpy(&h, qh, 4);
  for (int j = 0; j < kQK / 2; ++j) {
    code[j] = (qs[j] & 0x0f) | static_cast<int>(((h >> j) & 1u) << 4);
    code[j + kQK / 2] = (qs[j] >> 4) | static_cast<int>(((h >> (j + kQK / 2)) & 1u) << 4);
  }
}

void dequant_q5_0(const BlockQ5_0* b, float* y, std::int64_t nb, bool min) {
  for (std::int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(b[i].d);
    int code[kQK];
    q5_codes(b[i].qs, b[i].qh, code);
    for (int j = 0; j < kQK; ++j) y[j] = min ? 0.0f : d * static_cast<float>(code[j] - 16);
  }
}

void dequant_q5_1(const BlockQ5_1* b, float* y, std::int64_t nb, bool min) {
  for (std::int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(b[i].d);
    const float m = fp16_to_fp32(b[i].m);
    int code[kQK];
    q5_codes(b[i].qs, b[i].qh, code);
    for (int j = 0; j < kQK; ++j) y[j] = min ? m : d * static_cast<float>(code[j]) + m;
  }
}

// Q2_K: value n*128 + s*32 + l is bits 2s..2s+1 of qs[32n + l]; group of 16 = index / 16.
void dequant_q2_k(const BlockQ2_K* b, float* y, std::int64_t nb, bool min) {
  for (std::int64_t i = 0; i < nb; ++i, y += kQK_K) {
    const float d = fp16_to_fp32(b[i].d);
    const float dmin = fp16_to_fp32(b[i].dmin);
    for (int k = 0; k < kQK_K; ++k) {
      const int n = k / 128, s = (k / 32) % 4, l = k % 32;
      const int q = (b[i].qs[32 * n + l] >> (2 * s)) & 3;
      const std::uint8_t sc = b[i].scales[k / 16];
      const float dl = d * static_cast<float>(sc & 0x0f);
      const float ml = dmin * static_cast<float>(sc >> 4);
      y[k] = min ? -ml : dl * static_cast<float>(q) - ml;
    }
  }
}

// Q3_K: low 2 bits as in Q2_K; bit k / 32 of hmask[k % 32] set means no -4 offset.
void dequant_q3_k(const BlockQ3_K* b, float* y, std::int64_t nb, bool min) {
  for (std::int64_t i = 0; i < nb; ++i, y += kQK_K) {
    const float d = fp16_to_fp32(b[i].d);
    for (int k = 0; k < kQK_K; ++k) {
      const int n = k / 128, s = (k / 32) % 4, l = k % 32;
      const int lo = (b[i].qs[32 * n + l] >> (2 * s)) & 3;
      const int hbit = (b[i].hmask[l] >> (k / 32)) & 1;
      const float dl = d * static_cast<float>(scale_q3_k(k / 16, b[i].scales));
      y[k] = min ? 0.0f : dl * static_cast<float>(lo - (hbit ? 0 : 4));
    }
  }
}

// Q4_K / Q5_K: sub-block j (32 values) is the low (j even) or high (j odd)
// nibbles of qs[32 * (j / 2) ...]; Q5_K adds bit j of qh[l] as the 5th bit.
template <class Block, bool kFive>
void dequant_k45(const Block* b, float* y, std::int64_t nb, bool min) {
  for (std::int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d);
    const float dmin = fp16_to_fp32(b[i].dmin);
    for (int j = 0; j < 8; ++j, y += 32) {
      int sc, m;
      scale_min_k4(j, b[i].scales, sc, m);
      const float dl = d * static_cast<float>(sc);
      const float ml = dmin * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) {
        int q = (b[i].qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f;
        if constexpr (kFive) q |= ((b[i].qh[l] >> j) & 1) << 4;
        y[l] = min ? -ml : dl * static_cast<float>(q) - ml;
      }
    }
  }
}

void dequant_iq4_nl(const BlockIQ4_NL* b, float* y, std::int64_t nb, bool min) {
  for (std::int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = min ? 0.0f : d * static_cast<float>(kIq4Values[b[i].qs[j] & 0x0f]);
      y[j + kQK / 2] = min ? 0.0f : d * static_cast<float>(kIq4Values[b[i].qs[j] >> 4]);
    }
  }
}

void dequant_iq4_xs(const BlockIQ4_XS* b, float* y, std::int64_t nb, bool min) {
  for (std::int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < 8; ++j, y += 32) {
      const float dl = d * static_cast<float>(scale_iq4_xs(j, b[i].scales_h, b[i].scales_l));
      const std::uint8_t* qs = b[i].qs + 16 * j;
      for (int l = 0; l < 16; ++l) {
        y[l] = min ? 0.0f : dl * static_cast<float>(kIq4Values[qs[l] & 0x0f]);
        y[l + 16] = min ? 0.0f : dl * static_cast<float>(kIq4Values[qs[l] >> 4]);
      }
    }
  }
}

}  // namespace

bool dequantize_more_ref(GgmlType type, const std::uint8_t* src, float* y, std::int64_t n, bool min) {
  const std::int64_t nb = n / type_traits(type).block_size;
  switch (type) {
    case GgmlType::Q5_0: dequant_q5_0(as<BlockQ5_0>(src), y, nb, min); return true;
    case GgmlType::Q5_1: dequant_q5_1(as<BlockQ5_1>(src), y, nb, min); return true;
    case GgmlType::Q2_K: dequant_q2_k(as<BlockQ2_K>(src), y, nb, min); return true;
    case GgmlType::Q3_K: dequant_q3_k(as<BlockQ3_K>(src), y, nb, min); return true;
    case GgmlType::Q4_K: dequant_k45<BlockQ4_K, false>(as<BlockQ4_K>(src), y, nb, min); return true;
    case GgmlType::Q5_K: dequant_k45<BlockQ5_K, true>(as<BlockQ5_K>(src), y, nb, min); return true;
    case GgmlType::IQ4_NL: dequant_iq4_nl(as<BlockIQ4_NL>(src), y, nb, min); return true;
    case GgmlType::IQ4_XS: dequant_iq4_xs(as<BlockIQ4_XS>(src), y, nb, min); return true;
    default: return false;
  }
}

}  // namespace qkvshare::kernels::detail
