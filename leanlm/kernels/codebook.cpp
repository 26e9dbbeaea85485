// Additive-codebook weights (AQLM, leanlm/lowbit/codebook.py): every 8 consecutive inputs of an output row are the
// sum of C codewords, one from each of C codebooks of 256 entries, times the row's scale:
//   w[n, 8g + d] = scale[n] * sum_c codebooks[c, d, codes[g, c, n]]     codes [K/8, C, N] uint8 (C bits a weight)
// (the codebooks stored transposed, [C, 8, 256] bf16: the tables below read 16 entries' value d in one load)
//
// codebook_gemv (decode): y [M, N] float32 = x [M, K] w^T without forming w. For each row of x, a lookup table per
// (group g, codebook c) holds the dot products of x's 8 inputs of group g with the codebook's 256 entries; then
//   y[m, n] = scale[n] * sum over (g, c) of table[g, c][codes[g, c, n]]
// so a batch-1 product reads C / 8 bytes a weight (bf16: 2) and does K C / 8 lookups an output.
// - AVX-512: the tables are rounded to int16 in one unit per row of x (a bound on all its entries over 32767: a
//   rounding error of at most half a unit a lookup), so a table is 8 registers and `vpermi2w` looks up 64 of its
//   entries for 32 outputs at once (four permutes, three blends on the code's top two bits, 32 lookups in ~14
//   instructions); int32 sums, one float multiply at the end. Table-major loop: a table stays in registers while
//   its codes for 1024 outputs stream by, and asks for the codes of the table kAhead after it (each table's codes
//   are a run of 1 KiB, N bytes from the last, that the hardware prefetcher did not see coming: from memory the
//   lookups waited on every run). `python benchmarks/kernels_ab.py 527538c <this> --products aqlm` (Zen 5, the
//   default model's 120 projections, 2 threads): 1.86x / 1.58x / 1.36x / 1.18x at 1 / 2 / 4 / 8 rows; 2 or 4
//   tables ahead measured the same, 8 ~3% slower.
// - elsewhere: float32 tables, one scalar lookup at a time (a first AVX-512 version summed float tables with
//   `vgatherdps`, 16 outputs a gather: 212 us on a layer's gate_up + down at one row, Zen 4, about bf16's time).
// Where the time goes (Zen 4, one thread, cache-hot): ~10 cycles per 32 lookups, ~250 per table
// (128 FMAs); a layer's gate_up + down from memory takes 122 us against bf16's 227 and int4's 55
// (benchmarks/codebook.py). Byte permutes (`vpermi2b` on the tables' low and high bytes, 64 outputs a step) measured
// the same, so the lookups are not limited by the word permutes.
// codebook_dequant (prefill): w [N, K] bf16, for one GEMM.
// codebook_weight and its backward: the same weight from the float32 codebooks that training holds (below).
// Compiled into the same extension as cpu.cpp (leanlm/kernels/__init__.py), with the same ISA selection.

#include "common.h"

namespace {

constexpr int64_t kEntries = 256;  // entries of a codebook: 8-bit codes
constexpr int64_t kDim = 8;        // inputs a codeword covers
constexpr int64_t kTile = 1024;    // outputs whose int32 sums stay in L1 while the tables pass
constexpr int64_t kAhead = 4;      // tables ahead whose codes a lookup asks for (above)

// The codebooks [C, 8, 256] (stored transposed: entry e's 8 values 256 apart) in float32
std::vector<float> widened(const at::Tensor& codebooks) {
  const uint16_t* p = reinterpret_cast<const uint16_t*>(codebooks.data_ptr<bf16>());
  std::vector<float> f(codebooks.numel());
  for (size_t i = 0; i < f.size(); ++i) {
    const uint32_t bits = uint32_t(p[i]) << 16;  // bf16 is float32's top half: the compiler vectorizes this
    std::memcpy(&f[i], &bits, 4);
  }
  return f;
}

// table[c][e] = sum_d x[d] * cbt[c][d][e] for one group of 8 inputs x  # -> [C][256]
void group_tables(const float* x, const float* cbt, int64_t C, float* table) {
  for (int64_t c = 0; c < C; ++c) {
    const float* t = cbt + c * kDim * kEntries;
    float* out = table + c * kEntries;
    for (int64_t e = 0; e < kEntries; ++e) out[e] = 0.f;
    for (int64_t d = 0; d < kDim; ++d)
      for (int64_t e = 0; e < kEntries; ++e) out[e] += x[d] * t[d * kEntries + e];
  }
}

#ifdef LEANLM_AVX512
// As group_tables, rounded to int16 in units of `unit` (1 / inv) on the way out  # -> [C][256] int16
void group_tables16(const float* x, const float* cbt, int64_t C, float inv, int16_t* table) {
  __m512 xs[kDim];
  for (int64_t d = 0; d < kDim; ++d) xs[d] = _mm512_set1_ps(x[d] * inv);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t e = 0; e < kEntries; e += 64) {  // four independent chains of 8 FMAs
      const float* t = cbt + c * kDim * kEntries + e;
      __m512 acc[4];
      for (int i = 0; i < 4; ++i) acc[i] = _mm512_mul_ps(xs[0], _mm512_loadu_ps(t + 16 * i));
      for (int64_t d = 1; d < kDim; ++d)
        for (int i = 0; i < 4; ++i) acc[i] = _mm512_fmadd_ps(xs[d], _mm512_loadu_ps(t + d * kEntries + 16 * i), acc[i]);
      for (int i = 0; i < 4; ++i)
        _mm256_storeu_si256((__m256i*)(table + c * kEntries + e + 16 * i),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(acc[i])));
    }
}

// acc[i] += table[codes[i]] for i in [0, count), count <= kTile; table: 256 int16 entries in 8 registers. `ahead`:
// codes a later call reads, asked for a line every 64 lookups
inline void lookup_add(const __m512i (&t)[8], const uint8_t* codes, int64_t count, int32_t* acc, const uint8_t* ahead) {
  const __m512i bit6 = _mm512_set1_epi16(64), bit7 = _mm512_set1_epi16(128);
  for (int64_t i = 0; i < count; i += 32) {
    if (i % 64 == 0) _mm_prefetch((const char*)ahead + i, _MM_HINT_T0);
    const __mmask32 live = count - i >= 32 ? ~0u : (1u << (count - i)) - 1;
    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(live, codes + i));
    const __mmask32 hi6 = _mm512_test_epi16_mask(idx, bit6), hi7 = _mm512_test_epi16_mask(idx, bit7);
    const __m512i low = _mm512_mask_blend_epi16(hi6, _mm512_permutex2var_epi16(t[0], idx, t[1]),
                                                _mm512_permutex2var_epi16(t[2], idx, t[3]));
    const __m512i high = _mm512_mask_blend_epi16(hi6, _mm512_permutex2var_epi16(t[4], idx, t[5]),
                                                 _mm512_permutex2var_epi16(t[6], idx, t[7]));
    const __m512i v = _mm512_mask_blend_epi16(hi7, low, high);
    __m512i* a = (__m512i*)(acc + i);
    a[0] = _mm512_add_epi32(a[0], _mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
    a[1] = _mm512_add_epi32(a[1], _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
  }
}
#endif

void check(const at::Tensor& codes, const at::Tensor& codebooks, const at::Tensor& scale, const char* op) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.device().is_cpu(),
              op, " wants contiguous uint8 codes [K/8, C, N] on the CPU, got ", codes.sizes());
  const int64_t C = codes.size(1), N = codes.size(2);
  TORCH_CHECK(codebooks.dim() == 3 && codebooks.size(0) == C && codebooks.size(1) == kDim &&
                  codebooks.size(2) == kEntries && codebooks.scalar_type() == at::kBFloat16 &&
                  codebooks.is_contiguous(),
              op, " wants bf16 codebooks [C, 8, 256] (transposed) with C = codes.size(1) = ", C, ", got ",
              codebooks.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.numel() == N && scale.is_contiguous(), op,
              " wants bf16 scales [N]");
}

at::Tensor codebook_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& codebooks,
                         const at::Tensor& scale) {
  check(codes, codebooks, scale, "codebook_gemv");
  const int64_t G = codes.size(0), C = codes.size(1), N = codes.size(2), K = G * kDim, M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "codebook_gemv takes x [M, K] with K = 8 x codes.size(0) = ", K,
              ", got ", x.sizes());
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const Rows r(x);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const bf16* sp = scale.data_ptr<bf16>();
  float* yp = y.data_ptr<float>();
#ifdef LEANLM_AVX512
  // The groups split into one part a thread, in one parallel region: a part widens the codebooks to float32 and
  // builds its own groups' tables in its thread's own buffers, and sums their lookups for every output into its own
  // int32 sums, added up after. Data one core writes and the other then reads moves between their caches at ~40 ns
  // a 64-byte line (this 2-vCPU box): codebooks widened once on the calling thread for both took ~10 us a call, and
  // tables built in one region and looked up in a second, split by outputs, ~9 us more.
  const int64_t P = std::min<int64_t>(at::get_num_threads(), G);
  thread_local std::vector<int32_t> partial;  // [P][M][N]
  partial.resize(P * M * N);
  int32_t* sums = partial.data();
  std::vector<float> unit(M);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> books;     // [C][8][256] float32
    thread_local std::vector<int16_t> tables;  // [groups of the part][C][256]
    alignas(64) int32_t acc[kTile];
    books.resize(codebooks.numel());
    const bf16* bp = codebooks.data_ptr<bf16>();
    __m512 cmax16 = _mm512_setzero_ps();
    for (int64_t i = 0; i < codebooks.numel(); i += 16) {
      const __m512 v = bf16x16(bp + i);
      _mm512_storeu_ps(books.data() + i, v);
      cmax16 = _mm512_max_ps(cmax16, _mm512_abs_ps(v));
    }
    const float cmax = _mm512_reduce_max_ps(cmax16);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t g0 = G * p / P, g1 = G * (p + 1) / P, J = (g1 - g0) * C;  // J tables, from g0 * C
      tables.resize(J * kEntries);
      for (int64_t m = 0; m < M; ++m) {
        // One unit per row of x: every entry of its tables is bounded by max|codebooks| * max over groups of
        // |x_g|_1, which maps to 32767 (a bound, not the largest entry, so no pass over float tables; it costs a
        // few of the 16 bits). Every part computes the same unit, so their int32 sums add up exactly.
        float l1 = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          float sum = 0.f;
          for (int64_t d = 0; d < kDim; ++d) sum += std::fabs(r.f[m * K + g * kDim + d]);
          l1 = std::max(l1, sum);
        }
        const float u = l1 * cmax > 0.f ? l1 * cmax / 32767.f : 1.f;
        if (p == 0) unit[m] = u;
        for (int64_t g = g0; g < g1; ++g)
          group_tables16(r.f + m * K + g * kDim, books.data(), C, 1.f / u, tables.data() + (g - g0) * C * kEntries);
        for (int64_t n0 = 0; n0 < N; n0 += kTile) {  // a tile's int32 sums stay in L1 while the tables pass
          const int64_t count = std::min(kTile, N - n0);
          std::fill(acc, acc + kTile, 0);
          for (int64_t j = 0; j < J; ++j) {
            __m512i t[8];
            for (int i = 0; i < 8; ++i) t[i] = _mm512_loadu_si512(tables.data() + j * kEntries + 32 * i);
            // the last kAhead tables ask for the next tile's first (past the last tile: nothing a prefetch faults on)
            const uint8_t* codes = cp + (g0 * C + j) * N + n0;
            lookup_add(t, codes, count, acc, j + kAhead < J ? codes + kAhead * N : codes + kTile - (J - kAhead) * N);
          }
          std::copy(acc, acc + count, sums + (p * M + m) * N + n0);
        }
      }
    }
  });
  for (int64_t m = 0; m < M; ++m)  // y = (sums * unit) * scale, in the order of the scalar loops
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 live = Rows::tail(N - n);
      __m512i s = _mm512_maskz_loadu_epi32(live, sums + m * N + n);
      for (int64_t p = 1; p < P; ++p)
        s = _mm512_add_epi32(s, _mm512_maskz_loadu_epi32(live, sums + (p * M + m) * N + n));
      const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
          _mm256_maskz_loadu_epi16(live, sp + n)), 16));
      _mm512_mask_storeu_ps(yp + m * N + n, live,
                            _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(unit[m])), sc));
    }
#else
  const std::vector<float> cbt = widened(codebooks);
  const int64_t GC = G * C;
  thread_local std::vector<float> tables;  // [M][G * C][256]
  tables.resize(M * GC * kEntries);
  float* tp = tables.data();
  at::parallel_for(0, M * G, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      group_tables(r.f + (i / G) * K + (i % G) * kDim, cbt.data(), C, tp + i * C * kEntries);
  });
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) {
        float acc = 0.f;
        for (int64_t j = 0; j < GC; ++j) acc += tp[(m * GC + j) * kEntries + cp[j * N + n]];
        yp[m * N + n] = acc * float(sp[n]);
      }
  });
#endif
  return y;
}

#ifdef LEANLM_SIMD
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {  // rounding to nearest even as c10::BFloat16 does (the codebooks are finite)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  _mm_storeu_si128((__m128i*)p,
                   _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
}
#endif

// w [N, K] = scales[n] * the sum of each group's C codewords, books [C][256][8] (an entry's 8 values side by side)
template <typename Out>
void dequantize(const uint8_t* cp, const float* books, const float* scales, int64_t G, int64_t C, int64_t N, Out* wp) {
  const int64_t K = G * kDim;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* cg = cp + g * C * N + n;
#ifdef LEANLM_SIMD
        __m256 v = _mm256_loadu_ps(books + cg[0] * kDim);
        for (int64_t c = 1; c < C; ++c)
          v = _mm256_add_ps(v, _mm256_loadu_ps(books + (c * kEntries + cg[c * N]) * kDim));
        store8(wp + n * K + g * kDim, _mm256_mul_ps(v, _mm256_set1_ps(scales[n])));
#else
        float v[kDim] = {};
        for (int64_t c = 0; c < C; ++c) {
          const float* e = books + (c * kEntries + cg[c * N]) * kDim;
          for (int64_t d = 0; d < kDim; ++d) v[d] += e[d];
        }
        for (int64_t d = 0; d < kDim; ++d) wp[n * K + g * kDim + d] = Out(v[d] * scales[n]);
#endif
      }
  });
}

at::Tensor codebook_dequant(const at::Tensor& codes, const at::Tensor& codebooks, const at::Tensor& scale) {
  check(codes, codebooks, scale, "codebook_dequant");
  const int64_t G = codes.size(0), C = codes.size(1), N = codes.size(2);
  std::vector<float> books(C * kEntries * kDim);  // [C][256][8]
  const std::vector<float> cbt = widened(codebooks);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t d = 0; d < kDim; ++d)
      for (int64_t e = 0; e < kEntries; ++e) books[(c * kEntries + e) * kDim + d] = cbt[(c * kDim + d) * kEntries + e];
  const std::vector<float> scales = widened(scale);
  at::Tensor w = at::empty({N, G * kDim}, codebooks.options());
  dequantize(codes.data_ptr<uint8_t>(), books.data(), scales.data(), G, C, N, w.data_ptr<bf16>());
  return w;
}

// Training (compress/quant/aqlm.py's TunedCodebook: AQLM's block tuning and its end-to-end distillation) holds the
// codebooks as float32 [C, 256, 8] and the scales as float32 [N]
void check_train(const at::Tensor& codes, const at::Tensor& books, const at::Tensor& scale, const char* op) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.device().is_cpu(),
              op, " wants contiguous uint8 codes [K/8, C, N] on the CPU, got ", codes.sizes());
  TORCH_CHECK(books.dim() == 3 && books.size(0) == codes.size(1) && books.size(1) == kEntries &&
                  books.size(2) == kDim && books.scalar_type() == at::kFloat && books.is_contiguous(),
              op, " wants float32 codebooks [C, 256, 8] with C = codes.size(1), got ", books.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == codes.size(2) && scale.is_contiguous(), op,
              " wants float32 scales [N]");
}

// The weight of float32 codebooks, in float32 or bf16 (the dtype the product runs in: autocast's)  # -> [N, K]
at::Tensor codebook_weight(const at::Tensor& codes, const at::Tensor& books, const at::Tensor& scale,
                           at::ScalarType dtype) {
  check_train(codes, books, scale, "codebook_weight");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "codebook_weight writes float32 or bf16");
  const int64_t G = codes.size(0), C = codes.size(1), N = codes.size(2);
  at::Tensor w = at::empty({N, G * kDim}, books.options().dtype(dtype));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  if (dtype == at::kFloat)
    dequantize(cp, books.data_ptr<float>(), scale.data_ptr<float>(), G, C, N, w.data_ptr<float>());
  else
    dequantize(cp, books.data_ptr<float>(), scale.data_ptr<float>(), G, C, N, w.data_ptr<bf16>());
  return w;
}

// codebook_weight's backward from the weight's gradient gw [N, K] (float32 or bf16), in one pass over it:
//   d books[c, e, :] = sum over (g, n) with codes[g, c, n] = e of scale[n] gw[n, 8g:8g+8]
//   d scale[n]       = sum over g of gw[n, 8g:8g+8] . (the sum of group g's C codewords)
// each thread summing into its own copy of the codebooks (C x 8 KiB), added up at the end. torch's gathers and
// index_put (accumulate) had spent 2.2 s of a 7.6 s distillation step here (README: the distillation section).
template <typename G_t>
void weight_grads(const uint8_t* cp, const float* books, const float* scales, const G_t* gw, int64_t G, int64_t C,
                  int64_t N, float* sums, float* gs) {
  const int64_t K = G * kDim, size = C * kEntries * kDim;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float* mine = sums + at::get_thread_num() * size;
    for (int64_t n = n0; n < n1; ++n) {
      float dot[kDim] = {};
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* cg = cp + g * C * N + n;
        float grad[kDim];
        for (int64_t d = 0; d < kDim; ++d) grad[d] = float(gw[n * K + g * kDim + d]);
        for (int64_t c = 0; c < C; ++c) {
          const int64_t at = (c * kEntries + cg[c * N]) * kDim;
          for (int64_t d = 0; d < kDim; ++d) {
            dot[d] += grad[d] * books[at + d];
            mine[at + d] += scales[n] * grad[d];
          }
        }
      }
      float total = 0.f;
      for (int64_t d = 0; d < kDim; ++d) total += dot[d];
      gs[n] = total;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> codebook_weight_backward(const at::Tensor& codes, const at::Tensor& books,
                                                            const at::Tensor& scale, const at::Tensor& grad) {
  check_train(codes, books, scale, "codebook_weight_backward");
  const int64_t G = codes.size(0), C = codes.size(1), N = codes.size(2), size = C * kEntries * kDim;
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == N && grad.size(1) == G * kDim && grad.is_contiguous() &&
                  (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16),
              "codebook_weight_backward wants the weight's gradient [N, K] contiguous, float32 or bf16");
  const int64_t threads = at::get_num_threads();
  std::vector<float> sums(threads * size, 0.f);  // each thread's d books
  at::Tensor gs = at::empty({N}, scale.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  if (grad.scalar_type() == at::kFloat)
    weight_grads(cp, books.data_ptr<float>(), scale.data_ptr<float>(), grad.data_ptr<float>(), G, C, N, sums.data(),
                 gs.data_ptr<float>());
  else
    weight_grads(cp, books.data_ptr<float>(), scale.data_ptr<float>(), grad.data_ptr<bf16>(), G, C, N, sums.data(),
                 gs.data_ptr<float>());
  at::Tensor gb = at::empty(books.sizes(), books.options());
  float* gp = gb.data_ptr<float>();
  for (int64_t i = 0; i < size; ++i) gp[i] = sums[i];
  for (int64_t t = 1; t < threads; ++t)
    for (int64_t i = 0; i < size; ++i) gp[i] += sums[t * size + i];
  return {gb, gs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LEANLM_NS, m) {
  m.def("codebook_gemv(Tensor x, Tensor codes, Tensor codebooks, Tensor scale) -> Tensor");
  m.def("codebook_dequant(Tensor codes, Tensor codebooks, Tensor scale) -> Tensor");
  m.def("codebook_weight(Tensor codes, Tensor books, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("codebook_weight_backward(Tensor codes, Tensor books, Tensor scale, Tensor grad) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(LEANLM_NS, CPU, m) {
  m.impl("codebook_gemv", codebook_gemv);
  m.impl("codebook_dequant", codebook_dequant);
  m.impl("codebook_weight", codebook_weight);
  m.impl("codebook_weight_backward", codebook_weight_backward);
}
