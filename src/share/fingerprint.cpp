#include "qkvshare/share/fingerprint.hpp"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <string_view>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_codebook.hpp"

namespace qkvshare {

namespace {

// Feeds integers little-endian, so a fingerprint is the same on any host.
class Hasher {
 public:
  Hasher() : state_(XXH3_createState()) {
    if (state_ == nullptr) fail(ErrorCode::out_of_memory, "model fingerprint: cannot allocate a hash state");
    XXH3_128bits_reset(state_);
  }
  ~Hasher() { XXH3_freeState(state_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;

  void bytes(const void* p, std::size_t n) { XXH3_128bits_update(state_, p, n); }
  void u64(std::uint64_t v) {
    std::uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<std::uint8_t>(v >> (8 * i));
    bytes(b, sizeof b);
  }
  void text(std::string_view s) {
    u64(s.size());
    bytes(s.data(), s.size());
  }
  void f32(float f) { u64(std::bit_cast<std::uint32_t>(f)); }
  std::array<std::uint8_t, 16> digest() const {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(state_));
    std::array<std::uint8_t, 16> out;
    std::memcpy(out.data(), c.digest, out.size());
    return out;
  }

 private:
  XXH3_state_t* state_;
};

void tensor(Hasher& h, const TensorView& t) {
  h.u64(static_cast<std::uint64_t>(t.type));
  h.u64(static_cast<std::uint64_t>(t.n_dims));
  for (std::int64_t d : t.ne) h.u64(static_cast<std::uint64_t>(d));
  h.u64(t.nbytes);
  if (t.data == nullptr) return;
  constexpr std::size_t kEdge = 4096;
  const std::size_t head = std::min(t.nbytes, kEdge);
  h.u64(XXH3_64bits(t.data, head));
  h.u64(XXH3_64bits(t.data + (t.nbytes - head), head));
}

}  // namespace

std::uint64_t tokenizer_fingerprint(const Tokenizer& tok) {
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) fail(ErrorCode::out_of_memory, "tokenizer fingerprint: cannot allocate a hash state");
  XXH3_64bits_reset(state);
  const auto put = [state](std::uint64_t v) {
    std::uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<std::uint8_t>(v >> (8 * i));
    XXH3_64bits_update(state, b, sizeof b);
  };
  put(static_cast<std::uint64_t>(tok.vocab_size()));
  put(static_cast<std::uint64_t>(static_cast<std::int64_t>(tok.bos_id())));
  put(static_cast<std::uint64_t>(static_cast<std::int64_t>(tok.eos_id())));
  put(tok.add_bos() ? 1 : 0);
  for (TokenId id = 0; id < tok.vocab_size(); ++id) {
    const std::string& p = tok.piece(id);
    put(p.size());
    XXH3_64bits_update(state, p.data(), p.size());
    put(static_cast<std::uint64_t>(tok.token_type(id)));
  }
  const std::uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
}

ModelFingerprint model_fingerprint(const Model& model) {
  const ModelConfig& c = model.config();
  Hasher h;
  h.text("qkvshare model fingerprint v1");
  h.text(c.architecture);
  for (int v : {c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size})
    h.u64(static_cast<std::uint64_t>(v));
  h.f32(c.rms_eps);
  h.f32(c.rope_theta);
  h.u64(static_cast<std::uint64_t>(c.rope_style));
  h.u64(c.qkv_bias ? 1 : 0);
  ModelFingerprint fp;
  fp.tokenizer = tokenizer_fingerprint(model.tokenizer());
  h.u64(fp.tokenizer);
  const ModelWeights& w = model.weights();
  tensor(h, w.token_embedding);
  for (const LayerWeights& l : w.layers) {
    for (const TensorView* t : {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.w_gate, &l.w_up, &l.w_down})
      tensor(h, *t);
    for (const auto* b : {&l.bq, &l.bk, &l.bv})
      if (*b) tensor(h, **b);
  }
  tensor(h, w.output_norm);
  tensor(h, w.output);
  fp.model = h.digest();
  return fp;
}

void check_codebook_model(const KvFormat& format, const ModelFingerprint& fp, std::string_view where) {
  if (format.uses_pq() && format.book->header().model != fp.model)
    fail(ErrorCode::invalid_argument, "{}: KV format {}: the codebook was learned on another model (fingerprints differ)",
         where, format.to_string());
}

}  // namespace qkvshare
