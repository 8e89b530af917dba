// Dense-and-sparse tiles (KvCodec::outliers, after KVQuant): which elements a
// tile keeps apart, and how readers add them back.
#include "kv_outliers.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/half.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"

namespace qkvshare::kv {

namespace {

// One series of a tile (a channel of per-channel keys, a group of a row of
// per-token values): elements base + i * stride, i < n, less those taken out.
// It keeps the two smallest and the two largest of what is left (first
// occurrence on ties, so the choice is the same on every machine) and what
// taking either end out would save. No sorting: a tile gives up ~1% of its
// elements, and rescanning one series after each is cheaper than ordering all.
struct Series {
  int base, stride, n;
  int lo, hi;          // element indices of the smallest and largest left
  float lo2, hi2;      // the second smallest and second largest values
  int left;
  float saving;
  bool low;            // which end that saving is for

  void scan(const float* x, const std::uint8_t* taken) noexcept {
    left = 0;
    lo = hi = -1;
    for (int i = 0; i < n; ++i) {
      const int e = base + i * stride;
      if (taken[e]) continue;
      const float v = x[e];
      if (left++ == 0) {
        lo = hi = e;
        lo2 = std::numeric_limits<float>::infinity(), hi2 = -std::numeric_limits<float>::infinity();
        continue;
      }
      if (v < x[lo]) lo2 = x[lo], lo = e;
      else lo2 = std::min(lo2, v);
      if (v > x[hi]) hi2 = x[hi], hi = e;
      else hi2 = std::max(hi2, v);
    }
  }
  // The dense codes' squared error is about n * (range / qmax)^2 / 12 per
  // series, and every series of a tile has the same n, so an end is ranked
  // by range^2 - range'^2.
  void rank(const float* x) noexcept {
    saving = -1.0f;
    if (left < 3) return;  // a series keeps two elements at least
    const float a = x[lo], b = x[hi], r = b - a;
    const float by_low = r * r - (b - lo2) * (b - lo2), by_high = r * r - (hi2 - a) * (hi2 - a);
    low = by_low >= by_high;
    saving = low ? by_low : by_high;
  }
};

}  // namespace

std::vector<std::uint16_t> take_outliers(const KvCodec& codec, const TileLayout& l, float* rows) {
  const int T = l.tokens, D = l.head_dim;
  const bool channels = codec.axis == KvAxis::channel;
  const int G = channels ? T : effective_group(codec, D), groups = D / G, n_series = channels ? D : T * groups;
  thread_local std::vector<Series> series;
  thread_local std::vector<std::uint8_t> taken_mask;
  series.resize(static_cast<std::size_t>(n_series));
  taken_mask.assign(static_cast<std::size_t>(T) * static_cast<std::size_t>(D), 0);
  for (int k = 0; k < n_series; ++k) {
    Series& s = series[static_cast<std::size_t>(k)];
    // Series k of per-channel keys is channel k; of per-token values, row k / groups's group k % groups.
    s.base = channels ? k : (k / groups) * D + (k % groups) * G;
    s.stride = channels ? D : 1;
    s.n = G;
    s.scan(rows, taken_mask.data());
    s.rank(rows);
  }
  std::vector<std::uint16_t> taken;
  taken.reserve(l.n_outliers);
  while (taken.size() < l.n_outliers) {
    Series* best = nullptr;
    for (Series& s : series)
      if (s.saving >= 0.0f && (!best || s.saving > best->saving)) best = &s;
    if (!best) break;  // every series is down to two elements
    const int e = best->low ? best->lo : best->hi;
    taken.push_back(static_cast<std::uint16_t>(e));
    taken_mask[static_cast<std::size_t>(e)] = 1;
    best->scan(rows, taken_mask.data());
    best->rank(rows);
  }
  // A taken element stays in the dense codes clamped to what is left of its
  // series' range, so it does not widen the range the codes are fitted to;
  // its residual holds the rest.
  for (const Series& s : series) {
    if (s.left == s.n) continue;
    const float a = rows[s.lo], b = rows[s.hi];
    for (int i = 0; i < s.n; ++i) {
      const int e = s.base + i * s.stride;
      if (taken_mask[static_cast<std::size_t>(e)]) rows[e] = std::clamp(rows[e], a, b);
    }
  }
  // Unused slots (a tile with fewer candidates than slots) hold other
  // elements; their residuals are their own rounding error.
  for (std::size_t i = 0; taken.size() < l.n_outliers; ++i)
    if (!taken_mask[i]) taken.push_back(static_cast<std::uint16_t>(i));
  std::sort(taken.begin(), taken.end());
  return taken;
}

void store_outliers(const KvCodec& codec, const TileLayout& l, const std::vector<std::uint16_t>& index,
                    const float* original, std::byte* tile) {
  QKV_CHECK(index.size() == l.n_outliers);
  const kernels::TileCodes codes = tile_codes(codec, l);
  auto* idx = reinterpret_cast<std::uint16_t*>(tile + l.outlier_offset);
  std::uint16_t* res = idx + l.n_outliers;
  for (std::size_t e = 0; e < index.size(); ++e) {
    const int j = index[e] / l.head_dim, c = index[e] % l.head_dim;
    idx[e] = index[e];
    res[e] = fp32_to_fp16(original[index[e]] - kernels::decode_element_ref(codes, tile, j, c));
  }
}

TileOutliers tile_outliers(const TileLayout& l, const std::byte* tile) noexcept {
  if (l.n_outliers == 0) return {};
  const auto* idx = reinterpret_cast<const std::uint16_t*>(tile + l.outlier_offset);
  return {idx, idx + l.n_outliers, static_cast<int>(l.n_outliers)};
}

void add_outliers(const TileLayout& l, const std::byte* tile, int n_rows, float* rows) noexcept {
  const TileOutliers o = tile_outliers(l, tile);
  const std::size_t end = static_cast<std::size_t>(n_rows) * static_cast<std::size_t>(l.head_dim);
  for (int e = 0; e < o.n && o.index[e] < end; ++e) rows[o.index[e]] += fp16_to_fp32(o.residual[e]);
}

}  // namespace qkvshare::kv
