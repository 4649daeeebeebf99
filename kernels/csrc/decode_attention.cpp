// Decode attention on CPU, read straight from the paged KV pool (no gathered copy of K/V).
// Each row is one query token that attends to the first seq_len slots of its request; the query heads that
// share a KV head, and consecutive rows of one request (a verify block's tokens), are done together, so every
// K/V row is read once per run of rows. Rows of slots are prefetched ahead
// (the pool is paged: consecutive positions sit in unrelated slots). Accumulation and softmax in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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

template <typename T, typename I, int64_t HD>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& req_to_token,
         const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, float scale, at::Tensor& out) {
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
  const int64_t nruns = static_cast<int64_t>(runs.size()) - 1;
  at::parallel_for(0, nruns * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row(hd);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = runs[w / nkv], n = runs[w / nkv + 1] - b, h = w % nkv, offset = (b * nh + h * g) * hd;
      scores.resize(n * g * *std::max_element(lens + b, lens + b + n));
      attend<T, I, HD>(qp + offset, nh * hd, kc + h * hd, vc + h * hd, table + rows[b] * table_stride, lens + b, n,
                       kv_stride, g, hd, scale, scores.data(), row.data(), op + offset);
    }
  });
}

template <typename T, typename I>
void run_hd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
            const at::Tensor& rows, const at::Tensor& lens, float scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return run<T, I, 64>(q, k, v, table, rows, lens, scale, out);
    case 128: return run<T, I, 128>(q, k, v, table, rows, lens, scale, out);
    default: return run<T, I, 0>(q, k, v, table, rows, lens, scale, out);
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
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  const float s = static_cast<float>(scale);
  const bool i32 = req_to_token.scalar_type() == at::kInt;
  TORCH_CHECK(i32 || req_to_token.scalar_type() == at::kLong, "req_to_token must be int32 or int64");
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      i32 ? run_hd<float, int32_t>(qf, k_cache, v_cache, req_to_token, rows, lens, s, out)
          : run_hd<float, int64_t>(qf, k_cache, v_cache, req_to_token, rows, lens, s, out);
      break;
    case at::kBFloat16:
      i32 ? run_hd<c10::BFloat16, int32_t>(qf, k_cache, v_cache, req_to_token, rows, lens, s, out)
          : run_hd<c10::BFloat16, int64_t>(qf, k_cache, v_cache, req_to_token, rows, lens, s, out);
      break;
    default:
      TORCH_CHECK(false, "K/V cache must be float32 or bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode_attention", &decode_attention); }
