#pragma once
// Internal: the register-tiled GEMM loop shared by the SIMD levels. Include it
// only from ISA translation units: everything here has internal linkage, so
// each unit gets its own copy compiled with its own flags (kernel_table.hpp
// says why that matters).
//
// A format F describes one weight type at one ISA:
//   Acc                      accumulator register
//   W, X                     one step of weights / activations, in registers
//   steps(cols), tail(cols)  number of full steps, and whether a partial one follows
//   load_w(row, s, a), load_x(a, t, s)              step s of a weight row / token t
//   load_w_tail(row, s, a), load_x_tail(a, t, s)    the partial last step
//   mac(acc, w, x), reduce(acc)
// tile<F, R, T> keeps R rows x T tokens of accumulators in registers: each
// weight step is used T times, each activation step R times.
#include <cstddef>
#include <cstdint>
#include <new>

#include "kernel_table.hpp"

namespace qkvshare::kernels::detail {
namespace {

// acc[r][t] += step s of row r times step s of token t0 + t, for every step;
// then y = the sums. Weights come from Src: straight from the rows (decode,
// where each weight is used once) or from a buffer of decoded steps (prefill,
// where each is used by every token). Both run the same arithmetic in the
// same order, so a token's outputs do not depend on the batch around it.
template <class F, int R, int T, class Src>
void tile(const GemmArgs& a, const Src& src, std::int64_t r0, std::int64_t t0) {
  typename F::Acc acc[R][T];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[r][t] = F::zero();
  const std::int64_t n_steps = F::steps(a.cols);
  for (std::int64_t s = 0; s < n_steps; ++s) {
    typename F::W w[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) w[r] = src.template get<false>(r, s);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const typename F::X x = F::load_x(a, t0 + t, s);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) F::mac(acc[r][t], w[r], x);
    }
  }
  if (F::tail(a.cols)) {
    typename F::W w[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) w[r] = src.template get<true>(r, n_steps);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const typename F::X x = F::load_x_tail(a, t0 + t, n_steps);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) F::mac(acc[r][t], w[r], x);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) a.y[(t0 + t) * a.ldy + r0 + r] = F::reduce(acc[r][t]);
}

// Weights decoded from the rows as they are used.
template <class F, int R>
struct RowSource {
  const GemmArgs& a;
  const std::uint8_t* rows[R];
  RowSource(const GemmArgs& args, std::int64_t r0) : a(args) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) rows[r] = a.w + static_cast<std::size_t>(r0 + r) * a.row_bytes;
  }
  template <bool kTail>
  typename F::W get(int r, std::int64_t s) const {
    if constexpr (kTail)
      return F::load_w_tail(rows[r], s, a);
    else
      return F::load_w(rows[r], s, a);
  }
};

// Weights decoded once into buf[s * R + r] (the tail step last).
template <class F, int R>
struct BufferSource {
  const typename F::W* buf;
  template <bool>
  typename F::W get(int r, std::int64_t s) const {
    return buf[s * R + r];
  }
};

template <class F, int R>
void decode_rows(const GemmArgs& a, std::int64_t r0, typename F::W* buf) {
  const RowSource<F, R> src(a, r0);
  const std::int64_t n_steps = F::steps(a.cols);
  for (std::int64_t s = 0; s < n_steps; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) buf[s * R + r] = src.template get<false>(r, s);
  if (F::tail(a.cols))
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) buf[n_steps * R + r] = src.template get<true>(r, n_steps);
}

// This thread's buffer of decoded weight steps, grown on demand. Its type is
// local to the ISA unit, so each unit has its own.
template <class W>
W* step_buffer(std::size_t n) {
  struct Buffer {
    W* p = nullptr;
    std::size_t cap = 0;
    ~Buffer() { ::operator delete[](p, std::align_val_t(64)); }
  };
  thread_local Buffer b;
  if (b.cap < n) {
    ::operator delete[](b.p, std::align_val_t(64));
    b.p = static_cast<W*>(::operator new[](n * sizeof(W), std::align_val_t(64)));
    b.cap = n;
  }
  return b.p;
}

// Decoding streams every weight byte once from DRAM, where latency, not
// arithmetic, limits a core: ask for the rows kAheadRows past this tile
// before working on it, so that they arrive while it computes.
constexpr std::int64_t kAheadRows = 8;

inline void prefetch_rows(const GemmArgs& a, std::int64_t r0, std::int64_t n_rows) {
  if (r0 >= a.n_rows) return;
  const std::uint8_t* p = a.w + static_cast<std::size_t>(r0) * a.row_bytes;
  const std::int64_t rows = r0 + n_rows <= a.n_rows ? n_rows : a.n_rows - r0;
  const std::size_t bytes = static_cast<std::size_t>(rows) * a.row_bytes;
  for (std::size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Decode: R rows at a time straight from memory, each weight step used by
// all T tokens in registers (T > 1: several sessions decoding together).
template <class F, int R, int T>
void gemv_tokens(const GemmArgs& a) {
  std::int64_t r = 0;
  for (; r + R <= a.n_rows; r += R) {
    prefetch_rows(a, r + kAheadRows, R);
    tile<F, R, T>(a, RowSource<F, R>(a, r), r, 0);
  }
  for (; r < a.n_rows; ++r) tile<F, 1, T>(a, RowSource<F, 1>(a, r), r, 0);
}

template <class F, int R, int T>
void token_tiles(const GemmArgs& a, const typename F::W* buf, std::int64_t r0, std::int64_t t_begin,
                 std::int64_t t_end) {
  const BufferSource<F, R> src{buf};
  std::int64_t t = t_begin;
  for (; t + T <= t_end; t += T) tile<F, R, T>(a, src, r0, t);
  for (; t < t_end; ++t) tile<F, R, 1>(a, src, r0, t);
}

// Prefill: tokens go in chunks whose activations stay in L2; within a chunk,
// R rows at a time are decoded once and swept over all its tokens, T at a time.
template <class F, int R, int T>
void gemm_tiled(const GemmArgs& a) {
  switch (a.n_tokens) {
    case 1: return gemv_tokens<F, R, 1>(a);
    case 2: return gemv_tokens<F, R, 2>(a);
    case 3: return gemv_tokens<F, R, 3>(a);
    case 4: return gemv_tokens<F, R, 4>(a);
    default: break;
  }
  constexpr std::int64_t kTokenChunk = 64;
  const std::int64_t steps = F::steps(a.cols) + (F::tail(a.cols) ? 1 : 0);
  typename F::W* buf = step_buffer<typename F::W>(static_cast<std::size_t>(steps * R));
  for (std::int64_t tc = 0; tc < a.n_tokens; tc += kTokenChunk) {
    const std::int64_t tc_end = tc + kTokenChunk < a.n_tokens ? tc + kTokenChunk : a.n_tokens;
    std::int64_t r = 0;
    for (; r + R <= a.n_rows; r += R) {
      decode_rows<F, R>(a, r, buf);
      token_tiles<F, R, T>(a, buf, r, tc, tc_end);
    }
    for (; r < a.n_rows; ++r) {
      decode_rows<F, 1>(a, r, buf);
      token_tiles<F, 1, T>(a, buf, r, tc, tc_end);
    }
  }
}

}  // namespace
}  // namespace qkvshare::kernels::detail
