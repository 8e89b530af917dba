#pragma once
// The GGUF architectures the engine runs, as one table of traits (what the
// loader reads and the forward pass does differently), instead of `if`
// chains on the architecture name spread over the code.
#include <string>
#include <string_view>

#include "qkvshare/tensor/tensor.hpp"  // RopeStyle

namespace qkvshare {

struct ArchTraits {
  std::string_view name;  // general.architecture, and the prefix of its keys
  RopeStyle rope = RopeStyle::interleaved;
  bool qkv_bias = false;   // attn_{q,k,v}.bias (qwen2)
  bool qk_norm = false;    // attn_{q,k}_norm.weight: RMSNorm of each q and k head before RoPE (qwen3)
  bool fused_qkv = false;  // attn_qkv.weight = Q|K|V rows, ffn_up.weight = gate|up rows (phi3)
  // gemma3: embeddings scaled by sqrt(d_model); post_attention_norm and
  // post_ffw_norm on each block's output before its residual add; GeGLU
  // (tanh GELU) instead of SwiGLU.
  bool embed_scale = false;
  bool post_norms = false;
  bool gelu = false;
  // Interleaved sliding-window attention: in each run of `swa_pattern` layers
  // the last one attends to the whole context and the others to the last
  // `{arch}.attention.sliding_window` tokens, with RoPE base `swa_rope_base`
  // and no RoPE scaling (gemma3: 5 local layers, then a global one).
  int swa_pattern = 0;
  float swa_rope_base = 0.0f;
};

// nullptr when `name` is not a supported architecture.
const ArchTraits* find_architecture(std::string_view name) noexcept;
// "llama, mistral, qwen2, qwen3, phi3, gemma3": for error messages.
std::string supported_architectures();

}  // namespace qkvshare
