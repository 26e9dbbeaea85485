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
// The other products take the weight as tile B, one 16-channel tile of y at a time (tile_rows): A is 16 rows of x as
// they are (a tile load with x's row stride), B a 1 KiB chunk of the weight, C 16 rows x 16 channels; four row
// blocks share each B tile (four independent chains). The packed layouts of cpu.cpp are B as they are:
//   bf16_packed_amx: pack_bf16's [N/16, K/2, 16, 2] (32 inputs x 16 channels a chunk), `tdpbf16ps`
//   int8_packed_amx: pack_int8's [N/16, K/4, 16, 4] (codes + 128) against x's int8 codes, `tdpbsud`, exact int32
//     sums less 128 sum_k xq, then int8_packed_gemm's epilogue: its bits
//   w8a16_packed_amx: pack_pairs' int8 codes, widened to bf16 (exact) once a call
// W4A16 (int4_gemv's product: groups of g along K, w = (q - 8) s + z), from pack_int4's layout, where a 32-input
// chunk of a 16-channel tile is 256 contiguous bytes, a 16-bit word per channel and 4 inputs; a shift and a mask give
// each channel's input pair as two word indexes, and one `vpermw` turns them into the bf16 of q - 8 (exact):
//   int4_amx: y[m, n] = sum_g s[g, n] sum_{k in g} (q[n, k] - 8) x[m, k] + z[g, n] sum_{k in g} x[m, k], each
//     group's sums scaled into y (y[m, n0..n0+16] += C[m] * s[g] + xsum[g, m] * z[g])
//   int4_dequant_amx (prefill): each tile's weight (q - 8) s + z rounded to bf16 once a call, then plain tiles
// Sums are float32 over exact products (int32 for int8), in an order fixed by K (and g): a row's result does not
// depend on the other rows. Compiled only where the compiler targets AMX (-march=native on such a CPU); elsewhere
// amx() is false and the products refuse. Linux grants a process the tile state on request (arch_prctl), once.

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__) && \
    !defined(LEANLM_PORTABLE)
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

// The tile state of one thread, all 8 tiles 16 rows of 64 bytes, configured on entry and released on exit
struct Tiles {
  Tiles() {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
  }
  ~Tiles() { _tile_release(); }
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

// 32 int8 codes as 32 bf16, in order (exact: |code| <= 127 fits bf16's 8-bit significand)
inline __m512i bf16_of_codes(__m256i codes) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1)));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

// 16 output channels' codes for inputs [k0, k0 + 32) widened to bf16 rows of a tile (zero past N and K)
inline void widen_block(const int8_t* w, int64_t K, int64_t n0, int64_t N, int64_t k0, uint16_t* a) {
  const int64_t width = std::min<int64_t>(32, K - k0);
  const __mmask32 take = width == 32 ? ~0u : (1u << width) - 1;
  for (int r = 0; r < 16; ++r) {
    __m256i codes = _mm256_setzero_si256();
    if (n0 + r < N) codes = _mm256_maskz_loadu_epi8(take, w + (n0 + r) * K + k0);
    _mm512_store_si512(reinterpret_cast<__m512i*>(a + r * 32), bf16_of_codes(codes));
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
    Tiles tiles;
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

// vpermw's table for widen_int4: word q (and q + 16) holds bf16(q - 8)
inline __m512i int4_table() {
  alignas(64) uint16_t t[32];
  for (int q = 0; q < 32; ++q) t[q] = c10::BFloat16(float((q & 15) - 8)).x;
  return _mm512_load_si512(t);
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
    _mm512_storeu_si512(b + 32 * j, _mm512_permutexvar_epi16(first, table));
    _mm512_storeu_si512(b + 32 * j + 16, _mm512_permutexvar_epi16(second, table));
  }
}

enum class Dot { bf16, s8u8 };  // tdpbf16ps: bf16 pairs into float32; tdpbsud: signed x bytes by unsigned weight bytes

// chunk ch against the row blocks [r0, r0 + blocks): tile numbers are literals, hence macros (C tiles 0-3, A 4-5,
// B 6-7)
#define LEANLM_ROWS_DOT(C, A, B)                              \
  do {                                                        \
    if constexpr (D == Dot::bf16)                             \
      _tile_dpbf16ps(C, A, B);                                \
    else                                                      \
      _tile_dpbsud(C, A, B);                                  \
  } while (0)
#define LEANLM_ROWS_BLOCK(C, A, B, r)                         \
  do {                                                        \
    _tile_loadd(A, x + (r0 + (r)) * 16 * ldx + ch * 64, ldx); \
    LEANLM_ROWS_DOT(C, A, B);                                 \
  } while (0)
#define LEANLM_ROWS_CHUNK(B)                                  \
  do {                                                        \
    _tile_loadd(B, b + ch * 1024, 64);                        \
    LEANLM_ROWS_BLOCK(0, 4, B, 0);                            \
    if (blocks > 1) LEANLM_ROWS_BLOCK(1, 5, B, 1);            \
    if (blocks > 2) LEANLM_ROWS_BLOCK(2, 4, B, 2);            \
    if (blocks > 3) LEANLM_ROWS_BLOCK(3, 5, B, 3);            \
  } while (0)

// One 16-channel tile of y from every row of x: `chunks` chunks of 64 bytes of each row of x (blocks of 16 rows, ldx
// bytes apart) times B tiles of 1 KiB each from b, four row blocks at a time: four independent chains, each B tile
// loaded once per four blocks. epilogue(block) finds a block's 16 x 16 sums (rows of x by channels) in c.
template <Dot D, typename Epilogue>
void tile_rows(const char* x, int64_t ldx, int64_t row_blocks, const char* b, int64_t chunks, void* c,
               Epilogue&& epilogue) {
  for (int64_t r0 = 0; r0 < row_blocks; r0 += 4) {
    const int64_t blocks = std::min<int64_t>(4, row_blocks - r0);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ch = 0; ch < chunks; ++ch) {
      if (ch % 2 == 0)
        LEANLM_ROWS_CHUNK(6);
      else
        LEANLM_ROWS_CHUNK(7);
    }
    for (int64_t blk = 0; blk < blocks; ++blk) {
      switch (blk) {
        case 0: _tile_stored(0, c, 64); break;
        case 1: _tile_stored(1, c, 64); break;
        case 2: _tile_stored(2, c, 64); break;
        default: _tile_stored(3, c, 64); break;
      }
      epilogue(r0 + blk);
    }
  }
}

// x's M rows of `row` bytes, as rows rounded up to 16 (a tile reads 16): x itself, or a zero-padded copy in buf
const char* whole_blocks(const void* x, int64_t M, int64_t row, std::vector<char>& buf) {
  if (M % 16 == 0) return static_cast<const char*>(x);
  buf.assign((M + 15) / 16 * 16 * row, 0);
  std::memcpy(buf.data(), x, M * row);
  return buf.data();
}

// 16 float32 sums to a row of y, as they are or rounded to bf16 once
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
inline void store16(uint16_t* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// y [M, N] float32 from x (rows rounded up to 16, ldx = 2K bytes apart), xsum [G, Mp]
void int4_tiles(const char* x, int64_t M, int64_t Mp, int64_t K, const uint8_t* w, const bf16* scales,
                const bf16* zeros, int64_t g, const float* xsum, int64_t N, float* y) {
  const int64_t G = K / g, per_group = g / 32;
#pragma omp parallel
  {
    Tiles tiles;
    alignas(64) uint32_t wide[4 * 256];  // a group's chunks as B tiles (g <= 128)
    alignas(64) float c[16 * 16];
    const __m512i table = int4_table();
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < N / 16; ++tile) {
      const int64_t n0 = tile * 16;
      for (int64_t grp = 0; grp < G; ++grp) {
        for (int64_t ch = 0; ch < per_group; ++ch)  // a tile is 8K bytes, a chunk of it 256
          widen_int4(w + tile * 8 * K + (grp * per_group + ch) * 256, wide + ch * 256, table);
        const __m512 s = bf16x16(scales + grp * N + n0), z = bf16x16(zeros + grp * N + n0);
        tile_rows<Dot::bf16>(x + grp * g * 2, 2 * K, Mp / 16, reinterpret_cast<const char*>(wide), per_group, c,
                             [&](int64_t block) {
                               for (int64_t r = 0, m = block * 16; r < 16 && m < M; ++r, ++m) {
                                 float* out = y + m * N + n0;
                                 const __m512 shift = _mm512_mul_ps(_mm512_set1_ps(xsum[grp * Mp + m]), z);
                                 const __m512 sums = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * r), s, shift);
                                 _mm512_storeu_ps(out, grp == 0 ? sums : _mm512_add_ps(_mm512_loadu_ps(out), sums));
                               }
                             });
      }
    }
  }
}

void check_int4_amx(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros,
                    int64_t g, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), op, ": x [M, K] bf16");
  const int64_t K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && 2 * w.size(1) == K, op,
              ": w [N, K / 2] uint8 in pack_int4's layout");
  TORCH_CHECK(g > 0 && g % 32 == 0 && g <= 128 && K % g == 0 && N % 16 == 0, op, ": the group (", g,
              ") must be 32, 64 or 128 and divide K (", K, "), and N (", N, ") a multiple of 16");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16 &&
                  scales.numel() == K / g * N && zeros.numel() == K / g * N && scales.is_contiguous() &&
                  zeros.is_contiguous(),
              op, ": contiguous bf16 scales and zeros [K / g, N]");
  TORCH_CHECK(tiles_granted(), op, ": the kernel did not grant this process the AMX tile state");
}

at::Tensor int4_amx(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros,
                    int64_t g) {
  check_int4_amx(x, w, scales, zeros, g, "int4_amx");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = K / g;
  const int64_t Mp = (M + 15) / 16 * 16;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<float> xsum(G * Mp, 0.f);  // [G, Mp]: each group's sum of x, for the zero points
  for (int64_t m = 0; m < M; ++m)
    for (int64_t grp = 0; grp < G; ++grp) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = grp * g; k < (grp + 1) * g; k += 16)
        sum = _mm512_add_ps(sum, bf16x16(reinterpret_cast<const bf16*>(xs + m * K + k)));
      xsum[grp * Mp + m] = _mm512_reduce_add_ps(sum);
    }
  std::vector<char> padded;
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  int4_tiles(whole_blocks(xs, M, 2 * K, padded), M, Mp, K, w.data_ptr<uint8_t>(),
             reinterpret_cast<const bf16*>(scales.data_ptr<at::BFloat16>()),
             reinterpret_cast<const bf16*>(zeros.data_ptr<at::BFloat16>()), g, xsum.data(), N, y.data_ptr<float>());
  return y;
}

// W4A16 for many rows (prefill): each 16-channel tile's weight dequantized once a call to bf16, (q - 8) s + z in
// one float32 FMA rounded to bf16 once (as a bf16 copy of the weight would hold it), as B tiles in a buffer; then
// bf16_packed_amx's loop over every row with no per-group step. Not int4_amx's exact products: a row's result
// depends on which of the two ran.
at::Tensor int4_dequant_amx(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                            const at::Tensor& zeros, int64_t g) {
  check_int4_amx(x, w, scales, zeros, g, "int4_dequant_amx");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), per_group = g / 32;
  std::vector<char> padded;
  const char* xp = whole_blocks(x.data_ptr<at::BFloat16>(), M, 2 * K, padded);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const bf16 *sp = scales.data_ptr<bf16>(), *zp = zeros.data_ptr<bf16>();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
#pragma omp parallel
  {
    Tiles tiles;
    alignas(64) float c[16 * 16];
    std::vector<uint32_t> wide(8 * K);  // the tile as bf16 B tiles: K / 32 chunks of 16 pairs x 16 channels
    const __m512i table = int4_table();
    // lane 2n + e of a B row is channel n: each channel's scale and zero twice, channels 0-7 and 8-15
    const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N / 16; ++t) {
      for (int64_t grp = 0; grp < K / g; ++grp) {
        const __m512 s = bf16x16(sp + grp * N + t * 16), z = bf16x16(zp + grp * N + t * 16);
        const __m512 s0 = _mm512_permutexvar_ps(lo, s), s1 = _mm512_permutexvar_ps(hi, s);
        const __m512 z0 = _mm512_permutexvar_ps(lo, z), z1 = _mm512_permutexvar_ps(hi, z);
        for (int64_t ch = grp * per_group; ch < (grp + 1) * per_group; ++ch) {
          uint32_t* b = wide.data() + ch * 256;
          widen_int4(wp + t * 8 * K + ch * 256, b, table);
          for (int p = 0; p < 16; ++p) {  // each row of B: (q - 8) as bf16 -> float32, times s, plus z, to bf16
            const __m512i q = _mm512_loadu_si512(b + 16 * p);
            const __m512 q0 = _mm512_cvtpbh_ps(__m256bh(_mm512_castsi512_si256(q)));
            const __m512 q1 = _mm512_cvtpbh_ps(__m256bh(_mm512_extracti64x4_epi64(q, 1)));
            _mm512_storeu_si512(b + 16 * p, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
                                               _mm512_fmadd_ps(q1, s1, z1), _mm512_fmadd_ps(q0, s0, z0))));
          }
        }
      }
      tile_rows<Dot::bf16>(xp, 2 * K, (M + 15) / 16, reinterpret_cast<const char*>(wide.data()), K / 32, c,
                           [&](int64_t block) {
                             for (int64_t r = 0, m = block * 16; r < 16 && m < M; ++r, ++m)
                               store16(yp + m * N + t * 16, _mm512_load_ps(c + 16 * r));
                           });
    }
  }
  return y;
}

// bf16_packed_gemm's product on AMX: the packed weight [N / 16, K / 2, 16, 2] is tile B's layout as it is (a
// 32-input chunk of a 16-channel tile: 1 KiB, pairs of inputs by channels), x's rows tile A. y [M, N] bf16, float32
// sums rounded once.
at::Tensor bf16_packed_amx(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "bf16_packed_amx: x [M, K] bf16");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 && w.scalar_type() == at::kBFloat16 &&
                  w.is_contiguous() && 2 * w.size(1) == x.size(1) && x.size(1) % 32 == 0,
              "bf16_packed_amx: w packed [N / 16, K / 2, 16, 2] bf16 with K a multiple of 32, got ", w.sizes());
  TORCH_CHECK(tiles_granted(), "bf16_packed_amx: the kernel did not grant this process the AMX tile state");
  const int64_t M = x.size(0), K = x.size(1), N = 16 * w.size(0);
  auto y = at::empty({M, N}, x.options());
  std::vector<char> padded;
  const char* xp = whole_blocks(x.data_ptr<at::BFloat16>(), M, 2 * K, padded);
  const char* wp = reinterpret_cast<const char*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
#pragma omp parallel
  {
    Tiles tiles;
    alignas(64) float c[16 * 16];
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N / 16; ++t)
      tile_rows<Dot::bf16>(xp, 2 * K, (M + 15) / 16, wp + t * 32 * K, K / 32, c, [&](int64_t block) {
        for (int64_t r = 0, m = block * 16; r < 16 && m < M; ++r, ++m)
          store16(yp + m * N + t * 16, _mm512_load_ps(c + 16 * r));
      });
  }
  return y;
}

// int8_packed_gemm's product on AMX (AMX-INT8): the packed weight [N / 16, K / 4, 16, 4] (codes + 128) is tile B's
// layout as it is, x's int8 codes tile A; int32 sums sum_k xq (w + 128), exact, less 128 sum_k xq; then
// y = float(sum) * xs[m] * scale[n] in that order: the bits of int8_packed_gemm.
template <typename Out>
void q8_packed_amx(const char* xq, const int32_t* xsum, const float* xs, const uint8_t* w, const float* scale,
                   Out* y, int64_t M, int64_t N, int64_t K) {
#pragma omp parallel
  {
    Tiles tiles;
    alignas(64) int32_t c[16 * 16];
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N / 16; ++t) {
      const __m512 sc = _mm512_loadu_ps(scale + t * 16);
      tile_rows<Dot::s8u8>(xq, K, (M + 15) / 16, reinterpret_cast<const char*>(w + t * 16 * K), K / 64, c,
                           [&](int64_t block) {
                             for (int64_t r = 0, m = block * 16; r < 16 && m < M; ++r, ++m) {
                               const __m512i sums = _mm512_sub_epi32(_mm512_load_si512(c + 16 * r),
                                                                     _mm512_set1_epi32(128 * xsum[m]));
                               const __m512 v = _mm512_mul_ps(
                                   _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(xs[m])), sc);
                               store16(y + m * N + t * 16, v);
                             }
                           });
    }
  }
}

at::Tensor int8_packed_amx(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& w, const at::Tensor& scale,
                           at::ScalarType dtype) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 4 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "int8_packed_amx: w packed [N / 16, K / 4, 16, 4] uint8, got ", w.sizes());
  const int64_t M = xq.size(0), K = 4 * w.size(1), N = 16 * w.size(0);
  TORCH_CHECK(K % 64 == 0 && K <= 32768, "int8_packed_amx: K (", K, ") a multiple of 64, at most 32768");
  TORCH_CHECK(xq.dim() == 2 && xq.size(1) == K && xq.scalar_type() == at::kChar && xq.is_contiguous(),
              "int8_packed_amx: contiguous int8 codes xq [M, K]");
  TORCH_CHECK(xs.scalar_type() == at::kFloat && xs.numel() == M && xs.is_contiguous() &&
                  scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "int8_packed_amx: float32 scales of x [M] and of the weight [N]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "int8_packed_amx writes float32 or bfloat16");
  TORCH_CHECK(tiles_granted(), "int8_packed_amx: the kernel did not grant this process the AMX tile state");
  const int8_t* xp = xq.data_ptr<int8_t>();
  const std::vector<int32_t> xsum = group_sums(xp, M, K, K);
  std::vector<char> padded;
  const char* x = whole_blocks(xp, M, K, padded);
  at::Tensor y = at::empty({M, N}, xq.options().dtype(dtype));
  if (dtype == at::kFloat)
    q8_packed_amx(x, xsum.data(), xs.data_ptr<float>(), w.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                  y.data_ptr<float>(), M, N, K);
  else
    q8_packed_amx(x, xsum.data(), xs.data_ptr<float>(), w.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                  reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, N, K);
  return y;
}

// w8a16_packed_gemm's product on AMX: the packed int8 codes [N / 16, K / 2, 16, 2] are tile B's layout but for their
// width; a 16-channel tile's codes are widened to bf16 (exact) once a call into a buffer of B tiles. x's bf16 rows
// are tile A as they are (not rounded to int16 as w8a16_packed_gemm rounds them); float32 sums times scale[n].
template <typename Out>
void w8_packed_amx(const char* x, const int8_t* w, const bf16* scale, Out* y, int64_t M, int64_t N, int64_t K) {
#pragma omp parallel
  {
    Tiles tiles;
    alignas(64) float c[16 * 16];
    std::vector<uint16_t> wide(16 * K);  // a tile's codes as bf16 B tiles: K / 32 chunks of 16 x 32
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N / 16; ++t) {
      const int8_t* codes = w + t * 16 * K;
      for (int64_t i = 0; i < 16 * K; i += 32)  // 16 channels x 2 inputs (a row of B) a step
        _mm512_storeu_si512(wide.data() + i,
                            bf16_of_codes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i))));
      const __m512 sc = bf16x16(scale + t * 16);
      tile_rows<Dot::bf16>(x, 2 * K, (M + 15) / 16, reinterpret_cast<const char*>(wide.data()), K / 32, c,
                           [&](int64_t block) {
                             for (int64_t r = 0, m = block * 16; r < 16 && m < M; ++r, ++m)
                               store16(y + m * N + t * 16, _mm512_mul_ps(_mm512_load_ps(c + 16 * r), sc));
                           });
    }
  }
}

at::Tensor w8a16_packed_amx(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 && w.scalar_type() == at::kChar && w.is_contiguous(),
              "w8a16_packed_amx: w packed [N / 16, K / 2, 16, 2] int8, got ", w.sizes());
  const int64_t M = x.size(0), K = 2 * w.size(1), N = 16 * w.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && K % 32 == 0 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "w8a16_packed_amx: contiguous bf16 x [M, K] with K (", K, ") a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.numel() == N && scale.is_contiguous(),
              "w8a16_packed_amx: bf16 scales [N]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "w8a16_packed_amx writes float32 or bfloat16");
  TORCH_CHECK(tiles_granted(), "w8a16_packed_amx: the kernel did not grant this process the AMX tile state");
  std::vector<char> padded;
  const char* xp = whole_blocks(x.data_ptr<at::BFloat16>(), M, 2 * K, padded);
  const bf16* sp = scale.data_ptr<bf16>();
  at::Tensor y = at::empty({M, N}, x.options().dtype(dtype));
  if (dtype == at::kFloat)
    w8_packed_amx(xp, w.data_ptr<int8_t>(), sp, y.data_ptr<float>(), M, N, K);
  else
    w8_packed_amx(xp, w.data_ptr<int8_t>(), sp, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, N, K);
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

at::Tensor int4_dequant_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "int4_dequant_amx: this build has no AMX loops (the CPU or the compiler lacks AMX)");
}

at::Tensor bf16_packed_amx(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "bf16_packed_amx: this build has no AMX loops (the CPU or the compiler lacks AMX)");
}

at::Tensor int8_packed_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::ScalarType) {
  TORCH_CHECK(false, "int8_packed_amx: this build has no AMX loops (the CPU or the compiler lacks AMX)");
}

at::Tensor w8a16_packed_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::ScalarType) {
  TORCH_CHECK(false, "w8a16_packed_amx: this build has no AMX loops (the CPU or the compiler lacks AMX)");
}

bool amx() { return false; }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(LEANLM_NS, m) {
  m.def("amx() -> bool", amx);  // int8_amx can run here
  m.def("int8_amx(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int4_amx(Tensor x, Tensor w, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("int4_dequant_amx(Tensor x, Tensor w, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("bf16_packed_amx(Tensor x, Tensor w) -> Tensor");
  m.def("int8_packed_amx(Tensor xq, Tensor xs, Tensor w, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("w8a16_packed_amx(Tensor x, Tensor w, Tensor scale, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(LEANLM_NS, CPU, m) {
  m.impl("int8_amx", int8_amx);
  m.impl("int4_amx", int4_amx);
  m.impl("int4_dequant_amx", int4_dequant_amx);
  m.impl("bf16_packed_amx", bf16_packed_amx);
  m.impl("int8_packed_amx", int8_packed_amx);
  m.impl("w8a16_packed_amx", w8a16_packed_amx);
}
