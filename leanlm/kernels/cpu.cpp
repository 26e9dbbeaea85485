// Products of a few activation rows (decode, a short prompt, a speculative check) with quantized weights, on CPU:
//   int8_gemv: y[m, n] = scale[n] * sum_k x[m, k] w[n, k]               w [N, K] int8, one scale per row
//   int8_gemv_q8: the same with x given as int8 codes and a scale per row (W8A8's per-token activations); with
//                 AVX-512 on the codes as they are (`vpdpbusd`, blocks of 4 x rows by 4 weight rows: q8_block)
//   quantize_rows: those codes and scales from x in one pass
//   rescale: y = acc * xs[m] * scale[n], the epilogue of W8A8's torch._int_mm and W8A16's GEMM on widened codes
//   int4_gemv: y[m, n] = sum_k x[m, k] ((q[n, k] - 8) s[n, k/g] + z[n, k/g])   q in [0, 15], groups of g along K
//   bf16_gemm: y[m, n] = sum_k x[m, k] w[n, k]                       x, w bf16 (batched decode of 16-bit models)
//
// The activation rows are rounded to int16 with one scale per row (error at most 2^-16 of the row's largest
// entry, far below the 2^-9 of the bf16 rows themselves), so the inner loops are integer dot products:
// AVX-512 VNNI `vpdpwssd` multiplies 32 int16 pairs into 16 int32 lanes, half the instructions per weight of
// widening to float and FMA; the weights stream from memory at full speed instead of the cores falling behind.
//
// int4 layout (pack_int4 in leanlm/lowbit/linear.py): rows in tiles of 16; a tile holds, for every 4 columns
// k..k+3, 32 bytes where bytes 2i and 2i + 1 are row i's (q[k] | q[k + 2] << 4) and (q[k + 1] | q[k + 3] << 4).
// Zero-extended to 16 bits, a byte pair is one 32-bit lane: `& 15` gives row i's pair (q[k], q[k + 1]), `>> 4`
// the pair (q[k + 2], q[k + 3]), each against one broadcast pair of activations. The 16 lanes are 16 output rows,
// so a tile needs no horizontal sum, and its group scales are one vector load.
//
// Without AVX-512 (Zen 3 and older, most laptops) AVX2 does the same with `vpmaddwd`, 16 int16 pairs into 8 int32
// lanes: an int4 tile is two vectors of 8 rows, and the int16 sums need an add after each multiply. These loops
// also prefetch the weights a few KiB ahead of the loads, which the memory system then overlaps with the compute.
//
// Built at first use by leanlm/kernels/__init__.py with -march=native: AVX-512 (F, BW, VNNI) intrinsics where the
// CPU has them, else AVX2 + FMA intrinsics, else plain loops in float. LEANLM_PORTABLE forces the plain loops;
// -mno-avx512f gives the AVX2 loops on an AVX-512 machine (the tests build all three and check each against a
// float reference). isa() says which one a build runs.

#include "common.h"

namespace {

at::Tensor check(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, at::ScalarType wtype,
                 const char* what) {
  TORCH_CHECK(x.dim() == 2, "the product takes x [M, K], got ", x.sizes());
  TORCH_CHECK(x.size(1) == K, "x has K = ", x.size(1), ", the weight ", K);
  TORCH_CHECK(w.scalar_type() == wtype, "wants ", what);
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "the weight must be a contiguous CPU tensor");
  return at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
}

#ifdef LEANLM_SIMD
// Zen 3's hardware prefetcher alone leaves the AVX2 int4 loop at 9-15 GB/s and the int8 loop at 12-18 (2 threads);
// asking for the weight bytes 4 KiB ahead raised them by 5-25% (1024 to 4096 bytes all helped, 4096 most). On Zen 4
// the AVX-512 loops gained 4-18% from it with 4 rows of x, but one row (batch-1 decode) lost 7-25% in int8 and was
// level in int4 (3 A/B runs, the default model's matrices, 1 and 2 threads): they ask only for 2+ rows.
// -DLEANLM_PREFETCH=0 builds every loop without it, for such an A/B.
#ifndef LEANLM_PREFETCH
#define LEANLM_PREFETCH 4096
#endif
constexpr int64_t kPrefetch = LEANLM_PREFETCH;

inline void prefetch(const void* p) {
  if constexpr (kPrefetch > 0) _mm_prefetch((const char*)p + kPrefetch, _MM_HINT_T0);
}
#endif

#ifdef LEANLM_AVX512
constexpr int64_t kChunk = 4096;  // int32 sums go to float this often: |sum| < 2 * 32767 * 128 * 4096 / 32 < 2^31

inline __m512i pair(const int16_t* p) {  // broadcast two adjacent int16 to every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Rows n0..n1 of w against M rows of x, along K: each row's 16 int32 lanes are summed at its end.
template <int M, typename S>
void int8_rows(const int16_t* xq, const float* xs, int64_t K, int64_t Kp, const int8_t* w, const S* scale,
               float* y, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    __m512 sum[M];
    for (int m = 0; m < M; ++m) sum[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < K; c += kChunk) {
      const int64_t end = std::min(K, c + kChunk);
      __m512i acc[M][2];  // two chains hide vpdpwssd's latency when M is small
      for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
      int64_t k = c;
      for (; k + 64 <= end; k += 64) {
        if constexpr (M > 1) prefetch(row + k);
        for (int u = 0; u < 2; ++u) {
          const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(row + k + 32 * u)));
          for (int m = 0; m < M; ++m)
            acc[m][u] = _mm512_dpwssd_epi32(acc[m][u], wv, _mm512_loadu_si512(xq + m * Kp + k + 32 * u));
        }
      }
      for (; k < end; k += 32) {  // x is zero-padded to Kp, so only the weight load is masked
        const __mmask32 mask = end - k >= 32 ? ~0u : (1u << (end - k)) - 1;
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, row + k));
        for (int m = 0; m < M; ++m)
          acc[m][0] = _mm512_dpwssd_epi32(acc[m][0], wv, _mm512_loadu_si512(xq + m * Kp + k));
      }
      for (int m = 0; m < M; ++m)
        sum[m] = _mm512_add_ps(sum[m], _mm512_cvtepi32_ps(_mm512_add_epi32(acc[m][0], acc[m][1])));
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(sum[m]) * xs[m] * float(scale[n]);
  }
}

// Tiles t0..t1 (16 rows each) of the int4 weight against M rows of x; xsum [M, K/g]: x's sum over each group.
template <int M>
void int4_tiles(const int16_t* xq, const float* xs, const float* xsum, int64_t K, int64_t Kp, const uint8_t* w,
                const bf16* scales, const bf16* zeros, int64_t g, float* y, int64_t N, int64_t t0, int64_t t1) {
  // one or two rows of x: two quads of columns per step, four accumulator chains (10-20% faster from memory)
  constexpr int U = M <= 2 ? 2 : 1;
  const int64_t G = K / g;
  const __m512i low4 = _mm512_set1_epi16(15);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * 8 * K;  // 16 rows x K / 2 bytes
    __m512 sum[M];
    for (int m = 0; m < M; ++m) sum[m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < G; ++j) {
      __m512i acc[M][2 * U];
      for (int m = 0; m < M; ++m)
        for (int u = 0; u < 2 * U; ++u) acc[m][u] = _mm512_setzero_si512();
      for (int64_t k = j * g; k < (j + 1) * g; k += 4 * U) {
        if constexpr (M > 1) prefetch(tile + k * 8);
        for (int u = 0; u < U; ++u) {
          const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(tile + (k + 4 * u) * 8)));
          const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
          for (int m = 0; m < M; ++m) {
            const int16_t* xm = xq + m * Kp + k + 4 * u;
            acc[m][2 * u] = _mm512_dpwssd_epi32(acc[m][2 * u], lo, pair(xm));
            acc[m][2 * u + 1] = _mm512_dpwssd_epi32(acc[m][2 * u + 1], hi, pair(xm + 2));
          }
        }
      }
      for (int m = 0; m < M; ++m)
        for (int u = 1; u < 2 * U; ++u) acc[m][0] = _mm512_add_epi32(acc[m][0], acc[m][u]);
      // x w = s (x q) + (z - 8 s) x over the group, with x q = xs * (xq q)
      const __m512 s = bf16x16(scales + j * N + t * 16);
      const __m512 zb = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, bf16x16(zeros + j * N + t * 16));
      for (int m = 0; m < M; ++m) {
        const __m512 dot = _mm512_cvtepi32_ps(acc[m][0]);
        sum[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(xs[m])), sum[m]);
        sum[m] = _mm512_fmadd_ps(zb, _mm512_set1_ps(xsum[m * G + j]), sum[m]);
      }
    }
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + m * N + t * 16, sum[m]);
  }
}

#elif defined(LEANLM_AVX2)
constexpr int64_t kChunk = 4096;  // as above: 8 lanes, two chains, |sum| < 2 * 32767 * 128 * 4096 / 16 / 2 < 2^31

inline __m256 bf16x8(const bf16* p) {  // 8 bf16 -> float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) { return bf16x8(p); }
inline void to_float(const bf16* x, int64_t n, float* out) {  // n bf16 -> float32
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, bf16x8(x + i));
  for (; i < n; ++i) out[i] = float(x[i]);
}
inline __m256i bf16_bits(__m256 v) {  // rounded to nearest even as bf16(float), in the top half of each lane
  const __m256i b = _mm256_castps_si256(v);  // (the bottom half left to clear)
  return _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)),
                          _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)));
}
inline void store_out(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store_out(bf16* p, __m256 v) {
  const __m256i h = _mm256_srli_epi32(bf16_bits(v), 16);  // at most 0xFFFF: packs exactly
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xd8)));
}

inline __m256i pair(const int16_t* p) {  // broadcast two adjacent int16 to every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + (pairwise int16 products summed into int32); the sums in GCC's own int32 type, as arrays of __m256i (long long
// lanes) updated through the int32 intrinsics were copied and spilled around every product (perf, w8_packed_tile)
inline __v8si dot(__v8si acc, __m256i a, __m256i b) { return acc + (__v8si)_mm256_madd_epi16(a, b); }

// Rows n0..n1 of w against M rows of x, as the AVX-512 loop; columns past the last 16 in plain integer loops.
template <int M, typename S>
void int8_rows(const int16_t* xq, const float* xs, int64_t K, int64_t Kp, const int8_t* w, const S* scale,
               float* y, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    __m256 sum[M];
    int32_t rest[M] = {};
    for (int m = 0; m < M; ++m) sum[m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < K; c += kChunk) {
      const int64_t end = std::min(K, c + kChunk);
      __v8si acc[M][2];
      for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = __v8si{};
      int64_t k = c;
      for (; k + 32 <= end; k += 32) {
        prefetch(row + k);
        for (int u = 0; u < 2; ++u) {
          const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(row + k + 16 * u)));
          for (int m = 0; m < M; ++m)
            acc[m][u] = dot(acc[m][u], wv, _mm256_loadu_si256((const __m256i*)(xq + m * Kp + k + 16 * u)));
        }
      }
      for (; k + 16 <= end; k += 16) {
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(row + k)));
        for (int m = 0; m < M; ++m) acc[m][0] = dot(acc[m][0], wv, _mm256_loadu_si256((const __m256i*)(xq + m * Kp + k)));
      }
      for (; k < end; ++k)
        for (int m = 0; m < M; ++m) rest[m] += row[k] * xq[m * Kp + k];
      for (int m = 0; m < M; ++m)
        sum[m] = _mm256_add_ps(sum[m], _mm256_cvtepi32_ps((__m256i)(acc[m][0] + acc[m][1])));
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = (hsum(sum[m]) + float(rest[m])) * xs[m] * float(scale[n]);
  }
}

// Tiles t0..t1 of the int4 weight against M rows of x, as the AVX-512 loop; a tile's 16 rows are two vectors
// (h = 0, 1) of 8, each fed by 16 of the 32 bytes that hold 4 columns.
template <int M>
void int4_tiles(const int16_t* xq, const float* xs, const float* xsum, int64_t K, int64_t Kp, const uint8_t* w,
                const bf16* scales, const bf16* zeros, int64_t g, float* y, int64_t N, int64_t t0, int64_t t1) {
  const int64_t G = K / g;
  const __m256i low4 = _mm256_set1_epi16(15);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * 8 * K;
    __m256 sum[M][2];
    for (int m = 0; m < M; ++m) sum[m][0] = sum[m][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < G; ++j) {
      __v8si acc[M][2];
      for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = __v8si{};
      for (int64_t k = j * g; k < (j + 1) * g; k += 4) {
        prefetch(tile + k * 8);
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(tile + k * 8 + 16 * h)));
          const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_srli_epi16(v, 4);
          for (int m = 0; m < M; ++m)
            acc[m][h] = dot(dot(acc[m][h], lo, pair(xq + m * Kp + k)), hi, pair(xq + m * Kp + k + 2));
        }
      }
      for (int h = 0; h < 2; ++h) {  // x w = s (x q) + (z - 8 s) x over the group, with x q = xs * (xq q)
        const __m256 s = bf16x8(scales + j * N + t * 16 + 8 * h);
        const __m256 zb = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, bf16x8(zeros + j * N + t * 16 + 8 * h));
        for (int m = 0; m < M; ++m) {
          const __m256 dotf = _mm256_cvtepi32_ps((__m256i)acc[m][h]);
          sum[m][h] = _mm256_fmadd_ps(dotf, _mm256_mul_ps(s, _mm256_set1_ps(xs[m])), sum[m][h]);
          sum[m][h] = _mm256_fmadd_ps(zb, _mm256_set1_ps(xsum[m * G + j]), sum[m][h]);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + m * N + t * 16 + 8 * h, sum[m][h]);
  }
}
#endif

#ifdef LEANLM_SIMD
template <typename S>  // the weight scales' type: bf16 (W8A16) or float (W8A8)
struct Int8Rows {
  template <int M>
  static constexpr auto at = int8_rows<M, S>;
};
struct Int4Tiles {
  template <int M>
  static constexpr auto at = int4_tiles<M>;
};
#ifdef LEANLM_AVX2
// rows a pass: at 8 the 16 accumulators and the codes overflowed AVX2's 16 registers; 4 rows a pass were 1.13-1.17x
// faster at 8-64 rows than 8 (5 and 6 in between; Zen 3, 2 threads, 30 layers' gate_up_proj and down_proj)
constexpr int64_t kInt4Rows = 4;
#else
constexpr int64_t kInt4Rows = kMaxRows;
#endif
#endif

// q[n, k] of the tiled int4 layout above
inline int nibble(const uint8_t* w, int64_t K, int64_t n, int64_t k) {
  const uint8_t b = w[(n / 16) * 8 * K + (k / 4) * 32 + 2 * (n % 16) + (k % 2)];
  return k % 4 < 2 ? b & 15 : b >> 4;
}

// y [M, N] = r's rows times w [N, K] int8, times scale [N]
template <typename S>
void int8_product(const Rows& r, const at::Tensor& w, const S* sp, at::Tensor& y) {
  const int64_t N = w.size(0), K = w.size(1), M = r.M;
  const int8_t* wp = w.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
#ifdef LEANLM_SIMD
    for (int64_t t = n0; t < n1; t += 64)  // 64 weight rows stay in cache while each block of x rows uses them
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
        kTiles<Int8Rows<S>, kMaxRows>[std::min(kMaxRows, M - m0) - 1](r.q + m0 * r.Kp, r.scale + m0, K, r.Kp, wp, sp,
                                                                      yp + m0 * N, N, t, std::min(t + 64, n1));
#else
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += r.f[m * K + k] * float(wp[n * K + k]);
        yp[m * N + n] = acc * float(sp[n]);
      }
#endif
  });
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  at::Tensor y = check(x, w, w.size(0), w.size(1), at::kChar, "an int8 weight [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.numel() == w.size(0), "int8_gemv wants bf16 scales [N]");
  int8_product(Rows(x), w, scale.data_ptr<bf16>(), y);
  return y;
}

constexpr int64_t kQ8MaxK = 32768;  // the W8A8 kernels' int32 sums are exact up to this K (below)

#ifdef LEANLM_AVX512
// W8A8 on AVX-512 VNNI: `vpdpbusd` multiplies 64 unsigned-by-signed byte pairs into 16 int32 lanes, twice the
// products per instruction of the int16 loops above, read from the int8 codes as they are. The weight's codes are
// made unsigned (w + 128: an xor of the sign bit) and the activations' stay signed, so
// sum_k (w + 128) x = sum_k w x + 128 sum_k x, the second term one number per row of x. Exact while
// K * 255 * 128 < 2^31 (K <= kQ8MaxK). R weight rows against M rows of x: each weight load serves M rows.
// Zen 4, 2 threads, the default model's gate_up_proj and down_proj at 32 rows: 200-280 G multiply-adds a second,
// torch._int_mm 200-240, torch's bf16 GEMM 130-150; the int16 loops ran at half this speed from 8 rows on (one
// thread). Blocks of 4 x 6 were no faster; past ~64 rows oneDNN's packed GEMM is ahead (int8_rows times the switch).
constexpr int kQ8R = 4, kQ8M = 4;

// the lane sums of a, b, c and d  -> [sum a, sum b, sum c, sum d]
inline __m128i sum4x16(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));  // a b a b per 128
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));  // a b c d
  const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

template <int R, int M>
void q8_block(const int8_t* x, const int32_t* xsum, const float* xs, int64_t K, const int8_t* w, const float* scale,
              float* y, int64_t N, int64_t n) {
  __m512i acc[R * M];
#pragma GCC unroll 32
  for (int i = 0; i < R * M; ++i) acc[i] = _mm512_setzero_si512();
  const __m512i sign = _mm512_set1_epi8(-128);
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 mask = K - k >= 64 ? ~0ull : (1ull << (K - k)) - 1;  // past K: x is 0, so each product is 0
    __m512i wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + (n + r) * K + k), sign);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512i xv = _mm512_maskz_loadu_epi8(mask, x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r * M + m] = _mm512_dpbusd_epi32(acc[r * M + m], wv[r], xv);
    }
  }
  if constexpr (R == 4) {  // each row of x: its 4 sums reduced together, rescaled and stored as one vector
    const __m128 s4 = _mm_loadu_ps(scale + n);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m128i sums = sum4x16(acc[m], acc[M + m], acc[2 * M + m], acc[3 * M + m]);
      const __m128 v = _mm_cvtepi32_ps(_mm_sub_epi32(sums, _mm_set1_epi32(128 * xsum[m])));
      _mm_storeu_ps(y + m * N + n, _mm_mul_ps(_mm_mul_ps(v, _mm_set1_ps(xs[m])), s4));
    }
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
        y[m * N + n + r] = float(_mm512_reduce_add_epi32(acc[r * M + m]) - 128 * xsum[m]) * xs[m] * scale[n + r];
  }
}

using Q8Block = void (*)(const int8_t*, const int32_t*, const float*, int64_t, const int8_t*, const float*, float*,
                         int64_t, int64_t);
constexpr Q8Block kQ8[2][kQ8M + 1] = {{nullptr, q8_block<1, 1>, q8_block<1, 2>, q8_block<1, 3>, q8_block<1, 4>},
                                      {nullptr, q8_block<kQ8R, 1>, q8_block<kQ8R, 2>, q8_block<kQ8R, 3>,
                                       q8_block<kQ8R, 4>}};

// y [M, N] = xs * scale * (xq w^T) through q8_block, any number of rows
void q8_product(const at::Tensor& xq, const float* xs, const at::Tensor& w, const float* scale, at::Tensor& y) {
  const int64_t M = xq.size(0), K = xq.size(1), N = w.size(0);
  const int8_t *xp = xq.data_ptr<int8_t>(), *wp = w.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const std::vector<int32_t> xsum = group_sums(xp, M, K, K);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1;) {
      const int R = n + kQ8R <= n1 ? kQ8R : 1;
      for (int64_t m0 = 0; m0 < M; m0 += kQ8M)  // the R weight rows stay in L1 for the later rows of x
        kQ8[R == kQ8R][std::min<int64_t>(kQ8M, M - m0)](xp + m0 * K, xsum.data() + m0, xs + m0, K, wp, scale,
                                                        yp + m0 * N, N, n);
      n += R;
    }
  });
}
#endif

// W8A8: y = xs * scale * (xq w^T), the sums exact in int32 (converted to float every kChunk columns)
at::Tensor int8_gemv_q8(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& w, const at::Tensor& scale) {
  at::Tensor y = check(xq, w, w.size(0), w.size(1), at::kChar, "an int8 weight [N, K]");
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.is_contiguous(), "int8_gemv_q8 wants contiguous int8 codes x [M, K]");
  TORCH_CHECK(xs.scalar_type() == at::kFloat && xs.numel() == xq.size(0) && xs.is_contiguous(),
              "int8_gemv_q8 wants float32 scales of x [M]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == w.size(0) && scale.is_contiguous(),
              "int8_gemv_q8 wants float32 scales [N]");
#ifdef LEANLM_AVX512
  if (xq.size(1) <= kQ8MaxK) {
    q8_product(xq, xs.data_ptr<float>(), w, scale.data_ptr<float>(), y);
    return y;
  }
#endif
  int8_product(Rows(xq, xs), w, scale.data_ptr<float>(), y);
  return y;
}

// The last step of a product on int8 codes, in one pass: y = acc * xs[m] * scale[n] in float32, acc [M, N] int32
// (W8A8: torch._int_mm's sums) or bf16 (W8A16: the GEMM on widened codes), xs [M] float32 or none (1), scale [N]
// float32 or bf16. The same operations in the same order as the tensor expressions it replaces (acc.float() * xs *
// scale), so the same bits; those took a conversion and a multiplication or two over [M, N] each: on a 1024-token
// prefill of the default model 0.3 s of a 1.1 s step (W8A8, Zen 4).
at::Tensor rescale(const at::Tensor& acc, const c10::optional<at::Tensor>& xs, const at::Tensor& scale) {
  TORCH_CHECK(acc.dim() == 2 && acc.device().is_cpu() &&
                  (acc.scalar_type() == at::kInt || acc.scalar_type() == at::kBFloat16),
              "rescale takes int32 or bf16 sums [M, N] on the CPU, got ", acc.sizes(), " ", acc.scalar_type());
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(!xs || (xs->scalar_type() == at::kFloat && xs->numel() == M && xs->is_contiguous()),
              "rescale wants float32 scales of x [M]");
  TORCH_CHECK(scale.numel() == N && (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16),
              "rescale wants float32 or bf16 scales of the weight [N]");
  const at::Tensor a = acc.contiguous(), sf = scale.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, a.options().dtype(at::kFloat));
  const float *xp = xs ? xs->data_ptr<float>() : nullptr, *sp = sf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool ints = a.scalar_type() == at::kInt;
  const int32_t* ai = ints ? a.data_ptr<int32_t>() : nullptr;
  const bf16* ab = ints ? nullptr : a.data_ptr<bf16>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float x = xp ? xp[m] : 1.f;  // times 1 is exact
      float* out = yp + m * N;
      int64_t n = 0;
#ifdef LEANLM_AVX512
      const __m512 x16 = _mm512_set1_ps(x);
      for (; n < N; n += 16) {
        const __mmask16 mask = Rows::tail(N - n);
        const __m512 v = ints ? _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, ai + m * N + n))
                              : _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, ab + m * N + n)), 16));
        _mm512_mask_storeu_ps(out + n, mask, _mm512_mul_ps(_mm512_mul_ps(v, x16), _mm512_maskz_loadu_ps(mask, sp + n)));
      }
#endif
      for (; n < N; ++n)
        out[n] = (ints ? float(ai[m * N + n]) : float(ab[m * N + n])) * x * sp[n];
    }
  });
  return y;
}

// W8A8's per-token activation codes of one row of x (float32 or bf16, read as it is stored): scale = max(row's
// max |x|, 1e-12) / 127, codes = x / scale rounded half to even; float32 arithmetic in lowbit.primitives' order
// (compute_qparams, quantize), so codes and scale are bit-identical to them.  -> scale
template <typename T>
float quantize_row(const T* row, int64_t K, int8_t* code) {
  int64_t k = 0;
  float amax = 0.f;
#ifdef LEANLM_AVX512  // the same divisions and roundings, 16 at a time
  __m512 amax16 = _mm512_setzero_ps();
  for (; k < K; k += 16)  // NaN-blind as std::max: the second operand when either is NaN
    amax16 = _mm512_max_ps(_mm512_abs_ps(masked16(row + k, Rows::tail(K - k))), amax16);
  amax = _mm512_reduce_max_ps(amax16);
#elif defined(LEANLM_AVX2)  // 8 at a time, the rest in the scalar loops
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax8 = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, load8(row + k)), amax8);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax8);
  for (const float lane : lanes) amax = std::max(amax, lane);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(float(row[k])));
  const float scale = std::max(amax, 1e-12f) / 127.f;
  k = 0;
#ifdef LEANLM_AVX512
  const __m512 s16 = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  for (; k < K; k += 16) {
    const __mmask16 mask = Rows::tail(K - k);
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(masked16(row + k, mask), s16),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 clamped = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
    _mm_mask_storeu_epi8(code + k, mask, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(clamped)));
  }
#elif defined(LEANLM_AVX2)
  const __m256 s8 = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
  for (; k + 8 <= K; k += 8) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(load8(row + k), s8), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i q32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
    _mm_storel_epi64((__m128i*)(code + k), _mm_packs_epi16(q16, q16));
  }
#endif
  for (; k < K; ++k)
    code[k] = static_cast<int8_t>(std::min(std::max(std::nearbyint(float(row[k]) / scale), -128.f), 127.f));
  return scale;
}

// quantize_row over every row of x [M, K] (float32 or bf16, any other dtype converted to float32 first), in one op
// instead of ~10 tensor ops; bf16 is read as it is (converting it first took half of the op's time at one row)
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quantize_rows takes x [M, K] on the CPU, got ", x.sizes());
  const at::Tensor xc = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.contiguous().to(at::kFloat);
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor q = at::empty({M, K}, xc.options().dtype(at::kChar));
  at::Tensor s = at::empty({M}, xc.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  auto rows = [&](const auto* xp) {
    at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) sp[m] = quantize_row(xp + m * K, K, qp + m * K);
    });
  };
  if (xc.scalar_type() == at::kBFloat16) rows(xc.data_ptr<bf16>());
  else rows(xc.data_ptr<float>());
  return {q, s};
}

// the int4 weight's arguments of int4_gemv and int4_packed_gemm: groups of g along K, scales and zeros [K / g, N]
void check_int4(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros, int64_t g, const char* op) {
  const int64_t N = w.size(0), K = 2 * w.size(-1);
  TORCH_CHECK(g > 0 && g % 4 == 0 && K % g == 0 && N % 16 == 0, op, " needs K (", K, ") a multiple of the group ", g,
              " (a multiple of 4) and N (", N, ") of 16");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16 &&
                  scales.numel() == K / g * N && zeros.numel() == K / g * N && scales.is_contiguous() &&
                  zeros.is_contiguous(),
              op, " wants contiguous bf16 scales and zeros [K / g, N]");
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros,
                     int64_t g) {
  const int64_t N = w.size(0), K = 2 * w.size(-1), M = x.size(0);
  at::Tensor y = check(x, w, N, K, at::kByte, "a uint8 int4 weight [N, K / 2]");
  check_int4(w, scales, zeros, g, "int4_gemv");
  const Rows r(x);
#ifdef LEANLM_SIMD
  const int64_t G = K / g;
  thread_local std::vector<float> xsum;  // for the zero points: sum_k x (z - 8 s) over each group
  xsum.assign(M * G, 0.f);
  const float* xs = xsum.data();  // the lambda below runs on other threads too: they must not read their own xsum
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < G; ++j)
      for (int64_t k = j * g; k < (j + 1) * g; ++k) xsum[m * G + j] += r.f[m * K + k];
#endif
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const bf16 *sp = scales.data_ptr<bf16>(), *zp = zeros.data_ptr<bf16>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / 16, 2, [&](int64_t t0, int64_t t1) {
#ifdef LEANLM_SIMD
    for (int64_t t = t0; t < t1; t += 4)
      for (int64_t m0 = 0; m0 < M; m0 += kInt4Rows)
        kTiles<Int4Tiles, kInt4Rows>[std::min(kInt4Rows, M - m0) - 1](r.q + m0 * r.Kp, r.scale + m0, xs + m0 * G, K,
                                                                      r.Kp, wp, sp, zp, g, yp + m0 * N, N, t,
                                                                      std::min(t + 4, t1));
#else
    for (int64_t n = t0 * 16; n < t1 * 16; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t j = (k / g) * N + n;
          acc += r.f[m * K + k] * ((nibble(wp, K, n, k) - 8) * float(sp[j]) + float(zp[j]));
        }
        yp[m * N + n] = acc;
      }
#endif
  });
  return y;
}

// bf16 products of a few rows (batched decode of a 16-bit model): y [M, N] = x [M, K] w [N, K]^T, x and w bf16.
// torch's bf16 GEMM read the default model's weights at 2-14 GB/s at 2-8 rows here (Zen 4, 2 threads) against 17
// at one row. Here a few weight rows at a time come from memory once and serve every row of x from L1. With
// AVX512-BF16, `vdpbf16ps` multiplies 32 bf16 pairs into 16 float lanes; otherwise the bf16 are widened to float
// for FMAs (8 lanes, AVX2), or plain loops. Sums are float32, rounded to bf16 once. On AVX2 the loop asks for the
// weights 4 KiB ahead (`prefetch`): batch-1 decode's products of the default model, Zen 3, 2 threads, 8.4-9.1 ->
// 10.4-10.5 GB/s (A/B of two builds, alternating; torch's bf16 GEMV 10-11).
#if defined(LEANLM_AVX512) && defined(__AVX512BF16__)
#define LEANLM_BF16_DOT "avx512bf16"
constexpr int64_t kBf16Lanes = 32;  // bf16 of a row per step

inline __mmask32 bf16_tail(int64_t left) { return left >= 32 ? ~0u : (1u << left) - 1; }

// R weight rows from n against M rows of x: each weight load serves the M rows, R chains hide the latency
template <int R, int M>
void bf16_block(const bf16* x, int64_t K, const bf16* w, bf16* y, int64_t N, int64_t n) {
  // unrolled by hand (pragmas): GCC's own heuristics kept the 16 accumulators on the stack, a store and a load
  // around every vdpbf16ps
  __m512 acc[R * M];
#pragma GCC unroll 16
  for (int i = 0; i < R * M; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kBf16Lanes) {
    const __mmask32 mask = bf16_tail(K - k);
    __m512bh wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n + r) * K + k);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r * M + m] = _mm512_dpbf16_ps(acc[r * M + m], xv, wv[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) y[m * N + n + r] = bf16(_mm512_reduce_add_ps(acc[r * M + m]));
}
#elif defined(LEANLM_SIMD)
#define LEANLM_BF16_DOT "fma"
constexpr int64_t kBf16Lanes = 8;

inline __m256 widen8(const bf16* p) {  // 8 bf16 -> float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

template <int R, int M>
void bf16_block(const bf16* x, int64_t K, const bf16* w, bf16* y, int64_t N, int64_t n) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[R];
    if (k % 32 == 0)  // a cache line of each weight row: ask for the one 4 KiB ahead (the next block's rows)
      for (int r = 0; r < R; ++r) prefetch(w + (n + r) * K + k);
    for (int r = 0; r < R; ++r) wv[r] = widen8(w + (n + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = widen8(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(xv, wv[r], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float lanes[8], sum = 0.f;
      _mm256_storeu_ps(lanes, acc[r][m]);
      for (float l : lanes) sum += l;
      for (int64_t t = k; t < K; ++t) sum += float(x[m * K + t]) * float(w[(n + r) * K + t]);
      y[m * N + n + r] = bf16(sum);
    }
}
#endif

#ifdef LEANLM_BF16_DOT
using Bf16Block = void (*)(const bf16*, int64_t, const bf16*, bf16*, int64_t, int64_t);
constexpr int kBf16Block = 4;  // rows of w, and of x, per block
constexpr Bf16Block kBf16[2][kBf16Block + 1] = {
    {nullptr, bf16_block<1, 1>, bf16_block<1, 2>, bf16_block<1, 3>, bf16_block<1, 4>},
    {nullptr, bf16_block<4, 1>, bf16_block<4, 2>, bf16_block<4, 3>, bf16_block<4, 4>}};
#endif

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "bf16_gemm takes x [M, K] and w [N, K], got ", x.sizes(), " and ",
              w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16_gemm wants bf16 x and w");
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "the weight must be a contiguous CPU tensor");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const bf16 *xp = xc.data_ptr<bf16>(), *wp = w.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
#ifdef LEANLM_BF16_DOT
    for (int64_t n = n0; n < n1;) {
      const int R = n + kBf16Block <= n1 ? kBf16Block : 1;
      for (int64_t m0 = 0; m0 < M; m0 += kBf16Block)  // the R weight rows stay in L1 for the later rows of x
        kBf16[R == kBf16Block][std::min<int64_t>(kBf16Block, M - m0)](xp + m0 * K, K, wp, yp + m0 * N, N, n);
      n += R;
    }
#else
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += float(xp[m * K + k]) * float(wp[n * K + k]);
        yp[m * N + n] = bf16(acc);
      }
#endif
  });
  return y;
}

#ifndef LEANLM_BF16_DOT
#define LEANLM_BF16_DOT "portable"
#endif
std::string bf16_isa() { return LEANLM_BF16_DOT; }

// bf16 products on a packed weight (leanlm/kernels/__init__.py pack_bf16): w [N, K] stored as [N / 16, K / 2, 16, 2],
// so one 64-byte load is 16 columns' pair of weights k, k + 1, and `vdpbf16ps` against x's pair (k, k + 1) broadcast
// adds both products into 16 output lanes: no horizontal sums. A block of MB rows of x by NB tiles of 16 columns
// keeps MB x NB accumulators in registers (8 x 3: 24 of the 32), each weight load serving MB rows and each
// broadcast NB tiles. Zen 4, 2 threads, a SmolLM2-135M layer from memory: 342 GFLOP/s at 32 rows (84% of the 408
// torch's large GEMMs reach) against torch's 186 there, and 40 GB/s of weights at one row against its 10
// (benchmarks/kernels.py --sections b).
constexpr int64_t kPackRows = 8, kPackTiles = 3;  // rows of x and tiles of 16 columns a block
// Rows of x a block of tiles serves in turn (packed_split), bf16's, W8A16's and W8A8's: one register block on
// AVX-512; on AVX2 32, in tiles of up to 6 (bf16, W8A8) or 5 (W8A16) rows; 12, 32 and 48 the same within noise for
// bf16 (Zen 3, a model's projections at 8-256 rows)
#if defined(LEANLM_AVX2)
constexpr int64_t kSplitRows = 32;
#else
constexpr int64_t kSplitRows = kPackRows;
#endif

// A packed product's dispatch table: kBlocks<Blocks, R>[m - 1][n - 1] is Blocks::at<m, n>, its register block of
// m rows of x by n tiles of 16 columns, for m <= R and n <= kPackTiles (a product picks the shape at run time).
template <typename Blocks, size_t M, size_t... N>
constexpr auto block_row(std::index_sequence<N...>) {
  return std::array{Blocks::template at<int(M) + 1, int(N) + 1>...};
}
template <typename Blocks, size_t... M>
constexpr auto block_table(std::index_sequence<M...>) {
  return std::array{block_row<Blocks, M>(std::make_index_sequence<kPackTiles>())...};
}
template <typename Blocks, int64_t R = kPackRows>
constexpr auto kBlocks = block_table<Blocks>(std::make_index_sequence<R>());
// mb rows as tiles of up to R rows, as even as they go (8 rows as 4 + 4, not 6 + 2: a tile of fewer rows reuses
// each weight load less, and leaves AVX2's FMAs waiting on their latency): tile(m, rows) for each, m its first row
template <int64_t R, typename Tile>
void even_tiles(int64_t mb, const Tile& tile) {
  const int64_t tiles = (mb + R - 1) / R;
  for (int64_t i = 0, m = 0; i < tiles; ++i) {
    const int64_t rows = mb / tiles + (i < mb % tiles);
    tile(m, rows);
    m += rows;
  }
}

// The next block of a packed product's weights (packed_split), asked for into L2 while this block computes: cache
// lines [p, p + 64 lines). Without it a block's first pass waited on memory with the multipliers idle and its later
// passes ran from L2 with memory idle. AVX-512's blocks (bf16, W8A16, W8A8) ask; AVX2's tiles ask for their own bytes
// 4 KiB ahead (prefetch). Zen 5, 2 threads, the default model's 120 projections from memory (kernels_ab.py), at 4 /
// 8 / 16 / 32 / 64 rows: bf16 1.05 / 1.17 / 1.17 / 1.29 / 1.08x (850 GFLOP/s at 32 rows, 92% of the probe's large
// GEMM), W8A16 1.19 / 1.26 / 1.24 / 1.15 / 1.09x, W8A8 1.12 / 1.25 / 1.39 / 1.28 / 1.14x; level at 256. At 1-2 rows
// (bound by memory alone) asking for the next block lost up to 10%, so fewer than kAheadRows rows ask for nothing.
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0;
  Ahead part(int64_t i, int64_t n) const {  // the i-th of n even parts
    const int64_t a = i * lines / n, b = (i + 1) * lines / n;
    return {p + 64 * a, b - a};
  }
};
constexpr int64_t kAheadRows = 4;

#ifdef LEANLM_AVX512
// step(i) for i < steps, its lines asked for over the first steps, as few a step as they go; a loop with nothing to
// ask runs as if there were no ahead
template <typename Step>
inline void steps_asking(int64_t steps, const Ahead& ahead, const Step& step) {
  const int64_t per = (ahead.lines + steps - 1) / steps;
  int64_t i = 0;
  for (; i * per < ahead.lines; ++i) {
    for (int64_t l = i * per; l < std::min(ahead.lines, i * per + per); ++l)
      _mm_prefetch(ahead.p + 64 * l, _MM_HINT_T1);
    step(i);
  }
  for (; i < steps; ++i) step(i);
}

inline void store_out(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_out(bf16* p, __m512 v) {  // rounded to nearest even, as bf16(float)
#ifdef __AVX512BF16__
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float f[16];
  _mm512_store_ps(f, v);
  for (int i = 0; i < 16; ++i) p[i] = bf16(f[i]);
#endif
}
#endif

#if defined(LEANLM_AVX512) && defined(__AVX512BF16__)
template <int MB, int NB, typename Out>  // w: the block's first tile, its tiles ws elements apart
void packed_block(const bf16* x, int64_t K, const bf16* w, int64_t ws, Out* y, int64_t N, Ahead ahead) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  steps_asking(K / 2, ahead, [&](int64_t i) __attribute__((always_inline)) {
    const int64_t k = 2 * i;
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * ws + k * 16);
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + k, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  });
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) store_out(y + m * N + 16 * j, acc[m][j]);
}

template <typename Out>
struct PackedBf16 {
  template <int MB, int NB>
  static constexpr auto at = packed_block<MB, NB, Out>;
};
#endif

#if defined(LEANLM_AVX2)
// Without a bf16 dot product (AVX2): R rows of x, widened to float, by NT tiles of 16 columns (w: the first, tiles ws
// elements apart); a 32-byte load is 8 columns' pair of weights k, k + 1, split into two float vectors by a shift
// (k) and a mask (k + 1). Weights k go to all R rows, then weights k + 1 (loaded again), so each accumulator's two
// dependent FMAs a pair of k are spread over the others: R x NT x 2 accumulators, 12 at 6 rows by one tile (the two
// halves and x's broadcast fill the 16 registers) or 2 rows by 3 tiles (x's broadcasts held, a half at a time). At 4
// rows by one tile, both halves at once, the FMAs waited on their own latency (4 cycles on Zen 3); at one row by one
// tile they read it at 13-15 GB/s. The tiles' bytes are asked for 4 KiB ahead. A row's sums run in the same order
// at any R and NT.
template <int R, int NT, typename Out>
void packed_tile(const float* x, int64_t K, const bf16* w, int64_t ws, Out* y, int64_t N) {
  // unrolled by hand (pragmas): GCC's own heuristics stored the accumulators to the stack on every pair of k
  __m256 acc[R][NT][2];
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j][0] = acc[m][j][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  for (int64_t k = 0; k < K; k += 2) {
    const bf16* wk = w + k * 16;
    for (int j = 0; j < NT; ++j) prefetch(wk + j * ws);  // one cache line a tile and pair of k
#pragma GCC unroll 2
    for (int p = 0; p < 2; ++p) {  // weights k, then k + 1
      auto half = [&](int j, int h) {  // columns 8 h .. 8 h + 7 of tile j
        const __m256i v = _mm256_loadu_si256((const __m256i*)(wk + j * ws + h * 16));
        // weights k + 1 by two shifts where the mask would cost a register: 2 rows by 3 tiles kept 4 of their 12
        // accumulators on the stack
        const __m256i odd = NT == 1 ? _mm256_and_si256(v, high) : _mm256_slli_epi32(_mm256_srli_epi32(v, 16), 16);
        return _mm256_castsi256_ps(p ? odd : _mm256_slli_epi32(v, 16));
      };
      if constexpr (NT == 1) {
        const __m256 w0 = half(0, 0), w1 = half(0, 1);
#pragma GCC unroll 6
        for (int m = 0; m < R; ++m) {
          const __m256 a = _mm256_broadcast_ss(x + m * K + k + p);
          acc[m][0][0] = _mm256_fmadd_ps(a, w0, acc[m][0][0]);
          acc[m][0][1] = _mm256_fmadd_ps(a, w1, acc[m][0][1]);
        }
      } else {
        __m256 a[R];
        for (int m = 0; m < R; ++m) a[m] = _mm256_broadcast_ss(x + m * K + k + p);
#pragma GCC unroll 3
        for (int j = 0; j < NT; ++j)
          for (int h = 0; h < 2; ++h) {
            const __m256 wv = half(j, h);
            for (int m = 0; m < R; ++m) acc[m][j][h] = _mm256_fmadd_ps(a[m], wv, acc[m][j][h]);
          }
      }
      asm("" : "+r"(wk));  // load the pair again rather than hold it in registers through the first half
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NT; ++j)
      for (int h = 0; h < 2; ++h) store_out(y + m * N + 16 * j + 8 * h, acc[m][j][h]);
}

template <typename Out>
struct PackedTile {
  template <int R, int NT = 1>
  static constexpr auto at = packed_tile<R, NT, Out>;
};

// mb rows of x, widened to float, against nb tiles of a packed weight, as packed_rows below: one or two rows against
// every tile at once, more in tiles of up to 6 rows by one tile, as even as they go (8 rows as 4 + 4, not 6 + 2:
// the FMAs of fewer than 5 rows wait on their latency). 3 and 4 rows as tiles of 2 by every tile were slower.
template <typename Out>
void packed_rows(const float* x, int64_t K, const bf16* w, int64_t ws, Out* y, int64_t N, int64_t mb, int64_t nb,
                 Ahead = {}) {  // the tiles ask for their own bytes
  if (mb <= 2) return kBlocks<PackedTile<Out>, 2>[mb - 1][nb - 1](x, K, w, ws, y, N);
  for (int64_t j = 0; j < nb; ++j)
    even_tiles<6>(mb, [&](int64_t m, int64_t r) {
      kTiles<PackedTile<Out>, 6>[r - 1](x + m * K, K, w + j * ws, ws, y + m * N + 16 * j, N);
    });
}
#endif

// mb (<= kPackRows; any on AVX2) rows of x [mb, K] against nb (<= kPackTiles) tiles of a packed weight (w: the
// first; tiles ws elements apart, 16 K in a weight of K columns), into y's columns (float32, or rounded to bf16 once);
// ahead: asked for meanwhile on AVX-512 (AVX2's tiles ask for their own bytes 4 KiB ahead)
template <typename Out>
void packed_rows(const bf16* x, int64_t K, const bf16* w, int64_t ws, Out* y, int64_t N, int64_t mb, int64_t nb,
                 Ahead ahead = {}) {
#if defined(LEANLM_AVX512) && defined(__AVX512BF16__)
  kBlocks<PackedBf16<Out>>[mb - 1][nb - 1](x, K, w, ws, y, N, ahead);
#elif defined(LEANLM_AVX2)
  thread_local std::vector<float> xf;  // the rows widened once, for every tile
  xf.resize(mb * K);
  to_float(x, mb * K, xf.data());
  packed_rows(xf.data(), K, w, ws, y, N, mb, nb);
#else
  for (int64_t m = 0; m < mb; ++m)
    for (int64_t n = 0; n < nb * 16; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k)
        acc += float(x[m * K + k]) * float(w[n / 16 * ws + k / 2 * 32 + n % 16 * 2 + k % 2]);
      y[m * N + n] = Out(acc);
    }
#endif
}

// The packed products' split of the work: blocks of kPackTiles tiles of 16 columns across the threads, each block
// against every `rows` rows of x in turn, so its weights come from memory once and stay in L2 for the later rows:
// block(t, nb, m0, mb, ahead) computes tiles t..t + nb - 1 for rows m0..m0 + mb - 1, asking for its part of the
// thread's next block (w: the weight, tile_bytes a tile; from kAheadRows rows of x).
template <typename Block>
void packed_split(int64_t T, int64_t M, int64_t rows, const Block& block, const void* w = nullptr,
                  int64_t tile_bytes = 0) {
  const int64_t passes = (M + rows - 1) / rows;
  const bool ask = w != nullptr && M >= kAheadRows;
  at::parallel_for(0, (T + kPackTiles - 1) / kPackTiles, 1, [&](int64_t b0, int64_t b1) {
    const int64_t end = std::min(T, b1 * kPackTiles);
    for (int64_t t = b0 * kPackTiles; t < end; t += kPackTiles) {
      const int64_t next = ask ? std::clamp(end - t - kPackTiles, int64_t(0), kPackTiles) : 0;
      const Ahead ahead{next > 0 ? (const char*)w + (t + kPackTiles) * tile_bytes : nullptr, next * tile_bytes / 64};
      for (int64_t m0 = 0; m0 < M; m0 += rows)
        block(t, std::min(kPackTiles, T - t), m0, std::min(rows, M - m0), ahead.part(m0 / rows, passes));
    }
  });
}

// y [M, N] bf16 = x [M, K] w^T, w packed [N / 16, K / 2, 16, 2] bf16; sums in float32, rounded to bf16 once
at::Tensor bf16_packed_gemm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 && w.scalar_type() == at::kBFloat16 &&
                  w.is_contiguous() && w.device().is_cpu(),
              "bf16_packed_gemm wants a contiguous bf16 CPU weight packed [N / 16, K / 2, 16, 2], got ", w.sizes());
  const int64_t N = w.size(0) * 16, K = w.size(1) * 2, M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "bf16_packed_gemm takes bf16 x [M, K] with K = ", K, ", got ", x.sizes(), " ", x.scalar_type());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const bf16 *xp = xc.data_ptr<bf16>(), *wp = w.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
#if defined(LEANLM_AVX2)
  std::vector<float> xf(M * K);  // widened once, not for every block of tiles
  to_float(xp, M * K, xf.data());
  const float* xr = xf.data();
#else
  const bf16* xr = xp;
#endif
  packed_split(N / 16, M, kSplitRows, [&](int64_t t, int64_t nb, int64_t m0, int64_t mb, Ahead ahead) {
    packed_rows(xr + m0 * K, K, wp + t * 16 * K, 16 * K, yp + m0 * N + t * 16, N, mb, nb, ahead);
  }, wp, 32 * K);
  return y;
}

// W4A16 at many rows (prefill, a large batch) on the packed blocks above: each thread widens a block of tiles of the
// int4 weight (48 weight rows) into bf16_packed_gemm's layout in a buffer of its own (L2), then runs the packed
// blocks over every row of x against it (widened_gemm). The widening costs what ~8 rows' products cost, so this
// pays from a few dozen rows (kernels.int4_packed_rows()). W8A16 has its own packed layout (w8a16_packed_gemm below):
// widening int8 codes from [N, K] by gathers cost 5x more than their bf16 products at 2 rows.

// y [M, N] bf16 = x [M, K] bf16 times the weight whose tile t widen(t, out) writes as [K / 2, 16, 2] bf16 from its
// codes (tile_bytes a tile: the next block's asked for while this one computes, 1.07-1.14x at 16-64 rows on Zen 5,
// kernels_ab.py --products int4w)
template <typename Widen>
at::Tensor widened_gemm(const at::Tensor& x, int64_t N, int64_t K, const Widen& widen, const void* codes,
                        int64_t tile_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "the product takes bf16 x [M, ", K, "] on the CPU, got ", x.sizes(), " ", x.scalar_type());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  const bf16* xp = xc.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  packed_split(N / 16, M, kPackRows, [&](int64_t t, int64_t nb, int64_t m0, int64_t mb, Ahead ahead) {
    thread_local std::vector<bf16> block;  // this thread's widened tiles, made when a block starts
    if (m0 == 0) {
      block.resize(kPackTiles * 16 * K);
      for (int64_t j = 0; j < nb; ++j) widen(t + j, block.data() + j * 16 * K);
    }
    packed_rows(xp + m0 * K, K, block.data(), 16 * K, yp + m0 * N + t * 16, N, mb, nb, ahead);
  }, codes, tile_bytes);
  return y;
}

// int4 tile t as W4A16Linear.dequantized_weight gives it, w = (q - 8) s + z in float32, rounded to bf16 once
void widen_int4(const uint8_t* w, const bf16* s, const bf16* z, int64_t N, int64_t K, int64_t g, int64_t t, bf16* out) {
  const uint8_t* tile = w + t * 16 * (K / 2);  // K / 4 groups of 32 bytes: row i's (q[k] | q[k+2] << 4, q[k+1] | ...)
#if defined(LEANLM_AVX512) && defined(__AVX512BF16__)
  const __m512i low = _mm512_set1_epi32(15);
  const __m512 eight = _mm512_set1_ps(8.f);
  __m512 sv = _mm512_setzero_ps(), zv = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 4) {
    if (k % g == 0) {
      sv = bf16x16(s + k / g * N + t * 16);
      zv = bf16x16(z + k / g * N + t * 16);
    }
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(tile + k * 8)));
    const __m512i q[4] = {_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi32(v, 8), low),
                          _mm512_and_si512(_mm512_srli_epi32(v, 4), low), _mm512_srli_epi32(v, 12)};  // k .. k + 3
    __m512i h[4];
    for (int j = 0; j < 4; ++j) {
      const __m512 wf = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q[j]), eight), sv), zv);
      h[j] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(wf));
    }
    _mm512_storeu_si512(out + k * 16, _mm512_or_si512(h[0], _mm512_slli_epi32(h[1], 16)));  // the pair (k, k + 1)
    _mm512_storeu_si512(out + k * 16 + 32, _mm512_or_si512(h[2], _mm512_slli_epi32(h[3], 16)));
  }
#else
  for (int64_t k = 0; k < K; ++k)
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t j = k / g * N + t * 16 + i;
      out[k / 2 * 32 + i * 2 + k % 2] = bf16(float(nibble(w, K, t * 16 + i, k) - 8) * float(s[j]) + float(z[j]));
    }
#endif
}

// y [M, N] bf16 = x [M, K] bf16 times the int4 weight (int4_gemv's arguments), through widened packed tiles
at::Tensor int4_packed_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                            const at::Tensor& zeros, int64_t g) {
  const int64_t N = w.size(0), K = 2 * w.size(-1);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(),
              "int4_packed_gemm wants a contiguous uint8 CPU int4 weight [N, K / 2]");
  check_int4(w, scales, zeros, g, "int4_packed_gemm");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const bf16 *sp = scales.data_ptr<bf16>(), *zp = zeros.data_ptr<bf16>();
  return widened_gemm(x, N, K, [&](int64_t t, bf16* out) { widen_int4(wp, sp, zp, N, K, g, t, out); }, wp, 8 * K);
}

// W8A8 on a packed weight (leanlm/kernels/__init__.py pack_int8): codes w [N, K] stored as [N / 16, K / 4, 16, 4]
// unsigned (w + 128: the sign bit flipped once, when packed), so one 64-byte load is 16 columns' weights k..k + 3
// and `vpdpbusd` against x's codes k..k + 3 broadcast adds their 4 products into 16 int32 lanes: bf16_packed_gemm's
// register blocks with twice the products per instruction, and no horizontal sums (int8_gemv_q8's blocks end in
// them). As there, sum_k (w + 128) x = sum_k w x + 128 sum_k x, the second term one number per row of x; the sums
// are exact (K <= kQ8MaxK), so y is bit for bit int8_gemv_q8's (and torch._int_mm + rescale's): float(sum) * xs[m] *
// scale[n], stored as float32 or rounded to bf16 once.
#ifdef LEANLM_AVX512

template <int MB, int NB, typename Out>
void q8_packed_block(const int8_t* x, const int32_t* xsum, const float* xs, int64_t K, const uint8_t* w,
                     const float* scale, Out* y, int64_t N, Ahead ahead) {  // w, scale, y: the block's first tile
  // int vectors as GCC's own type: an array of __m512i (long long lanes) updated through the int32 intrinsic was
  // kept on the stack, a load and a store around every product
  __v16si acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = (__v16si)_mm512_setzero_si512();
  steps_asking(K / 4, ahead, [&](int64_t i) __attribute__((always_inline)) {
    const int64_t k = 4 * i;
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + j * K * 16 + k * 16);
    for (int m = 0; m < MB; ++m) {
      int32_t quad;
      std::memcpy(&quad, x + m * K + k, 4);
      const __m512i xv = _mm512_set1_epi32(quad);
      for (int j = 0; j < NB; ++j) acc[m][j] = (__v16si)_mm512_dpbusd_epi32((__m512i)acc[m][j], wv[j], xv);
    }
  });
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      const __m512i exact = _mm512_sub_epi32((__m512i)acc[m][j], _mm512_set1_epi32(128 * xsum[m]));
      const __m512 sum = _mm512_cvtepi32_ps(exact);
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(sum, _mm512_set1_ps(xs[m])), _mm512_loadu_ps(scale + 16 * j));
      store_out(y + m * N + 16 * j, v);
    }
}

template <typename Out>
struct PackedQ8 {
  template <int MB, int NB>
  static constexpr auto at = q8_packed_block<MB, NB, Out>;
};
#elif defined(LEANLM_AVX2)
// AVX2 has no `vpdpbusd`, and `vpmaddubsw` would saturate: its int16 sum of two (w + 128) x reaches 65280. The
// packed bytes are widened to int16 instead (`vpmovzxbw`, as stored) and `vpmaddwd` against x's codes k..k + 3
// (widened once, broadcast as 64 bits) adds pairs into int32, so a column's sum is two lanes (k, k + 1 and
// k + 2, k + 3), added once at the end: the same exact sums as the AVX-512 loop, the same bits. R rows by H halves
// of a tile (8 columns each, 32 of each quad's 64 bytes): 2RH accumulators. Three to six rows take a tile in two
// passes (H = 1); one or two rows take it in one (H = 2): the second pass read the tile again from L2 (a tile of
// 576 columns is 36 KiB), and one row ran at 0.8x int8_gemv_q8 (kernels.py --sections q), level with it since.
template <int R, int H, typename Out>
void q8_packed_half(const int16_t* x, const int32_t* xsum, const float* xs, int64_t K, const uint8_t* w,
                    const float* scale, Out* y, int64_t N) {  // w, scale, y: the first half-tile's
  __v8si acc[R][2 * H] = {};  // a half's columns 0-3 and 4-7, two lanes each
  for (int64_t k = 0; k < K; k += 4) {
    prefetch(w + k * 16);
    __m256i wv[2 * H];
    for (int i = 0; i < 2 * H; ++i)
      wv[i] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(w + k * 16 + 16 * i)));
#pragma GCC unroll 6
    for (int m = 0; m < R; ++m) {
      int64_t quad;
      std::memcpy(&quad, x + m * K + k, 8);
      const __m256i xv = _mm256_set1_epi64x(quad);
      for (int i = 0; i < 2 * H; ++i) acc[m][i] = dot(acc[m][i], wv[i], xv);
    }
  }
  for (int h = 0; h < H; ++h) {
    const __m256 s = _mm256_loadu_ps(scale + 8 * h);
    for (int m = 0; m < R; ++m) {
      // hadd: columns [0 1 4 5 | 2 3 6 7]; the permutation puts them in order
      const __m256i sums = _mm256_permute4x64_epi64(
          _mm256_hadd_epi32((__m256i)acc[m][2 * h], (__m256i)acc[m][2 * h + 1]), 0xd8);
      const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(sums, _mm256_set1_epi32(128 * xsum[m])));
      float f[8];
      _mm256_storeu_ps(f, _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(xs[m])), s));
      for (int i = 0; i < 8; ++i) y[m * N + 8 * h + i] = Out(f[i]);
    }
  }
}

constexpr int kQ8Rows = 6;  // 12 accumulators, two halves of w, x: 15 of the 16 registers

template <int H, typename Out>
struct Q8Halves {
  template <int R>
  static constexpr auto at = q8_packed_half<R, H, Out>;
};
#endif

template <typename Out>
void q8_packed_product(const int8_t* xp, const float* xs, const uint8_t* wp, const float* scale, Out* yp, int64_t M,
                       int64_t N, int64_t K) {
  const std::vector<int32_t> xsum = group_sums(xp, M, K, K);
#if defined(LEANLM_AVX2)
  const std::vector<int16_t> x16(xp, xp + M * K);  // the codes widened once, for every tile
#endif
  packed_split(N / 16, M, kSplitRows, [&](int64_t t, int64_t nb, int64_t m0, int64_t mb, Ahead ahead) {
#ifdef LEANLM_AVX512
    kBlocks<PackedQ8<Out>>[mb - 1][nb - 1](xp + m0 * K, xsum.data() + m0, xs + m0, K, wp + t * 16 * K,
                                           scale + t * 16, yp + m0 * N + t * 16, N, ahead);
#elif defined(LEANLM_AVX2)
    const bool whole = mb <= 2;  // one or two rows: a whole tile a pass (q8_packed_half)
    for (int64_t n = t * 16; n < (t + nb) * 16; n += whole ? 16 : 8)  // the tile's quads hold columns n % 16 at 4 n
      even_tiles<kQ8Rows>(mb, [&](int64_t i, int64_t rows) {
        const auto tile = whole ? kTiles<Q8Halves<2, Out>, 2>[rows - 1] : kTiles<Q8Halves<1, Out>, kQ8Rows>[rows - 1];
        const int64_t m = m0 + i;
        tile(x16.data() + m * K, xsum.data() + m, xs + m, K, wp + n / 16 * 16 * K + n % 16 * 4, scale + n,
             yp + m * N + n, N);
      });
#else
    for (int64_t m = m0; m < m0 + mb; ++m)
      for (int64_t n = t * 16; n < (t + nb) * 16; ++n) {
        int32_t acc = 0;
        for (int64_t k = 0; k < K; ++k)
          acc += int32_t(wp[(n / 16) * 16 * K + k / 4 * 64 + n % 16 * 4 + k % 4]) * xp[m * K + k];
        yp[m * N + n] = Out(float(acc - 128 * xsum[m]) * xs[m] * scale[n]);
      }
#endif
  }, wp, 16 * K);
}

// y [M, N] (float32 or bf16: dtype) = xs * scale * (xq w^T), w packed [N / 16, K / 4, 16, 4] uint8 (codes + 128)
at::Tensor int8_packed_gemm(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& w, const at::Tensor& scale,
                            at::ScalarType dtype) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 4 && w.scalar_type() == at::kByte &&
                  w.is_contiguous() && w.device().is_cpu(),
              "int8_packed_gemm wants a contiguous uint8 CPU weight packed [N / 16, K / 4, 16, 4], got ", w.sizes());
  const int64_t N = w.size(0) * 16, K = w.size(1) * 4, M = xq.size(0);
  TORCH_CHECK(K <= kQ8MaxK, "int8_packed_gemm's int32 sums are exact up to K = ", kQ8MaxK, ", got ", K);
  TORCH_CHECK(xq.dim() == 2 && xq.size(1) == K && xq.scalar_type() == at::kChar && xq.is_contiguous() &&
                  xq.device().is_cpu(),
              "int8_packed_gemm takes contiguous int8 codes xq [M, K] with K = ", K, ", got ", xq.sizes());
  TORCH_CHECK(xs.scalar_type() == at::kFloat && xs.numel() == M && xs.is_contiguous(),
              "int8_packed_gemm wants float32 scales of x [M]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "int8_packed_gemm wants float32 scales [N]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "int8_packed_gemm writes float32 or bfloat16");
  at::Tensor y = at::empty({M, N}, xq.options().dtype(dtype));
  const int8_t* xp = xq.data_ptr<int8_t>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (dtype == at::kFloat)
    q8_packed_product(xp, xs.data_ptr<float>(), wp, scale.data_ptr<float>(), y.data_ptr<float>(), M, N, K);
  else
    q8_packed_product(xp, xs.data_ptr<float>(), wp, scale.data_ptr<float>(), y.data_ptr<bf16>(), M, N, K);
  return y;
}

// W8A16 on a packed weight (leanlm/kernels/__init__.py pack_pairs): int8 codes w [N, K] stored as [N / 16, K / 2, 16,
// 2], so one 32-byte load is 16 columns' codes k, k + 1; widened to int16 (one `vpmovsxbw`), `vpdpwssd` against x's
// int16 pair (k, k + 1) broadcast adds both products into 16 int32 lanes: bf16_packed_gemm's blocks on half its
// bytes, at any row count. x is rounded to int16 per row as int8_gemv rounds it; a lane's int32 sum is exact over
// kW8Chunk columns (|x w| <= 2^22, two a product) and goes to float32 there. A row's y does not depend on the other
// rows of its batch. y = float(sums) * xs[m] * scale[n], stored as float32 or rounded to bf16 once.
constexpr int64_t kW8Chunk = 256;

#ifdef LEANLM_AVX512
template <int MB, int NB, typename Out>
void w8_packed_block(const int16_t* x, const float* xs, int64_t K, int64_t ldx, const int8_t* w, const bf16* scale,
                     Out* y, int64_t N, Ahead ahead) {  // x's rows ldx apart; w, scale, y: the block's first tile
  alignas(64) float sum[MB][NB][16] = {};  // touched once a chunk: in memory, the registers hold the int32 sums
  const int64_t chunks = (K + kW8Chunk - 1) / kW8Chunk;
  for (int64_t c = 0; c < K; c += kW8Chunk) {
    __v16si acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) acc[m][j] = (__v16si)_mm512_setzero_si512();
    steps_asking((std::min(K, c + kW8Chunk) - c) / 2, ahead.part(c / kW8Chunk, chunks),
                 [&](int64_t i) __attribute__((always_inline)) {
      const int64_t k = c + 2 * i;
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j)
        wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + j * K * 16 + k * 16)));
      for (int m = 0; m < MB; ++m) {
        const __m512i xv = pair(x + m * ldx + k);
        for (int j = 0; j < NB; ++j) acc[m][j] = (__v16si)_mm512_dpwssd_epi32((__m512i)acc[m][j], wv[j], xv);
      }
    });
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j)
        _mm512_store_ps(sum[m][j], _mm512_add_ps(_mm512_load_ps(sum[m][j]), _mm512_cvtepi32_ps((__m512i)acc[m][j])));
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      const __m512 v = _mm512_mul_ps(_mm512_load_ps(sum[m][j]), _mm512_set1_ps(xs[m]));
      store_out(y + m * N + 16 * j, _mm512_mul_ps(v, bf16x16(scale + 16 * j)));
    }
}

template <typename Out>
struct PackedW8 {
  template <int MB, int NB>
  static constexpr auto at = w8_packed_block<MB, NB, Out>;
};
#elif defined(LEANLM_AVX2)
// AVX2 has no `vpdpwssd`: `vpmaddwd` multiplies a half-tile's int16 pairs (8 columns' codes k, k + 1) by x's pair
// into 8 int32 lanes and a `vpaddd` adds them, the same exact int32 sums. R rows by one tile of 16 columns, up to 5:
// 2R accumulators, the tile's two halves, x's pair and a product (14 of the 16 registers at R = 5); the float sums,
// touched once a chunk, in memory. Zen 3, one core, in L2: ~125 GFLOP/s at 30 rows, ~85% of what its `vpmaddwd` +
// `vpaddd` pairs reach alone (bf16's tile: ~87, ~90% of its FMAs'). 5 rows against 4: 1.04-1.10x at 8-256 rows from
// memory; 6 rows a half at a time (x broadcast twice as often): 0.85-0.89x. The same bits as the AVX-512 loop.
template <int R, typename Out>
void w8_packed_tile(const int16_t* x, const float* xs, int64_t K, int64_t ldx, const int8_t* w, const bf16* scale,
                    Out* y, int64_t N) {  // x's rows ldx apart; w, scale, y: the tile's first
  alignas(32) float sum[R][16] = {};
  for (int64_t c = 0; c < K; c += kW8Chunk) {
    __v8si acc[R][2];
#pragma GCC unroll 5
    for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = (__v8si)_mm256_setzero_si256();
    for (int64_t k = c; k < std::min(K, c + kW8Chunk); k += 2) {
      prefetch(w + k * 16);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + k * 16)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + k * 16 + 16)));
#pragma GCC unroll 5
      for (int m = 0; m < R; ++m) {
        const __m256i xv = pair(x + m * ldx + k);
        acc[m][0] = dot(acc[m][0], w0, xv);
        acc[m][1] = dot(acc[m][1], w1, xv);
      }
    }
#pragma GCC unroll 5
    for (int m = 0; m < R; ++m)
      for (int h = 0; h < 2; ++h)
        _mm256_store_ps(sum[m] + 8 * h,
                        _mm256_add_ps(_mm256_load_ps(sum[m] + 8 * h), _mm256_cvtepi32_ps((__m256i)acc[m][h])));
  }
  for (int m = 0; m < R; ++m)
    for (int h = 0; h < 2; ++h) {
      const __m256 v = _mm256_mul_ps(_mm256_load_ps(sum[m] + 8 * h), _mm256_set1_ps(xs[m]));
      store_out(y + m * N + 8 * h, _mm256_mul_ps(v, bf16x8(scale + 8 * h)));
    }
}

template <typename Out>
struct W8Tile {
  template <int R>
  static constexpr auto at = w8_packed_tile<R, Out>;
};
#endif

template <typename Out>
void w8_packed_product(const at::Tensor& x, const int8_t* wp, const bf16* scale, Out* yp, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
#ifdef LEANLM_SIMD
  const Rows r(x);  // x's rows rounded to int16 as int8_gemv rounds them, Kp apart
#else
  const at::Tensor xf = x.to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
#endif
  packed_split(N / 16, M, kSplitRows, [&](int64_t t, int64_t nb, int64_t m0, int64_t mb, Ahead ahead) {
#ifdef LEANLM_AVX512
    kBlocks<PackedW8<Out>>[mb - 1][nb - 1](r.q + m0 * r.Kp, r.scale + m0, K, r.Kp, wp + t * 16 * K,
                                           scale + t * 16, yp + m0 * N + t * 16, N, ahead);
#elif defined(LEANLM_AVX2)
    for (int64_t j = t; j < t + nb; ++j)
      even_tiles<5>(mb, [&](int64_t m, int64_t tile_rows) {
        kTiles<W8Tile<Out>, 5>[tile_rows - 1](r.q + (m0 + m) * r.Kp, r.scale + m0 + m, K, r.Kp, wp + j * 16 * K,
                                              scale + j * 16, yp + (m0 + m) * N + j * 16, N);
      });
#else
    for (int64_t m = m0; m < m0 + mb; ++m)
      for (int64_t n = t * 16; n < (t + nb) * 16; ++n) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += xp[m * K + k] * wp[(n / 16) * 16 * K + k / 2 * 32 + n % 16 * 2 + k % 2];
        yp[m * N + n] = Out(acc * float(scale[n]));
      }
#endif
  }, wp, 16 * K);
}

// y [M, N] (float32 or bf16: dtype) = x w^T * scale, x [M, K] float, w packed [N / 16, K / 2, 16, 2] int8, scale [N]
at::Tensor w8a16_packed_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 && w.scalar_type() == at::kChar &&
                  w.is_contiguous() && w.device().is_cpu(),
              "w8a16_packed_gemm wants a contiguous int8 CPU weight packed [N / 16, K / 2, 16, 2], got ", w.sizes());
  const int64_t N = w.size(0) * 16, K = w.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && at::isFloatingType(x.scalar_type()) && x.device().is_cpu(),
              "w8a16_packed_gemm takes float x [M, K] with K = ", K, ", got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.numel() == N && scale.is_contiguous(),
              "w8a16_packed_gemm wants bf16 scales [N]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "w8a16_packed_gemm writes float32 or bfloat16");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(dtype));
  const int8_t* wp = w.data_ptr<int8_t>();
  if (dtype == at::kFloat)
    w8_packed_product(xc, wp, scale.data_ptr<bf16>(), y.data_ptr<float>(), N);
  else
    w8_packed_product(xc, wp, scale.data_ptr<bf16>(), y.data_ptr<bf16>(), N);
  return y;
}

// W4A8 on packed codes (leanlm/kernels/__init__.py pack_int4_q8): W4A16's int4 codes 0..15 (groups of g along K,
// scales and zeros as W4A16's) stored as [N / 16, K / 8, 16, 4] bytes, the low nibble of byte (i, c) row i's code
// k + c and the high nibble its code k + 4 + c, for each 8 columns k..k + 7. One 64-byte load, a mask, and a shift
// and a mask give two vectors of 16 rows' codes k..k + 3 and k + 4..k + 7, each a `vpdpbusd` operand against x's
// int8 codes (W8A8's per-token activations) broadcast: 4 products (codes by signed x) into 16 int32 lanes an
// instruction, as int8_packed_gemm. Per group x w = s (x q) + (z - 8 s) x, sum q x and sum x exact integers;
// y = xs * sum over the groups of that, in float32. MB rows of x by NB tiles a block (kQ4Rows below).
#ifdef LEANLM_AVX512
template <int MB, int NB, typename Out>
void int4_q8_block(const int8_t* x, const int32_t* xsum, const float* xs, int64_t K, const uint8_t* w,
                   const bf16* scales, const bf16* zeros, int64_t g, Out* y, int64_t N) {  // w...y: the first tile
  const int64_t G = K / g;
  const __m512i low = _mm512_set1_epi8(15);
  alignas(64) float sum[MB][NB][16] = {};  // touched once a group: in memory, the registers hold the int32 sums
  for (int64_t j = 0; j < G; ++j) {
    __v16si acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b) acc[m][b] = (__v16si)_mm512_setzero_si512();
    for (int64_t k = j * g; k < (j + 1) * g; k += 8) {
      __m512i lo[NB], hi[NB];
      for (int b = 0; b < NB; ++b) {
        const __m512i v = _mm512_loadu_si512(w + b * 8 * K + k * 8);
        lo[b] = _mm512_and_si512(v, low);
        hi[b] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int h = 0; h < 2; ++h)  // codes k..k + 3 for every row, then k + 4..k + 7: a sum's products far apart
        for (int m = 0; m < MB; ++m) {
          int32_t quad;
          std::memcpy(&quad, x + m * K + k + 4 * h, 4);
          const __m512i xv = _mm512_set1_epi32(quad);
          for (int b = 0; b < NB; ++b)
            acc[m][b] = (__v16si)_mm512_dpbusd_epi32((__m512i)acc[m][b], h ? hi[b] : lo[b], xv);
        }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 s = bf16x16(scales + j * N + 16 * b);
      const __m512 zb = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, bf16x16(zeros + j * N + 16 * b));
      for (int m = 0; m < MB; ++m) {
        __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps((__m512i)acc[m][b]), s, _mm512_load_ps(sum[m][b]));
        _mm512_store_ps(sum[m][b], _mm512_fmadd_ps(zb, _mm512_set1_ps(float(xsum[m * G + j])), v));
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NB; ++b)
      store_out(y + m * N + 16 * b, _mm512_mul_ps(_mm512_load_ps(sum[m][b]), _mm512_set1_ps(xs[m])));
}

template <typename Out>
struct PackedInt4Q8 {
  template <int MB, int NB>
  static constexpr auto at = int4_q8_block<MB, NB, Out>;
};
#endif
// rows of x a block: 4, where 8 (the other packed products' count) ran 10-18% slower at 32-256 rows (Zen 4, groups
// of 64): the 24 int32 sums and the group's epilogue did not fit the registers together
constexpr int64_t kQ4Rows = 4;

// code k of row n in the layout above
inline int q8_nibble(const uint8_t* w, int64_t K, int64_t n, int64_t k) {
  const uint8_t b = w[(n / 16) * 8 * K + (k / 8) * 64 + (n % 16) * 4 + k % 4];
  return k % 8 < 4 ? b & 15 : b >> 4;
}

template <typename Out>
void int4_q8_product(const int8_t* xq, const float* xs, const uint8_t* wp, const bf16* sp, const bf16* zp, int64_t g,
                     Out* yp, int64_t M, int64_t N, int64_t K) {
  const int64_t G = K / g;
  const std::vector<int32_t> xsum = group_sums(xq, M, K, g);  // for the zero points
  packed_split(N / 16, M, kQ4Rows, [&](int64_t t, int64_t nb, int64_t m0, int64_t mb, Ahead) {
#ifdef LEANLM_AVX512
    kBlocks<PackedInt4Q8<Out>, kQ4Rows>[mb - 1][nb - 1](xq + m0 * K, xsum.data() + m0 * G, xs + m0, K,
                                                        wp + t * 8 * K, sp + t * 16, zp + t * 16, g,
                                                        yp + m0 * N + t * 16, N);
#else
    for (int64_t m = m0; m < m0 + mb; ++m)
      for (int64_t n = t * 16; n < (t + nb) * 16; ++n) {
        float acc = 0.f;
        for (int64_t j = 0; j < G; ++j) {
          int32_t dot = 0;
          for (int64_t k = j * g; k < (j + 1) * g; ++k) dot += q8_nibble(wp, K, n, k) * xq[m * K + k];
          const float s = float(sp[j * N + n]), zb = float(zp[j * N + n]) - 8.f * s;
          acc += float(dot) * s + zb * float(xsum[m * G + j]);
        }
        yp[m * N + n] = Out(acc * xs[m]);
      }
#endif
  });
}

// y [M, N] (float32 or bf16: dtype) = x w^T, x = xq [M, K] int8 times xs [M], w int4 codes packed [N / 16, K / 8, 16,
// 4] (pack_int4_q8) with W4A16's scales and zeros [K / g, N]
at::Tensor int4_q8_gemm(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& w, const at::Tensor& scales,
                        const at::Tensor& zeros, int64_t g, at::ScalarType dtype) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 4 && w.scalar_type() == at::kByte &&
                  w.is_contiguous() && w.device().is_cpu(),
              "int4_q8_gemm wants contiguous uint8 CPU codes packed [N / 16, K / 8, 16, 4], got ", w.sizes());
  const int64_t N = w.size(0) * 16, K = w.size(1) * 8, M = xq.size(0);
  TORCH_CHECK(g > 0 && g % 8 == 0 && K % g == 0, "int4_q8_gemm needs K (", K, ") a multiple of the group ", g,
              " (a multiple of 8)");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16 &&
                  scales.numel() == K / g * N && zeros.numel() == K / g * N && scales.is_contiguous() &&
                  zeros.is_contiguous(),
              "int4_q8_gemm wants contiguous bf16 scales and zeros [K / g, N]");
  TORCH_CHECK(xq.dim() == 2 && xq.size(1) == K && xq.scalar_type() == at::kChar && xq.is_contiguous() &&
                  xq.device().is_cpu(),
              "int4_q8_gemm takes contiguous int8 codes xq [M, K] with K = ", K, ", got ", xq.sizes());
  TORCH_CHECK(xs.scalar_type() == at::kFloat && xs.numel() == M && xs.is_contiguous(),
              "int4_q8_gemm wants float32 scales of x [M]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "int4_q8_gemm writes float32 or bfloat16");
  at::Tensor y = at::empty({M, N}, xq.options().dtype(dtype));
  const int8_t* xp = xq.data_ptr<int8_t>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const bf16 *sp = scales.data_ptr<bf16>(), *zp = zeros.data_ptr<bf16>();
  if (dtype == at::kFloat)
    int4_q8_product(xp, xs.data_ptr<float>(), wp, sp, zp, g, y.data_ptr<float>(), M, N, K);
  else
    int4_q8_product(xp, xs.data_ptr<float>(), wp, sp, zp, g, y.data_ptr<bf16>(), M, N, K);
  return y;
}

// Paged decode attention: one query token per sequence against its keys and values in the block pool, read in
// place through its block table (a gathered copy would move as many bytes as attention reads).
// q [B, H, D]; k, v [slots, Hkv, D] (slot = block * bs + offset); tables [B, max_blocks] int32; lens [B] int32.
// A work item is (sequence, kv heads, part of its tokens): its G query heads share each key and value row it reads.
// Keys are read 16 tokens at a time: a token's dot product with a query head is 16 lanes of partial sums, and one
// transposing reduction (sum16x16: 45 shuffles and adds) turns 16 of them into a vector of 16 scores, where a
// horizontal sum per token cost ~8 dependent operations; keys stored by block (BlockedKeys) need no reduction. The
// softmax exponentials are vector too (exp16). When sequences are too few to keep every thread busy, a sequence's
// tokens (or kv heads, when too short) are split across threads; each part of the tokens keeps its own max, sum and
// weighted values, merged by log-sum-exp at the end.
// Rows are 16-float vectors (GCC vector extensions: AVX-512 here, pairs of AVX2 ops or plain code elsewhere). GCC
// keeps such vectors in memory on AVX2, which left decode attention at 2 GB/s on Zen 3: there the keys by block,
// and rows of every pool (float, bf16, int8, int4) widened to floats, go through 8-float intrinsics instead (3.4x;
// the int4 pool 3.8x: 6.8 -> 1.8 ms a layer at 32 x 384, benchmarks/kernels.py --sections a). Their value pass
// reads the float, bf16 and int8 pools' rows in place, widened in registers for up to three query heads at once
// (weigh_in_place: 1.2x over widening them into memory first).
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
constexpr int64_t kMaxVectors = 256;  // H * D / 16: query heads times a row's 16-float vectors
constexpr int64_t kMaxRow = 16;       // D / 16: a row of up to 256 values
constexpr int64_t kMinPart = 64;      // tokens: a sequence's tokens split across threads no finer than this
constexpr int64_t kMaxParts = 64;     // and in at most this many parts

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x16 load16(const bf16* p) {  // bf16 is the top half of a float32
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline f32x16 load16(const int8_t* p) {  // int8 codes (a quantized KV cache); the caller applies the scale
#if defined(LEANLM_AVX512)  // GCC 12 turns __builtin_convertvector of 16 int8 into 16 scalar conversions
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(LEANLM_AVX2)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
  float f[16];
  _mm256_storeu_ps(f, lo);
  _mm256_storeu_ps(f + 8, hi);
  return load16(f);
#else
  f32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = p[i];
  return v;
#endif
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
inline f32x16 splat(float x) { return f32x16{} + x; }

// a[t] holds 16 partial sums of token t's score; the result's lane t is their total. Each level adds pairs of
// vectors after interleaving them, halving the vectors and doubling the tokens each one holds (lane i of a level-n
// vector belongs to token i mod 2^n of its group).
inline f32x16 sum16x16(const f32x16* a) {
  f32x16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(d[0], d[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

// e^x for x <= 0 (scores less their max) within ~2 ulp, 0 below -87 (under float's normal range): x = n ln 2 + r,
// e^r by Cephes expf's polynomial on |r| <= ln 2 / 2, 2^n written into the exponent bits. F: a vector of floats, I:
// of as many int32 (16 lanes; 8, AVX2's register, where GCC keeps 16-float vectors in memory).
template <typename F, typename I>
inline F exp_lanes(F x) {
  const I under = x < -87.f;
  x = under ? F{} - 87.f : x;
  const F t = x * 1.44269504f + 12582912.f;  // adding 1.5 * 2^23 rounds x / ln 2 to the integer n in t's bits
  const F n = t - 12582912.f;
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts, so r keeps its low bits
  F p = F{} + 1.9875691500e-4f;
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = p * r + c;
  p = p * r * r + r + 1.f;
  const I two_n = ((I)t - 0x4B400000 + 127) << 23;
  return under ? F{} : p * (F)two_n;
}
inline f32x16 exp16(f32x16 x) { return exp_lanes<f32x16, i32x16>(x); }

inline float max_of(const float* s, int64_t width) {  // width a multiple of 16
  f32x16 top = splat(-INFINITY);
  for (int64_t c = 0; c < width; c += 16) {
    const f32x16 x = load16(s + c);
    top = top < x ? x : top;
  }
  float m = top[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, top[i]);
  return m;
}

inline float sum16(f32x16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// s [width] <- e^(s - m), m their max, returned with their sum; width a multiple of 16
inline std::pair<float, float> softmax_numerators(float* s, int64_t width) {
#if defined(LEANLM_AVX2)
  __m256 top = _mm256_set1_ps(-INFINITY), total = _mm256_setzero_ps();
  for (int64_t c = 0; c < width; c += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + c));
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  const float m = *std::max_element(lanes, lanes + 8);
  for (int64_t c = 0; c < width; c += 8) {
    const __m256 e = exp_lanes<f32x8, i32x8>(_mm256_sub_ps(_mm256_loadu_ps(s + c), _mm256_set1_ps(m)));
    _mm256_storeu_ps(s + c, e);
    total = _mm256_add_ps(total, e);
  }
  _mm256_storeu_ps(lanes, total);
  return {m, std::accumulate(lanes, lanes + 8, 0.f)};
#else
  const float m = max_of(s, width);
  f32x16 total{};
  for (int64_t c = 0; c < width; c += 16) {
    const f32x16 e = exp16(load16(s + c) - m);
    store16(s + c, e);
    total += e;
  }
  return {m, sum16(total)};
#endif
}

// Row conversions for the value pass: with AVX-512, 32 entries as two float vectors in the order its unpack of bf16
// gives (lo: entries 0-3, 8-11, 16-19, 24-27; hi: the other 16), one instruction each; the weighted sums keep that
// order and unpermute() restores it once at the end. A row of odd D / 16 ends in one vector in plain order. Elsewhere
// the order is plain: GCC lowers the permuting shuffle of 16-float vectors on AVX2 to a lane-by-lane copy through
// memory, which left decode attention at ~2 GB/s on Zen 3.
#if defined(LEANLM_AVX512)
constexpr bool kPairs = true;
#else
constexpr bool kPairs = false;
#endif
constexpr int kPairOrder[32] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27,
                                4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
inline void to_pairs(f32x16 a, f32x16 b, f32x16& lo, f32x16& hi) {  // 32 entries in plain order -> load32's
  if constexpr (!kPairs) {
    lo = a, hi = b;
    return;
  }
  lo = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  hi = __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
template <typename S>
inline void load32(const S* p, f32x16& lo, f32x16& hi) {
#if defined(LEANLM_AVX512)
  if constexpr (std::is_same_v<S, bf16>) {
    const __m512i x = _mm512_loadu_si512(p), zero = _mm512_setzero_si512();
    lo = (f32x16)_mm512_unpacklo_epi16(zero, x);
    hi = (f32x16)_mm512_unpackhi_epi16(zero, x);
    return;
  }
#endif
  to_pairs(load16(p), load16(p + 16), lo, hi);
}
inline void unpermute(const f32x16* v, int64_t V, float* out) {  // V vectors in load32's order -> out [16 V]
  int64_t j = 0;
  if constexpr (kPairs)
    for (; j + 1 < V; j += 2)
      for (int i = 0; i < 32; ++i) out[j * 16 + kPairOrder[i]] = v[j + i / 16][i % 16];
  for (; j < V; ++j) store16(out + j * 16, v[j]);
}

#if defined(LEANLM_AVX512) && defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
// 16 tokens' scores against one query head by vdpbf16ps (pairs of bf16 products summed in float): the key rows
// are read as they are, with no conversion. D a multiple of 32; rows past count score 0.
template <int VT>
inline f32x16 bf16_scores16(const bf16* qh, const bf16* const* row_of, int64_t count, int64_t D_) {
  const int64_t D = VT ? 16 * VT : D_;
  f32x16 a[16];
  for (int t = 0; t < 16; ++t) {
    __m512 s = _mm512_setzero_ps();
    if (t < count)
      for (int64_t d = 0; d < D; d += 32)
        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qh + d), (__m512bh)_mm512_loadu_si512(row_of[t] + d));
    a[t] = (f32x16)s;
  }
  return sum16x16(a);
}
#else
constexpr bool kBf16Dot = false;
template <int VT>
inline f32x16 bf16_scores16(const bf16*, const bf16* const*, int64_t, int64_t) { return f32x16{}; }
#endif

// acc + (a's bf16 pairs . b's pair x, lane by lane): vdpbf16ps where the CPU has it, else both halves widened
inline f32x16 pair_dot(f32x16 acc, u32x16 a, uint32_t x) {
#if defined(LEANLM_AVX512) && defined(__AVX512BF16__)
  return (f32x16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)(__m512i)a, (__m512bh)_mm512_set1_epi32(int(x)));
#else
  const u32x16 lo = a << 16, hi = a & 0xffff0000u;
  const uint32_t xl = x << 16, xh = x & 0xffff0000u;
  float fl, fh;
  std::memcpy(&fl, &xl, 4);
  std::memcpy(&fh, &xh, 4);
  return acc + (f32x16)lo * fl + (f32x16)hi * fh;
#endif
}

// Scores of one run of blocked keys (BlockedKeys) against N query heads q [N, D], times scale, into s (rows `width`
// apart): two accumulators a head, so 2N chains of products are in flight. Q: bf16, or on AVX2 the query widened to
// float (its channels broadcast from memory, one instruction each, where a bf16 pair took 7 to split).
template <int N, typename Q>
inline void blocked_scores(const Q* q, int64_t D, const bf16* run, int64_t stride, float scale, float* s,
                           int64_t width) {
#if defined(LEANLM_AVX2)  // 8-float registers by hand: GCC keeps 16-float vectors in memory on AVX2 (~2 GB/s)
  static_assert(std::is_same_v<Q, float>);
  __m256 a[N][2];  // tokens 0-7 and 8-15 of the run, a head
  for (int g = 0; g < N; ++g) a[g][0] = a[g][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  for (int64_t p = 0; p < D / 2; ++p) {  // channels 2p (a word's low half) and 2p + 1 of 16 tokens
    __m256 lo[2], hi[2];
    for (int j = 0; j < 2; ++j) {
      const __m256i k = _mm256_loadu_si256((const __m256i*)(run + p * stride + 16 * j));
      lo[j] = _mm256_castsi256_ps(_mm256_slli_epi32(k, 16));
      hi[j] = _mm256_castsi256_ps(_mm256_and_si256(k, high));
    }
    for (int g = 0; g < N; ++g) {
      const __m256 xl = _mm256_broadcast_ss(q + g * D + 2 * p), xh = _mm256_broadcast_ss(q + g * D + 2 * p + 1);
      for (int j = 0; j < 2; ++j) a[g][j] = _mm256_fmadd_ps(hi[j], xh, _mm256_fmadd_ps(lo[j], xl, a[g][j]));
    }
  }
  for (int g = 0; g < N; ++g)
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(s + g * width + 8 * j, _mm256_mul_ps(a[g][j], _mm256_set1_ps(scale)));
#else
  f32x16 a[N][2] = {};
  const uint32_t* qw = (const uint32_t*)q;  // a query's channel pair p is word p
  for (int64_t p = 0; p < D / 2; p += 2)
    for (int j = 0; j < 2; ++j) {
      u32x16 kv;
      std::memcpy(&kv, run + (p + j) * stride, sizeof kv);
      for (int g = 0; g < N; ++g) a[g][j] = pair_dot(a[g][j], kv, qw[g * D / 2 + p + j]);
    }
  for (int g = 0; g < N; ++g) store16(s + g * width, (a[g][0] + a[g][1]) * scale);
#endif
}

// 32 int8 codes as 16 lanes of int16 pairs (lane i: codes 2i, 2i + 1, the low half first)
inline i32x16 widen_pairs(const int8_t* p) {
#if defined(LEANLM_AVX512)
  return (i32x16)_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
#else
  i32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = int32_t(uint16_t(int16_t(p[2 * i])) | uint32_t(int32_t(p[2 * i + 1])) << 16);
  return v;
#endif
}

// acc + (a's int16 pairs . the int16 pair x, lane by lane; exact in int32): vpdpwssd where the build has AVX-512
// VNNI, else both halves sign-extended
inline i32x16 pair_dot16(i32x16 acc, i32x16 a, uint32_t x) {
#if defined(LEANLM_AVX512)
  return (i32x16)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)a, _mm512_set1_epi32(int(x)));
#else
  return acc + ((a << 16) >> 16) * int32_t(int16_t(x)) + (a >> 16) * int32_t(int16_t(x >> 16));
#endif
}

// blocked_scores over an int8 pool's keys by block: N query heads rounded to int16, q [N, D] with a scale each
// (qs, the softmax's 1 / sqrt(D) in it), against the run's codes, exact int32 sums (|sum| <= D 32767 128 < 2^31
// for D <= 256), times the 16 tokens' scales ks.
template <int N>
inline void blocked_scores(const int16_t* q, const float* qs, int64_t D, const int8_t* run, int64_t stride,
                           f32x16 ks, float* s, int64_t width) {
#if defined(LEANLM_AVX2)  // `vpmaddwd`: a run's codes widened to int16 pairs against the query's pair, in int32
  __v8si a[N][2];  // tokens 0-7 and 8-15 of the run, a head
  for (int g = 0; g < N; ++g) a[g][0] = a[g][1] = __v8si{};
  const uint32_t* qw = (const uint32_t*)q;
  for (int64_t p = 0; p < D / 2; ++p) {
    __m256i k[2];
    for (int j = 0; j < 2; ++j)
      k[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(run + p * stride + 16 * j)));
    for (int g = 0; g < N; ++g) {
      const __m256i x = _mm256_set1_epi32(int(qw[g * D / 2 + p]));
      for (int j = 0; j < 2; ++j) a[g][j] = dot(a[g][j], k[j], x);
    }
  }
  float k16[16];
  std::memcpy(k16, &ks, sizeof k16);
  for (int g = 0; g < N; ++g)
    for (int j = 0; j < 2; ++j)
      _mm256_storeu_ps(s + g * width + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps((__m256i)a[g][j]),
                                                            _mm256_mul_ps(_mm256_loadu_ps(k16 + 8 * j),
                                                                          _mm256_set1_ps(qs[g]))));
#else
  i32x16 a[N][2] = {};
  const uint32_t* qw = (const uint32_t*)q;
  for (int64_t p = 0; p < D / 2; p += 2)
    for (int j = 0; j < 2; ++j) {
      const i32x16 kv = widen_pairs(run + (p + j) * stride);
      for (int g = 0; g < N; ++g) a[g][j] = pair_dot16(a[g][j], kv, qw[g * D / 2 + p + j]);
    }
  for (int g = 0; g < N; ++g) store16(s + g * width, __builtin_convertvector(a[g][0] + a[g][1], f32x16) * ks * qs[g]);
#endif
}

#if defined(LEANLM_AVX2)
// 8 entries of a pool's row as floats: float, bf16, or int8 codes times the row's scale
inline __m256 widen8(const float* p, __m256) { return load8(p); }
inline __m256 widen8(const bf16* p, __m256) { return load8(p); }
inline __m256 widen8(const int8_t* p, __m256 scale) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))), scale);
}
#endif

// Where attention reads a token's key or value row of one kv head, as 16-float vectors (load32's order with
// pairs, for the value pass). PoolRows: the pool's entries [slots, Hkv, D] of S (float, bf16, or int8 codes times a
// float scale per (slot, kv head)).
template <typename S>
struct PoolRows {
  static constexpr bool kBf16 = std::is_same_v<S, bf16>;  // rows vdpbf16ps can read in place
  static constexpr bool kBlocked = false, kWidens = true;  // widen(): AVX2's key and value passes
  static constexpr bool kInPlace = true;                    // AVX2's value pass reads the rows as they are
  const S* base;
  const float* scales;  // int8: [slots, Hkv]; else null
  int64_t Hkv, D;
  const S* row(int64_t slot, int64_t h) const { return base + (slot * Hkv + h) * D; }
  void prefetch(int64_t slot, int64_t h) const {
    for (int64_t i = 0; i < int64_t(D * sizeof(S)); i += 64) __builtin_prefetch((const char*)row(slot, h) + i);
  }
  void load(int64_t slot, int64_t h, f32x16* r, int64_t V, bool pairs) const {
    const S* p = row(slot, h);
    int64_t j = 0;
    if (pairs)
      for (; j + 1 < V; j += 2) load32(p + j * 16, r[j], r[j + 1]);
    for (; j < V; ++j) r[j] = load16(p + j * 16);
    if (scales)
      for (j = 0; j < V; ++j) r[j] *= scales[slot * Hkv + h];
  }
#if defined(LEANLM_AVX2)
  void widen(int64_t slot, int64_t h, float* out) const {  // the row as D floats (D a multiple of 8)
    const S* p = row(slot, h);
    const __m256 scale = scales ? _mm256_set1_ps(scales[slot * Hkv + h]) : __m256{};
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, widen8(p + d, scale));
  }
#endif
};

// The keys of a pool stored by block, [blocks, Hkv, D / 2, bs, 2] (cache.paged): a run of 16 tokens of one kv head
// holds, in vector p, the 16 tokens' channels 2p and 2p + 1, so their 16 scores against a query are D / 2 pair
// products with the query's pair p broadcast, in lanes: no transposing sums (sum16x16), and a run of D / 2 vectors
// is one contiguous read when bs is 16. bs a multiple of 16; runs start at multiples of 16. S: bf16 (`vdpbf16ps`,
// 64-byte vectors), or int8 codes (32 bytes, widened to int16 pairs for `vpdpwssd` against the query rounded to
// int16) times a float scale per (slot, kv head). Zen 4, 2 threads (benchmarks/kernels.py --sections a), bf16:
// 1.2-1.3x the rows' layout from L3, 1.08-1.16x from memory, where attention is bound by its reads (13-14 GB/s:
// blocks of 16-128 tokens alike).
template <typename S>
struct BlockedKeys {
  static constexpr bool kBf16 = std::is_same_v<S, bf16>, kBlocked = true;  // else int8 codes
  const S* base;
  const float* scales;  // int8: [slots, Hkv]; bf16: null
  int64_t Hkv, D, bs;
  const S* run(int64_t block, int64_t offset, int64_t h) const {
    return base + (block * Hkv + h) * D * bs + 2 * offset;
  }
  int64_t stride() const { return 2 * bs; }  // elements from a run's vector p to vector p + 1
  void prefetch(int64_t block, int64_t offset, int64_t h) const {
    for (int64_t p = 0; p < D / 2; ++p) __builtin_prefetch(run(block, offset, h) + p * stride());
  }
  f32x16 scales16(int64_t block, int64_t offset, int64_t h) const {  // the run's 16 tokens' scales
    f32x16 v;
    for (int t = 0; t < 16; ++t) v[t] = scales[(block * bs + offset + t) * Hkv + h];
    return v;
  }
};

#if defined(__F16C__)
constexpr bool kF16c = true;
#else
constexpr bool kF16c = false;
#endif
inline f32x16 half16(const uint16_t* p) {  // 16 float16 -> float32
#if defined(LEANLM_AVX512)
  return (f32x16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
  f32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = float(c10::Half(p[i], c10::Half::from_bits()));
  return v;
#endif
}
inline f32x16 nibbles16(const uint8_t* c) {  // 8 bytes of 4-bit codes (channel 2i low, 2i + 1 high) -> 16 floats
#if defined(LEANLM_AVX512)
  const __m128i x = _mm_loadl_epi64((const __m128i*)c), mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(x, mask), hi = _mm_and_si128(_mm_srli_epi16(x, 4), mask);
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
#else
  f32x16 v;
  for (int i = 0; i < 8; ++i) v[2 * i] = c[i] & 15, v[2 * i + 1] = c[i] >> 4;
  return v;
#endif
}

// The int4 pool (leanlm/cache/int4.py): 4-bit codes [slots, Hkv, D / 2] times a float16 scale plus a float16
// minimum, per (block, kv head, channel) for the keys (per_block), per (slot, kv head, 16 channels) for the values;
// a sequence's first token read exact from `sink` [entries, Hkv, D] where sink_of[block] names an entry, and (keys)
// a block still filling read exact from `side` [entries * bs, Hkv, D] where entry_of[block] names one.
template <typename T>
struct Int4Rows {
  static constexpr bool kBf16 = false, kBlocked = false, kWidens = kF16c;  // widen(): float16 scales by F16C
  static constexpr bool kInPlace = false;
  const uint8_t* codes;
  const uint16_t *scale, *low;
  const T *side, *sink;
  const int64_t *entry_of, *sink_of;  // entry_of null for the values
  int64_t Hkv, D, bs;
  bool per_block;
  void prefetch(int64_t slot, int64_t h) const { __builtin_prefetch(codes + (slot * Hkv + h) * D / 2); }
  const T* exact(int64_t slot, int64_t h) const {  // the row read exact (a sink, an open block's key), or null
    const int64_t block = slot / bs, offset = slot % bs;
    if (offset == 0 && sink_of[block] >= 0) return sink + (sink_of[block] * Hkv + h) * D;
    if (entry_of && entry_of[block] >= 0) return side + ((entry_of[block] * bs + offset) * Hkv + h) * D;
    return nullptr;
  }
  void load(int64_t slot, int64_t h, f32x16* r, int64_t V, bool pairs) const {
    const int64_t block = slot / bs;
    if (const T* row = exact(slot, h)) return PoolRows<T>{row, nullptr, 0, D}.load(0, 0, r, V, pairs);
    const uint8_t* c = codes + (slot * Hkv + h) * D / 2;
    for (int64_t j = 0; j < V; ++j) {
      if (per_block) {
        const int64_t at = (block * Hkv + h) * D + j * 16;
        r[j] = nibbles16(c + j * 8) * half16(scale + at) + half16(low + at);
      } else {
        const int64_t at = (slot * Hkv + h) * V + j;
        r[j] = nibbles16(c + j * 8) * float(c10::Half(scale[at], c10::Half::from_bits())) +
               float(c10::Half(low[at], c10::Half::from_bits()));
      }
    }
    if (pairs)
      for (int64_t j = 0; j + 1 < V; j += 2) to_pairs(f32x16(r[j]), f32x16(r[j + 1]), r[j], r[j + 1]);
  }
#if defined(LEANLM_AVX2) && defined(__F16C__)
  void widen(int64_t slot, int64_t h, float* out) const {  // the row as D floats (D a multiple of 16)
    if (const T* row = exact(slot, h)) return PoolRows<T>{row, nullptr, 0, D}.widen(0, 0, out);
    const int64_t block = slot / bs;
    const uint8_t* c = codes + (slot * Hkv + h) * D / 2;
    const __m128i mask = _mm_set1_epi8(15);
    for (int64_t d = 0; d < D; d += 16) {  // 8 bytes of codes: channel d + 2i in byte i's low half, d + 2i + 1 high
      const __m128i x = _mm_loadl_epi64((const __m128i*)(c + d / 2));
      const __m128i u8 = _mm_unpacklo_epi8(_mm_and_si128(x, mask), _mm_and_si128(_mm_srli_epi16(x, 4), mask));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u8));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(u8, 8)));
      __m256 s[2], z[2];
      if (per_block) {
        const int64_t at = (block * Hkv + h) * D + d;
        for (int j = 0; j < 2; ++j) {
          s[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scale + at + 8 * j)));
          z[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(low + at + 8 * j)));
        }
      } else {
        const int64_t at = (slot * Hkv + h) * D / 16 + d / 16;
        s[0] = s[1] = _mm256_cvtph_ps(_mm_set1_epi16(short(scale[at])));
        z[0] = z[1] = _mm256_cvtph_ps(_mm_set1_epi16(short(low[at])));
      }
      _mm256_storeu_ps(out + d, _mm256_fmadd_ps(lo, s[0], z[0]));
      _mm256_storeu_ps(out + d + 8, _mm256_fmadd_ps(hi, s[1], z[1]));
    }
  }
#endif
};

#if defined(LEANLM_AVX2)
// The value pass in 8-float registers (GCC keeps 16-float vectors in memory on AVX2): out [D] += p[t] row t, for
// count rows of D = 16 VT floats (VT a multiple of 4), 64 channels at a time in 8 accumulators.
template <int VT>
inline void weigh_rows(const float* rows, int64_t count, const float* p, float* out) {
  constexpr int64_t D = 16 * VT;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m256 o[8];
    for (int j = 0; j < 8; ++j) o[j] = _mm256_loadu_ps(out + d0 + 8 * j);
    for (int64_t t = 0; t < count; ++t) {
      const __m256 w = _mm256_broadcast_ss(p + t);
      for (int j = 0; j < 8; ++j) o[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows + t * D + d0 + 8 * j), o[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + d0 + 8 * j, o[j]);
  }
}

// The value pass over a pool's rows read in place: out [NH, D] += p[g][t] row t for NH query heads (p's rows
// `width` apart), 32 channels at a time in 4 NH accumulators, each row widened once in registers for all NH heads
// (weigh_rows reads rows widened into memory: three loads an FMA). The same products in the same order. scale: the
// rows' int8 scales, else null.
template <int NH, int VT, typename S>
inline void weigh_in_place(const S* const* row_of, const float* scale, int64_t count, const float* p, int64_t width,
                           float* out) {
  constexpr int64_t D = 16 * VT;
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m256 o[NH][4];
    for (int g = 0; g < NH; ++g)
      for (int j = 0; j < 4; ++j) o[g][j] = _mm256_loadu_ps(out + g * D + d0 + 8 * j);
    for (int64_t t = 0; t < count; ++t) {
      __m256 w[NH];
      for (int g = 0; g < NH; ++g) w[g] = _mm256_broadcast_ss(p + g * width + t);
      const __m256 rs = std::is_same_v<S, int8_t> ? _mm256_broadcast_ss(scale + t) : __m256{};
      for (int j = 0; j < 4; ++j) {
        const __m256 r = widen8(row_of[t] + d0 + 8 * j, rs);
        for (int g = 0; g < NH; ++g) o[g][j] = _mm256_fmadd_ps(w[g], r, o[g][j]);
      }
    }
    for (int g = 0; g < NH; ++g)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + g * D + d0 + 8 * j, o[g][j]);
  }
}

inline __m256 sum8x8(const __m256* a) {  // lane t: the total of a[t]'s 8 lanes
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // tokens 0-3: halves
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// The rows' key pass in 8-float registers: s[t] = q . row t for 16 rows of D = 16 VT floats, 8 tokens' dot products
// in flight, their 8 lanes summed by one transposing reduction (sum8x8)
template <int VT>
inline void row_scores(const float* q, const float* rows, float* s) {
  constexpr int64_t D = 16 * VT;
  for (int64_t t0 = 0; t0 < 16; t0 += 8) {
    __m256 a[8];
    for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 x = _mm256_loadu_ps(q + d);
      for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows + (t0 + t) * D + d), a[t]);
    }
    _mm256_storeu_ps(s + t0, sum8x8(a));
  }
}
#endif

// One work item: query heads h0 * G .. (h0 + heads) * G of sequence b against its tokens [t0, t1), leaving each
// query head's softmax max, sum and unnormalized output (m, l [H], acc [H, D] at this item's heads). VT: D / 16 as a
// compile-time constant (4 and 8: the zoo's head sizes), or 0 for any other.
template <int VT, typename T, typename K, typename Vs>
void attend_part(const T* q, const K& keys, const Vs& values, const int32_t* table, int64_t t0, int64_t t1, int64_t h0,
                 int64_t heads, int64_t G, int64_t D, int64_t bs, float* m, float* l, float* acc) {
  const int64_t V = VT ? VT : D / 16, n = t1 - t0, width = (n + 15) / 16 * 16;
  thread_local std::vector<float> score_buf;
  score_buf.resize(heads * G * width);
  float* scores = score_buf.data();  // [heads * G, width]
  f32x16 qv[kMaxVectors], rows[16 * kMaxRow];
  const float scale = 1.f / std::sqrt(float(D));
  if constexpr (!K::kBlocked)  // the rows' key pass reads the query as float vectors; keys by block read q itself
    for (int64_t i = 0; i < heads * G * V; ++i) qv[i] = load16(q + h0 * G * D + i * 16) * scale;
#if defined(LEANLM_AVX2)
  else if constexpr (K::kBf16)  // but on AVX2 as floats, unscaled
    for (int64_t i = 0; i < heads * G * V; ++i) qv[i] = load16(q + h0 * G * D + i * 16);
#endif
  thread_local std::vector<int16_t> q16;  // int8 keys by block: the query heads rounded to int16, a scale each
  thread_local std::vector<float> qs;
  if constexpr (K::kBlocked && !K::kBf16) {
    q16.resize(heads * G * D), qs.resize(heads * G);
    for (int64_t g = 0; g < heads * G; ++g) {
      const T* x = q + (h0 * G + g) * D;
      float top = 0.f;
      for (int64_t d = 0; d < D; ++d) top = std::max(top, std::abs(float(x[d])));
      const float inv = top > 0.f ? 32767.f / top : 0.f;
      for (int64_t d = 0; d < D; ++d) q16[g * D + d] = int16_t(std::nearbyint(float(x[d]) * inv));
      qs[g] = top / 32767.f * scale;
    }
  }
  // The pool slots of tokens t0 + c + [0, 16), found once per 16 tokens, and of the 16 after them, whose rows are
  // prefetched while these are read: the blocks lie anywhere in the pool, so the hardware prefetcher restarts at
  // each, and the cores waited on memory, not overlapping it with the arithmetic (bf16, 32 sequences x 384 tokens,
  // 2 threads: 11 -> 14 GB/s, against 23 GB/s for a streaming read).
  int64_t slot_of[16], next_of[16], next_count = 0;
  auto find_slots = [&](int64_t c) {
    int64_t block = (t0 + c) / bs, offset = (t0 + c) % bs;
    for (int64_t* slots : {slot_of, next_of}) {
      const int64_t count = std::clamp<int64_t>(n - c, 0, 16);
      for (int64_t t = 0; t < count; ++t) {
        slots[t] = int64_t(table[block]) * bs + offset;
        if (++offset == bs) offset = 0, ++block;
      }
      next_count = count;
      c += 16;
    }
  };
  // rows[t * V + j]: vector j of those tokens' rows of kv head h0 + h, zero past the count; in plain order for the
  // keys, load32's for the values
  auto read_rows = [&](const auto& src, int64_t c, int64_t h, bool pairs) {
    const int64_t count = std::min<int64_t>(16, n - c);
    for (int64_t t = 0; t < next_count; ++t) src.prefetch(next_of[t], h0 + h);
    for (int64_t t = 0; t < count; ++t) src.load(slot_of[t], h0 + h, rows + t * V, V, pairs);
    for (int64_t t = count; t < 16; ++t)
      for (int64_t j = 0; j < V; ++j) rows[t * V + j] = f32x16{};
    return count;
  };
  for (int64_t c = 0; c < n; c += 16)
    for (int64_t h = 0; h < heads; ++h) {
      if constexpr (K::kBlocked) {  // t0 and c are multiples of 16: the 16 tokens are one run of a block
        if (c + 32 < n)  // two runs ahead (one ahead measured the same)
          keys.prefetch(table[(t0 + c + 32) / bs], (t0 + c + 32) % bs, h0 + h);
        const int64_t block = table[(t0 + c) / bs], offset = (t0 + c) % bs;
        const auto* run = keys.run(block, offset, h0 + h);
        for (int64_t g = h * G; g < (h + 1) * G; g += 4) {
          float* s = scores + g * width + c;
          const auto scores_of = [&](auto heads) {
            constexpr int N = decltype(heads)::value;
            if constexpr (K::kBf16)
#if defined(LEANLM_AVX2)
              blocked_scores<N>((const float*)qv + g * D, D, run, keys.stride(), scale, s, width);
#else
              blocked_scores<N>(q + (h0 * G + g) * D, D, run, keys.stride(), scale, s, width);
#endif
            else
              blocked_scores<N>(q16.data() + g * D, qs.data() + g, D, run, keys.stride(),
                                keys.scales16(block, offset, h0 + h), s, width);
          };
          switch (std::min<int64_t>(4, (h + 1) * G - g)) {
            case 4: scores_of(std::integral_constant<int, 4>{}); break;
            case 3: scores_of(std::integral_constant<int, 3>{}); break;
            case 2: scores_of(std::integral_constant<int, 2>{}); break;
            default: scores_of(std::integral_constant<int, 1>{});
          }
        }
      } else {
        if (h == 0) find_slots(c);
        if constexpr (kBf16Dot && K::kBf16) {
          if (V % 2 == 0) {
            const int64_t count = std::min<int64_t>(16, n - c);
            const bf16* row_of[16];
            for (int64_t t = 0; t < next_count; ++t) keys.prefetch(next_of[t], h0 + h);
            for (int64_t t = 0; t < count; ++t) row_of[t] = keys.row(slot_of[t], h0 + h);
            for (int64_t g = h * G; g < (h + 1) * G; ++g)
              store16(scores + g * width + c, bf16_scores16<VT>(q + (h0 * G + g) * D, row_of, count, D) * scale);
            continue;
          }
        }
#if defined(LEANLM_AVX2)
        if constexpr (VT > 0 && K::kWidens) {
          const int64_t count = std::min<int64_t>(16, n - c);
          float* rowf = (float*)rows;  // 16 tokens' rows of D floats
          for (int64_t t = 0; t < next_count; ++t) keys.prefetch(next_of[t], h0 + h);
          for (int64_t t = 0; t < count; ++t) keys.widen(slot_of[t], h0 + h, rowf + t * D);
          std::fill(rowf + count * D, rowf + 16 * D, 0.f);
          for (int64_t g = h * G; g < (h + 1) * G; ++g)
            row_scores<VT>((const float*)(qv + g * V), rowf, scores + g * width + c);
          continue;
        }
#endif
        read_rows(keys, c, h, false);
        for (int64_t g = h * G; g < (h + 1) * G; ++g) {
          f32x16 a[16];
          for (int t = 0; t < 16; ++t) {
            a[t] = qv[g * V] * rows[t * V];
            for (int64_t j = 1; j < V; ++j) a[t] += qv[g * V + j] * rows[t * V + j];
          }
          store16(scores + g * width + c, sum16x16(a));
        }
      }
    }
  for (int64_t g = 0; g < heads * G; ++g) {  // softmax numerators in place; l divides at the end
    float* s = scores + g * width;
    for (int64_t t = n; t < width; ++t) s[t] = -INFINITY;  // exp16 makes these 0
    std::tie(m[h0 * G + g], l[h0 * G + g]) = softmax_numerators(s, width);
  }
#if defined(LEANLM_AVX2)
  if constexpr (VT > 0 && VT % 4 == 0 && Vs::kWidens) {
    float* out = acc + h0 * G * D;  // [heads * G, D]: the weighted values in plain order
    float* rowf = (float*)rows;     // 16 tokens' rows of D floats
    std::fill(out, out + heads * G * D, 0.f);
    for (int64_t c = 0; c < n; c += 16)
      for (int64_t h = 0; h < heads; ++h) {
        if (h == 0) find_slots(c);
        const int64_t count = std::min<int64_t>(16, n - c);
        for (int64_t t = 0; t < next_count; ++t) values.prefetch(next_of[t], h0 + h);
        if constexpr (Vs::kInPlace) {
          const std::remove_pointer_t<decltype(values.base)>* row_of[16];
          float scale_of[16];
          for (int64_t t = 0; t < count; ++t) {
            row_of[t] = values.row(slot_of[t], h0 + h);
            if (values.scales) scale_of[t] = values.scales[slot_of[t] * values.Hkv + h0 + h];
          }
          const float* rs = values.scales ? scale_of : nullptr;
          for (int64_t g = h * G; g < (h + 1) * G; g += 3) {
            const float* p = scores + g * width + c;
            switch (std::min<int64_t>(3, (h + 1) * G - g)) {
              case 3: weigh_in_place<3, VT>(row_of, rs, count, p, width, out + g * D); break;
              case 2: weigh_in_place<2, VT>(row_of, rs, count, p, width, out + g * D); break;
              default: weigh_in_place<1, VT>(row_of, rs, count, p, width, out + g * D);
            }
          }
          continue;
        }
        for (int64_t t = 0; t < count; ++t) values.widen(slot_of[t], h0 + h, rowf + t * D);
        for (int64_t g = h * G; g < (h + 1) * G; ++g) weigh_rows<VT>(rowf, count, scores + g * width + c, out + g * D);
      }
    return;
  }
#endif
  for (int64_t i = 0; i < heads * G * V; ++i) qv[i] = f32x16{};  // qv now accumulates the weighted values
  for (int64_t c = 0; c < n; c += 16)
    for (int64_t h = 0; h < heads; ++h) {
      if (h == 0) find_slots(c);
      const int64_t count = read_rows(values, c, h, true);
      for (int64_t g = h * G; g < (h + 1) * G; ++g) {
        const float* p = scores + g * width + c;
        f32x16 o[kMaxRow];
        for (int64_t j = 0; j < V; ++j) o[j] = qv[g * V + j];
        for (int64_t t = 0; t < count; ++t)
          for (int64_t j = 0; j < V; ++j) o[j] += p[t] * rows[t * V + j];
        for (int64_t j = 0; j < V; ++j) qv[g * V + j] = o[j];
      }
    }
  for (int64_t g = 0; g < heads * G; ++g) unpermute(qv + g * V, V, acc + (h0 * G + g) * D);
}

// T: q and out (float or bf16); K, Vs: where the keys and values are read (PoolRows or Int4Rows)
template <int VT, typename T, typename K, typename Vs>
void paged_attention_impl(const T* q, const K& keys, const Vs& values, const int32_t* tables, const int32_t* lens,
                          T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks, int64_t bs) {
  // A work item reads whole slots (every kv head of a token: one contiguous run per block), which the hardware
  // prefetcher streams; one kv head per item read 1/Hkv of each slot and ran at ~2 GB/s. When sequences are too few
  // to keep every thread busy they are split by tokens, or by kv head (then tokens) when too short for that: one
  // sequence of 4096 tokens, 2 threads, split by kv head 468 us, by tokens 380 (kernels.py --sections a).
  const int64_t threads = at::get_num_threads(), G = H / Hkv;
  const int64_t longest = *std::max_element(lens, lens + B), most = (longest + kMinPart - 1) / kMinPart;
  const int64_t split = B * std::min(most, kMaxParts) < 2 * threads ? Hkv : 1, heads = Hkv / split;
  const int64_t parts = std::clamp<int64_t>(std::min((2 * threads + B * split - 1) / (B * split), most), 1, kMaxParts);
  const int64_t part = ((longest + parts - 1) / parts + 15) / 16 * 16;  // runs of 16 tokens stay whole
  std::vector<float> m(B * parts * H), l(B * parts * H), acc(B * parts * H * D);  // [B, parts, H(, D)]
  at::parallel_for(0, B * split * parts, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / (split * parts), h0 = w / parts % split * heads, p = w % parts;
      const int64_t t0 = std::min<int64_t>(p * part, lens[b]), t1 = std::min<int64_t>(t0 + part, lens[b]);
      const int64_t at = (b * parts + p) * H;
      if (t0 == t1) {  // a short sequence's empty part: nothing to merge
        std::fill(m.begin() + at + h0 * G, m.begin() + at + (h0 + heads) * G, -INFINITY);
        std::fill(l.begin() + at + h0 * G, l.begin() + at + (h0 + heads) * G, 0.f);
        std::fill(acc.begin() + (at + h0 * G) * D, acc.begin() + (at + (h0 + heads) * G) * D, 0.f);
        continue;
      }
      attend_part<VT>(q + b * H * D, keys, values, tables + b * max_blocks, t0, t1, h0, heads, G, D, bs,
                      m.data() + at, l.data() + at, acc.data() + at * D);
      if (parts == 1)  // nothing to merge: the item's heads are done (as the merge below writes them)
        for (int64_t i = (at + h0 * G) * D; i < (at + (h0 + heads) * G) * D; ++i) out[i] = T(acc[i] / l[i / D]);
    }
  });
  if (parts == 1) return;
  at::parallel_for(0, B * H, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {  // r = b * H + head
      const int64_t b = r / H, head = r % H;
      float top = -INFINITY, total = 0.f, weight[kMaxParts];
      for (int64_t p = 0; p < parts; ++p) top = std::max(top, m[(b * parts + p) * H + head]);
      for (int64_t p = 0; p < parts; ++p) {
        weight[p] = std::exp(m[(b * parts + p) * H + head] - top);
        total += weight[p] * l[(b * parts + p) * H + head];
      }
      for (int64_t d = 0; d < D; ++d) {
        float o = 0.f;
        for (int64_t p = 0; p < parts; ++p) o += weight[p] * acc[((b * parts + p) * H + head) * D + d];
        out[r * D + d] = T(o / total);
      }
    }
  });
}

template <typename T, typename K, typename Vs>
void attend_all(const T* q, const K& keys, const Vs& values, const int32_t* tables, const int32_t* lens, at::Tensor& out,
                int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t W, int64_t bs) {  // out has q's dtype
  T* op = out.data_ptr<T>();
  if (D == 64)
    paged_attention_impl<4>(q, keys, values, tables, lens, op, B, H, Hkv, D, W, bs);
  else if (D == 128)
    paged_attention_impl<8>(q, keys, values, tables, lens, op, B, H, Hkv, D, W, bs);
  else
    paged_attention_impl<0>(q, keys, values, tables, lens, op, B, H, Hkv, D, W, bs);
}

void check_tables(const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens, int64_t block_size) {
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt && tables.is_contiguous() &&
                  tables.dim() == 2 && tables.size(0) == q.size(0) && lens.numel() == q.size(0),
              "paged_attention wants int32 tables [B, max_blocks] and lens [B]");
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= tables.size(1) * block_size, "paged_attention: length ", lp[b],
                " of sequence ", b, " is not in [1, ", tables.size(1) * block_size, "]");
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                           const at::Tensor& lens, int64_t block_size, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && v.dim() == 3 && q.size(2) == v.size(2) && q.size(1) % v.size(1) == 0,
              "paged_attention wants q [B, H, D] and v [slots, Hkv, D] with H a multiple of Hkv");
  const bool blocked = k.dim() == 5, int8 = k.scalar_type() == at::kChar;  // keys by block (BlockedKeys)
  if (blocked) {
    TORCH_CHECK(k.size(0) * k.size(3) == v.size(0) && k.size(1) == v.size(1) && 2 * k.size(2) == v.size(2) &&
                    k.size(3) == block_size && block_size % 16 == 0 && k.size(4) == 2 &&
                    (int8 || (q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16)),
                "paged_attention: keys by block are [blocks, Hkv, D / 2, block_size, 2] (bf16 with bf16 q, or int8 "
                "codes), block_size a multiple of 16, beside values [blocks * block_size, Hkv, D]; got k ", k.sizes(),
                " v ", v.sizes());
  } else {
    TORCH_CHECK(k.sizes() == v.sizes(), "paged_attention wants k, v [slots, Hkv, D] alike (or keys by block)");
  }
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  (int8 || k.scalar_type() == q.scalar_type()) && v.scalar_type() == k.scalar_type(),
              "paged_attention wants q float32 or bfloat16, and k, v of q's dtype or int8");
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "paged_attention: int8 k, v need k_scale and "
              "v_scale (float32 [slots, Hkv, 1]), and only they do");
  if (int8)
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && v_scale->scalar_type() == at::kFloat &&
                    k_scale->numel() == v.size(0) * v.size(1) && v_scale->numel() == k_scale->numel() &&
                    k_scale->is_contiguous() && v_scale->is_contiguous(),
                "paged_attention wants contiguous float32 scales [slots, Hkv, 1]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "paged_attention wants contiguous q, k, v");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(1) * q.size(2) / 16 <= kMaxVectors && v.size(2) / 16 <= kMaxRow,
              "paged_attention wants head_dim a multiple of 16 up to 256 and heads x head_dim <= 4096");
  check_tables(q, tables, lens, block_size);
  const int32_t* lp = lens.data_ptr<int32_t>();
  at::Tensor out = at::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), Hkv = v.size(1), D = q.size(2), W = tables.size(1);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const float* ks = int8 ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = int8 ? v_scale->data_ptr<float>() : nullptr;
  auto run = [&](auto* qp, auto* vp) {  // out has q's dtype; the keys' entries are the values'
    using S = std::remove_pointer_t<decltype(vp)>;
    const PoolRows<S> values{vp, vs, Hkv, D};
    if (!blocked)
      attend_all(qp, PoolRows<S>{k.data_ptr<S>(), ks, Hkv, D}, values, tp, lp, out, B, H, Hkv, D, W, block_size);
    else if constexpr (std::is_same_v<S, int8_t> || std::is_same_v<decltype(qp), bf16*>)  // the checks allow no other
      attend_all(qp, BlockedKeys<S>{k.data_ptr<S>(), ks, Hkv, D, block_size}, values, tp, lp, out, B, H, Hkv, D, W,
                 block_size);
  };
  if (q.scalar_type() == at::kFloat)
    int8 ? run(q.data_ptr<float>(), v.data_ptr<int8_t>()) : run(q.data_ptr<float>(), v.data_ptr<float>());
  else
    int8 ? run(q.data_ptr<bf16>(), v.data_ptr<int8_t>()) : run(q.data_ptr<bf16>(), v.data_ptr<bf16>());
  return out;
}

// The int4 pool's tensors (leanlm/cache/int4.py), checked once for both of its ops: k, v [slots, Hkv, D / 2] uint8
// codes; k_scale, k_min [blocks, Hkv, D] and v_scale, v_min [slots, Hkv, D / 16] float16; side [entries * bs, Hkv, D]
// and entry_of [blocks] int64 (-1: none) for the keys of blocks still filling; sink_k, sink_v [entries, Hkv, D] and
// sink_of [blocks] for sequences' first tokens. Values come out in their stored (rotated) basis.
struct Int4Pool {
  const at::Tensor &k, &v, &k_scale, &k_min, &v_scale, &v_min, &side, &entry_of, &sink_k, &sink_v, &sink_of;
  int64_t bs;

  void check(at::ScalarType dtype) const {
    const int64_t slots = k.size(0), Hkv = k.size(1), D = 2 * k.size(2), blocks = slots / bs;
    TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && D % 16 == 0 && D / 16 <= kMaxRow && slots % bs == 0 &&
                    k.scalar_type() == at::kByte && v.scalar_type() == at::kByte,
                "int4 pool: uint8 codes k, v [slots, Hkv, D / 2], D a multiple of 16 up to 256");
    for (const at::Tensor* t : {&k_scale, &k_min})
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->numel() == blocks * Hkv * D, "int4 pool: float16 k_scale, "
                  "k_min [blocks, Hkv, D]");
    for (const at::Tensor* t : {&v_scale, &v_min})
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->numel() == slots * Hkv * D / 16, "int4 pool: float16 v_scale, "
                  "v_min [slots, Hkv, D / 16]");
    for (const at::Tensor* t : {&side, &sink_k, &sink_v})
      TORCH_CHECK(t->scalar_type() == dtype && t->dim() == 3 && t->size(1) == Hkv && t->size(2) == D,
                  "int4 pool: side and sinks [entries, Hkv, D] of the model's dtype");
    TORCH_CHECK(side.size(0) % bs == 0 && sink_k.sizes() == sink_v.sizes(), "int4 pool: side [entries * block_size, "
                "Hkv, D], sink_k and sink_v alike");
    for (const at::Tensor* t : {&entry_of, &sink_of})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == blocks, "int4 pool: int64 entry_of, sink_of [blocks]");
    for (const at::Tensor* t : {&k, &v, &k_scale, &k_min, &v_scale, &v_min, &side, &entry_of, &sink_k, &sink_v,
                                &sink_of})
      TORCH_CHECK(t->is_contiguous(), "int4 pool: contiguous tensors");
  }
  template <typename T>
  std::pair<Int4Rows<T>, Int4Rows<T>> rows() const {  // (keys, values)
    auto half = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); };
    const int64_t Hkv = k.size(1), D = 2 * k.size(2);
    const T* sp = side.data_ptr<T>();
    const int64_t* sop = sink_of.data_ptr<int64_t>();
    return {{k.data_ptr<uint8_t>(), half(k_scale), half(k_min), sp, sink_k.data_ptr<T>(), entry_of.data_ptr<int64_t>(),
             sop, Hkv, D, bs, true},
            {v.data_ptr<uint8_t>(), half(v_scale), half(v_min), sp, sink_v.data_ptr<T>(), nullptr, sop, Hkv, D, bs,
             false}};
  }
};

// Decode attention over the int4 pool (single-token queries q [B, H, D], as paged_attention).
at::Tensor paged_attention_int4(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& k_scale, const at::Tensor& k_min, const at::Tensor& v_scale,
                                const at::Tensor& v_min, const at::Tensor& side, const at::Tensor& entry_of,
                                const at::Tensor& sink_k, const at::Tensor& sink_v, const at::Tensor& sink_of,
                                const at::Tensor& tables, const at::Tensor& lens, int64_t block_size) {
  const Int4Pool pool{k, v, k_scale, k_min, v_scale, v_min, side, entry_of, sink_k, sink_v, sink_of, block_size};
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) && q.dim() == 3 &&
                  q.is_contiguous() && q.size(2) == 2 * k.size(2) && q.size(1) % k.size(1) == 0 &&
                  q.size(1) * q.size(2) / 16 <= kMaxVectors,
              "paged_attention_int4 wants contiguous q [B, H, D] (float32 or bfloat16), H a multiple of Hkv");
  pool.check(q.scalar_type());
  check_tables(q, tables, lens, block_size);
  at::Tensor out = at::empty_like(q);
  auto run = [&](auto* qp) {
    using T = std::remove_pointer_t<decltype(qp)>;
    const auto [keys, values] = pool.rows<T>();
    attend_all(qp, keys, values, tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out, q.size(0), q.size(1),
               k.size(1), q.size(2), tables.size(1), block_size);
  };
  if (q.scalar_type() == at::kFloat)
    run(q.data_ptr<float>());
  else
    run(q.data_ptr<bf16>());
  return out;
}

// The keys and values of the int4 pool at `slots` [S] (int64), in `dtype` (the model's): what a prompt chunk's
// attention reads, in one pass where the tensor ops took ~15.
std::tuple<at::Tensor, at::Tensor> read_int4(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_scale,
                                             const at::Tensor& k_min, const at::Tensor& v_scale,
                                             const at::Tensor& v_min, const at::Tensor& side,
                                             const at::Tensor& entry_of, const at::Tensor& sink_k,
                                             const at::Tensor& sink_v, const at::Tensor& sink_of,
                                             const at::Tensor& slots, int64_t block_size) {
  const Int4Pool pool{k, v, k_scale, k_min, v_scale, v_min, side, entry_of, sink_k, sink_v, sink_of, block_size};
  pool.check(side.scalar_type());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "read_int4 wants int64 slots [S]");
  const int64_t S = slots.size(0), Hkv = k.size(1), D = 2 * k.size(2), V = D / 16;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < S; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < k.size(0), "read_int4: slot ", sp[i], " is not in the pool");
  at::Tensor keys = at::empty({S, Hkv, D}, side.options()), values = at::empty_like(keys);
  auto run = [&](auto* kp, auto* vp) {
    using T = std::remove_pointer_t<decltype(kp)>;
    const auto [krows, vrows] = pool.rows<T>();
    at::parallel_for(0, S * Hkv, 64, [&](int64_t r0, int64_t r1) {
      f32x16 row[kMaxRow];
      for (int64_t r = r0; r < r1; ++r) {
        for (const auto& [src, out] : {std::pair{&krows, kp}, std::pair{&vrows, vp}}) {
          src->load(sp[r / Hkv], r % Hkv, row, V, false);
          for (int64_t j = 0; j < V; ++j)
            for (int i = 0; i < 16; ++i) out[r * D + j * 16 + i] = T(row[j][i]);
        }
      }
    });
  };
  if (side.scalar_type() == at::kFloat)
    run(keys.data_ptr<float>(), values.data_ptr<float>());
  else
    run(keys.data_ptr<bf16>(), values.data_ptr<bf16>());
  return {keys, values};
}

// The int4 KV cache's per-token values (fit() of leanlm/cache/int4.py over groups of 16 entries): x [R, C] float32,
// C a multiple of 16 -> codes two to a byte [R, C / 2] uint8 and a float16 scale and minimum [R, C / 16], bit for
// bit the Python grid's (minimum and scale rounded to float16 first, codes rounded half to even under them), in one
// pass where the tensor ops took ~12.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_int4(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % 16 == 0,
              "quantize_int4 wants contiguous float32 x [R, C], C a multiple of 16");
  const int64_t R = x.size(0), groups = R * x.size(1) / 16;
  at::Tensor codes = at::empty({R, x.size(1) / 2}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({R, x.size(1) / 16}, x.options().dtype(at::kHalf)), low = at::empty_like(scale);
  const float* xp = x.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  at::Half *sp = scale.data_ptr<at::Half>(), *lp = low.data_ptr<at::Half>();
  at::parallel_for(0, groups, 256, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const float* p = xp + g * 16;
      float lo = p[0], hi = p[0];
      for (int i = 1; i < 16; ++i) lo = std::min(lo, p[i]), hi = std::max(hi, p[i]);
      const at::Half l = lo, sc = std::max((hi - float(l)) / 15.f, 1e-7f);
      const float lf = l, sf = sc;
      auto code = [&](float v) { return uint8_t(std::clamp(std::nearbyint((v - lf) / sf), 0.f, 15.f)); };
      for (int i = 0; i < 16; i += 2) cp[g * 8 + i / 2] = code(p[i]) | (code(p[i + 1]) << 4);
      sp[g] = sc, lp[g] = l;
    }
  });
  return {codes, scale, low};
}

// The elementwise steps of a bf16 decoder layer in one op each, where eager PyTorch spends 3-8 ops (each a
// dispatch of several microseconds: at one decode row their overhead, not their bytes, is the cost). Same
// operations and roundings as the torch expressions they replace (layers.RMSNorm, layers.MLP); reductions and e^x
// in their own order, so the last bit of a result can differ.
inline u16x16 to_bf16(f32x16 v) {  // rounded to nearest even, as torch's float -> bf16 (NaN aside)
#if defined(LEANLM_AVX512) && defined(__AVX512BF16__)
  return (u16x16)_mm512_cvtneps_pbh((__m512)v);
#else
  u32x16 b;
  std::memcpy(&b, &v, sizeof b);
  return __builtin_convertvector((b + 0x7FFF + ((b >> 16) & 1)) >> 16, u16x16);
#endif
}
inline void store16(bf16* p, f32x16 v) {
  const u16x16 h = to_bf16(v);
  std::memcpy(p, &h, sizeof h);
}
inline f32x16 round_bf16(f32x16 v) {  // v rounded to bf16 and back
  const u32x16 w = __builtin_convertvector(to_bf16(v), u32x16) << 16;
  f32x16 r;
  std::memcpy(&r, &w, sizeof r);
  return r;
}

// The elementwise ops below run on Row vectors: 16 floats, or 8 on AVX2, where GCC kept 16-float vectors in memory
// (Zen 3, 256 rows of the default model, 2 threads: silu_mul 1108 -> 394 us, rms_norm 142 -> 62, rope 94 -> 82).
// silu_mul and rope give the same bits; rms_norm sums its squares in 8 lanes, not 16 (the same bits on those rows).
#if defined(LEANLM_AVX2)
using Row = f32x8;
using RowMask = i32x8;
inline Row load_row(const bf16* p) { return (Row)bf16x8(p); }
inline void store_row(bf16* p, Row v) { store_out(p, (__m256)v); }
inline Row round_bf16(Row v) { return (Row)((u32x8)bf16_bits((__m256)v) & 0xffff0000u); }
#else
using Row = f32x16;
using RowMask = i32x16;
inline Row load_row(const bf16* p) { return load16(p); }
inline void store_row(bf16* p, Row v) { store16(p, v); }
#endif
constexpr int64_t kRow = sizeof(Row) / sizeof(float);
inline float sum_row(Row v) {
  float s = 0.f;
  for (int i = 0; i < kRow; ++i) s += v[i];
  return s;
}

// x H_16 for 16 floats: four butterfly stages (strides 8, 4, 2, 1), each a lane swap, then lane i keeps a + b where
// bit s of i is clear and b - a where it is set (b the swapped lane: y[i] = x[i] + x[i ^ s], or x[i ^ s] - x[i])
inline f32x16 hadamard16(f32x16 a) {
  const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  f32x16 b = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  a = (lane & 8) ? b - a : a + b;
  b = __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  a = (lane & 4) ? b - a : a + b;
  b = __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  a = (lane & 2) ? b - a : a + b;
  b = __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return (lane & 1) ? b - a : a + b;
}

// y = w * bf16(x / sqrt(mean(x^2) + eps)), per row: x [M, D] bf16, w [D] bf16, D % 16 == 0
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                  w.numel() == x.size(1) && x.size(1) % 16 == 0 && w.is_contiguous() && x.device().is_cpu(),
              "rms_norm takes bf16 x [M, D] and w [D] with D % 16 == 0, got ", x.sizes(), " and ", w.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), D = xc.size(1);
  at::Tensor y = at::empty_like(xc);
  const bf16 *xp = xc.data_ptr<bf16>(), *wp = w.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const bf16* row = xp + m * D;
      Row sq{};
      for (int64_t d = 0; d < D; d += kRow) sq += load_row(row + d) * load_row(row + d);
      const float r = 1.f / std::sqrt(sum_row(sq) / float(D) + float(eps));
      for (int64_t d = 0; d < D; d += kRow)
        store_row(yp + m * D + d, round_bf16(load_row(row + d) * r) * load_row(wp + d));
    }
  });
  return y;
}

// h = bf16(silu(gate)) * up, rounded to bf16: gate_up [M, 2I] bf16 (gate the first I columns), I % 16 == 0
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.size(1) % 32 == 0 &&
                  gate_up.device().is_cpu(),
              "silu_mul takes bf16 gate_up [M, 2I] with I % 16 == 0, got ", gate_up.sizes());
  const at::Tensor gu = gate_up.contiguous();
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  at::Tensor h = at::empty({M, I}, gu.options());
  const bf16* gp = gu.data_ptr<bf16>();
  bf16* hp = h.data_ptr<bf16>();
  at::parallel_for(0, M, 16, [gp, hp, I](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t i = 0; i < I; i += kRow) {
        const Row g = load_row(gp + m * 2 * I + i);
        const RowMask neg = g < 0.f;  // e = e^-|g|: sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below
        const Row e = exp_lanes<Row, RowMask>(neg ? g : -g);
        const Row sigmoid = (neg ? e : Row{} + 1.f) / (1.f + e);
        store_row(hp + m * I + i, round_bf16(g * sigmoid) * load_row(gp + m * 2 * I + I + i));
      }
  });
  return h;
}

// Rotary embedding of the first `heads` heads of each row of qkv [R, (heads + rest) * D] bf16 by cos, sin [R, D] bf16
// (rotate_half layout): out [R, heads, D] = bf16(float(bf16(x cos)) + rotated(x) sin), as layers.apply_rope's
// torch.addcmul(x * cos, rotated, sin) rounds. D % 32 == 0.
at::Tensor rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0) &&
                  cos.size(1) % 32 == 0 && heads > 0 && heads * cos.size(1) <= qkv.size(1) && qkv.device().is_cpu() &&
                  qkv.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16,
              "rope takes bf16 qkv [R, >= heads * D], cos and sin [R, D] with D % 32 == 0, got ", qkv.sizes(), " ",
              cos.sizes());
  const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  const int64_t R = x.size(0), W = x.size(1), D = c.size(1), half = D / 2;
  at::Tensor out = at::empty({R, heads, D}, x.options());
  const bf16 *xp = x.data_ptr<bf16>(), *cp = c.data_ptr<bf16>(), *sp = s.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        const bf16* row = xp + r * W + h * D;
        for (int64_t d = 0; d < half; d += kRow) {
          const Row lo = load_row(row + d), hi = load_row(row + half + d);
          const Row c_lo = load_row(cp + r * D + d), c_hi = load_row(cp + r * D + half + d);
          const Row s_lo = load_row(sp + r * D + d), s_hi = load_row(sp + r * D + half + d);
          store_row(op + (r * heads + h) * D + d, round_bf16(lo * c_lo) - hi * s_lo);
          store_row(op + (r * heads + h) * D + half + d, round_bf16(hi * c_hi) + lo * s_hi);
        }
      }
  });
  return out;
}

// New keys x [N, Hkv, D] into a pool kept by block, store [blocks, Hkv, D / 2, bs, 2] (BlockedKeys; bf16, or int8
// codes), at slots [N]: as words of two entries, token n's channel pair p of kv head h goes to word
// ((slot / bs Hkv + h) D / 2 + p) bs + slot % bs.
void put_keys(at::Tensor store, const at::Tensor& slots, const at::Tensor& x) {
  TORCH_CHECK(store.dim() == 5 && (store.scalar_type() == at::kBFloat16 || store.scalar_type() == at::kChar) &&
                  store.is_contiguous() && store.size(4) == 2 && x.dim() == 3 &&
                  x.scalar_type() == store.scalar_type() && x.size(1) == store.size(1) &&
                  x.size(2) == 2 * store.size(2) && slots.dim() == 1 && slots.scalar_type() == at::kLong &&
                  slots.size(0) == x.size(0) && store.device().is_cpu() && x.device().is_cpu(),
              "put_keys wants a store [blocks, Hkv, D / 2, bs, 2] (bf16 or int8), int64 slots [N] and x [N, Hkv, D] "
              "of its dtype; got ", store.sizes(), " ", store.scalar_type(), ", ", slots.sizes(), ", ", x.sizes(), " ",
              x.scalar_type());
  const at::Tensor xc = x.contiguous(), sc = slots.contiguous();
  const int64_t N = xc.size(0), Hkv = xc.size(1), P = store.size(2), bs = store.size(3);
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(sp[n] >= 0 && sp[n] < store.size(0) * bs, "put_keys: slot ", sp[n], " is not in the pool");
  auto put = [&](auto word) {  // the type of two entries
    using W = decltype(word);
    const W* xp = (const W*)xc.data_ptr();
    W* out = (W*)store.data_ptr();
    at::parallel_for(0, N * Hkv, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t slot = sp[i / Hkv], h = i % Hkv;
        W* to = out + (slot / bs * Hkv + h) * P * bs + slot % bs;
        for (int64_t p = 0; p < P; ++p) to[p * bs] = xp[i * P + p];
      }
    });
  };
  store.scalar_type() == at::kChar ? put(uint16_t{}) : put(uint32_t{});
}

// Prefill attention over a bf16 or int8 pool (its keys by block too): a prompt chunk's T queries q [T, H, D] at
// positions C - T .. C - 1 against the C keys and values at pool `slots` (its context: the earlier chunks' tokens,
// then its own), causally; out [T, H, D] bf16. An int8 pool's rows are read as codes times their scale, rounded to
// bf16 (cache.int8). Both halves are packed products (packed_rows): each kv head's keys are packed once as a weight
// of C rows ([C / 16, D / 2, 16, 2]) and its values as one of D rows ([D / 16, C / 2, 16, 2]); a work item, the G
// query heads of one kv head at kPrefillPositions positions, takes its scores as float32, their softmax in float32
// (the weights rounded to bf16 for the second product, as torch's flash kernel rounds them), and its output. An
// item reads only the keys its last query sees. Zen 4, 2 threads, the zoo's heads, 256-1024 new tokens over
// 256-2048 of context: 2.2-3.7x torch's flash kernel on the gathered keys, 150-250 GFLOP/s (benchmarks/kernels.py
// --sections c).
constexpr int64_t kPrefillPositions = 16;

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                             const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const bool int8 = k.scalar_type() == at::kChar, blocked = k.dim() == 5;  // keys by block (either dtype)
  const bool keys_fit = blocked ? k.size(0) * k.size(3) == v.size(0) && k.size(1) == v.size(1) &&
                                      2 * k.size(2) == v.size(2) && k.size(3) % 16 == 0 && k.size(4) == 2
                                : k.sizes() == v.sizes();
  TORCH_CHECK(q.dim() == 3 && v.dim() == 3 && keys_fit && q.size(2) == v.size(2) && q.size(1) % v.size(1) == 0 &&
                  q.size(2) % 16 == 0 && q.size(2) <= 16 * kMaxRow && q.scalar_type() == at::kBFloat16 &&
                  (int8 || k.scalar_type() == at::kBFloat16) && v.scalar_type() == k.scalar_type() &&
                  k.is_contiguous() && v.is_contiguous() && q.device().is_cpu() && k.device().is_cpu() &&
                  v.device().is_cpu(),
              "prefill_attention wants bf16 q [T, H, D] and contiguous k, v [slots, Hkv, D] (bf16, or int8 codes; or "
              "the keys by block [blocks, Hkv, D / 2, block_size, 2]), H a multiple of Hkv and D of 16 up to 256; "
              "got ", q.sizes(), " ", k.sizes(), " ", v.sizes(), " ", k.scalar_type());
  for (const auto* scale : {&k_scale, &v_scale}) {
    const bool fits = !int8 || ((*scale)->scalar_type() == at::kFloat && (*scale)->is_contiguous() &&
                                (*scale)->numel() == v.size(0) * v.size(1));
    TORCH_CHECK(int8 == scale->has_value() && fits,
                "prefill_attention: int8 k, v need contiguous float32 k_scale and v_scale [slots, Hkv, 1], bf16 none");
  }
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.size(0) >= q.size(0),
              "prefill_attention wants int64 slots [C] with C >= T");
  const at::Tensor qc = q.contiguous(), sc = slots.contiguous();
  const int64_t T = qc.size(0), H = qc.size(1), D = qc.size(2), Hkv = v.size(1), G = H / Hkv, C = sc.size(0);
  const int64_t Cp = (C + 15) / 16 * 16;  // keys padded to whole tiles, with zeros
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t i = 0; i < C; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < v.size(0), "prefill_attention: slot ", sp[i], " is not in the pool");
  const bf16* qp = qc.data_ptr<bf16>();
  const float *ks = int8 ? k_scale->data_ptr<float>() : nullptr, *vs = int8 ? v_scale->data_ptr<float>() : nullptr;
  // an int8 entry as bf16: its code times its (slot, kv head)'s scale, as cache.int8.dequantize_per_token reads it
  const auto int8_entry = [](int8_t code, float scale) { return bf16(float(code) * scale); };
  // entry e = slot Hkv + kv head of a pool as bf16: in place, or an int8 row's entries in `buf`
  auto row = [&](const void* pool, const float* scales, int64_t e, bf16* buf) -> const bf16* {
    if (!scales) return (const bf16*)pool + e * D;
    const int8_t* c = (const int8_t*)pool + e * D;
    for (int64_t d = 0; d < D; ++d) buf[d] = int8_entry(c[d], scales[e]);
    return buf;
  };
  std::vector<bf16> keys(Hkv * Cp * D), values(Hkv * D * Cp);
  at::parallel_for(0, Hkv * Cp / 16, 1, [&](int64_t b0, int64_t b1) {  // b: 16 keys of one kv head
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t h = b / (Cp / 16), c0 = b % (Cp / 16) * 16;
      // as uint32: a key's pair (d, d + 1); two keys' (c, c + 1) values of one channel
      uint32_t* kt = (uint32_t*)keys.data() + (h * Cp + c0) * D / 2;
      uint32_t* vt = (uint32_t*)values.data() + h * D * Cp / 2;
      u16x16 zero{}, kv[2][kMaxRow];
      bf16 kbuf[16 * kMaxRow], vbuf[16 * kMaxRow];
      for (int64_t i = 0; i < 16; ++i) {
        const bool real = c0 + i < C;
        const int64_t e = sp[real ? c0 + i : 0] * Hkv + h;
        const bf16 *krow = blocked ? nullptr : row(k.data_ptr(), ks, e, kbuf), *vrow = row(v.data_ptr(), vs, e, vbuf);
        if (blocked) {  // the key's channel pair dp is one stride from its first (BlockedKeys)
          const int64_t bs = k.size(3), slot = sp[real ? c0 + i : 0];
          auto copy_pairs = [&](const auto* base) {
            using S = std::remove_cv_t<std::remove_pointer_t<decltype(base)>>;
            const BlockedKeys<S> pool{base, ks, Hkv, D, bs};
            const S* first = pool.run(slot / bs, slot % bs, h);
            const auto entry = [&](S x) -> bf16 {
              if constexpr (std::is_same_v<S, bf16>)
                return x;
              else
                return int8_entry(x, ks[e]);
            };
            for (int64_t dp = 0; dp < D / 2; ++dp) {
              const S* pair = first + dp * pool.stride();
              const bf16 two[2] = {entry(pair[0]), entry(pair[1])};
              std::memcpy(kt + dp * 16 + i, real ? (const void*)two : &zero, 4);
            }
          };
          int8 ? copy_pairs(k.data_ptr<int8_t>()) : copy_pairs(k.data_ptr<bf16>());
        } else {
          for (int64_t dp = 0; dp < D / 2; ++dp)
            std::memcpy(kt + dp * 16 + i, real ? (const void*)(krow + 2 * dp) : &zero, 4);
        }
        for (int64_t j = 0; j < D / 16; ++j)
          if (real)
            std::memcpy(&kv[i % 2][j], vrow + j * 16, 32);
          else
            kv[i % 2][j] = zero;
        if (i % 2)
          for (int64_t j = 0; j < D / 16; ++j) {
            const u32x16 pair =
                __builtin_convertvector(kv[0][j], u32x16) | __builtin_convertvector(kv[1][j], u32x16) << 16;
            std::memcpy(vt + j * 8 * Cp + (c0 + i) / 2 * 16, &pair, 64);
          }
      }
    }
  });
  at::Tensor out = at::empty({T, H, D}, qc.options());
  bf16* op = out.data_ptr<bf16>();
  const float scale = 1.f / std::sqrt(float(D));
  const int64_t tiles = (T + kPrefillPositions - 1) / kPrefillPositions;
  at::parallel_for(0, tiles * Hkv, 1, [&](int64_t w0, int64_t w1) {
    thread_local std::vector<bf16> rows, weights;
    thread_local std::vector<float> scores, acc, total;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t z = w / Hkv, h = w % Hkv;
      const int64_t tile = z % 2 ? tiles - 1 - z / 2 : z / 2;  // short and long items alternate: threads' shares even
      const int64_t i0 = tile * kPrefillPositions, R = std::min(kPrefillPositions, T - i0) * G;
      const int64_t width = (C - T + i0 + R / G + 15) / 16 * 16;  // the keys its last query sees, whole tiles
      rows.resize(R * D), weights.resize(R * width), scores.resize(R * width), acc.resize(R * D), total.resize(R);
      for (int64_t r = 0; r < R; ++r)  // row r: query head h G + r % G at position i0 + r / G
        std::memcpy(rows.data() + r * D, qp + ((i0 + r / G) * H + h * G + r % G) * D, D * sizeof(bf16));
      for (int64_t t = 0; t < width / 16; t += kPackTiles)
        for (int64_t m0 = 0; m0 < R; m0 += kPackRows)
          packed_rows(rows.data() + m0 * D, D, keys.data() + (h * Cp + t * 16) * D, 16 * D,
                      scores.data() + m0 * width + t * 16, width, std::min(kPackRows, R - m0),
                      std::min(kPackTiles, width / 16 - t));
      for (int64_t r = 0; r < R; ++r) {
        float* s = scores.data() + r * width;
        for (int64_t c = C - T + i0 + r / G + 1; c < width; ++c) s[c] = -INFINITY;  // past its position
        const float m = max_of(s, width);
        f32x16 sum{};
        for (int64_t c = 0; c < width; c += 16) {
          const f32x16 p = round_bf16(exp16((load16(s + c) - m) * scale));
          store16(weights.data() + r * width + c, p);
          sum += p;
        }
        total[r] = sum16(sum);
      }
      for (int64_t t = 0; t < D / 16; t += kPackTiles)
        for (int64_t m0 = 0; m0 < R; m0 += kPackRows)
          packed_rows(weights.data() + m0 * width, width, values.data() + (h * D + t * 16) * Cp, 16 * Cp,
                      acc.data() + m0 * D + t * 16, D, std::min(kPackRows, R - m0), std::min(kPackTiles, D / 16 - t));
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < D; d += 16)
          store16(op + ((i0 + r / G) * H + h * G + r % G) * D + d, load16(acc.data() + r * D + d) / total[r]);
    }
  });
  return out;
}

// QuaRot's online rotation of rows x [R, n] (lowbit/hadamard.py OnlineRotation): with n = m p, each row viewed as
// [m, p] becomes scale * (B^T (x H_p)) for Sylvester's H_p (a fast Walsh-Hadamard transform of each p-chunk: p log p
// adds, no multiplies) and an m x m matrix bt = B^T; scale [n] holds the random signs over sqrt(n). In float32, one
// row at a time per thread, out in x's dtype. Where 16 divides p the butterflies run on 16-float vectors: strides
// of 16 and more between vectors, 8 to 1 inside one by a lane swap and a blend.
template <typename T>
void rotate_row(const T* x, const float* bt, const float* scale, int64_t m, int64_t p, float* z, T* out) {
  const int64_t n = m * p;
  const bool vectors = p % 16 == 0;
  for (int64_t i = 0; i < n; ++i) z[i] = float(x[i]);
  for (int64_t c = 0; c < m; ++c) {  // z[c] <- z[c] H_p
    float* v = z + c * p;
    int64_t s = 1;  // the stride of the next butterfly stage
    if (vectors) {
      for (int64_t i = 0; i < p; i += 16) store16(v + i, hadamard16(load16(v + i)));
      s = 16;
    }
    for (; s < p; s *= 2)
      for (int64_t i = 0; i < p; i += 2 * s)
        for (int64_t j = i; j < i + s; ++j) {
          const float a = v[j], b = v[j + s];
          v[j] = a + b, v[j + s] = a - b;
        }
  }
  // out[r] = (sum_c bt[r, c] z[c]) * scale[r], 8 rows r at a time: each vector of z read once for 8 independent sums
  constexpr int64_t kRows = 8;
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    const int64_t rb = std::min(kRows, m - r0);
    for (int64_t i = 0; i < p; i += vectors ? 16 : 1) {
      if (vectors) {
        f32x16 acc[kRows] = {};
        for (int64_t c = 0; c < m; ++c) {
          const f32x16 zc = load16(z + c * p + i);
          for (int64_t k = 0; k < rb; ++k) acc[k] += bt[(r0 + k) * m + c] * zc;
        }
        for (int64_t k = 0; k < rb; ++k) store16(out + (r0 + k) * p + i, acc[k] * load16(scale + (r0 + k) * p + i));
      } else {
        for (int64_t k = 0; k < rb; ++k) {
          float acc = 0.f;
          for (int64_t c = 0; c < m; ++c) acc += bt[(r0 + k) * m + c] * z[c * p + i];
          out[(r0 + k) * p + i] = T(acc * scale[(r0 + k) * p + i]);
        }
      }
    }
  }
}

at::Tensor hadamard_rotate(const at::Tensor& x, const at::Tensor& bt, const at::Tensor& scale) {
  const int64_t m = bt.size(0), n = scale.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == n && bt.dim() == 2 && bt.size(1) == m && n % m == 0 &&
                  bt.scalar_type() == at::kFloat && scale.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "hadamard_rotate takes x [R, n] (float32 or bf16), float32 bt [m, m] and scale [n] with m dividing n; "
              "got ", x.sizes(), ", ", bt.sizes(), ", ", scale.sizes());
  const int64_t p = n / m;
  TORCH_CHECK((p & (p - 1)) == 0, "hadamard_rotate: n / m = ", p, " is not a power of two");
  const at::Tensor xc = x.contiguous(), b = bt.contiguous(), sc = scale.contiguous();
  at::Tensor out = at::empty_like(xc);
  const float *bp = b.data_ptr<float>(), *sp = sc.data_ptr<float>();
  auto rows = [&](const auto* xp, auto* op) {
    at::parallel_for(0, xc.size(0), 1, [&](int64_t r0, int64_t r1) {
      std::vector<float> z(n);
      for (int64_t r = r0; r < r1; ++r) rotate_row(xp + r * n, bp, sp, m, p, z.data(), op + r * n);
    });
  };
  if (xc.scalar_type() == at::kBFloat16)
    rows(xc.data_ptr<bf16>(), out.data_ptr<bf16>());
  else
    rows(xc.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

std::string isa() { return LEANLM_ISA; }

}  // namespace

TORCH_LIBRARY(LEANLM_NS, m) {
  m.def("isa() -> str", isa);  // no tensor argument: one kernel for every backend
  m.def("bf16_isa() -> str", bf16_isa);  // bf16_gemm's loops: "avx512bf16", "fma" or "portable"
  m.def("bf16_gemm(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_packed_gemm(Tensor x, Tensor w) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int8_gemv_q8(Tensor xq, Tensor xs, Tensor w, Tensor scale) -> Tensor");
  m.def("int8_packed_gemm(Tensor xq, Tensor xs, Tensor w, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("w8a16_packed_gemm(Tensor x, Tensor w, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("int4_q8_gemm(Tensor xq, Tensor xs, Tensor w, Tensor scales, Tensor zeros, int group_size, "
        "ScalarType dtype) -> Tensor");
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("rescale(Tensor acc, Tensor? xs, Tensor scale) -> Tensor");
  m.def("int4_gemv(Tensor x, Tensor w, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("int4_packed_gemm(Tensor x, Tensor w, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor qkv, Tensor cos, Tensor sin, int heads) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor tables, Tensor lens, int block_size, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor? k_scale=None, Tensor? v_scale=None) "
        "-> Tensor");
  m.def("put_keys(Tensor(a!) store, Tensor slots, Tensor x) -> ()");
  m.def("hadamard_rotate(Tensor x, Tensor bt, Tensor scale) -> Tensor");
  m.def("quantize_int4(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("read_int4(Tensor k, Tensor v, Tensor k_scale, Tensor k_min, Tensor v_scale, Tensor v_min, Tensor side, "
        "Tensor entry_of, Tensor sink_k, Tensor sink_v, Tensor sink_of, Tensor slots, int block_size) -> "
        "(Tensor, Tensor)");
  m.def("paged_attention_int4(Tensor q, Tensor k, Tensor v, Tensor k_scale, Tensor k_min, Tensor v_scale, "
        "Tensor v_min, Tensor side, Tensor entry_of, Tensor sink_k, Tensor sink_v, Tensor sink_of, Tensor tables, "
        "Tensor lens, int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(LEANLM_NS, CPU, m) {
  m.impl("int8_gemv", int8_gemv);
  m.impl("bf16_gemm", bf16_gemm);
  m.impl("bf16_packed_gemm", bf16_packed_gemm);
  m.impl("int8_gemv_q8", int8_gemv_q8);
  m.impl("int8_packed_gemm", int8_packed_gemm);
  m.impl("w8a16_packed_gemm", w8a16_packed_gemm);
  m.impl("int4_q8_gemm", int4_q8_gemm);
  m.impl("quantize_rows", quantize_rows);
  m.impl("rescale", rescale);
  m.impl("int4_gemv", int4_gemv);
  m.impl("int4_packed_gemm", int4_packed_gemm);
  m.impl("rms_norm", rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("rope", rope);
  m.impl("paged_attention", paged_attention);
  m.impl("paged_attention_int4", paged_attention_int4);
  m.impl("prefill_attention", prefill_attention);
  m.impl("put_keys", put_keys);
  m.impl("hadamard_rotate", hadamard_rotate);
  m.impl("quantize_int4", quantize_int4);
  m.impl("read_int4", read_int4);
}
