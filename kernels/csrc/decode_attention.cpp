// Decode attention on CPU, read straight from the paged KV pool (no gathered copy of K/V).
// Each row is one query token that attends to the first seq_len slots of its request; the query heads that
// share a KV head, and consecutive rows of one request (a verify block's tokens), are done together, so every
// K/V row is read once per run of rows. Rows of slots are prefetched ahead
// (the pool is paged: consecutive positions sit in unrelated slots). Accumulation and softmax in float32.
// With AVX-512 (head dim a multiple of 16) positions go in tiles of 16: a tile's K rows are converted once, each
// query's 16 dot products are reduced together (one transposing add tree, not 16 horizontal sums), the softmax
// is vectorised and the weighted V sum accumulates in registers. Every query's arithmetic is the same whatever
// the other rows of its run, so a row's output does not depend on the batch.
// With AVX512-BF16, bf16 queries on a bf16 cache (head dim a multiple of 32) take the bf16 dot-product path:
// q . k straight from the cache rows (bf16 products are exact in float32), and p . v with the softmax weights
// rounded to bf16, as FlashAttention rounds P for its second GEMM (the output is a bf16 activation anyway):
// no float32 copy of K/V tiles, half the multiply-adds.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPrefetch = 16;  // rows ahead
constexpr int64_t kMaxRun = 16;   // rows of one request read together (a verify block)

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline void prefetch_row(const T* row, int64_t hd) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t c = 0; c < hd * static_cast<int64_t>(sizeof(T)); c += 64) __builtin_prefetch(p + c);
}

// Position l's row of one KV head -> row [hd] float32, prefetching the row kPrefetch positions ahead.
template <typename T, typename I>
inline void load_row(const T* cache, const I* slots, int64_t l, int64_t len, int64_t kv_stride, int64_t hd,
                     float* row) {
  if (l + kPrefetch < len) prefetch_row(cache + slots[l + kPrefetch] * kv_stride, hd);
  const T* src = cache + slots[l] * kv_stride;
#pragma omp simd
  for (int64_t d = 0; d < hd; ++d) row[d] = to_float(src[d]);
}

// One run of n rows of the same request and one KV head: row r's g query heads (q + r * q_stride, [g, hd]
// float) attend to its first lens[r] positions. Each K/V row is read once for the whole run (a verify block's
// tokens as consecutive rows: one read of the context, not one per token); every query's sums run as they would
// alone, so a row's output does not depend on its run. scores [n * g, max len] and row [hd] are scratch.
template <typename T, typename I, int64_t HD>
void attend(const float* q, int64_t q_stride, const T* k_cache, const T* v_cache, const I* slots,
            const int64_t* lens, int64_t n, int64_t kv_stride, int64_t g, int64_t hd_runtime, float scale,
            float* scores, float* row, float* out) {
  const int64_t hd = HD ? HD : hd_runtime;
  const int64_t len = *std::max_element(lens, lens + n);  // the run's longest row; scores rows are this long
  for (int64_t l = 0; l < len; ++l) {
    load_row(k_cache, slots, l, len, kv_stride, hd, row);
    for (int64_t r = 0; r < n; ++r) {
      if (l >= lens[r]) continue;
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = q + r * q_stride + j * hd;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < hd; ++d) s += qj[d] * row[d];
        scores[(r * g + j) * len + l] = s * scale;
      }
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < g; ++j) {
      float* sj = scores + (r * g + j) * len;
      const int64_t lr = lens[r];
      float m = -INFINITY;
      for (int64_t l = 0; l < lr; ++l) m = std::max(m, sj[l]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t l = 0; l < lr; ++l) {
        sj[l] = expf(sj[l] - m);
        sum += sj[l];
      }
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t l = 0; l < lr; ++l) sj[l] *= inv;
    }
    std::fill(out + r * q_stride, out + r * q_stride + g * hd, 0.f);  // an empty row stays zeros
  }
  for (int64_t l = 0; l < len; ++l) {
    load_row(v_cache, slots, l, len, kv_stride, hd, row);
    for (int64_t r = 0; r < n; ++r) {
      if (l >= lens[r]) continue;
      for (int64_t j = 0; j < g; ++j) {
        const float p = scores[(r * g + j) * len + l];
        float* oj = out + r * q_stride + j * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) oj[d] += p * row[d];
      }
    }
  }
}

#if defined(__AVX512F__)
constexpr int64_t kTile = 16;  // positions per tile (one zmm of scores)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Lane i of the result = the sum of v[i]'s 16 lanes (a transposing add tree: 45 shuffles and adds for 16 sums).
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c, e, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c, e, _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp(x) for x <= 0 (Cephes' single-precision polynomial, ~1 ulp), 16 lanes.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Positions [l0, l0 + m) of one KV head -> tile [kTile, hd] float32 (rows m.. zero), prefetching the next tile.
template <typename T, typename I>
inline void load_tile(const T* cache, const I* slots, int64_t l0, int64_t m, int64_t len, int64_t kv_stride,
                      int64_t hd, float* tile) {
  for (int64_t i = 0; i < kTile; ++i) {
    if (l0 + kTile + i < len) prefetch_row(cache + slots[l0 + kTile + i] * kv_stride, hd);
    float* dst = tile + i * hd;
    if (i >= m) {
      std::fill(dst, dst + hd, 0.f);
      continue;
    }
    const T* src = cache + slots[l0 + i] * kv_stride;
    for (int64_t c = 0; c < hd; c += 16) _mm512_storeu_ps(dst + c, load16(src + c));
  }
}

// Each query row of scores [n * g, stride]: softmax over its row's own positions, weights 0 beyond them (up to
// stride); its output row (out + r * q_stride + j * hd, [hd]) zeroed, an empty row's stays zeros.
inline void softmax_rows(float* scores, const int64_t* lens, int64_t n, int64_t g, int64_t stride, float* out,
                         int64_t q_stride, int64_t hd) {
  for (int64_t r = 0; r < n; ++r) {  // softmax over each row's own positions; weights 0 beyond them
    const int64_t lr = lens[r];
    for (int64_t j = 0; j < g; ++j) {
      float* sj = scores + (r * g + j) * stride;
      float* oj = out + r * q_stride + j * hd;
      std::fill(oj, oj + hd, 0.f);  // an empty row stays zeros
      if (lr == 0) continue;
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      for (int64_t l = 0; l < lr; l += 16) {
        const __mmask16 mask = lr - l >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (lr - l)) - 1u);
        vmax = _mm512_mask_max_ps(vmax, mask, vmax, _mm512_maskz_loadu_ps(mask, sj + l));
      }
      const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t l = 0; l < stride; l += 16) {
        const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, lr - l));
        const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_loadu_ps(sj + l), m)));
        vsum = _mm512_add_ps(vsum, e);
        _mm512_storeu_ps(sj + l, e);
      }
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
      for (int64_t l = 0; l < lr; l += 16) _mm512_storeu_ps(sj + l, _mm512_mul_ps(_mm512_loadu_ps(sj + l), inv));
    }
  }
}

// `attend` in tiles of 16 positions (hd a multiple of 16, at most 256). scores [n * g, len rounded up to 16] and
// tile [kTile, hd] are scratch; out rows are the accumulators.
template <typename T, typename I, int64_t HD>
void attend_tiled(const float* q, int64_t q_stride, const T* k_cache, const T* v_cache, const I* slots,
                  const int64_t* lens, int64_t n, int64_t kv_stride, int64_t g, int64_t hd_runtime, float scale,
                  float* scores, float* tile, float* out) {
  const int64_t hd = HD ? HD : hd_runtime, chunks = hd / 16;
  const int64_t len = *std::max_element(lens, lens + n), stride = (len + kTile - 1) / kTile * kTile;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t l0 = 0; l0 < len; l0 += kTile) {  // scores: q . k for 16 positions at a time
    load_tile(k_cache, slots, l0, std::min(kTile, len - l0), len, kv_stride, hd, tile);
    for (int64_t r = 0; r < n; ++r) {
      if (lens[r] <= l0) continue;
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = q + r * q_stride + j * hd;
        __m512 part[kTile];
        for (int64_t i = 0; i < kTile; ++i) {
          const float* k = tile + i * hd;
          __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qj), _mm512_loadu_ps(k));
          for (int64_t c = 1; c < chunks; ++c)
            s = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * c), _mm512_loadu_ps(k + 16 * c), s);
          part[i] = s;
        }
        _mm512_storeu_ps(scores + (r * g + j) * stride + l0, _mm512_mul_ps(sum16(part), vscale));
      }
    }
  }
  softmax_rows(scores, lens, n, g, stride, out, q_stride, hd);
  for (int64_t l0 = 0; l0 < len; l0 += kTile) {  // out += p . v, a tile at a time, accumulators in registers
    const int64_t m = std::min(kTile, len - l0);
    load_tile(v_cache, slots, l0, m, len, kv_stride, hd, tile);
    for (int64_t r = 0; r < n; ++r) {
      if (lens[r] <= l0) continue;
      for (int64_t j = 0; j < g; ++j) {
        const float* p = scores + (r * g + j) * stride + l0;
        float* oj = out + r * q_stride + j * hd;
        for (int64_t c0 = 0; c0 < chunks; c0 += 4) {  // 4 zmm of the output row at a time
          const int64_t cn = std::min<int64_t>(4, chunks - c0);
          __m512 acc[4];
          for (int64_t c = 0; c < cn; ++c) acc[c] = _mm512_loadu_ps(oj + 16 * (c0 + c));
          for (int64_t i = 0; i < m; ++i) {
            const __m512 w = _mm512_set1_ps(p[i]);
            for (int64_t c = 0; c < cn; ++c)
              acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(tile + i * hd + 16 * (c0 + c)), acc[c]);
          }
          for (int64_t c = 0; c < cn; ++c) _mm512_storeu_ps(oj + 16 * (c0 + c), acc[c]);
        }
      }
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// `attend_tiled` for bf16 queries (q holds bf16 values as float) on a bf16 cache, hd a multiple of 32 (at most
// 256), with bf16 dot products straight from the cache rows, a tile's V rows interleaved in position pairs for
// p . v. Scratch: scores [n * g, len rounded up to 16], pairs [hd / 2] zmm, qb [n * g * hd / 32] (the queries in
// bf16). out rows accumulate in the pairs' lane order and are put back in dimension order at the end.
template <typename I, int64_t HD>
void attend_bf16(const float* q, int64_t q_stride, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                 const I* slots, const int64_t* lens, int64_t n, int64_t kv_stride, int64_t g, int64_t hd_runtime,
                 float scale, float* scores, __m512i* pairs, __m512bh* qb, float* out) {
  const int64_t hd = HD ? HD : hd_runtime, chunks = hd / 32;  // zmm of bf16 per row
  const int64_t len = *std::max_element(lens, lens + n), stride = (len + kTile - 1) / kTile * kTile;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < n; ++r)  // the queries in bf16 (exact: they are bf16 values)
    for (int64_t j = 0; j < g; ++j)
      for (int64_t c = 0; c < chunks; ++c) {
        const float* src = q + r * q_stride + j * hd + 32 * c;
        qb[(r * g + j) * chunks + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
      }
  const c10::BFloat16* rows[kTile];
  for (int64_t l0 = 0; l0 < len; l0 += kTile) {  // scores: q . k for 16 positions at a time
    const int64_t m = std::min(kTile, len - l0);
    for (int64_t i = 0; i < m; ++i) {
      if (l0 + kTile + i < len) prefetch_row(k_cache + slots[l0 + kTile + i] * kv_stride, hd);
      rows[i] = k_cache + slots[l0 + i] * kv_stride;
    }
    for (int64_t r = 0; r < n; ++r) {
      if (lens[r] <= l0) continue;
      for (int64_t j = 0; j < g; ++j) {
        const __m512bh* qj = qb + (r * g + j) * chunks;
        __m512 part[kTile];
        for (int64_t i = 0; i < kTile; ++i) {
          __m512 sum = _mm512_setzero_ps();
          if (i < m)
            for (int64_t c = 0; c < chunks; ++c)
              sum = _mm512_dpbf16_ps(sum, qj[c], (__m512bh)_mm512_loadu_si512(rows[i] + 32 * c));
          part[i] = sum;
        }
        _mm512_storeu_ps(scores + (r * g + j) * stride + l0, _mm512_mul_ps(sum16(part), vscale));
      }
    }
  }
  softmax_rows(scores, lens, n, g, stride, out, q_stride, hd);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t l0 = 0; l0 < len; l0 += kTile) {  // out += p . v, two positions per bf16 dot product
    const int64_t m = std::min(kTile, len - l0), npairs = (m + 1) / 2;
    for (int64_t t = 0; t < npairs; ++t) {  // V rows 2t and 2t + 1 interleaved: lane i = (v[2t][d], v[2t+1][d])
      const int64_t a = l0 + 2 * t, b = a + 1;
      if (b + kTile < len) prefetch_row(v_cache + slots[b + kTile] * kv_stride, hd);
      if (a + kTile < len) prefetch_row(v_cache + slots[a + kTile] * kv_stride, hd);
      const c10::BFloat16* va = v_cache + slots[a] * kv_stride;
      const c10::BFloat16* vb = b < l0 + m ? v_cache + slots[b] * kv_stride : nullptr;
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512i x = _mm512_loadu_si512(va + 32 * c), y = vb ? _mm512_loadu_si512(vb + 32 * c) : zero;
        pairs[(t * chunks + c) * 2] = _mm512_unpacklo_epi16(x, y);
        pairs[(t * chunks + c) * 2 + 1] = _mm512_unpackhi_epi16(x, y);
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      if (lens[r] <= l0) continue;
      for (int64_t j = 0; j < g; ++j) {
        alignas(64) uint32_t w[kTile / 2];  // the tile's weights in bf16, a position pair per 32 bits
        _mm256_store_si256(reinterpret_cast<__m256i*>(w),
                           (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores + (r * g + j) * stride + l0)));
        float* oj = out + r * q_stride + j * hd;
        for (int64_t c0 = 0; c0 < 2 * chunks; c0 += 8) {  // 8 zmm of the output row at a time
          const int64_t cn = std::min<int64_t>(8, 2 * chunks - c0);
          __m512 acc[8];
          for (int64_t c = 0; c < cn; ++c) acc[c] = _mm512_loadu_ps(oj + 16 * (c0 + c));
          for (int64_t t = 0; t < npairs; ++t) {
            const __m512bh wt = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[t]));
            for (int64_t c = 0; c < cn; ++c)
              acc[c] = _mm512_dpbf16_ps(acc[c], wt, (__m512bh)pairs[t * 2 * chunks + c0 + c]);
          }
          for (int64_t c = 0; c < cn; ++c) _mm512_storeu_ps(oj + 16 * (c0 + c), acc[c]);
        }
      }
    }
  }
  // lanes of the 32 dims of a chunk: unpacklo holds dims 8k + (0..3), unpackhi 8k + 4 + (0..3), k = 0..3
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < g; ++j) {
      float* oj = out + r * q_stride + j * hd;
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 lo = _mm512_loadu_ps(oj + 32 * c), hi = _mm512_loadu_ps(oj + 32 * c + 16);
        _mm512_storeu_ps(oj + 32 * c, _mm512_permutex2var_ps(lo, first, hi));
        _mm512_storeu_ps(oj + 32 * c + 16, _mm512_permutex2var_ps(lo, second, hi));
      }
    }
}
#endif

}  // namespace

// Whether rows of this head dim attend in tiles of 16 positions here (built with AVX-512; a multiple of 16 up to 256).
bool tiles(int64_t hd) {
#if defined(__AVX512F__)
  return hd % 16 == 0 && hd <= 256;
#else
  return false;
#endif
}

namespace {

// Whether bf16 queries on a bf16 cache take the bf16 dot-product path here (built with AVX512-BF16; head dim a
// multiple of 32 up to 256).
bool dot_bf16(int64_t hd) {
#if defined(__AVX512BF16__)
  return hd % 32 == 0 && hd <= 256;
#else
  return false;
#endif
}

template <typename T, typename I, int64_t HD>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& req_to_token,
         const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, float scale, bool q_bf16, at::Tensor& out) {
  const int64_t bs = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1), g = nh / nkv;
  const int64_t kv_stride = k_cache.stride(0), table_stride = req_to_token.stride(0);
  if (bs == 0) return;
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const float* qp = q.data_ptr<float>();
  const I* table = req_to_token.data_ptr<I>();
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  std::vector<int64_t> runs{0};  // runs of consecutive rows of one request (at most kMaxRun rows)
  for (int64_t b = 1; b < bs; ++b)
    if (rows[b] != rows[b - 1] || b - runs.back() == kMaxRun) runs.push_back(b);
  runs.push_back(bs);
  // too few tasks to keep every thread busy (one verify block: 3 tasks on 2 threads): split the longest runs
  while (static_cast<int64_t>(runs.size() - 1) * nkv < 2 * at::get_num_threads()) {
    int64_t longest = 0;
    for (size_t i = 1; i + 1 < runs.size(); ++i)
      if (runs[i + 1] - runs[i] > runs[longest + 1] - runs[longest]) longest = static_cast<int64_t>(i);
    const int64_t n = runs[longest + 1] - runs[longest];
    if (n < 2) break;
    runs.insert(runs.begin() + longest + 1, runs[longest] + n / 2);
  }
  const int64_t nruns = static_cast<int64_t>(runs.size()) - 1;
  const bool tiled = tiles(hd), dot = q_bf16 && std::is_same_v<T, c10::BFloat16> && dot_bf16(hd);
  at::parallel_for(0, nruns * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row(tiled ? 16 * hd : hd);
#if defined(__AVX512BF16__)
    std::vector<__m512i> pairs(dot ? hd / 2 : 0);
    std::vector<__m512bh> qb;
#endif
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = runs[w / nkv], n = runs[w / nkv + 1] - b, h = w % nkv, offset = (b * nh + h * g) * hd;
      const int64_t len = *std::max_element(lens + b, lens + b + n);
      const int64_t* lb = lens + b;
      const I* slots = table + rows[b] * table_stride;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (dot) {
          scores.resize(n * g * ((len + 15) / 16 * 16));
          qb.resize(n * g * hd / 32);
          attend_bf16<I, HD>(qp + offset, nh * hd, kc + h * hd, vc + h * hd, slots, lb, n, kv_stride, g, hd, scale,
                             scores.data(), pairs.data(), qb.data(), op + offset);
          continue;
        }
      }
#endif
#if defined(__AVX512F__)
      if (tiled) {
        scores.resize(n * g * ((len + 15) / 16 * 16));
        attend_tiled<T, I, HD>(qp + offset, nh * hd, kc + h * hd, vc + h * hd, slots, lb, n, kv_stride, g, hd,
                               scale, scores.data(), row.data(), op + offset);
        continue;
      }
#endif
      scores.resize(n * g * len);
      attend<T, I, HD>(qp + offset, nh * hd, kc + h * hd, vc + h * hd, slots, lb, n, kv_stride, g, hd, scale,
                       scores.data(), row.data(), op + offset);
    }
  });
}

template <typename T, typename I>
void run_hd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
            const at::Tensor& rows, const at::Tensor& lens, float scale, bool q_bf16, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return run<T, I, 64>(q, k, v, table, rows, lens, scale, q_bf16, out);
    case 128: return run<T, I, 128>(q, k, v, table, rows, lens, scale, q_bf16, out);
    default: return run<T, I, 0>(q, k, v, table, rows, lens, scale, q_bf16, out);
  }
}

}  // namespace

// q [bs, nH, hd]; k_cache, v_cache [slots, nKV, hd] (rows contiguous); req_to_token [R, ctx] int32/int64;
// req_pool_indices, seq_lens [bs] int64. Returns [bs, nH, hd] float32.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && q.size(2) == k_cache.size(2), "heads do not match");
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == q.size(2) && k_cache.strides() == v_cache.strides(),
              "K/V rows must be contiguous");
  TORCH_CHECK(req_to_token.stride(1) == 1, "req_to_token rows must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V dtypes differ");
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const at::Tensor rows = req_pool_indices.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < lens.numel(); ++b) {  // rows read their slots from req_to_token: never outside it
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= req_to_token.size(1), "seq_lens must be within [0, req_to_token.size(1)]");
    TORCH_CHECK(rp[b] >= 0 && rp[b] < req_to_token.size(0), "req_pool_indices must index rows of req_to_token");
  }
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  const float s = static_cast<float>(scale);
  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  const bool i32 = req_to_token.scalar_type() == at::kInt;
  TORCH_CHECK(i32 || req_to_token.scalar_type() == at::kLong, "req_to_token must be int32 or int64");
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      i32 ? run_hd<float, int32_t>(qf, k_cache, v_cache, req_to_token, rows, lens, s, q_bf16, out)
          : run_hd<float, int64_t>(qf, k_cache, v_cache, req_to_token, rows, lens, s, q_bf16, out);
      break;
    case at::kBFloat16:
      i32 ? run_hd<c10::BFloat16, int32_t>(qf, k_cache, v_cache, req_to_token, rows, lens, s, q_bf16, out)
          : run_hd<c10::BFloat16, int64_t>(qf, k_cache, v_cache, req_to_token, rows, lens, s, q_bf16, out);
      break;
    default:
      TORCH_CHECK(false, "K/V cache must be float32 or bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention);
  m.def("tiles", &tiles);
  m.def("dot_bf16", &dot_bf16);
}
