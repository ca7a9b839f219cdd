// CPU sampling of one token per row by inverse CDF, one uniform draw per row (what
// torch.multinomial does for one sample), without materializing the softmax or its
// cumulative sum:
//
//   sample_from_logits(logits [n, vocab] fp32, temperatures [n] fp32, uniforms [n] fp64)
//       -> [n] int64
//
// Row i: x = logits[i] / temperatures[i]; p_j proportional to exp(x_j - max x) (fp32
// terms, sums in float64 across chunks of 256 tokens); the pick is the first token whose
// cumulative sum exceeds uniforms[i] * total. Logits of -inf (top-k / top-p filtered)
// have probability 0 and are never picked. A row whose total is not a positive finite
// number (NaN or all -inf logits) gets its argmax, so the result is always a valid id.
// Three passes over a row (max; exp and chunk sums; the chosen chunk again) where
// softmax + float64 cumsum + searchsorted take five and a float64 copy of the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace pdserve_cpu;

constexpr int64_t kChunk = 256;   // tokens per partial sum (16 vectors)

int64_t argmax_row(const float* x, int64_t vocab) {
  int64_t best = 0;
  for (int64_t j = 1; j < vocab; ++j)
    if (x[j] > x[best] || (std::isnan(x[j]) && !std::isnan(x[best]))) best = j;
  return best;
}

int64_t sample_row(const float* logits, int64_t vocab, float temperature, double u,
                   std::vector<double>& chunk_sums) {
  const float inv_t = 1.f / temperature;
  const int64_t full = vocab / kLanes * kLanes;
  vec m = vset1(kNegInf);
  for (int64_t j = 0; j < full; j += kLanes) m = vmax(m, vload(logits + j));
  float mx = vhmax(m);
  for (int64_t j = full; j < vocab; ++j) mx = logits[j] > mx ? logits[j] : mx;
  if (!std::isfinite(mx)) return argmax_row(logits, vocab);   // NaN, +inf, or all -inf
  const vec scale = vset1(inv_t), shift = vset1(mx * inv_t);
  // the terms exp(x_j - max x) of tokens [lo, hi), hi - lo <= kChunk, into `terms`
  // (vectors where 16 tokens remain, the same vexp for the tail, padded with -inf)
  float terms[kChunk];
  auto chunk_terms = [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; j += kLanes) {
      float x[kLanes];
      const int64_t n = std::min<int64_t>(kLanes, hi - j);
      for (int64_t l = 0; l < kLanes; ++l) x[l] = l < n ? logits[j + l] : kNegInf;
      vstore(terms + (j - lo), vexp(vsub(vmul(vload(x), scale), shift)));
    }
  };
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  chunk_sums.resize(chunks);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(vocab, lo + kChunk);
    float s;
    if (hi - lo == kChunk) {
      vec acc = vzero();
      for (int64_t j = lo; j < hi; j += kLanes)
        acc = vadd(acc, vexp(vsub(vmul(vload(logits + j), scale), shift)));
      s = vhsum(acc);
    } else {
      chunk_terms(lo, hi);
      s = 0.f;
      for (int64_t j = 0; j < hi - lo; ++j) s += terms[j];
    }
    chunk_sums[c] = s;
    total += s;
  }
  if (!(total > 0.0) || !std::isfinite(total)) return argmax_row(logits, vocab);
  const double target = u * total;
  double cum = 0.0;
  int64_t last_positive = -1;
  for (int64_t c = 0; c < chunks; ++c) {
    if (!(chunk_sums[c] > 0.0)) continue;
    const int64_t lo = c * kChunk, hi = std::min(vocab, lo + kChunk);
    if (cum + chunk_sums[c] <= target && c < chunks - 1) {
      cum += chunk_sums[c];
      last_positive = -2 - c;      // some token of chunk c can be picked: found if needed
      continue;
    }
    chunk_terms(lo, hi);           // the chunk the target falls in: its tokens in order
    for (int64_t j = 0; j < hi - lo; ++j) {
      if (terms[j] > 0.f) {
        last_positive = lo + j;
        cum += terms[j];
        if (cum > target) return lo + j;
      }
    }
    // rounding left the target past this chunk's terms: the next chunks decide
  }
  if (last_positive <= -2) {       // the last chunk with mass, skipped whole above
    const int64_t c = -2 - last_positive, lo = c * kChunk, hi = std::min(vocab, lo + kChunk);
    chunk_terms(lo, hi);
    for (int64_t j = hi - lo - 1; j >= 0; --j)
      if (terms[j] > 0.f) return lo + j;
  }
  return last_positive >= 0 ? last_positive : argmax_row(logits, vocab);
}

torch::Tensor sample_from_logits(torch::Tensor logits, torch::Tensor temperatures,
                                 torch::Tensor uniforms) {
  const char* op = "sample_from_logits";
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              op, ": logits must be a CPU float32 [rows, vocab] tensor");
  const int64_t n = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && temperatures.numel() == n, op,
              ": temperatures must be float32 [rows]");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.numel() == n, op,
              ": uniforms must be float64 [rows]");
  TORCH_CHECK(vocab > 0, op, ": empty vocabulary");
  logits = logits.contiguous();
  temperatures = temperatures.contiguous();
  uniforms = uniforms.contiguous();
  const float* lp = logits.data_ptr<float>();
  const float* tp = temperatures.data_ptr<float>();
  const double* up = uniforms.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(tp[i] > 0.f && std::isfinite(tp[i]), op, ": temperatures[", i, "]=", tp[i],
                " must be a positive finite number");
    TORCH_CHECK(up[i] >= 0.0 && up[i] < 1.0, op, ": uniforms[", i, "]=", up[i],
                " must be in [0, 1)");
  }
  auto out = torch::empty({n}, torch::dtype(torch::kLong));
  int64_t* op_ = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    std::vector<double> chunk_sums;
    for (int64_t i = b; i < e; ++i)
      op_[i] = sample_row(lp + i * vocab, vocab, tp[i], up[i], chunk_sums);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("sample_from_logits(Tensor logits, Tensor temperatures, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("sample_from_logits", &sample_from_logits);
}
