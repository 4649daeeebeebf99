// The draft's K/V on CPU in one pass (`kernels/draft_kv.py`), instead of the ~15 tensor ops of the torch path (each a
// few microseconds, whatever the few tokens a decode step commits): per token and head, RMSNorm and RoPE (neox
// halves) in float32, rounded once. `materialize_draft_kv` writes the context K/V of every draft layer into the paged
// draft pool; `norm_rope_set_kv` does one layer's queries and writes its keys and values (a draft block's own).
// Tensors of one dtype (bfloat16 or float32), any strides.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

// dst[i * dst_stride] = RoPE(RMSNorm(src[i * src_stride]) * w) over head_dim values; x: float32 scratch [head_dim]
template <typename T>
inline void norm_rope(const T* src, int64_t src_stride, const float* w, int64_t hd, float eps, const float* cosp,
                      int64_t half, T* dst, int64_t dst_stride, float* x) {
  float ss = 0.f;
  for (int64_t i = 0; i < hd; ++i) {
    x[i] = static_cast<float>(src[i * src_stride]);
    ss += x[i] * x[i];
  }
  const float rstd = 1.f / std::sqrt(ss / static_cast<float>(hd) + eps);
  for (int64_t i = 0; i < hd; ++i) x[i] = x[i] * rstd * w[i];
  const float* sinp = cosp + half;
  for (int64_t i = 0; i < half; ++i) {
    dst[i * dst_stride] = static_cast<T>(x[i] * cosp[i] - x[i + half] * sinp[i]);
    dst[(i + half) * dst_stride] = static_cast<T>(x[i + half] * cosp[i] + x[i] * sinp[i]);
  }
  for (int64_t i = 2 * half; i < hd; ++i) dst[i * dst_stride] = static_cast<T>(x[i]);
}

struct Rope {  // float32 [P, rotary_dim] = [cos | sin] rows, and the tokens' positions
  at::Tensor cache, positions;
  Rope(const at::Tensor& cos_sin_cache, const at::Tensor& pos)
      : cache(cos_sin_cache.to(at::kFloat).contiguous()), positions(pos.to(at::kLong).contiguous()) {}
  const float* at(int64_t t) const {
    return cache.data_ptr<float>() + positions.data_ptr<int64_t>()[t] * cache.size(1);
  }
  int64_t half() const { return cache.size(1) / 2; }
};

// k, v [N, L, nKV, hd] -> rows loc of k_buffer / v_buffer [L, slots, nKV, hd], K normed (k_norm_weight [L, hd])
// and rotated
template <typename T>
void materialize(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_norm_weight, const Rope& rope,
                 double eps, at::Tensor& k_buffer, at::Tensor& v_buffer, const at::Tensor& loc) {
  const int64_t n = k.size(0), layers = k.size(1), heads = k.size(2), hd = k.size(3);
  const at::Tensor w = k_norm_weight.to(at::kFloat).contiguous();
  const at::Tensor slots = loc.to(at::kLong).contiguous();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kb = k_buffer.data_ptr<T>();
  T* vb = v_buffer.data_ptr<T>();
  const int64_t* slotp = slots.data_ptr<int64_t>();
  at::parallel_for(0, n * layers, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(hd);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / layers, l = task % layers, slot = slotp[t];
      for (int64_t h = 0; h < heads; ++h) {
        norm_rope(kp + t * k.stride(0) + l * k.stride(1) + h * k.stride(2), k.stride(3), w.data_ptr<float>() + l * hd,
                  hd, static_cast<float>(eps), rope.at(t), rope.half(),
                  kb + l * k_buffer.stride(0) + slot * k_buffer.stride(1) + h * k_buffer.stride(2), k_buffer.stride(3),
                  x.data());
        const T* vi = vp + t * v.stride(0) + l * v.stride(1) + h * v.stride(2);
        T* vo = vb + l * v_buffer.stride(0) + slot * v_buffer.stride(1) + h * v_buffer.stride(2);
        for (int64_t i = 0; i < hd; ++i) vo[i * v_buffer.stride(3)] = vi[i * v.stride(3)];
      }
    }
  });
}

// x [T, H, hd] -> [T, H, hd] normed (weight [hd]) and rotated
template <typename T>
at::Tensor norm_rope_rows(const at::Tensor& x, const at::Tensor& weight, const Rope& rope, double eps) {
  const int64_t n = x.size(0), heads = x.size(1), hd = x.size(2);
  at::Tensor out = at::empty({n, heads, hd}, x.options());
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(hd);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        norm_rope(xp + t * x.stride(0) + h * x.stride(1), x.stride(2), w.data_ptr<float>(), hd,
                  static_cast<float>(eps), rope.at(t), rope.half(), op + (t * heads + h) * hd, 1, scratch.data());
  });
  return out;
}

void check_rope(int64_t head_dim, const at::Tensor& cos_sin_cache, int64_t rotary_dim) {
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == rotary_dim && rotary_dim % 2 == 0 &&
              rotary_dim <= head_dim, "cos_sin_cache must be [P, rotary_dim], rotary_dim even and at most head_dim");
}

}  // namespace

// kv [N, L, 2, nKV, hd], k_norm_weight [L, hd], positions [N], cos_sin_cache [P, rotary_dim] (cos | sin),
// k_buffer / v_buffer [L, slots, nKV, hd], loc [N]: writes rows loc of every layer's buffers, in place.
void materialize_draft_kv(const at::Tensor& kv, const at::Tensor& k_norm_weight, const at::Tensor& positions,
                          const at::Tensor& cos_sin_cache, int64_t rotary_dim, double eps, at::Tensor k_buffer,
                          at::Tensor v_buffer, const at::Tensor& loc) {
  TORCH_CHECK(kv.dim() == 5 && kv.size(2) == 2, "kv must be [N, L, 2, nKV, hd]");
  TORCH_CHECK(kv.scalar_type() == k_buffer.scalar_type() && kv.scalar_type() == v_buffer.scalar_type(),
              "kv and the buffers must have one dtype");
  check_rope(kv.size(4), cos_sin_cache, rotary_dim);
  const Rope rope(cos_sin_cache, positions);
  const at::Tensor k = kv.select(2, 0), v = kv.select(2, 1);
  if (kv.scalar_type() == at::kBFloat16)
    materialize<c10::BFloat16>(k, v, k_norm_weight, rope, eps, k_buffer, v_buffer, loc);
  else if (kv.scalar_type() == at::kFloat)
    materialize<float>(k, v, k_norm_weight, rope, eps, k_buffer, v_buffer, loc);
  else
    TORCH_CHECK(false, "kv must be bfloat16 or float32");
}

// One draft layer's block: q [T, nH, hd] and k, v [T, nKV, hd] (its projections), q_norm / k_norm weights [hd]:
// writes the normed, rotated keys and the values into rows loc of k_cache / v_cache [slots, nKV, hd]; returns the
// normed, rotated queries [T, nH, hd].
at::Tensor norm_rope_set_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& q_norm_weight, const at::Tensor& k_norm_weight,
                            const at::Tensor& positions, const at::Tensor& cos_sin_cache, int64_t rotary_dim,
                            double eps, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& loc) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), "q must be [T, nH, hd], k and v [T, nKV, hd]");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && k_cache.scalar_type() == dtype &&
              v_cache.scalar_type() == dtype, "q, k, v and the caches must have one dtype");
  check_rope(q.size(2), cos_sin_cache, rotary_dim);
  const Rope rope(cos_sin_cache, positions);
  at::Tensor kb = k_cache.unsqueeze(0), vb = v_cache.unsqueeze(0);
  if (dtype == at::kBFloat16) {
    materialize<c10::BFloat16>(k.unsqueeze(1), v.unsqueeze(1), k_norm_weight.unsqueeze(0), rope, eps, kb, vb, loc);
    return norm_rope_rows<c10::BFloat16>(q, q_norm_weight, rope, eps);
  }
  TORCH_CHECK(dtype == at::kFloat, "q must be bfloat16 or float32");
  materialize<float>(k.unsqueeze(1), v.unsqueeze(1), k_norm_weight.unsqueeze(0), rope, eps, kb, vb, loc);
  return norm_rope_rows<float>(q, q_norm_weight, rope, eps);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("materialize_draft_kv", &materialize_draft_kv, py::arg("kv"), py::arg("k_norm_weight"), py::arg("positions"),
        py::arg("cos_sin_cache"), py::arg("rotary_dim"), py::arg("eps"), py::arg("k_buffer"), py::arg("v_buffer"),
        py::arg("out_cache_loc"));
  m.def("norm_rope_set_kv", &norm_rope_set_kv, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_norm_weight"),
        py::arg("k_norm_weight"), py::arg("positions"), py::arg("cos_sin_cache"), py::arg("rotary_dim"), py::arg("eps"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("loc"));
}
