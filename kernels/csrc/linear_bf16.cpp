// bf16 linear layers on CPUs with AVX512-BF16: y[M, N] = x[M, K] W^T (+ b), float32 accumulation.
// The weight is packed once into blocks of 16 output rows with K in pairs ([N/16][K/2][16][2], the layout
// `vdpbf16ps` consumes), so a block streams from memory once per call and stays in cache while the input rows are
// multiplied into it. A register tile is 1 block x up to 8 rows for small batches (decode, short verify blocks:
// bound by memory) and 2 blocks x up to 12 rows past 8 rows, where the multiply units are the limit: each loaded
// weight vector then feeds up to 12 multiplications and each broadcast input pair 2, instead of 1 load per
// multiplication. While a thread works on a tile, the next one is prefetched into L2, spread over all passes of the
// rows (not the first alone), so memory and multiplications overlap throughout. Measured over one model's layer
// weights (212 MB) on a 2-core Zen 5 EPYC, against 1 x 8 tiles prefetched in the first pass, interleaved calls,
// best of 15: 1 row 5.84 vs 5.78 ms, 8 rows 6.34 vs 6.41, 12 rows 6.79 vs 7.90, 16 rows 7.92 vs 8.61, 24 rows 8.91
// vs 11.87, 32 rows 11.06 vs 14.15 (the old kernel built beside the new one).
// Every output's sum runs over K in the same order whatever the tile, so a row's result does not depend on its batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockN = 16;  // output rows per packed block (one zmm of float32 accumulators)
constexpr int64_t kSmallM = 8;   // up to this many rows: 1-block tiles of up to 8 rows
constexpr int64_t kWideM = 12;   // past it: 2-block tiles of up to 12 rows (24 accumulators, 32 registers)

#if defined(__AVX512BF16__)
// R input rows (x pairs at xr[r * x_pairs + p]) times NB packed blocks (block b at w + b * kp) -> y rows (stride n,
// block b's 16 outputs at y + 16 b, masked by mask[b]). `next` (or null): the next tile's `next_blocks` blocks, one
// cache line per block prefetched into L2 every `pf_every`-th pair step from `pf_phase` on (pass i of n: the lines
// i, i + n, ...).
template <int NB, int R>
inline void tile_rows(const __m512bh* w, int64_t kp, const uint32_t* xr, int64_t x_pairs, const __m512* init,
                      at::BFloat16* y, int64_t n, const __mmask16* mask, const __m512bh* next, int next_blocks,
                      int pf_phase, int pf_every) {
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = init[b];
  const auto multiply = [&](int64_t p) __attribute__((always_inline)) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = w[b * kp + p];
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r * x_pairs + p]));
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv[b], xv);
    }
  };
  const auto prefetch = [&](int64_t p) __attribute__((always_inline)) {
    for (int b = 0; b < NB; ++b)
      if (b < next_blocks) _mm_prefetch(reinterpret_cast<const char*>(next + b * kp + p), _MM_HINT_T1);
  };
  if (!next) {
    for (int64_t p = 0; p < kp; ++p) multiply(p);
  } else if (pf_every == 1) {
    for (int64_t p = 0; p < kp; ++p) {
      prefetch(p);
      multiply(p);
    }
  } else {  // one pass of several: every pf_every-th line, from pf_phase on
    for (int64_t p = 0, phase = pf_phase; p < kp; ++p) {
      if (phase == 0) prefetch(p);
      if (++phase == pf_every) phase = 0;
      multiply(p);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b)
      _mm256_mask_storeu_epi16(y + r * n + b * kBlockN, mask[b], (__m256i)_mm512_cvtneps_pbh(acc[b][r]));
}

// tile_rows<NB, rows> for a run-time row count (1..kWideM)
template <int NB, int R = 1>
inline void tile(int rows, const __m512bh* w, int64_t kp, const uint32_t* xr, int64_t x_pairs, const __m512* init,
                 at::BFloat16* y, int64_t n, const __mmask16* mask, const __m512bh* next, int next_blocks,
                 int pf_phase, int pf_every) {
  if constexpr (R < kWideM) {
    if (rows > R)
      return tile<NB, R + 1>(rows, w, kp, xr, x_pairs, init, y, n, mask, next, next_blocks, pf_phase, pf_every);
  }
  tile_rows<NB, R>(w, kp, xr, x_pairs, init, y, n, mask, next, next_blocks, pf_phase, pf_every);
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
  // the rows split evenly over the fewest passes of at most `chunk` (33 rows in 1-block tiles: 7 7 7 6 6, not 8 8 8
  // 8 1): a pass of few rows is bound by the latency of its accumulator chains, not by the multiplications
  // (measured over one model's layers: 32 rows 19.4 ms, 33 rows 21.4 ms with a 1-row pass)
  const int tile_blocks = m > kSmallM ? 2 : 1;
  const int64_t chunk = m > kSmallM ? kWideM : kSmallM;
  const int64_t passes = (m + chunk - 1) / chunk;
  const auto rows_in = [&](int64_t pass) { return m / passes + (pass < m % passes ? 1 : 0); };
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; blk += tile_blocks) {
      const int blocks = static_cast<int>(std::min<int64_t>(tile_blocks, end - blk));
      const __m512bh* w = wp + blk * kp;
      __m512 init[2];
      __mmask16 mask[2];
      for (int b = 0; b < blocks; ++b) {
        const int64_t n0 = (blk + b) * kBlockN, valid = std::min(kBlockN, n - n0);
        mask[b] = static_cast<__mmask16>((1u << valid) - 1u);
        init[b] = bp ? _mm512_maskz_loadu_ps(mask[b], bp + n0) : _mm512_setzero_ps();
      }
      const int next_blocks = static_cast<int>(std::min<int64_t>(tile_blocks, end - blk - blocks));
      for (int64_t pass = 0, m0 = 0; pass < passes; m0 += rows_in(pass), ++pass) {
        const __m512bh* next = next_blocks > 0 ? w + blocks * kp : nullptr;
        const uint32_t* xr = xp + m0 * (x_stride / 2);
        at::BFloat16* yr = op + m0 * n + blk * kBlockN;
        const int rows = static_cast<int>(rows_in(pass));
        const int phase = static_cast<int>((passes - pass) % passes), every = static_cast<int>(passes);
        if (blocks == 2)
          tile<2>(rows, w, kp, xr, x_stride / 2, init, yr, n, mask, next, next_blocks, phase, every);
        else
          tile<1>(rows, w, kp, xr, x_stride / 2, init, yr, n, mask, next, next_blocks, phase, every);
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
