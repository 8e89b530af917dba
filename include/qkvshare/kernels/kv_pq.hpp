#pragma once
// Attention on product-quantized KV tiles (TileCodes::pq_sub > 0), without a
// decoded copy: a row is head_dim / sub one-byte indices, index s of row j
// naming centroid code[j][s] of sub-space s (channels s*sub .. s*sub+sub-1).
// - keys: per query, a lookup table of the query's product with every
//   centroid (pq_lut, once per query and head, for all tiles), so that a
//   row's score is head_dim / sub table reads (pq_scores);
// - values: per query, the weights of the rows are summed per centroid
//   (pq_accumulate, per tile) and multiplied with the centroids once at the
//   end (pq_reduce).
// The dense steps (pq_lut, pq_reduce) run on the dispatched tile kernels
// (weighted_sum, scores over the 256 centroids); the lookups are plain loops.
#include <cstddef>

#include "qkvshare/kernels/kv_tiles.hpp"

namespace qkvshare::kernels {

inline constexpr int kPqCentroids = 256;

// Floats of one query's lookup table or histogram.
inline std::size_t pq_table_floats(const TileCodes& t) noexcept {
  return static_cast<std::size_t>(t.head_dim / t.pq_sub) * kPqCentroids;
}

// lut[i][s][c] = scale * (q_i's sub-vector s . centroid c of space s), i < nq.
void pq_lut(const TileKernels& k, const TileCodes& t, const float* q, int nq, float scale, float* lut);
// s[i * s_stride + j] = sum over s of lut[i][s][code[j][s]], rows j in [lo, hi).
void pq_scores(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* lut, int nq, float* s,
               std::size_t s_stride);
// hist[i][s][code[j][s]] += p[i * p_stride + j], rows j in [lo, hi).
void pq_accumulate(const TileCodes& t, const std::byte* tile, int lo, int hi, const float* p, std::size_t p_stride,
                   int nq, float* hist);
// o[i][s * sub + e] += sum over c of hist[i][s][c] * centroid c of space s, channel e.
void pq_reduce(const TileKernels& k, const TileCodes& t, const float* hist, int nq, float* o);

}  // namespace qkvshare::kernels
