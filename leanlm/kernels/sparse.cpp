// 2:4-sparse int8 weights read in their compact form (leanlm/lowbit/sparse24.py: pack_24), for decode:
//   int8_24_gemv: y[m, n] = scale[n] * sum_k x[m, k] w[n, k]   w [N, K] int8 with at most 2 nonzeros per 4 inputs
// stored as values [N, K/2] int8 (the 2 kept codes of every group of 4, in column order) and masks [N, ceil(K/8)]
// uint8 (a 4-bit mask per group with exactly 2 bits set, group 2j in the low nibble of byte j, 2j + 1 in the high
// one): 5 bits a weight instead of 8, so a batch-1 product streams 0.625x the bytes of the dense int8 kernel's.
//
// The activation rows are rounded to int16 with a scale per row by cpu.cpp's Rows (common.h: the same codes),
// and the weights are placed back at their dense positions before the same integer dot products, so the int32
// sums, and with them the results, equal int8_gemv's on the unpacked codes:
// - AVX-512 (VBMI, BITALG): the 8 mask bytes of 64 inputs, read as one uint64, give each dense position the index of its kept
//   byte (`vpmultishiftqb`, one bit of the mask per position) and are the zeroing mask of the `vpermb` that places
//   the 32 kept bytes at their dense positions; then `vpdpwssd` as the dense loop.
// - AVX2: `pshufb` spreads the 8 kept bytes of 16 inputs with a control from a 256-entry table per mask byte.
// - plain loops in float otherwise (LEANLM_PORTABLE forces them).
// int8_24_unpack writes the dense codes [N, K] with the same expansion (prefill runs one bf16 GEMM on them).
// Compiled into the same extension as cpu.cpp (leanlm/kernels/__init__.py), with the same ISA selection.

#include <array>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && \
    defined(__AVX512BITALG__) && \
    !defined(LEANLM_PORTABLE)
#define LEANLM24_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && !defined(LEANLM_PORTABLE)
#define LEANLM24_AVX2 1
#endif
#if defined(LEANLM24_AVX512) || defined(LEANLM24_AVX2)
#define LEANLM24_SIMD 1
#endif

namespace {

constexpr int64_t kChunk = 4096;  // int32 sums go to float this often (as cpu.cpp: no int32 overflow)

#ifdef LEANLM24_AVX512
// The 64 dense codes of a block of 64 inputs from its 32 kept bytes and its 64-bit mask, with `vpermb` instead of
// `vpexpandb`: on Zen 4 vpexpandb alone cost ~4 ns a block against ~0.9 ns for the dense loop's whole step (in L2),
// while the three instructions below add ~0.3 ns. Dense byte k (group g = k/4, position p = k%4) takes kept byte
// 2g + rank, rank being the kept positions of its group before p; with exactly 2 of 4 kept, that is 0 for p = 0,
// mask bit 4g for p = 1, 1 - mask bit 4g+3 for p = 2 and 1 for p = 3 (unkept bytes are zeroed by the mask itself).
// `vpmultishiftqb` brings that one bit to bit 0 of byte k, and (bit & keep) ^ base adds it to 2g (or 2g + 1).
// The zeroing mask comes from the broadcast mask too (`vpshufbitqmb`, bit k of byte k): GCC otherwise loads the
// mask once into a general register and moves it to a k register and a vector from there, which made the kernel
// ~12% slower on Zen 4 (in L2, one row of x) than this load from memory.
struct Densify {
  __m512i shift, keep, base, iota;  // per byte k: the mask bit it reads, 1 where that bit counts, 2g + (p >= 2), k

  Densify() {
    alignas(64) uint8_t sh[64], kp[64], bs[64], io[64];
    for (int k = 0; k < 64; ++k) {
      const int g = k / 4, p = k % 4;
      sh[k] = uint8_t(4 * g + (p == 2 ? 3 : 0));
      kp[k] = p == 1 || p == 2;
      bs[k] = uint8_t(2 * g + (p >= 2));
      io[k] = uint8_t(k);
    }
    shift = _mm512_load_si512(sh);
    keep = _mm512_load_si512(kp);
    base = _mm512_load_si512(bs);
    iota = _mm512_load_si512(io);
  }

  // mask: the block's 64-bit mask (bit k = input k kept) in every qword; packed: its kept bytes in the low 32 bytes
  __m512i operator()(__m512i mask, __m512i packed) const {
    const __m512i rank = _mm512_multishift_epi64_epi8(shift, mask);
    return _mm512_maskz_permutexvar_epi8(_mm512_bitshuffle_epi64_mask(mask, iota),
                                         _mm512_ternarylogic_epi64(rank, keep, base, 0x6A), packed);
  }
};

// The dense step's integer dot products on 64 dense codes: as cpu.cpp's int8_rows, so the int32 lanes are its own
template <int M>
inline void dot64(__m512i dense, const int16_t* x, int64_t Kp, __m512i (&acc)[M][2]) {
  const __m512i w0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(dense));
  const __m512i w1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(dense, 1));
  for (int m = 0; m < M; ++m) {  // x is zero-padded to Kp, a multiple of 64
    acc[m][0] = _mm512_dpwssd_epi32(acc[m][0], w0, _mm512_loadu_si512(x + m * Kp));
    acc[m][1] = _mm512_dpwssd_epi32(acc[m][1], w1, _mm512_loadu_si512(x + m * Kp + 32));
  }
}

// Rows n0..n1 against M rows of x: 64 inputs a step, their 32 kept bytes placed at their dense positions.
template <int M>
void rows24(const int16_t* xq, const float* xs, int64_t K, int64_t Kp, const int8_t* vals, const uint8_t* masks,
            const bf16* scale, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t Kv = K / 2, Km = (K + 7) / 8;
  const Densify densify;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* v = vals + n * Kv;
    const uint8_t* mk = masks + n * Km;
    __m512 sum[M];
    for (int m = 0; m < M; ++m) sum[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < K; c += kChunk) {
      const int64_t end = std::min(K, c + kChunk);
      __m512i acc[M][2];
      for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
      int64_t k = c;
      for (; k + 64 <= end; k += 64) {
        const __m512i mask = _mm512_broadcastq_epi64(_mm_loadu_si64(mk + k / 8));
        const __m512i packed = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(v + k / 2)));
        dot64<M>(densify(mask, packed), xq + k, Kp, acc);
      }
      if (k < end) {  // the row's last inputs (a multiple of 4): only its own bytes are read
        const int64_t left = end - k;
        uint64_t bits = 0;
        std::memcpy(&bits, mk + k / 8, (left + 7) / 8);
        bits &= (uint64_t(1) << left) - 1;
        const __m512i packed = _mm512_castsi256_si512(_mm256_maskz_loadu_epi8((1u << (left / 2)) - 1, v + k / 2));
        dot64<M>(densify(_mm512_set1_epi64(int64_t(bits)), packed), xq + k, Kp, acc);
      }
      for (int m = 0; m < M; ++m)
        sum[m] = _mm512_add_ps(sum[m], _mm512_cvtepi32_ps(_mm512_add_epi32(acc[m][0], acc[m][1])));
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(sum[m]) * xs[m] * float(scale[n]);
  }
}

#elif defined(LEANLM24_AVX2)
constexpr int64_t kPrefetch = 2048;  // cpu.cpp's 4 KiB ahead of a dense row, in kept bytes

// For a mask byte (two groups of 4 inputs), the pshufb control that spreads its 4 kept bytes (0..3) over the 8
// positions; 0x80 (a zero) where nothing is kept. Only the first two set bits of a nibble take a byte.
constexpr std::array<uint64_t, 256> spread_table() {
  std::array<uint64_t, 256> t{};
  for (int b = 0; b < 256; ++b) {
    uint64_t ctl = 0;
    for (int g = 0; g < 2; ++g) {
      int rank = 0;
      for (int i = 0; i < 4; ++i) {
        uint64_t byte = 0x80;
        if ((b >> (4 * g + i)) & 1 && rank < 2) byte = 2 * g + rank++;
        ctl |= byte << (8 * (4 * g + i));
      }
    }
    t[b] = ctl;
  }
  return t;
}
constexpr std::array<uint64_t, 256> kSpread = spread_table();

// Rows n0..n1 against M rows of x: 16 inputs a step (8 kept bytes, 2 mask bytes), the last K % 16 in integers.
template <int M>
void rows24(const int16_t* xq, const float* xs, int64_t K, int64_t Kp, const int8_t* vals, const uint8_t* masks,
            const bf16* scale, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t Kv = K / 2, Km = (K + 7) / 8;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* v = vals + n * Kv;
    const uint8_t* mk = masks + n * Km;
    __m256 sum[M];
    int32_t rest[M] = {};
    for (int m = 0; m < M; ++m) sum[m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < K; c += kChunk) {
      const int64_t end = std::min(K, c + kChunk);
      __v8si acc[M][2];  // GCC's own int32 type: arrays of __m256i were spilled around every product (cpu.cpp dot)
      for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = __v8si{};
      int64_t k = c;
      for (int u = 0; k + 16 <= end; k += 16, u ^= 1) {
        if (u == 0) _mm_prefetch((const char*)(v + k / 2 + kPrefetch), _MM_HINT_T0);
        const __m128i ctl = _mm_set_epi64x(int64_t(kSpread[mk[k / 8 + 1]] + 0x0404040404040404ull),
                                           int64_t(kSpread[mk[k / 8]]));
        const __m128i dense = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i*)(v + k / 2)), ctl);
        const __m256i wv = _mm256_cvtepi8_epi16(dense);
        for (int m = 0; m < M; ++m)
          acc[m][u] += (__v8si)_mm256_madd_epi16(wv, _mm256_loadu_si256((const __m256i*)(xq + m * Kp + k)));
      }
      for (; k < end; k += 4) {  // 4, 8 or 12 inputs left
        const int bits = (mk[k / 8] >> (k % 8)) & 15;
        for (int i = 0, j = 0; i < 4; ++i)
          if ((bits >> i) & 1 && j < 2) {
            const int32_t wv = v[k / 2 + j++];
            for (int m = 0; m < M; ++m) rest[m] += wv * xq[m * Kp + k + i];
          }
      }
      for (int m = 0; m < M; ++m)
        sum[m] = _mm256_add_ps(sum[m], _mm256_cvtepi32_ps((__m256i)(acc[m][0] + acc[m][1])));
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = (hsum(sum[m]) + float(rest[m])) * xs[m] * float(scale[n]);
  }
}
#endif

#ifdef LEANLM24_SIMD
struct Rows24 {
  template <int M>
  static constexpr auto at = rows24<M>;
};
#endif

at::Tensor int8_24_gemv(const at::Tensor& x, const at::Tensor& values, const at::Tensor& masks,
                        const at::Tensor& scale) {
  const int64_t N = values.size(0), K = 2 * values.size(-1), M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "int8_24_gemv takes x [M, K] with K = 2 x values' columns (", K,
              "), got ", x.sizes());
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kChar && K % 4 == 0,
              "int8_24_gemv wants int8 values [N, K/2] with K a multiple of 4");
  TORCH_CHECK(masks.scalar_type() == at::kByte && masks.dim() == 2 && masks.size(0) == N &&
                  masks.size(1) == (K + 7) / 8,
              "int8_24_gemv wants uint8 masks [N, ceil(K/8)], got ", masks.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.numel() == N && scale.is_contiguous(),
              "int8_24_gemv wants bf16 scales [N]");
  TORCH_CHECK(values.is_contiguous() && masks.is_contiguous() && values.device().is_cpu() && masks.device().is_cpu(),
              "int8_24_gemv wants contiguous CPU values and masks");
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const Rows r(x);
  const int8_t* vp = values.data_ptr<int8_t>();
  const uint8_t* mp = masks.data_ptr<uint8_t>();
  const bf16* sp = scale.data_ptr<bf16>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
#ifdef LEANLM24_SIMD
    for (int64_t t = n0; t < n1; t += 64)  // 64 weight rows stay in cache while each block of x rows uses them
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
        kTiles<Rows24, kMaxRows>[std::min(kMaxRows, M - m0) - 1](r.q + m0 * r.Kp, r.scale + m0, K, r.Kp, vp, mp, sp,
                                                                 yp + m0 * N, N, t, std::min(t + 64, n1));
#else
    const int64_t Kv = K / 2, Km = (K + 7) / 8;
    std::vector<float> acc(M);
    for (int64_t n = n0; n < n1; ++n) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k = 0; k < K; k += 4) {
        const int bits = (mp[n * Km + k / 8] >> (k % 8)) & 15;
        for (int i = 0, j = 0; i < 4; ++i)
          if ((bits >> i) & 1 && j < 2) {
            const float wv = vp[n * Kv + k / 2 + j++];
            for (int64_t m = 0; m < M; ++m) acc[m] += r.f[m * K + k + i] * wv;
          }
      }
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = acc[m] * float(sp[n]);
    }
#endif
  });
  return y;
}

// The dense codes [N, K] of the compact form, for prefill's GEMM (and checks): the kernels' expansion, stored.
void unpack_row(const int8_t* v, const uint8_t* mk, int64_t K, int8_t* out) {
  int64_t k = 0;
#if defined(LEANLM24_AVX512)
  const Densify densify;
  for (; k < K; k += 64) {
    const int64_t left = std::min<int64_t>(64, K - k);
    uint64_t bits = 0;
    std::memcpy(&bits, mk + k / 8, (left + 7) / 8);
    const __mmask32 kept = left == 64 ? ~0u : (1u << (left / 2)) - 1;
    const __m512i packed = _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(kept, v + k / 2));
    const __mmask64 all = left == 64 ? ~uint64_t(0) : (uint64_t(1) << left) - 1;
    _mm512_mask_storeu_epi8(out + k, all, densify(_mm512_set1_epi64(int64_t(bits & all)), packed));
  }
#elif defined(LEANLM24_AVX2)
  for (; k + 16 <= K; k += 16) {
    const __m128i ctl = _mm_set_epi64x(int64_t(kSpread[mk[k / 8 + 1]] + 0x0404040404040404ull),
                                       int64_t(kSpread[mk[k / 8]]));
    _mm_storeu_si128((__m128i*)(out + k), _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i*)(v + k / 2)), ctl));
  }
#endif
  for (; k < K; k += 4) {
    const int bits = (mk[k / 8] >> (k % 8)) & 15;
    for (int i = 0, j = 0; i < 4; ++i) out[k + i] = (bits >> i) & 1 && j < 2 ? v[k / 2 + j++] : 0;
  }
}

at::Tensor int8_24_unpack(const at::Tensor& values, const at::Tensor& masks) {
  const int64_t N = values.size(0), K = 2 * values.size(-1);
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kChar && K % 4 == 0 && masks.dim() == 2 &&
                  masks.scalar_type() == at::kByte && masks.size(0) == N && masks.size(1) == (K + 7) / 8 &&
                  values.is_contiguous() && masks.is_contiguous(),
              "int8_24_unpack wants contiguous int8 values [N, K/2] (K % 4 == 0) and uint8 masks [N, ceil(K/8)]");
  at::Tensor w = at::empty({N, K}, values.options());
  const int8_t* vp = values.data_ptr<int8_t>();
  const uint8_t* mp = masks.data_ptr<uint8_t>();
  int8_t* wp = w.data_ptr<int8_t>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) unpack_row(vp + n * (K / 2), mp + n * ((K + 7) / 8), K, wp + n * K);
  });
  return w;
}

#if defined(LEANLM24_AVX512)
#define LEANLM24_ISA "avx512vbmi"
#elif defined(LEANLM24_AVX2)
#define LEANLM24_ISA "avx2"
#else
#define LEANLM24_ISA "portable"
#endif
std::string sparse_isa() { return LEANLM24_ISA; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(LEANLM_NS, m) {
  m.def("sparse_isa() -> str", sparse_isa);  // int8_24_gemv's loops: "avx512vbmi", "avx2" or "portable"
  m.def("int8_24_gemv(Tensor x, Tensor values, Tensor masks, Tensor scale) -> Tensor");
  m.def("int8_24_unpack(Tensor values, Tensor masks) -> Tensor");
}

TORCH_LIBRARY_IMPL(LEANLM_NS, CPU, m) {
  m.impl("int8_24_gemv", int8_24_gemv);
  m.impl("int8_24_unpack", int8_24_unpack);
}
