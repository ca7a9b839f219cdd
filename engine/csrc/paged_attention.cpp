// CPU paged attention, read in place from the KV cache through the block table (no
// gather, no padding), and the KV write that fills that cache.
//
//   k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]   float32 | bfloat16
//       A block's K (or V) of one KV head is one contiguous [block_size, head_dim] tile;
//       a range of KV heads of a block is one contiguous region (tensor-parallel ranks
//       send and receive head ranges).
//
// paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale)
//   q:            [num_tokens, num_heads, head_dim]  the new tokens of every sequence, flat
//   block_table:  [batch, max_blocks] int32
//   cu_seqlens_q: [batch + 1] int32   sequence b's new tokens are q rows cu[b] .. cu[b+1]-1
//   seq_lens_k:   [batch] int32       sequence b's context, its new tokens included: new
//                                     token i sits at position seq_lens_k[b] - n_b + i and
//                                     sees keys 0 .. that position (causal, aligned
//                                     bottom-right as flash-attn's varlen with a KV cache)
//   returns       [num_tokens, num_heads, head_dim], q's dtype
// paged_decode_attention(q, k_cache, v_cache, block_table, context_lens, scale)
//   the same with one new token per sequence (q [batch, num_heads, head_dim]).
// reshape_and_cache(k, v, k_cache!, v_cache!, slot_mapping)
//   k, v [num_tokens, num_kv_heads, head_dim]; token t's rows go to block
//   slot_mapping[t] // block_size, offset slot_mapping[t] % block_size; -1 is skipped.
//
// GQA: query head h reads KV head h / (num_heads / num_kv_heads), as HF's repeat_kv lays
// them out. Scores, softmax and the weighted sum of V are fp32 (bf16 K/V widened exactly).
// Two ways to vectorize, picked per sequence:
//   decode (one new token): lanes over 16 keys. Each (query head, key) dot product is
//     head_dim/16 FMAs into a vector of partial sums; the 16 vectors of 16 keys are summed
//     lane-wise by a transpose-reduce (45 shuffles and adds for 16 scores, against ~8 per
//     score for a horizontal add). Two passes: scores of the whole context, softmax, then
//     V weighted by the probabilities with the g heads' accumulators in registers.
//   prefill (several new tokens): lanes over query rows (token, head of the group), 32
//     rows (two vectors) a tile, FlashAttention's tiling and online softmax (Dao et al.
//     2022; Milakov & Gimelshein 2018): per 16 keys, S^T = K Q^T by broadcast FMAs (no
//     horizontal operation at all), causal mask, running max and sum per lane,
//     O^T += V^T P^T.
// Work items ((sequence, KV head) for decode, (sequence, KV head, 32 query rows) for
// prefill) are taken from a shared counter by each thread, most expensive first.
// head_dim must be a multiple of 16 and block_size a multiple of 16. Measurements:
// docs/performance.md.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"
#include "cpu_vec.h"

namespace {

using namespace pdserve_cpu;

// Tiles of one KV head are 4 KiB (fp32) apart from the next at random places: the
// hardware prefetcher does not follow, and fetching one tile ahead leaves the kernel
// waiting on DRAM (14 GB/s). Three tiles ahead measured best (24 GB/s; 2: 21, 4-6: 20-26).
constexpr int kPrefetchTiles = 3;

// ---- rows as fp32: an fp32 cache is read in place, bf16 is widened into a buffer.
inline const float* rows_f32(const float* src, float*, int64_t) { return src; }
inline const float* rows_f32(const at::BFloat16* src, float* buf, int64_t n) {
#if defined(__AVX512F__)
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {     // bf16 -> fp32 is a 16-bit shift left
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(buf + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) buf[i] = to_float(src[i]);
#else
  for (int64_t i = 0; i < n; ++i) buf[i] = to_float(src[i]);
#endif
  return buf;
}

template <typename T>
inline void prefetch(const T* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

struct Shape {
  int num_heads, num_kv_heads, head_dim, block_size, table_width, group;
  float scale;
  int64_t q_stride;      // elements between tokens of q and out
  int64_t tile;          // elements of one (block, KV head) tile: block_size * head_dim
};

// Per-thread scratch, grown as needed and reused across the items a thread takes.
struct Scratch {
  std::vector<float> a, b, c, d, e, f, g, h;
  static float* get(std::vector<float>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};

// ---- decode: one query token, its g heads of KV head `kvh`, lanes over keys.
template <typename T, int DV>   // DV = head_dim / 16
void decode_item(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                 int ctx, int kvh, const Shape& s, T* out, Scratch& sc) {
  constexpr int D = DV * kLanes;
  const int g = s.group;
  const int padded = (ctx + kLanes - 1) / kLanes * kLanes;
  float* qf = Scratch::get(sc.a, static_cast<size_t>(g) * D);          // [g, D] scaled
  float* scores = Scratch::get(sc.b, static_cast<size_t>(g) * padded); // [g, padded]
  float* buf = Scratch::get(sc.c, static_cast<size_t>(kLanes) * D);    // bf16 rows widened
  for (int j = 0; j < g; ++j) {
    const T* qh = q + static_cast<int64_t>(kvh * g + j) * D;
    for (int i = 0; i < D; ++i) qf[j * D + i] = to_float(qh[i]) * s.scale;
  }
  auto tile_of = [&](const T* cache, int blk) {
    return cache + (static_cast<int64_t>(table[blk]) * s.num_kv_heads + kvh) * s.tile;
  };
  const int64_t tile_bytes = s.tile * static_cast<int64_t>(sizeof(T));
  // pass 1: scores[j][t] = q_j . k_t over 16 keys at a time
  const int num_blocks = (ctx + s.block_size - 1) / s.block_size;
  for (int blk = 0; blk < num_blocks; ++blk) {
    const T* kt = tile_of(k_cache, blk);
    if (blk == 0)
      for (int a = 1; a < kPrefetchTiles && a < num_blocks; ++a) prefetch(tile_of(k_cache, a), tile_bytes);
    const int ahead = blk + kPrefetchTiles;      // past the last K tile: the first V tiles
    if (ahead < num_blocks) prefetch(tile_of(k_cache, ahead), tile_bytes);
    else if (ahead - num_blocks < num_blocks) prefetch(tile_of(v_cache, ahead - num_blocks), tile_bytes);
    for (int sub = 0; sub < s.block_size; sub += kLanes) {
      const int key0 = blk * s.block_size + sub;
      if (key0 >= ctx) break;
      const float* k = rows_f32(kt + static_cast<int64_t>(sub) * D, buf, static_cast<int64_t>(kLanes) * D);
      for (int j = 0; j < g; ++j) {
        vec qv[DV];
        for (int c = 0; c < DV; ++c) qv[c] = vload(qf + j * D + c * kLanes);
        vec part[kLanes];
        for (int t = 0; t < kLanes; ++t) {
          vec acc = vmul(qv[0], vload(k + t * D));
          for (int c = 1; c < DV; ++c) acc = vfma(qv[c], vload(k + t * D + c * kLanes), acc);
          part[t] = acc;
        }
        vstore(scores + static_cast<size_t>(j) * padded + key0, transpose_reduce(part));
      }
    }
  }
  // softmax over the ctx valid keys of each head (lanes past ctx are -inf)
  std::vector<float>& inv = sc.d;
  inv.resize(g);
  for (int j = 0; j < g; ++j) {
    float* sj = scores + static_cast<size_t>(j) * padded;
    for (int t = ctx; t < padded; ++t) sj[t] = kNegInf;
    vec m = vload(sj);
    for (int t = kLanes; t < padded; t += kLanes) m = vmax(m, vload(sj + t));
    const vec mx = vset1(vhmax(m));
    vec sum = vzero();
    for (int t = 0; t < padded; t += kLanes) {
      const vec p = vexp(vsub(vload(sj + t), mx));
      vstore(sj + t, p);
      sum = vadd(sum, p);
    }
    inv[j] = 1.f / vhsum(sum);
  }
  // pass 2: out_j = sum_t p_j[t] v_t, heads in chunks whose accumulators fit registers
  // (a variant reading all KV heads of a block as one run, with the accumulators kept
  // in memory between blocks, measured 1.3-2x slower)
  constexpr int kRows = DV >= 16 ? 1 : 16 / DV;
  for (int j0 = 0; j0 < g; j0 += kRows) {
    const int rows = std::min(kRows, g - j0);
    vec acc[kRows][DV];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < DV; ++c) acc[r][c] = vzero();
    for (int blk = 0; blk < num_blocks; ++blk) {
      const T* vt = tile_of(v_cache, blk);
      if (j0 == 0 && blk + kPrefetchTiles < num_blocks)
        prefetch(tile_of(v_cache, blk + kPrefetchTiles), tile_bytes);
      for (int sub = 0; sub < s.block_size; sub += kLanes) {
        const int key0 = blk * s.block_size + sub;
        if (key0 >= ctx) break;
        const int nk = std::min(kLanes, ctx - key0);
        const float* v = rows_f32(vt + static_cast<int64_t>(sub) * D, buf, static_cast<int64_t>(nk) * D);
        for (int t = 0; t < nk; ++t) {
          vec vv[DV];
          for (int c = 0; c < DV; ++c) vv[c] = vload(v + t * D + c * kLanes);
          for (int r = 0; r < kRows; ++r) {
            if (r >= rows) break;
            const vec p = vset1(scores[static_cast<size_t>(j0 + r) * padded + key0 + t]);
            for (int c = 0; c < DV; ++c) acc[r][c] = vfma(p, vv[c], acc[r][c]);
          }
        }
      }
    }
    for (int r = 0; r < rows; ++r) {
      T* o = out + static_cast<int64_t>(kvh * g + j0 + r) * D;
      const vec f = vset1(inv[j0 + r]);
      float tmp[kLanes];
      for (int c = 0; c < DV; ++c) {
        vstore(tmp, vmul(acc[r][c], f));
        for (int l = 0; l < kLanes; ++l) o[c * kLanes + l] = static_cast<T>(tmp[l]);
      }
    }
  }
}

// ---- prefill: 32 query rows (row = token * g + head of the group) of one sequence and
// ---- KV head, two vectors of 16 lanes over rows, online softmax over tiles of 16 keys.
// Each K (V) element broadcast feeds both row vectors, and with head_dim a compile-time
// constant the 16 key rows are immediate offsets from one pointer: the first version (16
// rows, runtime head_dim) spent its time reloading row pointers and ran at ~140 GFLOP/s.
constexpr int kPrefillRows = 2 * kLanes;

template <typename T, int DV>   // DV = head_dim / 16
void prefill_item(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                  int ctx, int n_new, int row0, int kvh, const Shape& s, T* out, Scratch& sc) {
  constexpr int D = DV * kLanes, R = kPrefillRows;
  const int g = s.group;
  const int rows = std::min(R, n_new * g - row0);
  float* qt = Scratch::get(sc.a, static_cast<size_t>(D) * R);        // Q^T [D, 32] scaled
  float* ot = Scratch::get(sc.b, static_cast<size_t>(D) * R);        // O^T [D, 32]
  float* pt = Scratch::get(sc.c, static_cast<size_t>(kLanes) * R);   // P^T [16 keys, 32]
  float* kbuf = Scratch::get(sc.d, static_cast<size_t>(kLanes) * D); // bf16 widened
  float* vbuf = Scratch::get(sc.e, static_cast<size_t>(kLanes) * D);
#if defined(__AVX512BF16__)
  // bf16: S = K Q^T by vdpbf16ps (two bf16 products a lane, summed in fp32) straight
  // from the cache, the scale applied to S: Q^T as pairs of head dims [D/2, 32 rows]
  // (V pairs are built 32 dims at a time: head_dim 16, 48, ... take the fp32 path)
  constexpr bool kDot = std::is_same_v<T, at::BFloat16> && D % 32 == 0;
  uint32_t* qt2 = kDot ? reinterpret_cast<uint32_t*>(Scratch::get(sc.f, static_cast<size_t>(D / 2) * R))
                       : nullptr;
  // ... and O^T += V^T P^T the same way: P^T as bf16 pairs of keys [8, 32 rows] (P is
  // rounded to bf16 there, as torch's bf16 flash attention rounds it), V's 16 keys as
  // pairs [8, D] interleaved per 128-bit quarter (vpunpck*wd), `vpair_at` finding a dim
  uint32_t* pt2 = kDot ? reinterpret_cast<uint32_t*>(Scratch::get(sc.g, static_cast<size_t>(8) * R))
                       : nullptr;
  uint32_t* vp = kDot ? reinterpret_cast<uint32_t*>(Scratch::get(sc.h, static_cast<size_t>(8) * D))
                      : nullptr;
#else
  constexpr bool kDot = false;
#endif
  alignas(64) int32_t pos[R];
  const int first_pos = ctx - n_new;   // position of the sequence's first new token
  int max_pos = 0, min_pos = std::numeric_limits<int>::max();
  for (int r = 0; r < R; ++r) {
    if (r < rows) {
      const int row = row0 + r, tok = row / g, head = kvh * g + row % g;
      pos[r] = first_pos + tok;
      const T* qh = q + tok * s.q_stride + static_cast<int64_t>(head) * D;
      for (int d = 0; d < D; ++d) qt[d * R + r] = to_float(qh[d]) * s.scale;
#if defined(__AVX512BF16__)
      if constexpr (kDot) {
        const auto* qb = reinterpret_cast<const uint16_t*>(qh);
        for (int j = 0; j < D / 2; ++j) qt2[j * R + r] = qb[2 * j] | (uint32_t{qb[2 * j + 1]} << 16);
      }
#endif
      max_pos = std::max(max_pos, pos[r]);
      min_pos = std::min(min_pos, pos[r]);
    } else {                          // padding lanes: zero query, every key masked
      pos[r] = -1;
      for (int d = 0; d < D; ++d) qt[d * R + r] = 0.f;
#if defined(__AVX512BF16__)
      if constexpr (kDot)
        for (int j = 0; j < D / 2; ++j) qt2[j * R + r] = 0;
#endif
    }
  }
  std::fill(ot, ot + static_cast<size_t>(D) * R, 0.f);
  vec m[2] = {vset1(kNegInf), vset1(kNegInf)}, l[2] = {vzero(), vzero()};
  const int64_t tile_bytes = s.tile * static_cast<int64_t>(sizeof(T));
  const int num_keys = max_pos + 1;
  const bool second = rows > kLanes;   // the second row vector holds rows
  for (int key0 = 0; key0 < num_keys; key0 += kLanes) {
    const int blk = key0 / s.block_size, sub = key0 % s.block_size;
    const int64_t tile = (static_cast<int64_t>(table[blk]) * s.num_kv_heads + kvh) * s.tile;
    if (sub == 0 && key0 + s.block_size < num_keys) {
      const int64_t next = (static_cast<int64_t>(table[blk + 1]) * s.num_kv_heads + kvh) * s.tile;
      prefetch(k_cache + next, tile_bytes);
      prefetch(v_cache + next, tile_bytes);
    }
    const int nk = std::min(kLanes, num_keys - key0);
    vec st[kLanes][2];                 // st[t][v] lane r: score of row 16 v + r, key key0 + t
#if defined(__AVX512BF16__)
    if constexpr (kDot) {
      const auto* kp = reinterpret_cast<const uint32_t*>(k_cache + tile + static_cast<int64_t>(sub) * D);
      const vec sc_v = vset1(s.scale);
      for (int h = 0; h < kLanes; h += 8) {
        vec acc[8][2];
        for (int t = 0; t < 8; ++t) acc[t][0] = acc[t][1] = vzero();
        if (h < nk) {
          for (int j = 0; j < D / 2; ++j) {
            const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qt2 + j * R);
            const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qt2 + j * R + kLanes);
            for (int t = 0; t < 8; ++t) {
              const __m512bh kb = (__m512bh)_mm512_set1_epi32(kp[(h + t) * (D / 2) + j]);
              acc[t][0] = _mm512_dpbf16_ps(acc[t][0], q0, kb);
              acc[t][1] = _mm512_dpbf16_ps(acc[t][1], q1, kb);
            }
          }
        }
        for (int t = 0; t < 8; ++t) {
          st[h + t][0] = vmul(acc[t][0], sc_v);
          st[h + t][1] = vmul(acc[t][1], sc_v);
        }
      }
    } else
#endif
    {
    const float* k = rows_f32(k_cache + tile + static_cast<int64_t>(sub) * D, kbuf,
                              static_cast<int64_t>(nk) * D);
    for (int h = 0; h < kLanes; h += 8) {          // keys in halves of 8: 16 accumulators
      vec acc[8][2];
      for (int t = 0; t < 8; ++t) acc[t][0] = acc[t][1] = vzero();
      if (h < nk) {
        for (int d = 0; d < D; ++d) {
          const vec q0 = vload(qt + d * R), q1 = vload(qt + d * R + kLanes);
          for (int t = 0; t < 8; ++t) {   // rows past nk are read (inside the block), masked
            const vec kb = vset1(k[(h + t) * D + d]);
            acc[t][0] = vfma(kb, q0, acc[t][0]);
            acc[t][1] = vfma(kb, q1, acc[t][1]);
          }
        }
      }
      for (int t = 0; t < 8; ++t) {
        st[h + t][0] = acc[t][0];
        st[h + t][1] = acc[t][1];
      }
    }
    }
    // causal: key key0 + t is kept for the rows whose position is >= it
    alignas(64) int32_t key[kLanes];
    vec mx[2] = {vset1(kNegInf), vset1(kNegInf)};
    for (int t = 0; t < kLanes; ++t) {
      for (int v = 0; v < 2; ++v) {
        if (t >= nk) { st[t][v] = vset1(kNegInf); continue; }
        if (key0 + t > min_pos || rows < R) {
          for (int r = 0; r < kLanes; ++r) key[r] = key0 + t;
          st[t][v] = vmask_neginf(st[t][v], vle_int(key, pos + v * kLanes));
        }
        mx[v] = vmax(mx[v], st[t][v]);
      }
    }
    vec alpha[2];
    for (int v = 0; v < 2; ++v) {
      const vec m_new = vmax(m[v], mx[v]);
      const vec m_use = vsel_eq_neginf(m_new, 0.f);   // lanes with no key yet: exp(-inf) = 0
      alpha[v] = vexp(vsub(m[v], m_use));
      vec sum = vzero();
      for (int t = 0; t < nk; ++t) {
        const vec p = vexp(vsub(st[t][v], m_use));
        vstore(pt + t * R + v * kLanes, p);
        sum = vadd(sum, p);
      }
      l[v] = vfma(l[v], alpha[v], sum);
      m[v] = m_new;
    }
#if defined(__AVX512BF16__)
    if constexpr (kDot) {
      // P^T pairs: lane r of pt2[tp] = (P[r][2tp], P[r][2tp+1]) as bf16
      const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                             24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                             1, 16, 0);
      for (int tp = 0; tp < 8; ++tp)
        for (int v = 0; v < 2; ++v) {
          const vec a = 2 * tp < nk ? vload(pt + 2 * tp * R + v * kLanes) : vzero();
          const vec b = 2 * tp + 1 < nk ? vload(pt + (2 * tp + 1) * R + v * kLanes) : vzero();
          const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);   // [a 0..15 | b 0..15]
          _mm512_storeu_si512(pt2 + tp * R + v * kLanes, _mm512_permutexvar_epi16(inter, ab));
        }
      // V pairs: quarter q of vp[tp] row = keys (2tp, 2tp+1) at dims 8q..8q+3 (unpacklo)
      // and, 16 uint32 on, 8q+4..8q+7 (unpackhi), per 32 dims
      const auto* vb16 = reinterpret_cast<const uint16_t*>(v_cache + tile + static_cast<int64_t>(sub) * D);
      for (int tp = 0; tp < 8; ++tp)
        for (int d0 = 0; d0 < D; d0 += 32) {
          const __m512i a = 2 * tp < nk ? _mm512_loadu_si512(vb16 + 2 * tp * D + d0) : _mm512_setzero_si512();
          const __m512i b = 2 * tp + 1 < nk ? _mm512_loadu_si512(vb16 + (2 * tp + 1) * D + d0)
                                            : _mm512_setzero_si512();
          _mm512_storeu_si512(vp + tp * D + d0, _mm512_unpacklo_epi16(a, b));
          _mm512_storeu_si512(vp + tp * D + d0 + 16, _mm512_unpackhi_epi16(a, b));
        }
      auto vpair_at = [](int d) {   // index in a vp row of dim d's pair
        const int d32 = d & ~31, q = (d & 31) >> 3, i = d & 7;
        return d32 + (i < 4 ? 0 : 16) + q * 4 + (i & 3);
      };
      for (int d0 = 0; d0 < D; d0 += 8) {
        vec acc[8][2];
        for (int i = 0; i < 8; ++i) {
          acc[i][0] = vmul(vload(ot + (d0 + i) * R), alpha[0]);
          acc[i][1] = second ? vmul(vload(ot + (d0 + i) * R + kLanes), alpha[1]) : vzero();
        }
        int at[8];
        for (int i = 0; i < 8; ++i) at[i] = vpair_at(d0 + i);
        for (int tp = 0; tp < (nk + 1) / 2; ++tp) {
          const __m512bh p0 = (__m512bh)_mm512_loadu_si512(pt2 + tp * R);
          const __m512bh p1 = (__m512bh)_mm512_loadu_si512(pt2 + tp * R + kLanes);
          const uint32_t* vr = vp + tp * D;
          for (int i = 0; i < 8; ++i) {
            const __m512bh vb = (__m512bh)_mm512_set1_epi32(vr[at[i]]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], p0, vb);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], p1, vb);
          }
        }
        for (int i = 0; i < 8; ++i) {
          vstore(ot + (d0 + i) * R, acc[i][0]);
          vstore(ot + (d0 + i) * R + kLanes, acc[i][1]);
        }
      }
      continue;
    }
#endif
    const float* vrow = rows_f32(v_cache + tile + static_cast<int64_t>(sub) * D, vbuf,
                                 static_cast<int64_t>(nk) * D);
    for (int d0 = 0; d0 < D; d0 += 8) {  // O^T[d] = O^T[d] alpha + sum_t v_t[d] P^T[t]
      vec acc[8][2];
      for (int i = 0; i < 8; ++i) {
        acc[i][0] = vmul(vload(ot + (d0 + i) * R), alpha[0]);
        acc[i][1] = second ? vmul(vload(ot + (d0 + i) * R + kLanes), alpha[1]) : vzero();
      }
      for (int t = 0; t < nk; ++t) {
        const vec p0 = vload(pt + t * R), p1 = vload(pt + t * R + kLanes);
        const float* vr = vrow + t * D + d0;
        for (int i = 0; i < 8; ++i) {
          const vec vb = vset1(vr[i]);
          acc[i][0] = vfma(vb, p0, acc[i][0]);
          acc[i][1] = vfma(vb, p1, acc[i][1]);
        }
      }
      for (int i = 0; i < 8; ++i) {
        vstore(ot + (d0 + i) * R, acc[i][0]);
        vstore(ot + (d0 + i) * R + kLanes, acc[i][1]);
      }
    }
  }
  alignas(64) float inv[R];
  vstore(inv, l[0]);
  vstore(inv + kLanes, l[1]);
  for (int r = 0; r < rows; ++r) {
    const int row = row0 + r, tok = row / g, head = kvh * g + row % g;
    T* o = out + tok * s.q_stride + static_cast<int64_t>(head) * D;
    const float f = 1.f / inv[r];
    for (int d = 0; d < D; ++d) o[d] = static_cast<T>(ot[d * R + r] * f);
  }
}

struct Item {
  int32_t seq, kvh, row0;   // row0 < 0: a decode item
  int64_t cost;             // ~ keys read x query rows: most expensive first
};

template <typename T>
void run_items(std::vector<Item>& items, const T* q, const T* k_cache, const T* v_cache,
               const int32_t* table, const int32_t* cu_q, const int32_t* lens_k,
               const Shape& s, T* out) {
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch sc;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      const Item& it = items[i];
      const int b = it.seq;
      const int32_t* tb = table + static_cast<int64_t>(b) * s.table_width;
      const T* qb = q + cu_q[b] * s.q_stride;
      T* ob = out + cu_q[b] * s.q_stride;
      if (it.row0 < 0) {
        switch (s.head_dim / kLanes) {
#define PDSERVE_DECODE(dv) \
          case dv: decode_item<T, dv>(qb, k_cache, v_cache, tb, lens_k[b], it.kvh, s, ob, sc); break;
          PDSERVE_DECODE(1) PDSERVE_DECODE(2) PDSERVE_DECODE(3) PDSERVE_DECODE(4)
          PDSERVE_DECODE(5) PDSERVE_DECODE(6) PDSERVE_DECODE(7) PDSERVE_DECODE(8)
          PDSERVE_DECODE(16)
#undef PDSERVE_DECODE
          default: TORCH_CHECK(false, "paged attention: head_dim ", s.head_dim, " not built");
        }
      } else {
        const int n = cu_q[b + 1] - cu_q[b];
        switch (s.head_dim / kLanes) {
#define PDSERVE_PREFILL(dv)           case dv: prefill_item<T, dv>(qb, k_cache, v_cache, tb, lens_k[b], n, it.row0, it.kvh, s, ob, sc); break;
          PDSERVE_PREFILL(1) PDSERVE_PREFILL(2) PDSERVE_PREFILL(3) PDSERVE_PREFILL(4)
          PDSERVE_PREFILL(5) PDSERVE_PREFILL(6) PDSERVE_PREFILL(7) PDSERVE_PREFILL(8)
          PDSERVE_PREFILL(16)
#undef PDSERVE_PREFILL
          default: TORCH_CHECK(false, "paged attention: head_dim ", s.head_dim, " not built");
        }
      }
    }
  });
}

bool head_dim_supported(int64_t d) { return d % kLanes == 0 && (d / kLanes <= 8 || d == 256); }

void check_cache(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const char* op) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              op, ": CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), op,
              ": q must be [tokens, heads, head_dim] and the caches [blocks, kv_heads, "
              "block_size, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              op, ": q and the caches must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 only, got ", q.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": caches must be contiguous");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && head_dim_supported(q.size(2)), op,
              ": head_dim must match the cache's and be a multiple of 16 up to 128, or 256; got ",
              q.size(2));
  TORCH_CHECK(k_cache.size(2) % kLanes == 0, op, ": block_size must be a multiple of 16, got ",
              k_cache.size(2));
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, op, ": num_heads ", q.size(1),
              " must be a multiple of num_kv_heads ", k_cache.size(1));
}

Shape shape_of(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& table,
               double scale) {
  Shape s;
  s.num_heads = q.size(1);
  s.head_dim = q.size(2);
  s.num_kv_heads = k_cache.size(1);
  s.block_size = k_cache.size(2);
  s.table_width = table.size(1);
  s.group = s.num_heads / s.num_kv_heads;
  s.scale = static_cast<float>(scale);
  s.q_stride = static_cast<int64_t>(s.num_heads) * s.head_dim;
  s.tile = static_cast<int64_t>(s.block_size) * s.head_dim;
  return s;
}

torch::Tensor attention(torch::Tensor q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        torch::Tensor block_table, torch::Tensor cu_q, torch::Tensor lens_k,
                        double scale, const char* op) {
  q = q.contiguous();
  block_table = block_table.contiguous();
  cu_q = cu_q.contiguous();
  lens_k = lens_k.contiguous();
  const int batch = lens_k.size(0);
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch, op,
              ": block_table must be [batch, max_blocks]");
  const Shape s = shape_of(q, k_cache, block_table, scale);
  const int32_t* cu = cu_q.data_ptr<int32_t>();
  const int32_t* lk = lens_k.data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0 && cu[batch] == q.size(0), op, ": cu_seqlens_q must run from 0 to ",
              q.size(0), " (q's tokens)");
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(batch) * s.num_kv_heads);
  for (int b = 0; b < batch; ++b) {
    const int n = cu[b + 1] - cu[b];
    TORCH_CHECK(n >= 1 && lk[b] >= n, op, ": sequence ", b, " has ", n, " new tokens and a "
                "context of ", lk[b], " (need 1 <= new tokens <= context)");
    TORCH_CHECK((lk[b] + s.block_size - 1) / s.block_size <= s.table_width, op,
                ": context of sequence ", b, " (", lk[b], " tokens) is not covered by its "
                "block_table row");
    for (int h = 0; h < s.num_kv_heads; ++h) {
      if (n == 1) {
        items.push_back({b, h, -1, static_cast<int64_t>(lk[b]) * s.group});
        continue;
      }
      for (int row0 = 0; row0 < n * s.group; row0 += kPrefillRows) {
        const int last_tok = std::min(n * s.group, row0 + kPrefillRows) / s.group;
        items.push_back({b, h, row0, static_cast<int64_t>(lk[b] - n + last_tok) * kPrefillRows});
      }
    }
  }
  auto out = torch::empty_like(q);
  if (items.empty()) return out;
  if (q.scalar_type() == at::kFloat) {
    run_items<float>(items, q.data_ptr<float>(), k_cache.data_ptr<float>(),
                     v_cache.data_ptr<float>(), block_table.data_ptr<int32_t>(), cu, lk, s,
                     out.data_ptr<float>());
  } else {
    run_items<at::BFloat16>(items, q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                            v_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int32_t>(),
                            cu, lk, s, out.data_ptr<at::BFloat16>());
  }
  return out;
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_table, torch::Tensor cu_seqlens_q,
                              torch::Tensor seq_lens_k, double scale) {
  const char* op = "paged_attention";
  check_cache(q, k_cache, v_cache, op);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && cu_seqlens_q.scalar_type() == at::kInt &&
                  seq_lens_k.scalar_type() == at::kInt,
              op, ": block_table, cu_seqlens_q and seq_lens_k must be int32");
  TORCH_CHECK(cu_seqlens_q.dim() == 1 && seq_lens_k.dim() == 1 &&
                  cu_seqlens_q.size(0) == seq_lens_k.size(0) + 1,
              op, ": cu_seqlens_q must be [batch + 1] and seq_lens_k [batch]");
  return attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, op);
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor context_lens,
                                     double scale) {
  const char* op = "paged_decode_attention";
  check_cache(q, k_cache, v_cache, op);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              op, ": block_table and context_lens must be int32");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == q.size(0), op,
              ": context_lens must be [batch]");
  auto cu = torch::arange(q.size(0) + 1, torch::dtype(torch::kInt32));
  return attention(q, k_cache, v_cache, block_table, cu, context_lens, scale, op);
}

void reshape_and_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                       torch::Tensor v_cache, torch::Tensor slot_mapping) {
  const char* op = "reshape_and_cache";
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu() && slot_mapping.device().is_cpu(),
              op, ": CPU tensors only");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && k.size(1) == k_cache.size(1) &&
                  k.size(2) == k_cache.size(3),
              op, ": k, v must be [tokens, kv_heads, head_dim] and the caches [blocks, kv_heads, "
              "block_size, head_dim]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              op, ": k, v and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": caches must be contiguous");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, op, ": head_dim must be contiguous in k and v");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == k.size(0), op,
              ": slot_mapping must be int64 [tokens]");
  slot_mapping = slot_mapping.contiguous();
  const int64_t tokens = k.size(0), heads = k.size(1), d = k.size(2);
  const int64_t block_size = k_cache.size(2), slots = k_cache.size(0) * block_size;
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sm[t] >= -1 && sm[t] < slots, op, ": slot_mapping[", t, "]=", sm[t],
                " is outside the cache's ", slots, " slots");
  const int64_t elem = k.element_size();
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  at::parallel_for(0, tokens, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (sm[t] < 0) continue;
      const int64_t blk = sm[t] / block_size, off = sm[t] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = ((blk * heads + h) * block_size + off) * d * elem;
        std::memcpy(kc + dst, kp + (t * ks0 + h * ks1) * elem, d * elem);
        std::memcpy(vc + dst, vp + (t * vs0 + h * vs1) * elem, d * elem);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor cu_seqlens_q, Tensor seq_lens_k, float scale) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor context_lens, float scale) -> Tensor");
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
