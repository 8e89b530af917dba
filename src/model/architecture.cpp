#include "qkvshare/model/architecture.hpp"

namespace qkvshare {

namespace {

// GGUF `llama` files are permuted by the converter for ggml's "normal"
// (adjacent-pair) RoPE; the others keep the HF layout and use NeoX RoPE.
// Mistral files from llama.cpp's converter say `llama`; `mistral` is the name
// some converters write for the same network.
constexpr ArchTraits kArchitectures[] = {
    {.name = "llama"},
    {.name = "mistral"},
    {.name = "qwen2", .rope = RopeStyle::neox, .qkv_bias = true},
    {.name = "qwen3", .rope = RopeStyle::neox, .qk_norm = true},
    {.name = "phi3", .rope = RopeStyle::neox, .fused_qkv = true},
    // The converter stores Gemma's RMSNorm weights as 1 + w already, so its
    // norms are the plain ones here.
    {.name = "gemma3",
     .rope = RopeStyle::neox,
     .qk_norm = true,
     .embed_scale = true,
     .post_norms = true,
     .gelu = true,
     .swa_pattern = 6,
     .swa_rope_base = 10000.0f},
};

}  // namespace

const ArchTraits* find_architecture(std::string_view name) noexcept {
  for (const ArchTraits& a : kArchitectures)
    if (a.name == name) return &a;
  return nullptr;
}

std::string supported_architectures() {
  std::string out;
  for (const ArchTraits& a : kArchitectures) out += (out.empty() ? "" : ", ") + std::string(a.name);
  return out;
}

}  // namespace qkvshare
