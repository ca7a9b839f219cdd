// Scalar helpers shared by pdserve's CPU kernels (paged_attention.cpp, fused_ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pdserve_cpu {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x): 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6
// polynomial (max relative error ~2e-7, about one float ulp); branch-free, so gcc
// vectorizes the loops that call it. Below -87 it returns exp(-87) (~1.6e-38) instead
// of a subnormal or 0; from 88.38 on it returns +inf (expf overflows at 88.72).
inline float fast_exp(float x) {
  x = x < -87.f ? -87.f : (x > 88.8f ? 88.8f : x);
  float t = x * 1.44269504088896341f;
  float n = std::nearbyint(t);
  float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace pdserve_cpu
