#pragma once
// Internal: the nearest centroid of a sub-vector, for the pq encoder
// (kv_kernels.cpp) and the codebook's k-means (kv_codebook_train.cpp), so
// that training assigns points exactly as storage will.
#include <cstddef>

#include "qkvshare/kv/kv_codebook.hpp"

namespace qkvshare::kv {

// norms[c] = |centroid c|^2 of one space, from its transposed table ct[e * 256 + c].
inline void centroid_norms(const float* ct, int sub, float* norms) {
  constexpr int C = KvCodebook::kCentroids;
  for (int c = 0; c < C; ++c) norms[c] = 0.0f;
  for (int e = 0; e < sub; ++e)
    for (int c = 0; c < C; ++c) norms[c] += ct[static_cast<std::size_t>(e) * C + c] * ct[static_cast<std::size_t>(e) * C + c];
}

// The index of the centroid nearest to x[sub] by |c|^2 - 2 x.c (|x|^2 is the
// same for every c); the first of equals. d: 256 floats of scratch.
inline int nearest_centroid(const float* x, const float* ct, const float* norms, int sub, float* d) {
  constexpr int C = KvCodebook::kCentroids;
  for (int c = 0; c < C; ++c) d[c] = norms[c];
  for (int e = 0; e < sub; ++e) {
    const float m = -2.0f * x[e];
    const float* row = ct + static_cast<std::size_t>(e) * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) d[c] += m * row[c];
  }
  // The least distance first (a vectorized reduction), then its first index.
  float least = d[0];
#pragma omp simd reduction(min : least)
  for (int c = 0; c < C; ++c) least = d[c] < least ? d[c] : least;
  int best = 0;
  while (best < C - 1 && d[best] != least) ++best;  // (NaN rows: the last index)
  return best;
}

}  // namespace qkvshare::kv
