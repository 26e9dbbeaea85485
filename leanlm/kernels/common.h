// What cpu.cpp, sparse.cpp and amx.cpp share: the ISA selection, the activation rows rounded to int16 (Rows), and small
// vector helpers. Both files include it inside one extension (leanlm/kernels/__init__.py hashes it with them).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef LEANLM_NS
#define LEANLM_NS leanlm  // the op namespace: torch.ops.leanlm.*
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(LEANLM_PORTABLE)
#define LEANLM_AVX512 1
#define LEANLM_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && !defined(LEANLM_PORTABLE)
#define LEANLM_AVX2 1
#define LEANLM_ISA "avx2"
#else
#define LEANLM_ISA "portable"
#endif
#if defined(LEANLM_AVX512) || defined(LEANLM_AVX2)
#define LEANLM_SIMD 1  // integer dot products on int16-rounded activations
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kMaxRows = 8;  // rows of x per pass over the weights (their accumulators stay in registers)

// A kernel's dispatch table by rows of x: kTiles<Tiles, R>[m - 1] is Tiles::at<m>, for m <= R (a kernel's loops are
// unrolled over its rows, whose count is picked at run time)
template <typename Tiles, size_t... M>
constexpr auto tile_table(std::index_sequence<M...>) {
  return std::array{Tiles::template at<int(M) + 1>...};
}
template <typename Tiles, int64_t R>
constexpr auto kTiles = tile_table<Tiles>(std::make_index_sequence<R>());

// The rows of x as float32 (any float dtype, any strides), and for the vector loops also as int16 with a scale
// per row, zero-padded to Kp (a multiple of 64: sparse.cpp reads 64 a step). Plain loops: a tensor op costs
// microseconds, ~120 per step. The buffers are kept per thread and reused, as a decode step makes ~120 products
// and their malloc/free showed.
struct Rows {
  int64_t M, K, Kp;
  const float* f;                // [M, K]
  const int16_t* q = nullptr;    // [M, Kp]
  const float* scale = nullptr;  // [M]: x ~ q * scale

  // x [M, K] rounded to int16 per row; from 16 rows on (prefill) the rows are split across the threads
  explicit Rows(const at::Tensor& x) : Rows(x.size(0), x.size(1)) {
    float* fp = fbuf().data();  // this thread's buffers, filled by every thread
    [[maybe_unused]] float* sp = sbuf().data();
    [[maybe_unused]] int16_t* qp = qbuf().data();
    const int64_t sm = x.stride(0), sk = x.stride(1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rows", [&] {
      const scalar_t* p = x.data_ptr<scalar_t>();
      at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
          for (int64_t k = 0; k < K; ++k) fp[m * K + k] = float(p[m * sm + k * sk]);
#ifdef LEANLM_SIMD
          sp[m] = round_row(fp + m * K, K, qp + m * Kp);
#endif
        }
      });
    });
  }

  // x = codes [M, K] int8 (contiguous) times scales [M] float32, as W8A8 quantized it: widened, not rounded again
  Rows(const at::Tensor& codes, const at::Tensor& scales) : Rows(codes.size(0), codes.size(1)) {
    const int8_t* c = codes.data_ptr<int8_t>();
    float *fp = fbuf().data(), *sp = sbuf().data();
    std::memcpy(sp, scales.data_ptr<float>(), M * sizeof(float));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) fp[m * K + k] = c[m * K + k] * sp[m];
#ifdef LEANLM_SIMD
    for (int64_t m = 0; m < M; ++m) std::copy(c + m * K, c + (m + 1) * K, qbuf().data() + m * Kp);
#endif
  }

 private:
  Rows(int64_t M_, int64_t K_) : M(M_), K(K_), Kp((K_ + 63) / 64 * 64) {
    fbuf().resize(M * K);
    sbuf().resize(M);
    f = fbuf().data();
    scale = sbuf().data();
#ifdef LEANLM_SIMD
    qbuf().assign(M * Kp, 0);
    q = qbuf().data();
#endif
  }
  static std::vector<float>& fbuf() { thread_local std::vector<float> b; return b; }
  static std::vector<float>& sbuf() { thread_local std::vector<float> b; return b; }
  static std::vector<int16_t>& qbuf() { thread_local std::vector<int16_t> b; return b; }

 public:
#ifdef LEANLM_AVX512
  static __mmask16 tail(int64_t left) { return left >= 16 ? 0xffff : (1u << left) - 1; }

  // f [K] -> q [K] = round(f / scale) to nearest even (as std::nearbyint), |q| <= 32767; returns the scale
  static float round_row(const float* f, int64_t K, int16_t* q) {
    __m512 amax16 = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16)
      amax16 = _mm512_max_ps(amax16, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail(K - k), f + k)));
    const float amax = _mm512_reduce_max_ps(amax16);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    for (int64_t k = 0; k < K; k += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail(K - k), f + k), inv));
      _mm256_mask_storeu_epi16(q + k, tail(K - k), _mm512_cvtsepi32_epi16(v));
    }
    return amax / 32767.f;
  }
#elif defined(LEANLM_AVX2)
  static float round_row(const float* f, int64_t K, int16_t* q) {  // as above, 8 at a time
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 amax8 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, _mm256_loadu_ps(f + k)));
    float amax = 0.f, lanes[8];
    _mm256_storeu_ps(lanes, amax8);
    for (float a : lanes) amax = std::max(amax, a);
    for (int64_t t = k; t < K; ++t) amax = std::max(amax, std::fabs(f[t]));
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (k = 0; k + 8 <= K; k += 8) {
      const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(f + k), _mm256_set1_ps(inv)));
      _mm_storeu_si128((__m128i*)(q + k), _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
    }
    for (; k < K; ++k) q[k] = int16_t(std::nearbyint(f[k] * inv));
    return amax / 32767.f;
  }
#endif
};

// sum_k x[m, k] over each group of g columns of M rows of int8 codes -> [M, K / g]: with g = K the W8A8 kernels'
// 128 x sum term, with W4A16's groups W4A8's zero-point term (cpu.cpp)
std::vector<int32_t> group_sums(const int8_t* x, int64_t M, int64_t K, int64_t g) {
  const int64_t G = K / g;
  std::vector<int32_t> sums(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < G; ++j) {
      int32_t s = 0;
      for (int64_t k = j * g; k < (j + 1) * g; ++k) s += x[m * K + k];
      sums[m * G + j] = s;
    }
  return sums;
}

#ifdef LEANLM_AVX512
inline __m512 bf16x16(const bf16* p) {  // 16 bf16 -> float32 (bf16 is float32's top half)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 masked16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 masked16(const bf16* p, __mmask16 mask) {  // the masked lanes 0
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
#endif

#ifdef LEANLM_SIMD
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

}  // namespace
