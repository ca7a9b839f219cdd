// CPU fused elementwise ops of the decoder layer, each one pass over its rows where
// torch's eager ops take four to eight (measured in docs/performance.md). Same
// arithmetic as transformers' Llama modules, in the same order and with the same
// roundings, so fp32 results match HF's to the ulp (only the exp in SiLU and the order of
// the RMS sum differ):
//
//   rms_norm(x, w, eps) -> out              out = w * (x * rsqrt(mean(x^2) + eps))
//   fused_add_rms_norm(x!, residual!, w, eps)  residual = x + residual; x = rms_norm(residual)
//   rotary_embedding(q!, k!, positions, cos, sin)  x = x * cos + rotate_half(x) * sin,
//                                           in place, on q [T, Hq, D] and k [T, Hk, D]
//   silu_and_mul(gate_up) -> out            gate_up [T, 2I] = [gate | up]; out = silu(gate) * up
//
// float32 or bfloat16 tensors; in bf16 every intermediate that torch rounds to bf16 is
// rounded here too (the norm runs in fp32, as LlamaRMSNorm does). Rows are split over
// threads with at::parallel_for. Built with -ffp-contract=off semantics per function:
// a fused multiply-add would skip the rounding torch does between the multiply and add.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

namespace {

using pdserve_cpu::fast_exp;
using pdserve_cpu::to_float;

template <typename T> inline float round_to(float x) { return to_float(static_cast<T>(x)); }

// fn(T{}) with T the C++ type of `dtype`: float or at::BFloat16; any other dtype fails.
template <typename Fn>
void dispatch_fp32_bf16(at::ScalarType dtype, const char* op, Fn&& fn) {
  if (dtype == at::kFloat)
    fn(float{});
  else if (dtype == at::kBFloat16)
    fn(at::BFloat16{});
  else
    TORCH_CHECK(false, op, ": float32 or bfloat16 tensors only, got ", dtype);
}

template <typename T>
__attribute__((optimize("fp-contract=off")))
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  constexpr int kLanes = 16;
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      float v = to_float(x[i + l]);
      part[l] += v * v;
    }
  float ss = 0.f;
  for (; i < n; ++i) ss += to_float(x[i]) * to_float(x[i]);
  for (int l = 0; l < kLanes; ++l) ss += part[l];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j)   // (x * r).to(dtype), then weight * that (in dtype)
    out[j] = static_cast<T>(to_float(w[j]) * round_to<T>(to_float(x[j]) * r));
}

template <typename T>
__attribute__((optimize("fp-contract=off")))
void add_row(T* x, T* residual, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    residual[j] = static_cast<T>(to_float(x[j]) + to_float(residual[j]));
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1,
              "rms_norm: x must be a contiguous CPU tensor");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1),
              "rms_norm: weight must be [hidden] in x's dtype");
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / n;
  dispatch_fp32_bf16(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T *xp = x.data_ptr<T>(), *wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_row(xp + r * n, wp, op + r * n, n, eps);
    });
  });
  return out;
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                        double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && residual.is_contiguous() &&
                  x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "fused_add_rms_norm: x and residual must be contiguous CPU tensors of one shape "
              "and dtype");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1),
              "fused_add_rms_norm: weight must be [hidden] in x's dtype");
  weight = weight.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  dispatch_fp32_bf16(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    T *xp = x.data_ptr<T>(), *rp = residual.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        add_row(xp + r * n, rp + r * n, n);
        rms_row(rp + r * n, wp, xp + r * n, n, eps);
      }
    });
  });
}

// One head's row in place: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
// cos/sin rows are rounded to T first (the Python path casts the tables to q's dtype).
template <typename T>
__attribute__((optimize("fp-contract=off")))
void rope_head(T* x, const float* cos, const float* sin, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + h]);
    const float a1 = round_to<T>(x1 * round_to<T>(cos[i]));
    const float b1 = round_to<T>(-x2 * round_to<T>(sin[i]));
    const float a2 = round_to<T>(x2 * round_to<T>(cos[i + h]));
    const float b2 = round_to<T>(x1 * round_to<T>(sin[i + h]));
    x[i] = static_cast<T>(a1 + b1);
    x[i + h] = static_cast<T>(a2 + b2);
  }
}

template <typename T>
void rope_run(torch::Tensor& q, torch::Tensor& k, const int64_t* pos, const float* cos,
              const float* sin) {
  const int64_t tokens = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2);
  const int64_t qs = q.stride(0), ks = k.stride(0);
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  at::parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cos + pos[t] * d;
      const float* s = sin + pos[t] * d;
      for (int64_t j = 0; j < hq; ++j) rope_head(qp + t * qs + j * d, c, s, d);
      for (int64_t j = 0; j < hk; ++j) rope_head(kp + t * ks + j * d, c, s, d);
    }
  });
}

void rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor positions,
                      torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2) && q.scalar_type() == k.scalar_type(),
              "rotary_embedding: q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] "
              "on CPU, one dtype");
  const int64_t d = q.size(2);
  TORCH_CHECK(d % 2 == 0 && q.stride(2) == 1 && q.stride(1) == d && k.stride(2) == 1 &&
                  k.stride(1) == d,
              "rotary_embedding: each token's heads must be contiguous (rows may be strided)");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) == d && sin.sizes() == cos.sizes(),
              "rotary_embedding: cos and sin must be contiguous float32 [max_len, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == q.size(0),
              "rotary_embedding: positions must be int64 [tokens]");
  positions = positions.contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_embedding: positions[", t,
                "]=", pos[t], " is outside the table's ", cos.size(0), " positions");
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  dispatch_fp32_bf16(q.scalar_type(), "rotary_embedding", [&](auto tag) {
    rope_run<decltype(tag)>(q, k, pos, cp, sp);
  });
}

// silu(g) = g / (1 + exp(-g)), torch's formula (a gate below about -88.7 gives -0,
// exp(-g) being +inf, as in torch); only exp's last-ulp rounding differs.
template <typename T>
__attribute__((optimize("fp-contract=off")))
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float g = to_float(gate[j]);
    const float s = g / (1.f + fast_exp(-g));
    out[j] = static_cast<T>(round_to<T>(s) * to_float(up[j]));
  }
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be a CPU [tokens, 2 * intermediate] tensor");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  dispatch_fp32_bf16(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_mul_row(gp + r * 2 * n, gp + r * 2 * n + n, op + r * n, n);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, "
        "Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
