// CPU paged decode attention: one query token per sequence against its context, read
// in place from the paged KV cache through the block table (no gather, no padding).
//
//   q:            [batch, num_heads, head_dim]                    float32 | bfloat16
//   k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim] q's dtype
//   block_table:  [batch, max_blocks_per_seq] int32
//   context_lens: [batch] int32 (tokens, the new one included; >= 1)
//   returns       [batch, num_heads, head_dim], q's dtype
//
// Per sequence (one task of at::parallel_for): pass 1 reads each key once (all KV heads
// of a token are one contiguous row), scores -> softmax in fp32 -> pass 2 reads each
// value once and accumulates. GQA: query head h reads KV head h / (num_heads /
// num_kv_heads), as HF's repeat_kv lays them out. head_dim must be a multiple of 16
// (16 fp32 lanes: AVX-512 intrinsics where the build machine has them, a portable loop
// otherwise). Measurements of each step: docs/performance.md.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"

namespace {

using pdserve_cpu::fast_exp;
using pdserve_cpu::to_float;

constexpr int kLanes = 16;

// One token's K or V row (all KV heads) as fp32: in place for an fp32 cache, converted
// into `buf` for bf16.
inline const float* row_f32(const float* src, float*, int) { return src; }
inline const float* row_f32(const at::BFloat16* src, float* buf, int n) {
#if defined(__AVX512F__)
  for (int i = 0; i < n; i += kLanes) {   // bf16 -> fp32 is a 16-bit shift left
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(buf + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
#else
  for (int i = 0; i < n; ++i) buf[i] = to_float(src[i]);
#endif
  return buf;
}

// Rows are 12 cache lines apart in the token's block and blocks are scattered, so the
// hardware prefetcher loses the stream at every block boundary: fetch the row
// kPrefetchTokens ahead explicitly (the kernel was load-latency bound without it).
constexpr int kPrefetchTokens = 4;

template <typename T>
inline void prefetch_row(const T* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

#if defined(__AVX512F__)
// One FMA per 16 lanes and a shuffle-tree reduction: a sequential sum of 16 partial
// sums (the portable loop below) is a 16-add dependency chain per dot product, which
// made the kernel slower than gather + SDPA.
inline float dot(const float* a, const float* b, int n) {
  __m512 acc = _mm512_setzero_ps();
  for (int i = 0; i < n; i += kLanes)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}
#else
inline float dot(const float* a, const float* b, int n) {
  float acc[kLanes] = {0};
  for (int i = 0; i < n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int w = kLanes / 2; w > 0; w /= 2)     // tree, not a chain of 16 adds
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}
#endif

inline void axpy(float a, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}


template <typename T>
void decode_one(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                int ctx, int num_heads, int num_kv_heads, int head_dim, int block_size,
                float scale, T* out, std::vector<float>& scores, std::vector<float>& acc,
                std::vector<float>& row) {
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  scores.resize(static_cast<size_t>(num_heads) * ctx);
  acc.assign(static_cast<size_t>(num_heads) * head_dim, 0.f);
  row.resize(static_cast<size_t>(num_heads) * head_dim + token_stride + num_heads);
  float* qf = row.data();                  // [num_heads * head_dim] scaled query
  float* kv = row.data() + num_heads * head_dim;  // one token's K or V row, as fp32 (bf16)
  for (int i = 0; i < num_heads * head_dim; ++i) qf[i] = to_float(q[i]) * scale;

  auto slot_of = [&](int t) {
    return static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
  };
  const int64_t row_bytes = token_stride * static_cast<int64_t>(sizeof(T));
  for (int t = 0; t < ctx; ++t) {          // pass 1: scores[h][t] = q_h . k_t
    if (t + kPrefetchTokens < ctx)
      prefetch_row(k_cache + slot_of(t + kPrefetchTokens) * token_stride, row_bytes);
    const float* k = row_f32(k_cache + slot_of(t) * token_stride, kv, static_cast<int>(token_stride));
    for (int h = 0; h < num_heads; ++h)
      scores[static_cast<size_t>(h) * ctx + t] =
          dot(qf + h * head_dim, k + (h / group) * head_dim, head_dim);
  }
  float* inv_sum = row.data() + num_heads * head_dim + token_stride;   // [num_heads]
  for (int h = 0; h < num_heads; ++h) {    // softmax over t, in place
    float* s = scores.data() + static_cast<size_t>(h) * ctx;
    float m = s[0];
    for (int t = 1; t < ctx; ++t) m = s[t] > m ? s[t] : m;
    float sum = 0.f;
    for (int t = 0; t < ctx; ++t) {
      s[t] = fast_exp(s[t] - m);
      sum += s[t];
    }
    inv_sum[h] = 1.f / sum;
  }
  for (int t = 0; t < ctx; ++t) {          // pass 2: acc[h] += p[h][t] * v_t
    if (t + kPrefetchTokens < ctx)
      prefetch_row(v_cache + slot_of(t + kPrefetchTokens) * token_stride, row_bytes);
    const float* v = row_f32(v_cache + slot_of(t) * token_stride, kv, static_cast<int>(token_stride));
    for (int h = 0; h < num_heads; ++h)
      axpy(scores[static_cast<size_t>(h) * ctx + t], v + (h / group) * head_dim,
           acc.data() + h * head_dim, head_dim);
  }
  for (int h = 0; h < num_heads; ++h)
    for (int i = 0; i < head_dim; ++i)
      out[h * head_dim + i] = static_cast<T>(acc[h * head_dim + i] * inv_sum[h]);
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_table, const int32_t* ctx, torch::Tensor& out, int batch,
         int num_heads, int num_kv_heads, int head_dim, int block_size, int table_width,
         double scale) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = block_table.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t q_stride = static_cast<int64_t>(num_heads) * head_dim;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, row;   // per thread, reused across its sequences
    for (int64_t b = begin; b < end; ++b)
      decode_one<T>(qp + b * q_stride, kp, vp, tp + b * table_width, ctx[b], num_heads,
                    num_kv_heads, head_dim, block_size, static_cast<float>(scale),
                    op + b * q_stride, scores, acc, row);
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_table,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [batch, heads, head_dim] and the caches [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32,
              "block_table and context_lens must be int32");
  q = q.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  block_table = block_table.contiguous();
  context_lens = context_lens.contiguous();
  const int batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && head_dim % kLanes == 0,
              "head_dim must match the cache's and be a multiple of 16");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const int table_width = block_table.size(1);
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  for (int b = 0; b < batch; ++b)
    TORCH_CHECK(ctx[b] >= 1 && (ctx[b] + block_size - 1) / block_size <= table_width,
                "context_lens[", b, "]=", ctx[b], " is not covered by its block_table row");
  auto out = torch::empty_like(q);
  AT_DISPATCH_SWITCH(q.scalar_type(), "paged_decode_attention",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        run<scalar_t>(q, k_cache, v_cache, block_table, ctx, out, batch, num_heads,
                      num_kv_heads, head_dim, block_size, table_width, scale);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        run<scalar_t>(q, k_cache, v_cache, block_table, ctx, out, batch, num_heads,
                      num_kv_heads, head_dim, block_size, table_width, scale);
      }));
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
