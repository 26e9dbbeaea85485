// Weight-only quantized matrix-vector products for decode on CPU: y[m, n] = sum_k x[m, k] * w[n, k] for a
// few rows of x (M <= 8) against int8 or int4 weights, streaming each weight byte once.
//
// Built at first use by leanlm/kernels/__init__.py with -march=native. With AVX-512 (F, BW, BF16) the inner
// loops are written with intrinsics; otherwise plain loops that the compiler vectorizes. LEANLM_PORTABLE forces
// the plain loops (the tests build both and check each against a float reference).
//
// int8 (W8A16): w [N, K] int8, one scale per row.  y = scale[n] * sum_k x[k] w[n, k], accumulated in float32.
// int4 (W4A16): w [N, K/2] uint8 in chunks of c = 64 weights along K (c = 32 for a last, partial chunk): byte i
// of a chunk holds its weight i in the low nibble and i + c/2 in the high one, so one load unpacks to two runs of
// consecutive k. Groups of G along K (G = 32, 64 or 128) carry a scale s and a minimum m: w = q * s + m, q in
// [0, 15]. K % G == 0, so a partial chunk happens only with G = 32, as the last group.
// The AVX-512 int4 loop turns q into the bf16 number 128 + q by OR-ing 0x4300 into it (128 + q is exact in
// bf16 for q < 128) and multiplies with bf16 x by `vdpbf16ps` (32 products per instruction, float32 sums), so
// sum_k x (q s + m) = s * sum_k x (128 + q) + (m - 128 s) * sum_k x, per group.

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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && !defined(LEANLM_PORTABLE)
#define LEANLM_AVX512 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 8;  // rows of x per call; more is prefill, which a GEMM does better
constexpr int64_t kChunk = 64;   // int4 weights per 32-byte chunk

void check(const at::Tensor& x, const at::Tensor& w, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows, "leanlm kernels take x [M <= 8, K], got ", x.sizes());
  TORCH_CHECK(x.size(1) == K, "x has K = ", x.size(1), ", the weight ", K);
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "the weight must be a contiguous CPU tensor");
}

// ---------------------------------------------------------------------------------------------- int8
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
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const c10::BFloat16* sp = scale.data_ptr<c10::BFloat16>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
#ifdef LEANLM_AVX512
    kInt8Blocks[M](xp, K, wp, sp, yp, N, n0, n1);
#else
    for (int64_t n = n0; n < n1; ++n) int8_row(xp, M, K, wp, sp, yp, N, n);
#endif
  });
  return y;
}

// ---------------------------------------------------------------------------------------------- int4
// Per group sums of x, which the group minima multiply.  -> [M, K / G]
std::vector<float> group_sums(const float* x, int64_t M, int64_t K, int64_t G) {
  std::vector<float> s(M * (K / G), 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) s[m * (K / G) + k / G] += x[m * K + k];
  return s;
}

#ifdef LEANLM_AVX512
// Rows n .. n + R - 1: per row sum_g s_g sum_{k in g} x_k (128 + q_k) -> tot [M, R]. Each 32-byte chunk (64
// weights) unpacks to two vectors of 32 bf16 numbers 128 + q, multiplied with x by vdpbf16ps.
template <int M, int G, int R>
void int4_rows(const c10::BFloat16* x, int64_t K, const uint8_t* w, const c10::BFloat16* scale, float* tot,
               int64_t n) {
  constexpr int64_t step = G < kChunk ? kChunk : G;  // weights per pass: a group, or a chunk of two groups of 32
  const __m512i low4 = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);  // bf16 0x4300 = 128
  __m512 sum[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) sum[r][m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 + step <= K; k0 += step) {
    __m512 lo_acc[R][M], hi_acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) lo_acc[r][m] = hi_acc[r][m] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k0 + step; k += kChunk) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* chunk = w + (n + r) * K / 2 + k / 2;
        const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)chunk));
        const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(q, low4, bias, 0xEA);  // (q & 15) | 0x4300
        const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(q, 4), bias);
        for (int m = 0; m < M; ++m) {
          lo_acc[r][m] = _mm512_dpbf16_ps(lo_acc[r][m], lo, (__m512bh)_mm512_loadu_si512(x + m * K + k));
          hi_acc[r][m] = _mm512_dpbf16_ps(hi_acc[r][m], hi, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const c10::BFloat16* s = scale + (n + r) * (K / G) + k0 / G;
      for (int m = 0; m < M; ++m) {
        if (G == 32) {  // the low and high halves of a chunk are two groups
          sum[r][m] = _mm512_fmadd_ps(lo_acc[r][m], _mm512_set1_ps(float(s[0])), sum[r][m]);
          sum[r][m] = _mm512_fmadd_ps(hi_acc[r][m], _mm512_set1_ps(float(s[1])), sum[r][m]);
        } else {
          sum[r][m] = _mm512_fmadd_ps(_mm512_add_ps(lo_acc[r][m], hi_acc[r][m]), _mm512_set1_ps(float(s[0])), sum[r][m]);
        }
      }
    }
  }
  if (G == 32 && K % kChunk) {  // the last group of 32 is a partial chunk: 16 bytes, 16-wide halves
    const int64_t k = K - 32;
    const __m256i low4h = _mm256_set1_epi16(0x000F), biash = _mm256_set1_epi16(0x4300);
    for (int r = 0; r < R; ++r) {
      const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(w + (n + r) * K / 2 + k / 2)));
      const __m256bh lo = (__m256bh)_mm256_ternarylogic_epi32(q, low4h, biash, 0xEA);
      const __m256bh hi = (__m256bh)_mm256_or_si256(_mm256_srli_epi16(q, 4), biash);
      const __m512 s = _mm512_set1_ps(float(scale[(n + r) * (K / G) + K / G - 1]));
      for (int m = 0; m < M; ++m) {
        __m256 acc = _mm256_dpbf16_ps(_mm256_setzero_ps(), lo, (__m256bh)_mm256_loadu_si256((const __m256i*)(x + m * K + k)));
        acc = _mm256_dpbf16_ps(acc, hi, (__m256bh)_mm256_loadu_si256((const __m256i*)(x + m * K + k + 16)));
        sum[r][m] = _mm512_fmadd_ps(_mm512_zextps256_ps512(acc), s, sum[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) tot[m * R + r] = _mm512_reduce_add_ps(sum[r][m]);
}

template <int M, int G>
void int4_block(const c10::BFloat16* x, int64_t K, const uint8_t* w, const c10::BFloat16* scale, float* tot,
                int64_t n0, int64_t n1) {  // tot [M, n1 - n0]
  constexpr int R = 1;
  float t[M * R];
  for (int64_t n = n0; n < n1; n += R) {
    if (n + R > n1) {  // an odd last row
      int4_rows<M, G, 1>(x, K, w, scale, t, n);
      for (int m = 0; m < M; ++m) tot[m * (n1 - n0) + n - n0] = t[m];
      continue;
    }
    int4_rows<M, G, R>(x, K, w, scale, t, n);
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) tot[m * (n1 - n0) + n - n0 + r] = t[m * R + r];
  }
}

using Int4Block = void (*)(const c10::BFloat16*, int64_t, const uint8_t*, const c10::BFloat16*, float*, int64_t,
                           int64_t);
template <int G>
constexpr Int4Block kInt4Blocks[] = {nullptr,          int4_block<1, G>, int4_block<2, G>, int4_block<3, G>,
                                     int4_block<4, G>, int4_block<5, G>, int4_block<6, G>, int4_block<7, G>,
                                     int4_block<8, G>};
#endif

// The same sums in plain loops.  -> tot [M, n1 - n0]
void int4_block_portable(const float* x, int64_t M, int64_t K, int64_t G, const uint8_t* w,
                         const c10::BFloat16* scale, float* tot, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * K / 2;
    for (int64_t m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t g = 0; g < K / G; ++g) {
        float acc = 0.f;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) {
          const int64_t start = k / kChunk * kChunk, half = std::min(kChunk, K - start) / 2;
          const uint8_t byte = row[start / 2 + (k - start) % half];
          acc += x[m * K + k] * float(128 + (k - start < half ? byte & 15 : byte >> 4));
        }
        sum += acc * float(scale[n * (K / G) + g]);
      }
      tot[m * (n1 - n0) + n - n0] = sum;
    }
  }
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& mins,
                     int64_t G) {
  const int64_t N = w.size(0), K = 2 * w.size(1), M = x.size(0);
  check(x, w, K);
  TORCH_CHECK(G == 32 || G == 64 || G == 128, "int4_gemv: group size must be 32, 64 or 128, got ", G);
  TORCH_CHECK(K % G == 0, "int4_gemv: K = ", K, " must be a multiple of the group size ", G);
  TORCH_CHECK(w.scalar_type() == at::kByte && scale.scalar_type() == at::kBFloat16 &&
                  mins.scalar_type() == at::kBFloat16 && scale.numel() == N * (K / G) && mins.numel() == N * (K / G),
              "int4_gemv wants a uint8 weight [N, K/2] and bf16 scales and minima [N, K/G]");
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();  // the products use x rounded to bf16
  const at::Tensor xf = xb.to(at::kFloat);
  const std::vector<float> xsum = group_sums(xf.data_ptr<float>(), M, K, G);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::BFloat16 *sp = scale.data_ptr<c10::BFloat16>(), *mp = mins.data_ptr<c10::BFloat16>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    std::vector<float> tot(M * (n1 - n0));
#ifdef LEANLM_AVX512
    const Int4Block* blocks = G == 32 ? kInt4Blocks<32> : G == 64 ? kInt4Blocks<64> : kInt4Blocks<128>;
    blocks[M](xb.data_ptr<c10::BFloat16>(), K, wp, sp, tot.data(), n0, n1);
#else
    int4_block_portable(xf.data_ptr<float>(), M, K, G, wp, sp, tot.data(), n0, n1);
#endif
    for (int64_t n = n0; n < n1; ++n) {
      const c10::BFloat16 *s = sp + n * (K / G), *mn = mp + n * (K / G);
      for (int64_t m = 0; m < M; ++m) {  // + sum_g (m_g - 128 s_g) sum_{k in g} x_k
        float corr = 0.f;
        for (int64_t g = 0; g < K / G; ++g) corr += (float(mn[g]) - 128.f * float(s[g])) * xsum[m * (K / G) + g];
        yp[m * N + n] = tot[m * (n1 - n0) + n - n0] + corr;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(LEANLM_NS, m) {
  m.def("int8_gemv(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int4_gemv(Tensor x, Tensor w, Tensor scale, Tensor mins, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(LEANLM_NS, CPU, m) {
  m.impl("int8_gemv", int8_gemv);
  m.impl("int4_gemv", int4_gemv);
}
