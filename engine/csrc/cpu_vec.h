// 16-lane fp32 vectors for pdserve's CPU kernels: AVX-512 intrinsics where the build
// machine has them (-march=native), a portable struct of 16 floats otherwise (same
// results up to FMA contraction, slower). Used by paged_attention.cpp and sampler.cpp.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_math.h"

namespace pdserve_cpu {

constexpr int kLanes = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(__AVX512F__)
using vec = __m512;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float vhmax(vec a) { return _mm512_reduce_max_ps(a); }
inline float vhsum(vec a) { return _mm512_reduce_add_ps(a); }
// lanes where `keep` is false become -inf
inline vec vmask_neginf(vec a, __mmask16 keep) {
  return _mm512_mask_blend_ps(keep, _mm512_set1_ps(kNegInf), a);
}
inline __mmask16 vle_int(const int32_t* a, const int32_t* b) {   // a[i] <= b[i]
  return _mm512_cmple_epi32_mask(_mm512_loadu_si512(a), _mm512_loadu_si512(b));
}
inline vec vsel_eq_neginf(vec m, float x) {                       // m == -inf ? x : m
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ), m,
                              _mm512_set1_ps(x));
}
// exp(x) with fast_exp's polynomial (cpu_math.h), 0 below -87.3 (so exp(-inf) = 0).
inline vec vexp(vec x) {
  const vec lo = _mm512_set1_ps(-87.3f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.8f));
  const vec t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const vec n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vec f = _mm512_sub_ps(t, n);
  vec p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}
// v[t] = sum of the 16 lanes of a[t], for 16 vectors: four levels of shuffles and adds
// that leave the sums in key order (lanes of 128-bit quarter q hold keys 4q .. 4q+3).
inline vec transpose_reduce(const vec* a) {
  vec b[8], c[4], w[2];
  for (int i = 0; i < 8; ++i)          // keys (2i, 2i+1) interleaved per quarter
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)          // keys 4i .. 4i+3 in order, per quarter
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)          // quarters summed pairwise
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                       _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#else
struct vec { float v[kLanes]; };
inline vec vload(const float* p) { vec r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void vstore(float* p, vec a) { std::memcpy(p, a.v, sizeof a.v); }
inline vec vset1(float x) { vec r; for (float& e : r.v) e = x; return r; }
inline vec vzero() { return vset1(0.f); }
#define PDSERVE_LANEWISE(name, expr) \
  inline vec name(vec a, vec b) { vec r; for (int l = 0; l < kLanes; ++l) r.v[l] = (expr); return r; }
PDSERVE_LANEWISE(vmul, a.v[l] * b.v[l])
PDSERVE_LANEWISE(vadd, a.v[l] + b.v[l])
PDSERVE_LANEWISE(vsub, a.v[l] - b.v[l])
PDSERVE_LANEWISE(vmax, a.v[l] > b.v[l] ? a.v[l] : b.v[l])
#undef PDSERVE_LANEWISE
inline vec vfma(vec a, vec b, vec c) {
  vec r; for (int l = 0; l < kLanes; ++l) r.v[l] = std::fma(a.v[l], b.v[l], c.v[l]); return r;
}
inline float vhmax(vec a) { float m = a.v[0]; for (float e : a.v) m = e > m ? e : m; return m; }
inline float vhsum(vec a) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) a.v[l] += a.v[l + w];
  return a.v[0];
}
using mask16 = uint32_t;
inline vec vmask_neginf(vec a, mask16 keep) {
  for (int l = 0; l < kLanes; ++l) if (!(keep >> l & 1)) a.v[l] = kNegInf;
  return a;
}
inline mask16 vle_int(const int32_t* a, const int32_t* b) {
  mask16 m = 0; for (int l = 0; l < kLanes; ++l) m |= static_cast<mask16>(a[l] <= b[l]) << l; return m;
}
inline vec vsel_eq_neginf(vec m, float x) {
  for (float& e : m.v) if (e == kNegInf) e = x; return m;
}
inline vec vexp(vec x) {
  vec r; for (int l = 0; l < kLanes; ++l) r.v[l] = x.v[l] < -87.3f ? 0.f : fast_exp(x.v[l]);
  return r;
}
inline vec transpose_reduce(const vec* a) {
  vec r; for (int t = 0; t < kLanes; ++t) r.v[t] = vhsum(a[t]); return r;
}
#endif

}  // namespace pdserve_cpu
