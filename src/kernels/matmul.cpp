#include "qkvshare/kernels/matmul.hpp"

#include <algorithm>
#include <array>
#include <vector>

#include "kernel_table.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/packed_weights.hpp"
#include "qkvshare/kernels/quant.hpp"

namespace qkvshare::kernels {

namespace {

using detail::GemmArgs;
using detail::KernelTable;

std::int32_t bias_mult(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_0: return detail::kBiasQ4_0;
    case GgmlType::Q8_0: return detail::kBiasQ8_0;
    case GgmlType::Q5_0: return detail::kBiasQ5_0;
    case GgmlType::Q3_K: return detail::kBiasQ3_K;
    case GgmlType::IQ4_NL:
    case GgmlType::IQ4_XS: return detail::kBiasQ8_0;
    default: return 0;  // the types with a minimum (Q4_1, Q5_1, Q2_K) need none
  }
}

detail::GemmFn gemm_for(const KernelTable& k, GgmlType type) {
  switch (type) {
    case GgmlType::F32: return k.gemm_f32;
    case GgmlType::F16: return k.gemm_f16;
    case GgmlType::BF16: return k.gemm_bf16;
    case GgmlType::Q8_0: return k.gemm_q8_0;
    case GgmlType::Q4_0: return k.gemm_q4_0;
    case GgmlType::Q4_1: return k.gemm_q4_1;
    case GgmlType::Q6_K: return k.gemm_q6_k;
    case GgmlType::Q5_0: return k.gemm_q5_0;
    case GgmlType::Q5_1: return k.gemm_q5_1;
    case GgmlType::Q2_K: return k.gemm_q2_k;
    case GgmlType::Q3_K: return k.gemm_q3_k;
    case GgmlType::Q4_K: return k.gemm_q4_k;
    case GgmlType::Q5_K: return k.gemm_q5_k;
    case GgmlType::IQ4_NL: return k.gemm_iq4_nl;
    case GgmlType::IQ4_XS: return k.gemm_iq4_xs;
    default: fail(ErrorCode::unsupported, "no matmul kernel for tensor type {}", type_name(type));
  }
}

// The quantized activations of one matmul call. They live in the calling
// thread (the workers only read them during the call) and grow to the
// largest call seen, so steady-state decoding allocates nothing.
struct ActBuffers {
  std::vector<std::int8_t> qs;
  std::vector<float> d, dl, xs, s, dk;
  std::vector<std::int32_t> bias, bsum, g16;
};

// What a weight type needs from the activations: f32, 8-bit in blocks of 32
// with a bias multiplier (the kind is -bias_mult >= 0), or 8-bit in
// super-blocks of 256 (Q4_K, Q5_K, Q6_K: ActQ8::dk).
constexpr std::int32_t kFloatActs = -1;
constexpr std::int32_t kSuperBlockActs = -2;
std::int32_t activation_kind(GgmlType type) {
  switch (activation_block(type)) {
    case 0: return kFloatActs;
    case kQK_K: return kSuperBlockActs;
    default: return -bias_mult(type);
  }
}

detail::ActQ8 quantize_activations(ThreadPool& pool, const KernelTable& k, const float* x, std::int64_t n_tokens,
                                   std::int64_t cols, std::int32_t kind) {
  // A thread_local named inside the lambda would be each worker's own: bind it here.
  thread_local ActBuffers tl_buf;
  ActBuffers& buf = tl_buf;
  const auto n = static_cast<std::size_t>(n_tokens * cols);
  if (buf.qs.size() < n) {
    buf.qs.resize(n);
    buf.d.resize(n / kQK);
    buf.dl.resize(n / 4);
    buf.bias.resize(n / 4);
    buf.xs.resize(n / 4);
    buf.bsum.resize(n / kQK);
    buf.s.resize(n / kQK);
    buf.dk.resize(n / kQK_K);
    buf.g16.resize(n / 16);
  }
  const auto run = [&buf, &k, x, cols, kind](std::size_t begin, std::size_t end, int) {
    for (std::size_t t = begin; t < end; ++t) {
      const std::int64_t off = static_cast<std::int64_t>(t) * cols;
      const detail::ActQ8Out out{buf.qs.data() + off,       buf.d.data() + off / kQK,    buf.dl.data() + off / 4,
                                 buf.bias.data() + off / 4, buf.xs.data() + off / 4, buf.bsum.data() + off / kQK,
                                 buf.s.data() + off / kQK,  buf.dk.data() + off / kQK_K,
                                 buf.g16.data() + off / 16};
      if (kind == kSuperBlockActs)
        detail::quantize_act_k(x + off, cols, out);
      else
        k.quantize_act(x + off, cols, -kind, out);
    }
  };
  // A token row quantizes in about a microsecond: only batches are worth the threads.
  if (n_tokens >= 16)
    pool.parallel_for(static_cast<std::size_t>(n_tokens), 4, run);
  else
    run(0, static_cast<std::size_t>(n_tokens), 0);
  detail::ActQ8 act{buf.qs.data(), buf.d.data(), buf.dl.data(), buf.bias.data(), buf.xs.data(),
                    buf.bsum.data(), buf.s.data()};
  act.dk = buf.dk.data();
  act.g16 = buf.g16.data();
  act.cols = cols;
  return act;
}

void check_shapes(const TensorView& w, std::int64_t cols) {
  QKV_CHECK(w.cols() == cols);
  QKV_CHECK(w.cols() % type_traits(w.type).block_size == 0);
}

// Rows per work unit: big enough to fill a register tile and keep each
// thread on a contiguous run of weight rows.
constexpr std::size_t kRowGrain = 16;

}  // namespace

int activation_block(GgmlType type) noexcept {
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16: return 0;
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K: return kQK_K;
    default: return kQK;
  }
}

void dequantize_row(const TensorView& w, std::int64_t r, float* dst) {
  QKV_CHECK(r >= 0 && r < w.rows());
  if (w.packed == nullptr) return dequantize_row_ref(w.type, w.row(r), dst, w.cols());
  // From the packed copy: the file's pages of a packed matrix were dropped,
  // and a tied embedding's lookups would bring them back a fault-around at a time.
  thread_local std::vector<std::uint8_t> row;
  row.resize(w.row_bytes());
  unpack_row(w, r, row.data());
  dequantize_row_ref(w.type, row.data(), dst, w.cols());
}

void matmul_ref(const TensorView& w, const float* x, std::int64_t n_tokens, float* y) {
  const std::int64_t rows = w.rows();
  const std::int64_t cols = w.cols();
  for (std::int64_t t = 0; t < n_tokens; ++t)
    for (std::int64_t r = 0; r < rows; ++r) y[t * rows + r] = dot_row_ref(w.type, w.row(r), x + t * cols, cols);
}

void matmul_exact(ThreadPool& pool, const TensorView& w, const float* x, std::int64_t n_tokens, float* y) {
  const std::int64_t rows = w.rows();
  const std::int64_t cols = w.cols();
  pool.parallel_for(static_cast<std::size_t>(rows), kRowGrain, [&](std::size_t begin, std::size_t end, int) {
    for (std::int64_t t = 0; t < n_tokens; ++t)
      for (auto r = static_cast<std::int64_t>(begin); r < static_cast<std::int64_t>(end); ++r)
        y[t * rows + r] = dot_row_ref(w.type, w.row(r), x + t * cols, cols);
  });
}

void matmul(ThreadPool& pool, const TensorView& w, const float* x, std::int64_t n_tokens, float* y) {
  const MatmulOut out{&w, y};
  matmul_multi(pool, std::span<const MatmulOut>(&out, 1), x, n_tokens);
}

void matmul_multi(ThreadPool& pool, std::span<const MatmulOut> outs, const float* x, std::int64_t n_tokens) {
  if (outs.empty() || n_tokens <= 0) return;
  QKV_CHECK(outs.size() <= kMaxMatmulOuts);
  const KernelTable& k = detail::kernels();
  const std::int64_t cols = outs[0].w->cols();
  struct Job {
    GemmArgs args;
    detail::GemmFn fn = nullptr;
    detail::GemmFn packed_fn = nullptr;  // reads w.packed (packed_weights.hpp), whole tiles only
    const std::uint8_t* packed = nullptr;
    std::int32_t kind = 0;
    std::size_t first_row = 0;  // within its group
    bool done = false;
  };
  std::array<Job, kMaxMatmulOuts> jobs;
  for (std::size_t i = 0; i < outs.size(); ++i) {
    const TensorView& w = *outs[i].w;
    check_shapes(w, cols);
    GemmArgs& a = jobs[i].args;
    a.w = w.data;
    a.row_bytes = w.row_bytes();
    a.n_rows = w.rows();
    a.cols = cols;
    a.n_tokens = n_tokens;
    a.x = x;
    a.y = outs[i].y;
    a.ldy = w.rows();
    jobs[i].fn = gemm_for(k, w.type);
    jobs[i].kind = activation_kind(w.type);
    if (w.packed != nullptr && jobs[i].kind != kFloatActs) {
      jobs[i].packed_fn = detail::packed_gemm(k, w.type);
      jobs[i].packed = w.packed;
    }
  }
  // Weights that read the same activations form a group: its activations are
  // quantized once, and one parallel_for covers the rows of all its weights
  // (a thread's range may span several of them).
  for (std::size_t first = 0; first < outs.size(); ++first) {
    if (jobs[first].done) continue;
    const std::int32_t kind = jobs[first].kind;
    detail::ActQ8 act;
    if (kind != kFloatActs) act = quantize_activations(pool, k, x, n_tokens, cols, kind);
    std::array<std::size_t, kMaxMatmulOuts> group{};
    std::size_t n_group = 0, rows = 0;
    for (std::size_t i = first; i < outs.size(); ++i) {
      if (jobs[i].done || jobs[i].kind != kind) continue;
      jobs[i].done = true;
      jobs[i].args.act = act;
      jobs[i].first_row = rows;
      rows += static_cast<std::size_t>(jobs[i].args.n_rows);
      group[n_group++] = i;
    }
    pool.parallel_for(rows, kRowGrain, [&](std::size_t begin, std::size_t end, int) {
      for (std::size_t g = 0; g < n_group; ++g) {
        const Job& j = jobs[group[g]];
        const std::size_t lo = std::max(begin, j.first_row);
        const std::size_t hi = std::min(end, j.first_row + static_cast<std::size_t>(j.args.n_rows));
        if (lo >= hi) continue;
        GemmArgs a = j.args;
        const std::size_t r0 = lo - j.first_row;
        a.n_rows = static_cast<std::int64_t>(hi - lo);
        a.y += r0;
        constexpr std::size_t R = kPackedTileRows;
        if (j.packed_fn != nullptr && r0 % R == 0 && (hi - lo) % R == 0) {  // whole packed tiles
          a.w = j.packed + r0 * a.row_bytes;
          j.packed_fn(a);
        } else {
          a.w += r0 * a.row_bytes;
          j.fn(a);
        }
      }
    });
  }
}

}  // namespace qkvshare::kernels
