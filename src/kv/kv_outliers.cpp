// Dense-and-sparse tiles (KvCodec::outliers, after KVQuant): which elements a
// tile keeps apart, and how readers add them back.
#include "kv_outliers.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/half.hpp"

namespace qkvshare::kv {

namespace {

// One element of a series: its value and where it sits in the tile.
struct Element {
  float value;
  std::uint16_t index;
  bool operator<(const Element& o) const noexcept { return value < o.value || (value == o.value && index < o.index); }
};

// One series of a tile (a channel of per-channel keys, a group of a row of
// per-token values): its elements sorted by value (ties by index, so the
// choice is the same on every machine), the run [lo, hi] of them still inside
// the dense range, and what taking either end out would save.
struct Series {
  Element* sorted;
  int lo, hi;
  float saving;
  bool low;  // which end that saving is for

  // The dense codes' squared error is about n * (range / qmax)^2 / 12 per
  // series, and every series of a tile has the same n, so an end is ranked
  // by range^2 - range'^2.
  void rank() noexcept {
    saving = -1.0f;
    if (hi - lo < 2) return;  // a series keeps two elements at least
    const float a = sorted[lo].value, b = sorted[hi].value, r = b - a;
    const float by_low = r * r - (b - sorted[lo + 1].value) * (b - sorted[lo + 1].value);
    const float by_high = r * r - (sorted[hi - 1].value - a) * (sorted[hi - 1].value - a);
    low = by_low >= by_high;
    saving = low ? by_low : by_high;
  }
};

}  // namespace

std::vector<std::uint16_t> take_outliers(const KvCodec& codec, const TileLayout& l, float* rows) {
  const int T = l.tokens, D = l.head_dim;
  const bool channels = codec.axis == KvAxis::channel;
  const int G = channels ? T : effective_group(codec, D), n_series = channels ? D : T * (D / G);
  thread_local std::vector<Element> elements;
  thread_local std::vector<Series> series;
  elements.resize(static_cast<std::size_t>(T) * static_cast<std::size_t>(D));
  series.resize(static_cast<std::size_t>(n_series));
  for (int k = 0; k < n_series; ++k) {
    Element* e = &elements[static_cast<std::size_t>(k) * static_cast<std::size_t>(G)];
    for (int i = 0; i < G; ++i) {
      // Series k of per-channel keys is channel k; of per-token values, row k / groups's group k % groups.
      const int idx = channels ? i * D + k : (k / (D / G)) * D + (k % (D / G)) * G + i;
      e[i] = {rows[idx], static_cast<std::uint16_t>(idx)};
    }
    std::sort(e, e + G);
    series[static_cast<std::size_t>(k)] = {e, 0, G - 1, 0.0f, false};
    series[static_cast<std::size_t>(k)].rank();
  }
  std::vector<std::uint16_t> taken;
  taken.reserve(l.n_outliers);
  while (taken.size() < l.n_outliers) {
    Series* best = nullptr;
    for (Series& s : series)
      if (s.saving >= 0.0f && (!best || s.saving > best->saving)) best = &s;
    if (!best) break;  // every series is down to two elements
    taken.push_back(best->sorted[best->low ? best->lo++ : best->hi--].index);
    best->rank();
  }
  // A taken element stays in the dense codes clamped to what is left of its
  // series' range, so it does not widen the range the codes are fitted to;
  // its residual holds the rest.
  for (const Series& s : series) {
    const float a = s.sorted[s.lo].value, b = s.sorted[s.hi].value;
    for (int i = 0; i < s.lo; ++i) rows[s.sorted[i].index] = a;
    for (int i = s.hi + 1; i < G; ++i) rows[s.sorted[i].index] = b;
  }
  // Unused slots (a tile with fewer candidates than slots) hold other
  // elements; their residuals are their own rounding error.
  if (taken.size() < l.n_outliers) {
    std::vector<bool> used(static_cast<std::size_t>(T) * static_cast<std::size_t>(D), false);
    for (const std::uint16_t i : taken) used[i] = true;
    for (std::size_t i = 0; taken.size() < l.n_outliers; ++i)
      if (!used[i]) taken.push_back(static_cast<std::uint16_t>(i));
  }
  std::sort(taken.begin(), taken.end());
  return taken;
}

namespace {

// The value element (j, c) of an integer tile decodes to from its codes
// alone, as kernels::decode_tile_ref computes it (the same fma).
float dense_value(const KvCodec& codec, const TileLayout& l, const std::byte* tile, int j, int c) {
  const int bits = codec.bits();
  const std::byte* unit = tile + static_cast<std::size_t>(j) * l.row_bytes + static_cast<std::size_t>(c / 8 * bits);
  std::uint64_t word = 0;
  for (int b = 0; b < bits; ++b) word |= static_cast<std::uint64_t>(unit[b]) << (8 * b);
  const auto code = static_cast<float>((word >> ((c % 8) * bits)) & ((1u << bits) - 1u));
  const std::size_t p = codec.axis == KvAxis::channel
                            ? static_cast<std::size_t>(c)
                            : static_cast<std::size_t>(j * (l.head_dim / effective_group(codec, l.head_dim)) +
                                                       c / effective_group(codec, l.head_dim));
  const auto* scales = reinterpret_cast<const std::uint16_t*>(tile + l.param_offset);
  return std::fma(code, fp16_to_fp32(scales[p]), fp16_to_fp32(scales[l.param_stride + p]));
}

}  // namespace

void store_outliers(const KvCodec& codec, const TileLayout& l, const std::vector<std::uint16_t>& index,
                    const float* original, std::byte* tile) {
  QKV_CHECK(index.size() == l.n_outliers);
  auto* idx = reinterpret_cast<std::uint16_t*>(tile + l.outlier_offset);
  std::uint16_t* res = idx + l.n_outliers;
  for (std::size_t e = 0; e < index.size(); ++e) {
    const int j = index[e] / l.head_dim, c = index[e] % l.head_dim;
    idx[e] = index[e];
    res[e] = fp32_to_fp16(original[index[e]] - dense_value(codec, l, tile, j, c));
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
