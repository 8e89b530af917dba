#pragma once
// Internal: the one vector exp, written once over the vector-width trait of
// vec.hpp and used by every SIMD level (softmax, SwiGLU, the KV scores'
// exp_sum) and by GeGLU. Include it only from ISA units, after vec.hpp.
#include <cstdint>
#include <cstring>

#include "vec.hpp"

namespace qkvshare::kernels::detail {
namespace {

// A product kept rounded on its own. GCC contracts a vector multiply and the
// add that follows into one FMA when the unit's ISA has one (the intrinsics
// are plain vector arithmetic to it); the range search (kv_tiles.hpp) and
// GeGLU must round each step as their references do, so their products pass
// through this empty asm, which the compiler cannot see into.
template <class F>
inline F unfused(F v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
  return v;
}

// exp(x) within 2 ulp (Cephes' expf polynomial after a Cody-Waite range
// reduction). The input is clamped to [-104, 89] and 2^n is applied as
// 2^(n/2) * 2^(n - n/2), two normal floats for every n in [-150, 128], so
// results underflow to 0 (-inf gives 0) and overflow to inf as expf does.
template <class V>
inline typename V::F vexp(typename V::F x) {
  x = V::min(V::max(x, V::set1(-104.0f)), V::set1(89.0f));
  const typename V::F n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  typename V::F r = V::fmadd(n, V::set1(-0.693359375f), x);
  r = V::fmadd(n, V::set1(2.12194440e-4f), r);
  typename V::F p = V::set1(1.9875691500e-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
  const typename V::F y = V::add(V::fmadd(p, V::mul(r, r), r), V::set1(1.0f));
  const typename V::I ni = V::to_int(n);
  const typename V::I n1 = V::half(ni);
  return V::mul(V::mul(y, V::pow2i(n1)), V::pow2i(V::isub(ni, n1)));
}

// gate = gelu(gate) * up, GELU in its tanh form (Gemma's GeGLU), written as
// g / (1 + exp(-2y)) with y = sqrt(2/pi) * (g + 0.044715 g^3): the same value
// as 0.5 g (1 + tanh(y)) without its cancellation for negative g. The products
// are not fused, so every level computes y as gelu_mul_ref does.
template <class V>
inline typename V::F vgelu(typename V::F g) {
  const typename V::F g3 = V::mul(V::mul(g, g), g);
  const typename V::F y = V::mul(V::set1(0.7978845608028654f), V::add(g, unfused(V::mul(V::set1(0.044715f), g3))));
  const typename V::F e = vexp<V>(V::mul(V::set1(-2.0f), y));
  return V::div(g, V::add(V::set1(1.0f), e));
}

template <class V>
inline void gelu_mul_rows(float* gate, const float* up, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + V::N <= n; i += V::N) V::storeu(gate + i, V::mul(vgelu<V>(V::loadu(gate + i)), V::loadu(up + i)));
  if (i == n) return;
  float g[V::N] = {}, u[V::N] = {};
  const auto rest = static_cast<std::size_t>(n - i) * sizeof(float);
  std::memcpy(g, gate + i, rest);
  std::memcpy(u, up + i, rest);
  V::storeu(g, V::mul(vgelu<V>(V::loadu(g)), V::loadu(u)));
  std::memcpy(gate + i, g, rest);
}

}  // namespace
}  // namespace qkvshare::kernels::detail
