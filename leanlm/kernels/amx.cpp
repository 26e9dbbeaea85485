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
// are zero-padded). Compiled only where the compiler targets AMX (-march=native on such a CPU); elsewhere amx()
// is false and int8_amx refuses. Linux grants a process the tile state on request (arch_prctl), asked once.

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

bool amx() { return tiles_granted(); }
#else
at::Tensor int8_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "int8_amx: this build has no AMX loops (the CPU or the compiler lacks AMX)");
}

bool amx() { return false; }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(LEANLM_NS, m) {
  m.def("amx() -> bool", amx);  // int8_amx can run here
  m.def("int8_amx(Tensor x, Tensor w, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(LEANLM_NS, CPU, m) { m.impl("int8_amx", int8_amx); }
