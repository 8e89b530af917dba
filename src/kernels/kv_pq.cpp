#include "qkvshare/kernels/kv_pq.hpp"

#include <algorithm>
#include <cstring>

namespace qkvshare::kernels {

void pq_lut(const TileKernels& k, const TileCodes& t, const float* q, int nq, float scale, float* lut) {
  const int sub = t.pq_sub, S = t.head_dim / sub;
  float qs[8];
  for (int i = 0; i < nq; ++i)
    for (int s = 0; s < S; ++s) {
      float* out = lut + (static_cast<std::size_t>(i) * S + static_cast<std::size_t>(s)) * kPqCentroids;
      for (int e = 0; e < sub; ++e) qs[e] = scale * q[static_cast<std::size_t>(i) * t.head_dim + s * sub + e];
      std::fill(out, out + kPqCentroids, 0.0f);
      // The transposed centroids of a space are `sub` rows of 256: one weighted sum.
      k.weighted_sum(out, qs, t.centroids_t + static_cast<std::size_t>(s) * sub * kPqCentroids, sub, kPqCentroids);
    }
}

void pq_scores(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* lut, int nq, float* s,
               std::size_t s_stride) {
  const int S = t.head_dim / t.pq_sub;
  const std::size_t per_query = static_cast<std::size_t>(S) * kPqCentroids;
  const auto* codes = reinterpret_cast<const std::uint8_t*>(tile);
  for (int i = 0; i < nq; ++i) {
    const float* li = lut + static_cast<std::size_t>(i) * per_query;
    float* si = s + static_cast<std::size_t>(i) * s_stride;
    for (int j = lo; j < hi; ++j) si[j] = 0.0f;
    // Space by space, so that the rows' sums are independent of each other
    // (one chain of adds per row would wait on every add).
    for (int p = 0; p < S; ++p) {
      const float* lp = li + static_cast<std::size_t>(p) * kPqCentroids;
      for (int j = lo; j < hi; ++j) si[j] += lp[codes[static_cast<std::size_t>(j) * t.row_bytes + static_cast<std::size_t>(p)]];
    }
  }
}

void pq_accumulate(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p, std::size_t p_stride,
                   int nq, float* hist) {
  const int S = t.head_dim / t.pq_sub;
  const std::size_t per_query = static_cast<std::size_t>(S) * kPqCentroids;
  for (int j = lo; j < hi; ++j) {
    const auto* codes = reinterpret_cast<const std::uint8_t*>(tile + static_cast<std::size_t>(j) * t.row_bytes);
    for (int i = 0; i < nq; ++i) {
      const float w = p[static_cast<std::size_t>(i) * p_stride + static_cast<std::size_t>(j)];
      if (w == 0.0f) continue;
      float* hi_ = hist + static_cast<std::size_t>(i) * per_query;
      for (int q = 0; q < S; ++q) hi_[static_cast<std::size_t>(q) * kPqCentroids + codes[q]] += w;
    }
  }
}

void pq_reduce(const TileKernels& k, const TileCodes& t, const float* hist, int nq, float* o) {
  const int sub = t.pq_sub, S = t.head_dim / sub;
  float part[8];
  for (int i = 0; i < nq; ++i)
    for (int s = 0; s < S; ++s) {
      const float* h = hist + (static_cast<std::size_t>(i) * S + static_cast<std::size_t>(s)) * kPqCentroids;
      // One score per channel of the space: the histogram against its transposed centroids.
      k.scores(h, t.centroids_t + static_cast<std::size_t>(s) * sub * kPqCentroids, sub, kPqCentroids, 1.0f, part);
      float* out = o + static_cast<std::size_t>(i) * t.head_dim + static_cast<std::size_t>(s) * sub;
      for (int e = 0; e < sub; ++e) out[e] += part[e];
    }
}

}  // namespace qkvshare::kernels
