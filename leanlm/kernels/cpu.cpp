// The W8A16 product for decode on CPU: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k], w [N, K] int8 with one
// scale per row, accumulated in float32, for a few rows of x (decode, a short prompt, a speculative check).
// Each weight byte is read from memory once: tiles of 64 weight rows stay in cache while blocks of up to 8 rows
// of x use them.
//
// Built at first use by leanlm/kernels/__init__.py with -march=native. With AVX-512 (F, BW) the inner loop is
// written with intrinsics; otherwise a plain loop. LEANLM_PORTABLE forces the plain loop (the tests build both
// and check each against a float reference).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#ifndef LEANLM_NS
#define LEANLM_NS leanlm  // the op namespace: torch.ops.leanlm.*
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(LEANLM_PORTABLE)
#define LEANLM_AVX512 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 8;  // rows of x per pass over a tile of weights (accumulators in registers)
constexpr int64_t kTile = 64;    // rows of w per tile: a tile stays in cache while every block of x rows uses it

// x [M, K] (float32, bf16 or fp16, any strides) as float32: a plain loop, no tensor ops (each of those costs
// microseconds, which add up over the ~120 products of a decode step).
std::vector<float> rows_as_float(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> out(M * K);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rows_as_float", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) out[m * K + k] = float(p[m * x.stride(0) + k * x.stride(1)]);
  });
  return out;
}

void check(const at::Tensor& x, const at::Tensor& w, int64_t K) {
  TORCH_CHECK(x.dim() == 2, "int8_gemv takes x [M, K], got ", x.sizes());
  TORCH_CHECK(x.size(1) == K, "x has K = ", x.size(1), ", the weight ", K);
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "the weight must be a contiguous CPU tensor");
}

#ifdef LEANLM_AVX512
// Row n of w against M rows of x; M is a template constant so that every accumulator lives in a register.
// Rows are read one after another (interleaving several rows' streams measured ~2x slower from memory); for
// one or two rows of x, U accumulators per row hide the FMA latency.
template <int M>
void int8_row_avx512(const float* x, int64_t K, const int8_t* w, const c10::BFloat16* scale, float* y, int64_t N,
                     int64_t n) {
  constexpr int U = M <= 2 ? 4 : 1;
  const int8_t* row = w + n * K;
  __m512 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U)
    for (int u = 0; u < U; ++u) {
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + k + 16 * u))));
      for (int m = 0; m < M; ++m) acc[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k + 16 * u), acc[m][u]);
    }
  for (; k < K; k += 16) {  // the last K % (16 U) weights
    const __mmask16 mask = K - k >= 16 ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, row + k)));
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * K + k), acc[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    for (int u = 1; u < U; ++u) acc[m][0] = _mm512_add_ps(acc[m][0], acc[m][u]);
    y[m * N + n] = _mm512_reduce_add_ps(acc[m][0]) * float(scale[n]);
  }
}

template <int M>
void int8_block(const float* x, int64_t K, const int8_t* w, const c10::BFloat16* scale, float* y, int64_t N,
                int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) int8_row_avx512<M>(x, K, w, scale, y, N, n);
}

using Int8Block = void (*)(const float*, int64_t, const int8_t*, const c10::BFloat16*, float*, int64_t, int64_t,
                           int64_t);
constexpr Int8Block kInt8Blocks[] = {nullptr,        int8_block<1>, int8_block<2>, int8_block<3>, int8_block<4>,
                                     int8_block<5>, int8_block<6>, int8_block<7>, int8_block<8>};
#endif

void int8_row(const float* x, int64_t M, int64_t K, const int8_t* w, const c10::BFloat16* scale, float* y,
              int64_t N, int64_t n) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    const int8_t* wn = w + n * K;
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += xm[k] * float(wn[k]);
    y[m * N + n] = acc * float(scale[n]);
  }
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  check(x, w, K);
  TORCH_CHECK(w.scalar_type() == at::kChar && scale.scalar_type() == at::kBFloat16 && scale.numel() == N,
              "int8_gemv wants an int8 weight [N, K] and bf16 scales [N]");
  const std::vector<float> xf = rows_as_float(x);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data();
  const int8_t* wp = w.data_ptr<int8_t>();
  const c10::BFloat16* sp = scale.data_ptr<c10::BFloat16>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
#ifdef LEANLM_AVX512
    for (int64_t t0 = n0; t0 < n1; t0 += kTile)
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
        kInt8Blocks[std::min(kMaxRows, M - m0)](xp + m0 * K, K, wp, sp, yp + m0 * N, N, t0, std::min(t0 + kTile, n1));
#else
    for (int64_t n = n0; n < n1; ++n) int8_row(xp, M, K, wp, sp, yp, N, n);
#endif
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(LEANLM_NS, m) { m.def("int8_gemv(Tensor x, Tensor w, Tensor scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(LEANLM_NS, CPU, m) { m.impl("int8_gemv", int8_gemv); }
