// Rotary embedding of a layer's bf16 queries and keys on CPU, with the keys and values written into the paged
// KV pool, in one pass (torch: roll, two multiplies, addcmul, then two index_copy_: ~20 us a layer at 1 token).
// Rounds as `models/rotary.py: apply_rope` does in bf16: y = bf16(bf16(x * cos) + rot(x) * sin), where rot(x) is x
// rolled by half the head dim and the table's sin row is (-sin, sin); products of two bf16 are exact in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGrainTokens = 16;

inline float to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;  // as torch: one quiet NaN
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// y[d] = bf16(bf16(x[d] * c[d]) + x[d +- half] * s[d]): the two halves as two loops, so each vectorises
inline void rotate(const uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t hd, uint16_t* y) {
  const int64_t half = hd / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d)
    y[d] = to_bf16(to_float(to_bf16(to_float(x[d]) * to_float(c[d]))) + to_float(x[d + half]) * to_float(s[d]));
#pragma omp simd
  for (int64_t d = half; d < hd; ++d)
    y[d] = to_bf16(to_float(to_bf16(to_float(x[d]) * to_float(c[d]))) + to_float(x[d - half]) * to_float(s[d]));
}

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<c10::BFloat16>()); }

}  // namespace

// qk [T, H, hd] (queries, then the KV heads' keys), v [T, KV, hd], cos and sin [T, 1, hd] (`rope_at`), all bf16 with
// head rows contiguous; k_cache, v_cache [S, KV, hd] bf16 contiguous; loc [T] int64 slots. Returns the rotated queries
// [T, H - KV, hd]; writes the rotated keys and the values into rows loc of the caches.
at::Tensor rope_set_kv(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                       at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& loc) {
  const auto bf16 = at::kBFloat16;
  TORCH_CHECK(qk.dim() == 3 && v.dim() == 3 && cos.dim() == 3 && sin.dim() == 3, "qk, v, cos, sin must be 3-d");
  TORCH_CHECK(qk.scalar_type() == bf16 && v.scalar_type() == bf16 && cos.scalar_type() == bf16 &&
                  sin.scalar_type() == bf16 && k_cache.scalar_type() == bf16 && v_cache.scalar_type() == bf16,
              "rope_set_kv takes bf16 tensors");
  const int64_t t = qk.size(0), h = qk.size(1), hd = qk.size(2), kv = v.size(1), nq = h - kv;
  TORCH_CHECK(hd % 2 == 0 && v.size(0) == t && v.size(2) == hd && nq > 0, "qk [T, H, hd] and v [T, KV, hd] disagree");
  TORCH_CHECK(cos.size(0) == t && cos.size(2) == hd && sin.sizes() == cos.sizes(), "cos, sin must be [T, 1, hd]");
  TORCH_CHECK(qk.stride(2) == 1 && v.stride(2) == 1 && cos.stride(2) == 1 && sin.stride(2) == 1,
              "head rows must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 3 && k_cache.size(1) == kv && k_cache.size(2) == hd,
              "k_cache, v_cache must be contiguous [S, KV, hd]");
  TORCH_CHECK(loc.dim() == 1 && loc.size(0) == t && loc.scalar_type() == at::kLong, "loc must be [T] int64");
  const at::Tensor lc = loc.contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  const int64_t slots = k_cache.size(0);
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(lp[i] >= 0 && lp[i] < slots, "loc must index rows of the caches");
  at::Tensor q = at::empty({t, nq, hd}, qk.options().memory_format(at::MemoryFormat::Contiguous));
  const uint16_t *xp = bits(qk), *vp = bits(v), *cp = bits(cos), *sp = bits(sin);
  uint16_t* qp = reinterpret_cast<uint16_t*>(q.data_ptr<c10::BFloat16>());
  uint16_t* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr<c10::BFloat16>());
  uint16_t* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr<c10::BFloat16>());
  const int64_t row = kv * hd;
  at::parallel_for(0, t, kGrainTokens, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint16_t *c = cp + i * cos.stride(0), *s = sp + i * sin.stride(0);
      for (int64_t j = 0; j < h; ++j) {
        const uint16_t* x = xp + i * qk.stride(0) + j * qk.stride(1);
        rotate(x, c, s, hd, j < nq ? qp + (i * nq + j) * hd : kc + lp[i] * row + (j - nq) * hd);
      }
      for (int64_t j = 0; j < kv; ++j)
        std::memcpy(vc + lp[i] * row + j * hd, vp + i * v.stride(0) + j * v.stride(1), hd * sizeof(uint16_t));
    }
  });
  return q;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("rope_set_kv", &rope_set_kv); }
