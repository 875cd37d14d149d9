// The bf16 product on AMX tiles: weight [N, K] × rows [M, K] → [M, N] fp32 or bf16, any M.
//
// tdpbf16ps multiplies a 16 x 32 bf16 tile A by a 32 x 16 tile B (stored as 16 rows of 16
// pairs) into a 16 x 16 fp32 tile C. Here A is 16 weight rows read in place (row stride K),
// B 16 input rows packed once per call (a 16 x 16 transpose of bf16 pairs), and C the output
// transposed (16 weights x 16 rows), written back by another 16 x 16 transpose. Four C tiles
// (32 weights x 32 rows) take two weight tiles and two input tiles per 32 columns of K, so
// every weight tile loaded serves two input tiles; the weight rows a step streams from memory
// stay in cache for the other input rows. Each output element is one sum over K in blocks of
// 32, in the same order whatever M is and whichever other rows share its tiles: a row gets the
// same bits alone or in any batch.
//
// The default model's projections of one decode step, bf16 out (30 layers, 2 vCPU Xeon with
// AMX, ad hoc): 9.6 ms at 1 row (the AVX512-BF16 product: 11.7, torch's GEMM: 18.5), 9.8 at
// 16 (23.3, 18.9), 15.3 at 64 (79, 25.2), 25.1 at 128 (torch 30.5), 40.3 at 256 (45.7).
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <memory>

#include "bf16_kernels.h"

namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an XSAVE feature
constexpr long kXfeatureXtiledata = 18;     // the AMX tile data
constexpr int64_t kChunkBlocks = 8;         // 16-row input blocks per work item (128 rows)
// fp32 outputs this large (a head's logits over a batch: 25 MB at 128 rows of 49152) are
// written past the caches: they would not stay in them anyway, and a cached store reads each
// line from memory first (128 x 576 x 49152, caches cold: 8.7 -> 6.4 ms on the AMX Xeon).
constexpr int64_t kStreamBytes = 8 << 20;

bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 0, a, b, c, d);
  return (d >> 22 & 1u) && (d >> 24 & 1u);  // AMX-BF16, AMX-TILE
}

// Output rows i < n of a C tile's transpose, at out + i * os: fp32, or bf16 rounded to nearest
// even (as torch's conversion and f32_to_bf16) where out16.
TLT_AMX inline void store_rows(const __m512 (&r)[16], float* out, uint16_t* out16, int64_t os,
                               int64_t n, bool stream = false) {
  for (int64_t i = 0; i < n; ++i) {
    if (out16 != nullptr)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out16 + i * os),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(r[i])));
    else if (stream)
      _mm512_stream_ps(out + i * os, r[i]);
    else
      _mm512_storeu_ps(out + i * os, r[i]);
  }
}

// x [M, K] → xp [K / 32][MB][16 pairs][16 rows][2]: the B tiles, rows past M zero.
TLT_AMX void pack_rows(const uint16_t* x, int64_t M, int64_t K, int64_t MB, uint16_t* xp) {
  alignas(64) uint16_t part[16][32];
  for (int64_t mb = 0; mb < MB; ++mb) {
    const int64_t valid = std::min<int64_t>(16, M - mb * 16);
    for (int64_t kb = 0; kb < K / 32; ++kb) {
      const uint16_t* src = x + mb * 16 * K + kb * 32;
      int64_t stride = K;
      if (valid < 16) {  // the last rows, padded with zeros
        for (int64_t m = 0; m < 16; ++m)
          if (m < valid) std::memcpy(part[m], src + m * K, 64);
          else std::memset(part[m], 0, 64);
        src = part[0];
        stride = 32;
      }
      __m512 r[16];
      transpose16(reinterpret_cast<const float*>(src), stride / 2, r);
      store_rows(r, reinterpret_cast<float*>(xp + (kb * MB + mb) * 512), nullptr, 16, 16);
    }
  }
}

// Work items [i0, i1): item i is 32 weight rows (i % NB) × up to 128 input rows (i / NB).
TLT_AMX void product_items(const uint16_t* w, const uint16_t* xp, float* out, uint16_t* out16,
                           int64_t M, int64_t N, int64_t K, int64_t MB, int64_t NB, int64_t i0,
                           int64_t i1) {
  amx_configure();
  alignas(64) float c[4][16][16];  // [weight half * 2 + row half][weight][row]
  const int64_t KB = K / 32;
  const bool stream = out16 == nullptr && M * N * 4 >= kStreamBytes &&
                      reinterpret_cast<uintptr_t>(out) % 64 == 0 && N % 16 == 0;
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t nb = it % NB, first = it / NB * kChunkBlocks;
    const uint16_t* w0 = w + nb * 32 * K;
    const uint16_t* w1 = w0 + 16 * K;
    const bool two_w = nb * 32 + 16 < N;
    const int64_t last = std::min(MB, first + kChunkBlocks);
    for (int64_t mb = first; mb < last; mb += 2) {
      const bool two_x = mb + 1 < last;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < KB; ++kb) {
        _tile_loadd(4, w0 + kb * 32, K * 2);
        _tile_loadd(6, xp + (kb * MB + mb) * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_x) {
          _tile_loadd(7, xp + (kb * MB + mb + 1) * 512, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_w) {
          _tile_loadd(5, w1 + kb * 32, K * 2);
          _tile_dpbf16ps(2, 5, 6);
          if (two_x) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      for (int t = 0; t < 4; ++t) {
        if (((t & 1) && !two_x) || ((t >> 1) && !two_w)) continue;
        const int64_t m0 = (mb + (t & 1)) * 16;
        const int64_t at = m0 * N + nb * 32 + (t >> 1) * 16;
        __m512 r[16];
        transpose16(&c[t][0][0], 16, r);
        store_rows(r, out + at, out16 == nullptr ? nullptr : out16 + at, N,
                   std::min<int64_t>(16, M - m0), stream);
      }
    }
  }
  if (stream) _mm_sfence();  // the streamed stores visible before the threads' barrier
  amx_release();
}

}  // namespace

bool amx_ready() {
  static const bool ready = cpu_has_amx_bf16() && avx512_bf16() &&
                            syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 as 16 rows of 64 bytes. A constant in memory: GCC 12 does not count ldtilecfg as a
// read of its operand and drops the stores that fill a local configuration.
constexpr TileConfig sixteen_rows_of_64() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  return cfg;
}
constexpr TileConfig kTiles = sixteen_rows_of_64();

TLT_AMX void amx_configure() { _tile_loadconfig(&kTiles); }

TLT_AMX void amx_release() { _tile_release(); }

bool amx_fits(int64_t N, int64_t K) { return K % 32 == 0 && N % 16 == 0; }

void amx_product(const uint16_t* w, const uint16_t* x, float* out, uint16_t* out16, int64_t M,
                 int64_t N, int64_t K) {
  const int64_t MB = (M + 15) / 16, NB = (N + 31) / 32;
  // Every element is written by pack_rows: no zero fill first (M x K x 2 bytes a product).
  const std::unique_ptr<uint16_t[]> xp(new uint16_t[static_cast<size_t>(K / 32 * MB * 512)]);
  pack_rows(x, M, K, MB, xp.get());
  const int64_t items = (MB + kChunkBlocks - 1) / kChunkBlocks * NB;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    product_items(w, xp.get(), out, out16, M, N, K, MB, NB, i0, i1);
  });
}
