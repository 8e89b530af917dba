#pragma once
// Internal: the one vector exp, written once over the vector-width trait of
// vec.hpp and used by every SIMD level (softmax, SwiGLU, the KV scores'
// exp_sum). Include it only from ISA units, after vec.hpp.
#include "vec.hpp"

namespace qkvshare::kernels::detail {
namespace {

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

}  // namespace
}  // namespace qkvshare::kernels::detail
