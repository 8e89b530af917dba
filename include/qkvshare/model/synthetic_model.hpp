#pragma once
// Random-weight GGUF models of real architectures' shapes, for benchmarks and
// tests (`qkvshare make-model`). Speed does not depend on weight values, so a
// synthetic file of the same shape and type measures what the real one would.
// The files carry a synthetic GPT-2 style byte-level BPE vocabulary of the
// shape's size, so this engine and llama.cpp both load them.
//
// Note on layering: the generator quantizes with kernels/quant.hpp's scalar
// reference quantizers; it is a file-making tool that sits beside the model
// loader, not part of it, and nothing in the loader depends on it.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "qkvshare/tensor/tensor.hpp"

namespace qkvshare {

struct SyntheticShape {
  std::string name;
  // "llama", "qwen2" (q/k/v biases), "qwen3" (q/k norms), "phi3" (fused),
  // "gemma3" (q/k norms, post-norms, GeGLU, sliding-window layers)
  std::string architecture = "llama";
  int n_layers = 0;
  int d_model = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int d_ff = 0;
  int vocab_size = 0;
  int context_length = 2048;
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  bool tied_embedding = true;  // no output.weight: the logits reuse token_embd
  // tokenizer.ggml.pre: the real model's pre-tokenizer name, one that both this
  // engine and llama.cpp know ("smollm", "qwen2", "llama-bpe"; llama.cpp has no "gpt2").
  std::string pre = "smollm";

  int head_size = 0;  // 0: d_model / n_heads; else written as attention.key_length (Qwen3's wider heads)
  int sliding_window = 0;   // > 0: written as attention.sliding_window
  float rope_scale = 1.0f;  // > 1: rope.scaling.type linear with this factor

  int head_dim() const noexcept { return head_size > 0 ? head_size : (n_heads > 0 ? d_model / n_heads : 0); }
  // Parameters of all weight tensors (norms and biases included).
  std::int64_t n_params() const noexcept;
};

// The built-in shapes: smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, llama3.2-1b,
// phi3-mini, gemma3-1b, and the tiny tiny-llama / tiny-qwen2 / tiny-qwen3 /
// tiny-phi3 / tiny-gemma3 used by tests.
const std::vector<SyntheticShape>& synthetic_shapes();
// Throws Error(invalid_argument) naming the known shapes when `name` is none of them.
const SyntheticShape& find_synthetic_shape(std::string_view name);
// Throws Error(invalid_argument) naming the field and the rule it breaks.
void validate_shape(const SyntheticShape& shape, GgmlType type);

// "F16" | "Q8_0" | "Q4_0" (case-insensitive); throws Error(invalid_argument) otherwise.
GgmlType parse_synthetic_type(std::string_view text);

// The synthetic tokenizer block: the 256 byte tokens (GPT-2 byte-to-unicode
// form), filler tokens each made by one merge of two earlier tokens, then the
// special tokens <|endoftext|>, <|im_start|>, <|im_end|> at the end.
struct SyntheticVocab {
  std::vector<std::string> tokens;
  std::vector<std::string> merges;  // "left right", in rank order
  std::vector<std::int32_t> types;  // 1 normal, 3 control
  std::int32_t bos_id = -1;         // <|endoftext|>
  std::int32_t eos_id = -1;         // <|im_end|>
};
// vocab_size must be at least 259 (256 bytes + 3 specials).
SyntheticVocab make_synthetic_vocab(int vocab_size);

struct SyntheticOptions {
  GgmlType type = GgmlType::Q8_0;  // matrices and token_embd; norms and biases are F32
  std::uint64_t seed = 1;
  int n_threads = 0;  // 0: all hardware threads
};

// Generates the weights (matrices ~ N(0, 0.02), norms = 1, biases ~ N(0, 0.02)),
// quantizes them with the scalar reference quantizers and writes the GGUF file
// (atomically: a temporary file renamed over `path`). The same shape, type and
// seed always give the same bytes, whatever the thread count. Returns the file size.
std::uint64_t write_synthetic_model(const SyntheticShape& shape, const SyntheticOptions& options,
                                    const std::string& path);

}  // namespace qkvshare
