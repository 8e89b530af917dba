#pragma once
// Product-quantization codebooks of the KV pool (the `pqN` formats): each
// head_dim-wide K or V row is cut into head_dim / sub sub-vectors of `sub`
// channels, and each sub-vector is stored as the one-byte index of its
// nearest centroid among kCentroids, learned per layer, KV head, K/V and
// sub-space from a calibration text (`qkvshare calibrate`). A row then costs
// 8 / sub bits per element, nothing else (no scales); the codebook is a fixed
// cost per model, not per context.
//
// File (.kvc), little-endian: the 8-byte magic "QKVSPQCB", u32 version (2;
// 1 is read too), u32 n_layers, n_kv_heads, head_dim, sub, centroids,
// calibration tokens, seed; 16 bytes of the model's fingerprint
// (share/fingerprint.hpp: a codebook is only valid for the model it was
// learned on); u64 XXH3-64 of the payload; from version 2 a u32 of flags
// (bits 0-1: KeyRope of the keys it was learned on, 1 pre, 2 block; from
// version 3, bits 8-15 for keys=block: 1 + log2 of the block size the key
// rows are relative to); then the payload: K tables, then V tables, each
// [layer][kv head][sub-space][centroid][sub] f32.
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "qkvshare/kv/kv_cache.hpp"
#include "qkvshare/kv/kv_format.hpp"

namespace qkvshare {

class KvCodebook {
 public:
  static constexpr int kCentroids = 256;  // one byte per index
  static constexpr std::uint32_t kVersion = 3;  // 2: keys' KeyRope; 3: keys=block's block size

  struct Header {
    int n_layers = 0, n_kv_heads = 0, head_dim = 0, sub = 0;
    int calibration_tokens = 0;
    std::uint32_t seed = 0;
    KeyRope keys = KeyRope::post;  // how the keys it was learned on were stored (KvFormat::key_rope)
    int block_tokens = 0;  // keys=block: the block size its key rows are relative to (0: not recorded, version 2)
    std::array<std::uint8_t, 16> model{};  // ModelFingerprint::model

    // The header of a codebook for a model of KV shape `s`.
    static Header of(const KvShape& s, int sub, int calibration_tokens) {
      Header h;
      h.n_layers = s.n_layers;
      h.n_kv_heads = s.n_kv_heads;
      h.head_dim = s.head_dim;
      h.sub = sub;
      h.calibration_tokens = calibration_tokens;
      return h;
    }
  };

  // Tables of zeros for `h`; train_codebook fills them. Throws
  // Error(invalid_argument) for a sub that is not 2, 4 or 8 or does not divide head_dim.
  explicit KvCodebook(const Header& h);

  const Header& header() const noexcept { return h_; }
  int sub() const noexcept { return h_.sub; }
  int spaces() const noexcept { return h_.head_dim / h_.sub; }
  // XXH3-64 of the header and the tables: what a descriptor would name.
  std::uint64_t id() const noexcept { return id_; }
  bool fits(const KvShape& s) const noexcept {
    return s.n_layers == h_.n_layers && s.n_kv_heads == h_.n_kv_heads && s.head_dim == h_.head_dim;
  }

  // kind 0: keys, 1: values. [spaces][kCentroids][sub], the centroids whole.
  const float* table(int kind, int layer, int head) const noexcept { return data(kind, layer, head, 0); }
  float* table(int kind, int layer, int head) noexcept { return data(kind, layer, head, 0); }
  // The same tables transposed per space, [spaces][sub][kCentroids], for
  // kernels that run over the centroids (lookup tables, nearest centroid).
  const float* table_t(int kind, int layer, int head) const noexcept { return data(kind, layer, head, 1); }
  // Recomputes the transposed tables and the id after the tables changed.
  void finish();

  // Throws Error(io) when the file cannot be written.
  void save(const std::string& path) const;
  // Throws Error(io) for a missing or unreadable file and
  // Error(invalid_argument) naming what is wrong with a corrupt, truncated,
  // foreign or newer file.
  static KvCodebook load(const std::string& path);
  // The same from a file's bytes; `name` goes into the errors.
  static KvCodebook parse(std::string_view bytes, const std::string& name);
  // load() once per path in this process; formats hold the shared copy.
  static std::shared_ptr<const KvCodebook> shared(const std::string& path);
  // A codebook that shared() has loaded in this process, by id (null: none),
  // so that a consumer can open a context a descriptor names by id.
  static std::shared_ptr<const KvCodebook> find(std::uint64_t id);
  // The file it was loaded from (empty for one made in memory).
  const std::string& path() const noexcept { return path_; }

 private:
  std::size_t table_floats() const noexcept;
  float* data(int kind, int layer, int head, int transposed) const noexcept;
  Header h_;
  std::uint64_t id_ = 0;
  std::string path_;
  std::vector<float> tables_;  // [transposed][kind][layer][head][...]
};

// Learns a codebook by k-means (Lloyd iterations from centroids drawn from the
// rows, deterministic for a seed) on calibration rows: keys and values
// [layer][token][kv_dim] f32, as the pool would store them (keys after RoPE,
// or as Header::keys says).
struct CodebookTraining {
  int iterations = 12;
  std::uint32_t seed = 1;
  int threads = 1;
};
KvCodebook train_codebook(const KvCodebook::Header& header, const std::vector<float>& keys,
                          const std::vector<float>& values, int tokens, const CodebookTraining& how);

}  // namespace qkvshare
