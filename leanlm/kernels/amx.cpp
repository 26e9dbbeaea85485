// W8A16 products on AMX tiles (Intel Sapphire Rapids and later), for the row counts where the int8 dot-product
// loops of cpu.cpp turn compute-bound (16-64 rows: a decode step of many sequences) and for prefill:
//   int8_amx: y[m, n] = scale[n] * sum_k x[m, k] w[n, k]   x [M, K] bf16, w [N, K] int8 codes, scale [N] bf16
// computed as y^T = w x^T so that the weight is the tile operand that keeps its natural layout:
// - A (16 output channels x 32 inputs): 16 rows of the weight's int8 codes widened to bf16 (exact: |code| <= 127
//   fits bf16's 8-bit significand), written to a 1 KiB buffer and loaded as a tile.
// - B (32 inputs x 16 rows of x): x packed once per call as bf16 pairs, [row panel][32-input chunk][16 pairs][16
//   rows] (the layout `tdpbf16ps` reads: consecutive inputs paired in each 32-bit lane).
// - C: 16 x 16 float32 accumulators, two per 16 rows of a 32-row panel (even and odd chunks, added at the end);
//   each weight block is widened once per panel and used by both blocks. Sums are float32 over bf16 products, as a
//   bf16 GEMM's, in the same order for a row whatever the other rows.
// Output channels are split across threads in blocks of 16. K and N need not be multiples of 32 and 16 (tails
// are zero-padded).
//
// W4A16 (int4_gemv's product: groups of g along K, w = (q - 8) s + z) with the weight as tile B instead:
//   int4_amx: y[m, n] = sum_g s[g, n] sum_{k in g} (q[n, k] - 8) x[m, k] + z[g, n] sum_{k in g} x[m, k]
// - B (16 input pairs x 16 output channels): a 32-input chunk of a 16-channel tile of pack_int4's layout is 256
//   contiguous bytes, 32 per 4 inputs, a 16-bit word per channel holding its 4 codes; a shift and a mask give each
//   channel's input pair as two word indexes, and one `vpermw` turns them into the bf16 of q - 8 (exact). Each
//   group's chunks are widened once per call and serve every row of x.
// - A (16 rows of x x 32 inputs): x's bf16 rows as they are (a tile load with x's row stride).
// - C: 16 rows x 16 channels, one group's sums; up to four row blocks at a time (4 independent chains). After each
//   group the rows are scaled into y: y[m, n0..n0+16] += C[m] * s[g] + xsum[g, m] * z[g], one 16-lane FMA pair.
// Sums are float32 over exact products, in an order fixed by K and g: a row's result does not depend on the
// other rows. Compiled only where the compiler targets AMX (-march=native on such a CPU); elsewhere amx() is
// false and both products refuse. Linux grants a process the tile state on request (arch_prctl), asked once.

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(LEANLM_PORTABLE)
#define LEANLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#ifdef LEANLM_AMX
constexpr int64_t PANEL = 32;  // rows of x a pass over the weight serves (two 16-row blocks)

bool tiles_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// x rows [m0, m0 + rows) as bf16 pairs: out[panel block][chunk][pair][row] (32-bit words), zero past K and rows
void pack_rows(const uint16_t* x, int64_t K, int64_t m0, int64_t rows, int64_t chunks, uint32_t* out) {
  const int64_t blocks = (rows + 15) / 16;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t c = 0; c < chunks; ++c) {
      uint32_t* o = out + (b * chunks + c) * 256;
      for (int p = 0; p < 16; ++p)
        for (int r = 0; r < 16; ++r) {
          const int64_t m = b * 16 + r, k = c * 32 + 2 * p;
          uint32_t word = 0;
          if (m < rows && k < K) {
            const uint16_t* src = x + (m0 + m) * K + k;
            word = src[0] | (k + 1 < K ? uint32_t(src[1]) << 16 : 0u);
          }
          o[p * 16 + r] = word;
        }
    }
}

// 16 output channels' codes for inputs [k0, k0 + 32) widened to bf16 rows of a tile (zero past N and K)
inline void widen_block(const int8_t* w, int64_t K, int64_t n0, int64_t N, int64_t k0, uint16_t* a) {
  const int64_t width = std::min<int64_t>(32, K - k0);
  const __mmask32 take = width == 32 ? ~0u : (1u << width) - 1;
  for (int r = 0; r < 16; ++r) {
    __m256i codes = _mm256_setzero_si256();
    if (n0 + r < N) codes = _mm256_maskz_loadu_epi8(take, w + (n0 + r) * K + k0);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1)));
    _mm512_store_si512(reinterpret_cast<__m512i*>(a + r * 32), reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
}

// one 32-input chunk: widen the weight block into `abuf`, load it as tile A and multiply it into the C tiles of
// the panel's two 16-row blocks (tiles are named by literal numbers, hence a macro)
#define LEANLM_AMX_CHUNK(A, abuf, ch, C0, C1)                \
  do {                                                       \
    widen_block(w, K, n0, N, (ch) * 32, abuf);               \
    _tile_loadd(A, abuf, 64);                                \
    const uint32_t* b = xp + (ch) * 256;                     \
    _tile_loadd(5, b, 64);                                   \
    _tile_dpbf16ps(C0, A, 5);                                \
    if (blocks > 1) {                                        \
      _tile_loadd(6, b + chunks * 256, 64);                  \
      _tile_dpbf16ps(C1, A, 6);                              \
    }                                                        \
  } while (0)

void panel(const uint32_t* xp, int64_t rows, int64_t K, int64_t chunks, const int8_t* w, const bf16* scale, int64_t N,
           float* y, int64_t m0) {
  const int64_t blocks = (rows + 15) / 16;
#pragma omp parallel
  {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    alignas(64) uint16_t a0[16 * 32], a1[16 * 32];
    alignas(64) float even[16 * 16], odd[16 * 16];
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
      // even chunks into C tiles 0 and 1, odd ones into 2 and 3: a tile's products wait on its previous one, so
      // two chains a block keep twice the products in flight; the two sums are added at the end
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      int64_t ch = 0;
      for (; ch + 1 < chunks; ch += 2) {
        LEANLM_AMX_CHUNK(4, a0, ch, 0, 1);
        LEANLM_AMX_CHUNK(7, a1, ch + 1, 2, 3);
      }
      if (ch < chunks) LEANLM_AMX_CHUNK(4, a0, ch, 0, 1);
      for (int64_t blk = 0; blk < blocks; ++blk) {
        if (blk == 0) {
          _tile_stored(0, even, 64);
          _tile_stored(2, odd, 64);
        } else {
          _tile_stored(1, even, 64);
          _tile_stored(3, odd, 64);
        }
        // row by row: y's rows are N floats apart, a multiple of 4 KiB for many models, so writing a column at a
        // time sent every store to the same cache set (3-5x slower at N = 3072)
        const int64_t width = std::min<int64_t>(16, N - n0);
        for (int j = 0; j < 16 && blk * 16 + j < rows; ++j) {
          float* out = y + (m0 + blk * 16 + j) * N + n0;
          for (int i = 0; i < width; ++i) out[i] = (even[i * 16 + j] + odd[i * 16 + j]) * float(scale[n0 + i]);
        }
      }
    }
    _tile_release();
  }
}

at::Tensor int8_amx(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "int8_amx: x [M, K] bf16");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(1) == x.size(1),
              "int8_amx: w [N, K] int8");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.numel() == w.size(0), "int8_amx: scale [N] bf16");
  TORCH_CHECK(tiles_granted(), "int8_amx: the kernel did not grant this process the AMX tile state");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), chunks = (K + 31) / 32;
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  std::vector<uint32_t> packed(((std::min(M, PANEL) + 15) / 16) * chunks * 256);
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t m0 = 0; m0 < M; m0 += PANEL) {
    const int64_t rows = std::min(PANEL, M - m0);
    pack_rows(xs, K, m0, rows, chunks, packed.data());
    panel(packed.data(), rows, K, chunks, w.data_ptr<int8_t>(),
          reinterpret_cast<const bf16*>(scale.data_ptr<at::BFloat16>()), N, y.data_ptr<float>(), m0);
  }
  return y;
}

inline __m512 bf16x16(const bf16* p) {
  return _mm512_cvtpbh_ps(__m256bh(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

// one 32-input chunk of a 16-channel int4 tile (256 bytes of pack_int4's layout) as tile B: row p holds each
// channel's bf16 pair (q[2p] - 8, q[2p + 1] - 8)
inline void widen_int4(const uint8_t* codes, uint32_t* b, __m512i table) {
  const __m512i nibble = _mm512_set1_epi32(0x000F000F);
  for (int j = 0; j < 8; ++j) {  // inputs 4j..4j + 3: word (q[k] | q[k + 2] << 4 | q[k + 1] << 8 | q[k + 3] << 12)
    const __m512i d = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * j)));
    // (a | b) & c is ternary-logic table 0xA8: q[k] to word 0 and q[k + 1] to word 1; then q[k + 2], q[k + 3]
    const __m512i first = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 8), nibble, 0xA8);
    const __m512i second = _mm512_ternarylogic_epi32(_mm512_srli_epi32(d, 4), _mm512_slli_epi32(d, 4), nibble, 0xA8);
    _mm512_store_si512(b + 32 * j, _mm512_permutexvar_epi16(first, table));
    _mm512_store_si512(b + 32 * j + 16, _mm512_permutexvar_epi16(second, table));
  }
}

// chunk ch of the group against the row blocks [r0, r0 + blocks): A from x, B from the widened chunk (tile numbers
// are literals, hence a macro: C tiles 0-3, A 4-5, B 6-7)
#define LEANLM_INT4_BLOCK(C, A, B, r)                                     \
  do {                                                                    \
    _tile_loadd(A, x + ((r0 + (r)) * 16) * K + k0, 2 * K);                \
    _tile_dpbf16ps(C, A, B);                                              \
  } while (0)
#define LEANLM_INT4_CHUNK(B)                                              \
  do {                                                                    \
    _tile_loadd(B, wide + ch * 256, 64);                                  \
    LEANLM_INT4_BLOCK(0, 4, B, 0);                                        \
    if (blocks > 1) LEANLM_INT4_BLOCK(1, 5, B, 1);                        \
    if (blocks > 2) LEANLM_INT4_BLOCK(2, 4, B, 2);                        \
    if (blocks > 3) LEANLM_INT4_BLOCK(3, 5, B, 3);                        \
  } while (0)

// y [M, N] float32 from x [Mp, K] bf16 (Mp = M rounded up to 16, rows past M zero), xsum [G, Mp]
void int4_tiles(const uint16_t* x, int64_t M, int64_t Mp, int64_t K, const uint8_t* w, const bf16* scales,
                const bf16* zeros, int64_t g, const float* xsum, int64_t N, float* y) {
  const int64_t G = K / g, per_group = g / 32, row_blocks = Mp / 16;
#pragma omp parallel
  {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    alignas(64) uint32_t wide_buf[4 * 256];  // a group's chunks as B tiles (g <= 128)
    alignas(64) float c[16 * 16];
    uint32_t* wide = wide_buf;
    __m512i table;  // word q: bf16(q - 8)
    {
      alignas(64) uint16_t t[32];
      for (int q = 0; q < 32; ++q) t[q] = c10::BFloat16(float((q & 15) - 8)).x;
      table = _mm512_load_si512(t);
    }
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < N / 16; ++tile) {
      const int64_t n0 = tile * 16;
      for (int64_t grp = 0; grp < G; ++grp) {
        for (int64_t ch = 0; ch < per_group; ++ch)  // a tile is 8K bytes, a chunk of it 256
          widen_int4(w + tile * 8 * K + (grp * per_group + ch) * 256, wide + ch * 256, table);
        const __m512 s = bf16x16(scales + grp * N + n0), z = bf16x16(zeros + grp * N + n0);
        for (int64_t r0 = 0; r0 < row_blocks; r0 += 4) {
          const int64_t blocks = std::min<int64_t>(4, row_blocks - r0);
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t ch = 0; ch < per_group; ++ch) {
            const int64_t k0 = grp * g + ch * 32;
            if (ch % 2 == 0) LEANLM_INT4_CHUNK(6);
            else LEANLM_INT4_CHUNK(7);
          }
          for (int64_t blk = 0; blk < blocks; ++blk) {
            switch (blk) {
              case 0: _tile_stored(0, c, 64); break;
              case 1: _tile_stored(1, c, 64); break;
              case 2: _tile_stored(2, c, 64); break;
              default: _tile_stored(3, c, 64); break;
            }
            for (int64_t r = 0; r < 16; ++r) {
              const int64_t m = (r0 + blk) * 16 + r;
              if (m >= M) break;
              float* out = y + m * N + n0;
              const __m512 sums =
                  _mm512_fmadd_ps(_mm512_load_ps(c + 16 * r), s, _mm512_mul_ps(_mm512_set1_ps(xsum[grp * Mp + m]), z));
              _mm512_storeu_ps(out, grp == 0 ? sums : _mm512_add_ps(_mm512_loadu_ps(out), sums));
            }
          }
        }
      }
    }
    _tile_release();
  }
}

at::Tensor int4_amx(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros,
                    int64_t g) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "int4_amx: x [M, K] bf16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = K / std::max<int64_t>(g, 1);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && 2 * w.size(1) == K,
              "int4_amx: w [N, K / 2] uint8 in pack_int4's layout");
  TORCH_CHECK(g % 32 == 0 && g <= 128 && K % g == 0 && N % 16 == 0, "int4_amx: the group (", g,
              ") must be 32, 64 or 128 and divide K (", K, "), and N (", N, ") a multiple of 16");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16 &&
                  scales.numel() == G * N && zeros.numel() == G * N && scales.is_contiguous() && zeros.is_contiguous(),
              "int4_amx: contiguous bf16 scales and zeros [K / g, N]");
  TORCH_CHECK(tiles_granted(), "int4_amx: the kernel did not grant this process the AMX tile state");
  const int64_t Mp = (M + 15) / 16 * 16;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<uint16_t> padded;  // x's rows rounded up to 16 with zero rows: a tile reads 16
  if (Mp != M) {
    padded.assign(Mp * K, 0);
    std::copy(xs, xs + M * K, padded.begin());
    xs = padded.data();
  }
  std::vector<float> xsum(G * Mp, 0.f);  // [G, Mp]: each group's sum of x, for the zero points
  for (int64_t m = 0; m < M; ++m)
    for (int64_t grp = 0; grp < G; ++grp) {
      float sum = 0.f;
      for (int64_t k = grp * g; k < (grp + 1) * g; ++k)
        sum += float(c10::BFloat16(xs[m * K + k], c10::BFloat16::from_bits()));
      xsum[grp * Mp + m] = sum;
    }
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  int4_tiles(xs, M, Mp, K, w.data_ptr<uint8_t>(), reinterpret_cast<const bf16*>(scales.data_ptr<at::BFloat16>()),
             reinterpret_cast<const bf16*>(zeros.data_ptr<at::BFloat16>()), g, xsum.data(), N, y.data_ptr<float>());
  return y;
}

bool amx() { return tiles_granted(); }
#else
at::Tensor int8_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "int8_amx: this build has no AMX loops (the CPU or the compiler lacks AMX)");
}

at::Tensor int4_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "int4_amx: this build has no AMX loops (the CPU or the compiler lacks AMX)");
}

bool amx() { return false; }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(LEANLM_NS, m) {
  m.def("amx() -> bool", amx);  // int8_amx can run here
  m.def("int8_amx(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int4_amx(Tensor x, Tensor w, Tensor scales, Tensor zeros, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(LEANLM_NS, CPU, m) {
  m.impl("int8_amx", int8_amx);
  m.impl("int4_amx", int4_amx);
}
