// Random-weight GGUF files of named shapes (`qkvshare make-model`).
#include "qkvshare/model/synthetic_model.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>

#include "qkvshare/core/error.hpp"
#include "qkvshare/core/thread_pool.hpp"
#include "qkvshare/kernels/quant.hpp"
#include "qkvshare/model/gguf.hpp"

namespace qkvshare {

namespace {

constexpr float kInitStd = 0.02f;

SyntheticShape make_shape(std::string name, std::string arch, int layers, int d, int heads, int kv_heads, int ff,
                          int vocab, int ctx, float theta, float eps, std::string pre) {
  SyntheticShape s;
  s.name = std::move(name);
  s.architecture = std::move(arch);
  s.n_layers = layers;
  s.d_model = d;
  s.n_heads = heads;
  s.n_kv_heads = kv_heads;
  s.d_ff = ff;
  s.vocab_size = vocab;
  s.context_length = ctx;
  s.rope_theta = theta;
  s.rms_eps = eps;
  s.pre = std::move(pre);
  return s;
}

SyntheticShape with_head(SyntheticShape s, int head_size) {
  s.head_size = head_size;
  return s;
}

SyntheticShape windowed(SyntheticShape s, int window, float rope_scale) {
  s.sliding_window = window;
  s.rope_scale = rope_scale;
  return s;
}

SyntheticShape untied(SyntheticShape s) {
  s.tied_embedding = false;
  return s;
}

std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Approximately N(0, std^2): the sum of four 16-bit uniforms (Irwin-Hall),
// centred and scaled. Cheap enough for a billion weights; the tails are bounded
// at 2*sqrt(3)*std, which keeps every activation finite.
void fill_normal(float* out, std::int64_t n, std::uint64_t state, float stddev) {
  constexpr float kScale = 1.7320508f / 65536.0f;  // sqrt(3) / 2^16
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint64_t r = splitmix64(state);
    const auto sum = static_cast<float>((r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48));
    out[i] = (sum - 131070.0f) * kScale * stddev;
  }
}

// The weight types make-model writes, with their general.file_type (llama.cpp's
// llama_ftype; the k-quants as the "_S" variants, whose matrices are all of one type).
struct FileType {
  GgmlType type;
  std::uint32_t file_type;
};
constexpr FileType kFileTypes[] = {
    {GgmlType::F16, 1},   {GgmlType::BF16, 32}, {GgmlType::Q8_0, 7},    {GgmlType::Q4_0, 2},    {GgmlType::Q4_1, 3},
    {GgmlType::Q5_0, 8},  {GgmlType::Q5_1, 9},  {GgmlType::Q2_K, 10},   {GgmlType::Q3_K, 11},   {GgmlType::Q4_K, 14},
    {GgmlType::Q5_K, 16}, {GgmlType::Q6_K, 18}, {GgmlType::IQ4_NL, 25}, {GgmlType::IQ4_XS, 30},
};

// A matrix whose rows are not whole 256-value super-blocks (SmolLM2's 576
// columns) gets the 32-block type llama-quantize falls back to for it.
GgmlType fitting_type(GgmlType type, std::int64_t cols) {
  if (cols % type_traits(type).block_size == 0) return type;
  switch (type) {
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::IQ4_XS: return GgmlType::IQ4_NL;
    case GgmlType::Q4_K: return GgmlType::Q5_0;
    case GgmlType::Q5_K: return GgmlType::Q5_1;
    case GgmlType::Q6_K: return GgmlType::Q8_0;
    default: return type;
  }
}

std::uint32_t file_type_of(GgmlType type) {
  for (const FileType& f : kFileTypes)
    if (f.type == type) return f.file_type;
  return 0;
}

class TensorMaker {
 public:
  TensorMaker(GgufWriter& writer, const SyntheticOptions& options)
      : writer_(writer), options_(options), pool_(options.n_threads) {}

  // A [rows x cols] matrix (GGUF shape {cols, rows}) of N(0, 0.02) in `type`.
  void random(const std::string& name, GgmlType wanted, std::int64_t cols, std::int64_t rows) {
    const GgmlType type = fitting_type(wanted, cols);
    const std::size_t row_bytes = type_row_bytes(type, cols);
    std::vector<std::uint8_t> data(row_bytes * static_cast<std::size_t>(rows));
    const std::uint64_t tensor_seed = options_.seed * 0x100000001B3ULL + index_++;
    pool_.parallel_for(static_cast<std::size_t>(rows), 16, [&](std::size_t begin, std::size_t end, int) {
      std::vector<float> row(static_cast<std::size_t>(cols));
      for (std::size_t r = begin; r < end; ++r) {
        std::uint64_t key = tensor_seed ^ (static_cast<std::uint64_t>(r) << 32);
        fill_normal(row.data(), cols, splitmix64(key), kInitStd);
        kernels::quantize_row_ref(type, row.data(), data.data() + r * row_bytes, cols);
      }
    });
    writer_.add_tensor(name, type, rows == 1 ? std::vector<std::int64_t>{cols} : std::vector<std::int64_t>{cols, rows},
                       std::move(data));
  }

  // An F32 vector of 1 + N(0, 0.25^2): norm weights that differ per element, so a wrong index shows.
  void random_around_one(const std::string& name, std::int64_t n) {
    std::vector<float> v(static_cast<std::size_t>(n));
    std::uint64_t key = options_.seed * 0x100000001B3ULL + index_++;
    fill_normal(v.data(), n, splitmix64(key), 0.25f);
    for (float& x : v) x += 1.0f;
    std::vector<std::uint8_t> data(reinterpret_cast<const std::uint8_t*>(v.data()),
                                   reinterpret_cast<const std::uint8_t*>(v.data() + n));
    writer_.add_tensor(name, GgmlType::F32, {n}, std::move(data));
  }

  // An F32 vector of ones (RMSNorm weights).
  void ones(const std::string& name, std::int64_t n) {
    std::vector<float> v(static_cast<std::size_t>(n), 1.0f);
    std::vector<std::uint8_t> data(reinterpret_cast<const std::uint8_t*>(v.data()),
                                   reinterpret_cast<const std::uint8_t*>(v.data() + n));
    ++index_;
    writer_.add_tensor(name, GgmlType::F32, {n}, std::move(data));
  }

 private:
  static std::size_t type_row_bytes(GgmlType type, std::int64_t cols) {
    const TypeTraits& t = type_traits(type);
    return static_cast<std::size_t>(cols / t.block_size) * t.type_size;
  }

  GgufWriter& writer_;
  const SyntheticOptions& options_;
  ThreadPool pool_;
  std::uint64_t index_ = 0;
};

void write_metadata(GgufWriter& w, const SyntheticShape& s, GgmlType type) {
  const std::string a = s.architecture + ".";
  w.set_string("general.architecture", s.architecture);
  w.set_string("general.name", "synthetic " + s.name);
  w.set_string("general.description", "random weights made by qkvshare make-model; for benchmarks and tests only");
  w.set_u32("general.file_type", file_type_of(type));
  w.set_u32("general.quantization_version", 2);
  w.set_u32(a + "context_length", static_cast<std::uint32_t>(s.context_length));
  w.set_u32(a + "embedding_length", static_cast<std::uint32_t>(s.d_model));
  w.set_u32(a + "block_count", static_cast<std::uint32_t>(s.n_layers));
  w.set_u32(a + "feed_forward_length", static_cast<std::uint32_t>(s.d_ff));
  w.set_u32(a + "attention.head_count", static_cast<std::uint32_t>(s.n_heads));
  w.set_u32(a + "attention.head_count_kv", static_cast<std::uint32_t>(s.n_kv_heads));
  w.set_f32(a + "attention.layer_norm_rms_epsilon", s.rms_eps);
  w.set_f32(a + "rope.freq_base", s.rope_theta);
  w.set_u32(a + "rope.dimension_count", static_cast<std::uint32_t>(s.head_dim()));
  if (s.head_size > 0) {
    w.set_u32(a + "attention.key_length", static_cast<std::uint32_t>(s.head_dim()));
    w.set_u32(a + "attention.value_length", static_cast<std::uint32_t>(s.head_dim()));
  }
  if (s.sliding_window > 0) w.set_u32(a + "attention.sliding_window", static_cast<std::uint32_t>(s.sliding_window));
  if (s.rope_scale > 1.0f) {
    w.set_string(a + "rope.scaling.type", "linear");
    w.set_f32(a + "rope.scaling.factor", s.rope_scale);
  }
  w.set_u32(a + "vocab_size", static_cast<std::uint32_t>(s.vocab_size));

  SyntheticVocab v = make_synthetic_vocab(s.vocab_size);
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", s.pre);
  w.set_string_array("tokenizer.ggml.tokens", v.tokens);
  w.set_i32_array("tokenizer.ggml.token_type", v.types);
  w.set_string_array("tokenizer.ggml.merges", v.merges);
  w.set_u32("tokenizer.ggml.bos_token_id", static_cast<std::uint32_t>(v.bos_id));
  w.set_u32("tokenizer.ggml.eos_token_id", static_cast<std::uint32_t>(v.eos_id));
  w.set_u32("tokenizer.ggml.padding_token_id", static_cast<std::uint32_t>(v.bos_id));
  w.set_bool("tokenizer.ggml.add_bos_token", false);
}

}  // namespace

std::int64_t SyntheticShape::n_params() const noexcept {
  const std::int64_t d = d_model, kv = static_cast<std::int64_t>(n_kv_heads) * head_dim(), ff = d_ff;
  const std::int64_t q = static_cast<std::int64_t>(n_heads) * head_dim();
  std::int64_t layer = d * q * 2 + d * kv * 2 + 3 * d * ff + 2 * d;
  if (architecture == "qwen2") layer += q + 2 * kv;
  if (architecture == "qwen3") layer += 2 * head_dim();
  if (architecture == "gemma3") layer += 2 * head_dim() + 2 * d;
  return static_cast<std::int64_t>(vocab_size) * d * (tied_embedding ? 1 : 2) + layer * n_layers + d;
}

const std::vector<SyntheticShape>& synthetic_shapes() {
  static const std::vector<SyntheticShape> shapes = {
      make_shape("smollm2-135m", "llama", 30, 576, 9, 3, 1536, 49152, 8192, 100000.0f, 1e-5f, "smollm"),
      make_shape("qwen2.5-0.5b", "qwen2", 24, 896, 14, 2, 4864, 151936, 32768, 1000000.0f, 1e-6f, "qwen2"),
      with_head(make_shape("qwen3-0.6b", "qwen3", 28, 1024, 16, 8, 3072, 151936, 40960, 1000000.0f, 1e-6f, "qwen2"),
                128),
      make_shape("llama3.2-1b", "llama", 16, 2048, 32, 8, 8192, 128256, 131072, 500000.0f, 1e-5f, "llama-bpe"),
      untied(make_shape("phi3-mini", "phi3", 32, 3072, 32, 32, 8192, 32064, 4096, 10000.0f, 1e-5f, "llama-bpe")),
      make_shape("tiny-llama", "llama", 2, 64, 4, 2, 128, 512, 256, 10000.0f, 1e-5f, "smollm"),
      make_shape("tiny-qwen2", "qwen2", 2, 64, 4, 2, 128, 512, 256, 1000000.0f, 1e-6f, "qwen2"),
      // 256 wide so that every k-quant fits whole super-blocks; heads wider than d_model / n_heads as in Qwen3.
      with_head(make_shape("tiny-qwen3", "qwen3", 2, 256, 4, 2, 512, 512, 256, 1000000.0f, 1e-6f, "qwen2"), 128),
      untied(make_shape("tiny-phi3", "phi3", 2, 256, 4, 4, 512, 512, 256, 10000.0f, 1e-5f, "llama-bpe")),
      // Gemma 3 1B: 26 layers in runs of 5 local (512-token window) + 1 global.
      windowed(with_head(make_shape("gemma3-1b", "gemma3", 26, 1152, 4, 1, 6912, 262144, 32768, 1000000.0f, 1e-6f,
                                    "llama-bpe"),
                         256),
               512, 1.0f),
      // One run of 5 local layers and a global one; an 8-token window and the
      // 4B's linear RoPE scaling (x8) on the global layer, so 16 test tokens cross both.
      windowed(with_head(make_shape("tiny-gemma3", "gemma3", 6, 256, 4, 2, 512, 512, 32768, 1000000.0f, 1e-6f,
                                    "llama-bpe"),
                         128),
               8, 8.0f),
  };
  return shapes;
}

const SyntheticShape& find_synthetic_shape(std::string_view name) {
  std::string known;
  for (const SyntheticShape& s : synthetic_shapes()) {
    if (s.name == name) return s;
    known += (known.empty() ? "" : ", ") + s.name;
  }
  fail(ErrorCode::invalid_argument, "--shape: unknown shape '{}' (known: {})", name, known);
}

GgmlType parse_synthetic_type(std::string_view text) {
  std::string upper(text);
  std::transform(upper.begin(), upper.end(), upper.begin(), [](unsigned char c) { return std::toupper(c); });
  std::string names;
  for (const FileType& f : kFileTypes) {
    if (type_name(f.type) == upper) return f.type;
    names += (names.empty() ? "" : ", ") + std::string(type_name(f.type));
  }
  fail(ErrorCode::invalid_argument, "--type: '{}' is not a weight type make-model writes ({})", text, names);
}

void validate_shape(const SyntheticShape& s, GgmlType type) {
  const auto bad = [&](std::string_view what) {
    fail(ErrorCode::invalid_argument, "shape '{}': {}", s.name, what);
  };
  if (s.architecture != "llama" && s.architecture != "qwen2" && s.architecture != "qwen3" && s.architecture != "phi3" &&
      s.architecture != "gemma3")
    bad(fmt::format("architecture '{}' is not llama, qwen2, qwen3, phi3 or gemma3", s.architecture));
  if (s.architecture == "gemma3" && s.sliding_window <= 0) bad("gemma3 needs a sliding window");
  if (s.n_layers < 1 || s.n_layers > 1024) bad(fmt::format("{} layers is outside [1, 1024]", s.n_layers));
  if (s.d_model < 2 || s.d_model > (1 << 16)) bad(fmt::format("d_model {} is outside [2, 65536]", s.d_model));
  if (s.n_heads < 1 || (s.head_size == 0 && s.d_model % s.n_heads != 0))
    bad(fmt::format("d_model {} is not a multiple of {} heads", s.d_model, s.n_heads));
  if (s.n_kv_heads < 1 || s.n_heads % s.n_kv_heads != 0)
    bad(fmt::format("{} heads is not a multiple of {} KV heads", s.n_heads, s.n_kv_heads));
  if (s.head_dim() % 2 != 0) bad(fmt::format("head size {} is odd (RoPE needs pairs)", s.head_dim()));
  if (s.d_ff < 1 || s.d_ff > (1 << 18)) bad(fmt::format("d_ff {} is outside [1, 262144]", s.d_ff));
  if (s.context_length < 1) bad(fmt::format("context length {} is not positive", s.context_length));
  if (!(s.rms_eps > 0.0f && s.rms_eps < 1.0f)) bad("rms_eps must be in (0, 1)");
  if (!(s.rope_theta > 1.0f)) bad("rope_theta must be > 1");
  for (const auto& [what, n] : {std::pair{"d_model", s.d_model}, std::pair{"d_ff", s.d_ff}}) {
    const GgmlType t = fitting_type(type, n);
    const std::int64_t block = type_traits(t).block_size;
    if (n % block != 0)
      bad(fmt::format("{} {} is not a multiple of the {} block size {}", what, n, type_name(t), block));
  }
  make_synthetic_vocab(s.vocab_size);  // throws on a bad vocabulary size
}

std::uint64_t write_synthetic_model(const SyntheticShape& s, const SyntheticOptions& options,
                                    const std::string& path) {
  parse_synthetic_type(type_name(options.type));  // only the types make-model supports
  validate_shape(s, options.type);
  GgufWriter w;
  write_metadata(w, s, options.type);
  // GgufWriter keeps every tensor in memory and serialises the file into one
  // more buffer, so writing peaks at about twice the file size.
  TensorMaker make(w, options);
  const std::int64_t d = s.d_model, kv = static_cast<std::int64_t>(s.n_kv_heads) * s.head_dim(), ff = s.d_ff;
  const std::int64_t q = static_cast<std::int64_t>(s.n_heads) * s.head_dim();
  const GgmlType t = options.type;
  make.random("token_embd.weight", t, d, s.vocab_size);
  for (int l = 0; l < s.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    make.ones(p + "attn_norm.weight", d);
    if (s.architecture == "phi3") {
      make.random(p + "attn_qkv.weight", t, d, q + 2 * kv);
    } else {
      make.random(p + "attn_q.weight", t, d, q);
      make.random(p + "attn_k.weight", t, d, kv);
      make.random(p + "attn_v.weight", t, d, kv);
    }
    if (s.architecture == "qwen2") {
      make.random(p + "attn_q.bias", GgmlType::F32, q, 1);
      make.random(p + "attn_k.bias", GgmlType::F32, kv, 1);
      make.random(p + "attn_v.bias", GgmlType::F32, kv, 1);
    }
    if (s.architecture == "qwen3" || s.architecture == "gemma3") {  // norms near 1: a wrong weight index shows
      make.random_around_one(p + "attn_q_norm.weight", s.head_dim());
      make.random_around_one(p + "attn_k_norm.weight", s.head_dim());
    }
    make.random(p + "attn_output.weight", t, q, d);
    if (s.architecture == "gemma3") make.random_around_one(p + "post_attention_norm.weight", d);
    make.ones(p + "ffn_norm.weight", d);
    if (s.architecture == "phi3") {
      make.random(p + "ffn_up.weight", t, d, 2 * ff);
    } else {
      make.random(p + "ffn_gate.weight", t, d, ff);
      make.random(p + "ffn_up.weight", t, d, ff);
    }
    make.random(p + "ffn_down.weight", t, ff, d);
    if (s.architecture == "gemma3") make.random_around_one(p + "post_ffw_norm.weight", d);
  }
  make.ones("output_norm.weight", d);
  if (!s.tied_embedding) make.random("output.weight", t, d, s.vocab_size);
  w.write(path);
  return std::filesystem::file_size(path);
}

}  // namespace qkvshare
