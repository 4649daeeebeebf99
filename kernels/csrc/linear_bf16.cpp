// bf16 linear layers on CPUs with AVX512-BF16: y[M, N] = x[M, K] W^T (+ b), float32 accumulation.
// The weight is packed once into blocks of 16 output rows with K in pairs ([N/16][K/2][16][2], the layout
// `vdpbf16ps` consumes), so a block streams from memory once per call and stays in cache while the input rows,
// up to 8 at a time in registers, are multiplied into it: small batches (decode, verify blocks) read the
// weights at memory speed. The first pass over a block prefetches the next one into L2, so memory and the
// multiplications overlap (212 MB of weights on 2 cores: 8 rows as fast as 1, 16 rows 1.6x).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockN = 16;  // output rows per block (one zmm of float32 accumulators)
constexpr int64_t kChunkM = 8;   // input rows per pass over a block

#if defined(__AVX512BF16__)
// R input rows (x pairs at xr[r * x_pairs + p]) times one packed block of 16 outputs -> y rows (stride n);
// `next` (or null): a block of the same size to prefetch into L2 meanwhile, one cache line per pair step.
template <int R>
inline void block_rows(const __m512bh* w, int64_t kp, const uint32_t* xr, int64_t x_pairs, __m512 init,
                       at::BFloat16* y, int64_t n, __mmask16 mask, const __m512bh* next) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = init;
  for (int64_t p = 0; p < kp; ++p) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + p), _MM_HINT_T1);
    const __m512bh wv = w[p];
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r * x_pairs + p])));
  }
  for (int r = 0; r < R; ++r) _mm256_mask_storeu_epi16(y + r * n, mask, (__m256i)_mm512_cvtneps_pbh(acc[r]));
}
#endif

}  // namespace

bool linear_bf16_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// W [N, K] bf16 -> packed [ceil(N/16), ceil(K/2), 16, 2] bf16 (zero-padded).
at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight must be [N, K] bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t nb = (n + kBlockN - 1) / kBlockN, kp = (k + 1) / 2;
  at::Tensor padded = at::zeros({nb * kBlockN, kp * 2}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [nb, 16, kp, 2] -> [nb, kp, 16, 2]
  return padded.view({nb, kBlockN, kp, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bf16 (rows contiguous), packed from pack_weight, bias [N] or undefined -> [M, N] bf16.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bf16");
  const int64_t m = x.size(0), k = x.size(1), nb = packed.size(0), kp = packed.size(1);
  TORCH_CHECK(kp == (k + 1) / 2 && nb * kBlockN >= n, "packed weight does not match x");
  at::Tensor xc = x;
  if (k % 2) xc = at::constant_pad_nd(x, {0, 1});  // K padded to pairs; the packed weight has zeros there
  const int64_t x_stride = xc.stride(0);
  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) b32 = bias->to(at::kFloat).contiguous();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  const __m512bh* wp = reinterpret_cast<const __m512bh*>(packed.data_ptr<at::BFloat16>());
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  // the rows split evenly over the fewest passes of at most kChunkM (33 rows: 7 7 7 6 6, not 8 8 8 8 1): a pass of
  // few rows is bound by the latency of its accumulator chains, not by the multiplications (measured over one
  // model's layers: 32 rows 19.4 ms, 33 rows 21.4 ms with a 1-row pass); each row's sums are the same either way
  const int64_t passes = (m + kChunkM - 1) / kChunkM;
  const auto rows_in = [&](int64_t pass) { return m / passes + (pass < m % passes ? 1 : 0); };
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const __m512bh* w = wp + blk * kp;
      const int64_t n0 = blk * kBlockN, valid = std::min(kBlockN, n - n0);
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
      const __m512 init = bp ? _mm512_maskz_loadu_ps(mask, bp + n0) : _mm512_setzero_ps();
      for (int64_t pass = 0, m0 = 0; pass < passes; m0 += rows_in(pass), ++pass) {
        const uint32_t* xr = xp + m0 * (x_stride / 2);
        at::BFloat16* yr = op + m0 * n + n0;
        const __m512bh* next = (pass == 0 && blk + 1 < end) ? w + kp : nullptr;
        switch (rows_in(pass)) {
          case 1: block_rows<1>(w, kp, xr, x_stride / 2, init, yr, n, mask, next); break;
          case 2: block_rows<2>(w, kp, xr, x_stride / 2, init, yr, n, mask, next); break;
          case 3: block_rows<3>(w, kp, xr, x_stride / 2, init, yr, n, mask, next); break;
          case 4: block_rows<4>(w, kp, xr, x_stride / 2, init, yr, n, mask, next); break;
          case 5: block_rows<5>(w, kp, xr, x_stride / 2, init, yr, n, mask, next); break;
          case 6: block_rows<6>(w, kp, xr, x_stride / 2, init, yr, n, mask, next); break;
          case 7: block_rows<7>(w, kp, xr, x_stride / 2, init, yr, n, mask, next); break;
          default: block_rows<8>(w, kp, xr, x_stride / 2, init, yr, n, mask, next); break;
        }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "linear_bf16 needs a CPU with AVX512-BF16");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &linear_bf16_supported);
  m.def("pack_weight", &pack_weight);
  m.def("linear_bf16", &linear_bf16);
}
