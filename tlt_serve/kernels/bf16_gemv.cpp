// y = W[N, K] · x for bf16 W (row-major) and fp32 rows x, fp32 accumulation.
// torch's own bf16 matrix-vector kernel reaches about half of this machine's memory bandwidth
// on AVX2-only CPUs; a step at batch 1 is a chain of such products, so it is worth owning.
// Rows of W are split over torch's threads by at::parallel_for, which needs this file to be
// compiled with OpenMP (see tlt_serve/kernels/__init__.py).
#include "bf16_kernels.h"

#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>
#include <algorithm>
#include <cmath>
#include <vector>

// Every output of the AVX2 product is summed in one order, whatever M and whichever kernel
// below takes it: one 8-lane chain of FMAs over the 8-wide blocks of K in order, its lanes
// added by hsum, then the columns after the last whole block one by one. So a row's result
// does not depend on the rows beside it (a verify step's rows get a decode step's bits), nor
// on the split over threads. The chains the loop needs to keep the FMA units busy come from
// several weight rows at once and several rows of X, never from splitting one output's sum.
//
// Y[M, N] = X[M, K] · W[N, K]^T for M < 8 rows: each bf16 weight row is read once and
// multiplied into all M rows (a verify step at batch 1 scores a handful of tokens, and
// reading bf16 once beats an fp32 GEMM that reads twice the bytes). From 3 rows up the weight
// row 16 rows on is prefetched into L2, as on the AVX512-BF16 path below (kPrefetchRows).
constexpr int64_t kPrefetchRows = 16;

// The end of every output's sum, the one order above: the chain's lanes added, then the
// columns [k, K) after the last whole 8-wide block, one FMA each.
static inline float finish_sum(__m256 chain, const uint16_t* row, const float* x, int64_t k,
                               int64_t K) {
  float sum = hsum(chain);
  for (int64_t j = k; j < K; ++j) sum = std::fma(bf16_to_f32(row[j]), x[j], sum);
  return sum;
}

// T runs of weight rows at once, (end - begin) / T rows apart. A core following one stream of
// weight rows reads memory slower than one following several: the 210 products of a step of
// the default model (212 MB, 2 threads, ad hoc, three alternating pairs) read 15.5-17.6 GB/s
// with one run per thread, 20.1-24.4 GB/s with four, and a step at batch 1 is those reads.
// The runs' T x M chains of FMAs also hide the FMA's latency (one chain per output): four runs
// at 1-2 rows, three at 3 and two at 4 (at most 12 accumulators), one from 5 rows on.
constexpr int streams_for(int M) { return M <= 2 ? 4 : M == 3 ? 3 : M == 4 ? 2 : 1; }

template <int M, int T>
static void rows_kernel(const uint16_t* w, const float* xv, float* out, int64_t N, int64_t K,
                        int64_t begin, int64_t end) {
  constexpr bool ahead = M >= 3;
  const int64_t run = (end - begin) / T;
  for (int64_t i = 0; i < run; ++i) {
    const uint16_t* row[T];
    const char* next[T];
    for (int t = 0; t < T; ++t) {
      const int64_t n = begin + t * run + i;
      row[t] = w + n * K;
      next[t] = reinterpret_cast<const char*>(w + std::min(n + kPrefetchRows, N - 1) * K);
    }
    __m256 acc[T][M];
    for (int t = 0; t < T; ++t)
      for (int m = 0; m < M; ++m) acc[t][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      if (ahead && k % 32 == 0)  // one cache line
        for (int t = 0; t < T; ++t) _mm_prefetch(next[t] + 2 * k, _MM_HINT_T1);
      __m256 wv[T];
      for (int t = 0; t < T; ++t) wv[t] = load_bf16x8(row[t] + k);
      for (int m = 0; m < M; ++m) {
        const __m256 x = _mm256_loadu_ps(xv + m * K + k);
        for (int t = 0; t < T; ++t) acc[t][m] = _mm256_fmadd_ps(wv[t], x, acc[t][m]);
      }
    }
    for (int t = 0; t < T; ++t)
      for (int m = 0; m < M; ++m)
        out[m * N + begin + t * run + i] = finish_sum(acc[t][m], row[t], xv + m * K, k, K);
  }
  if constexpr (T > 1) rows_kernel<M, 1>(w, xv, out, N, K, begin + T * run, end);
}

// Y[B, A] for A weight rows from n times B rows of X, A x B accumulators: each 8-wide block of
// a weight row is widened once for B rows of X and each block of X loaded once for A weight
// rows (3 x 4: 7 loads per 12 FMAs, where a weight row at a time takes 9 per 8 and waits on the
// loads). 12 accumulators, 3 weights and 1 row of X fill AVX2's 16 registers. Each output is
// summed as one 8-lane chain over K, then its lanes added.
template <int A, int B>
static void block_kernel(const uint16_t* w, const float* xv, float* out, int64_t N, int64_t K,
                         int64_t n) {
  const uint16_t* row = w + n * K;
  const char* next = reinterpret_cast<const char*>(w + std::min(n + kPrefetchRows, N - A) * K);
  __m256 acc[A][B];
  for (int a = 0; a < A; ++a)
    for (int b = 0; b < B; ++b) acc[a][b] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (k % 32 == 0)  // the weight rows 16 on, a cache line each (L2 for the next X rows)
      for (int a = 0; a < A; ++a) _mm_prefetch(next + 2 * (a * K + k), _MM_HINT_T1);
    __m256 wv[A];
    for (int a = 0; a < A; ++a) wv[a] = load_bf16x8(row + a * K + k);
    for (int b = 0; b < B; ++b) {
      const __m256 x = _mm256_loadu_ps(xv + b * K + k);
      for (int a = 0; a < A; ++a) acc[a][b] = _mm256_fmadd_ps(wv[a], x, acc[a][b]);
    }
  }
  for (int a = 0; a < A; ++a)
    for (int b = 0; b < B; ++b)
      out[b * N + n + a] = finish_sum(acc[a][b], row + a * K, xv + b * K, k, K);
}

constexpr int kBlockW = 3, kBlockX = 4;  // block_kernel's weight rows x rows of X

// Rows [0, M) of X times weight rows [begin, end). From 8 rows of X on, 4 rows at a time
// against 3 weight rows at a time (a tile's last one or two weight rows together), the 1-3
// rows left one weight row at a time; fewer than 8 rows in one pass over the weights, one
// weight row at a time, while the product waits on memory rather than on loads (5 rows in two
// passes, 4 + 1, measured 13% slower here). Both kernels sum an output the one way (see
// rows_kernel), so neither M, a row's place among the others, nor the split over threads
// (tiles starting elsewhere) changes a bit.
static void rows_block(const uint16_t* w, const float* xv, float* out, int64_t M, int64_t N,
                       int64_t K, int64_t begin, int64_t end) {
  int64_t c = 0;
  if (M >= 8)
    for (; c + kBlockX <= M; c += kBlockX) {
      const float* x = xv + c * K;
      float* o = out + c * N;
      int64_t n = begin;
      for (; n + kBlockW <= end; n += kBlockW) block_kernel<kBlockW, kBlockX>(w, x, o, N, K, n);
      if (end - n == 2) block_kernel<2, kBlockX>(w, x, o, N, K, n);
      if (end - n == 1) block_kernel<1, kBlockX>(w, x, o, N, K, n);
    }
  if (c == M) return;
  const float* x = xv + c * K;
  float* o = out + c * N;
  switch (M - c) {
    case 1: rows_kernel<1, streams_for(1)>(w, x, o, N, K, begin, end); break;
    case 2: rows_kernel<2, streams_for(2)>(w, x, o, N, K, begin, end); break;
    case 3: rows_kernel<3, streams_for(3)>(w, x, o, N, K, begin, end); break;
    case 4: rows_kernel<4, streams_for(4)>(w, x, o, N, K, begin, end); break;
    case 5: rows_kernel<5, streams_for(5)>(w, x, o, N, K, begin, end); break;
    case 6: rows_kernel<6, streams_for(6)>(w, x, o, N, K, begin, end); break;
    default: rows_kernel<7, streams_for(7)>(w, x, o, N, K, begin, end); break;
  }
}

// ---- AVX512-BF16: bf16 rows times bf16 weights with vdpbf16ps (32 products per instruction).
// Where the CPU has it (Zen 4+, Cooper Lake, Sapphire Rapids+) and the rows are bf16 (a bf16
// model's activations always are), the product needs no widening: one 64-byte load of weights
// and one of each row feed one dot-product instruction per row, a quarter of the loads and
// about half of the instructions per product of the AVX2 path. Every output is summed the same
// way whatever M is (two accumulators over alternating blocks, then the remainder): a row's
// result does not depend on how many rows it is multiplied with, nor on the thread split.
#define TLT_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// Two accumulators per row over alternating 32-wide blocks hide the dot product's latency when
// M is small (blocking several weight rows per pass with one accumulator each, to save loads of
// the rows, measured 1.1-1.5x slower here); then the remainder, then the two summed.
// From 3 rows up, the work per weight row is long enough that the core no longer runs ahead of
// the weight stream, and waiting for memory and computing add up instead of overlapping (30
// layers of the default model at 5 rows: 11.7 ms against 5.8 ms at 1 row). Prefetching the
// weight row 16 rows ahead into L2 overlaps them again (5 rows: 6.4 ms, 8 rows: 8.8 vs 13.5 ms);
// into L1, or fewer rows ahead, gains little; at 1-2 rows it costs ~3%, so they go without.

// One 64-wide step of a weight row's sums: row[k, k + 64) times each X row into its two
// accumulator sets (32 columns each). Both tile walks below sum only through these two, so a
// row's FMAs run in one order whichever walk takes it.
template <int M>
TLT_AVX512BF16 __attribute__((always_inline)) static inline void dot_step64(
    __m512 (&acc)[2][M], const uint16_t* row, const uint16_t* xv, int64_t K, int64_t k) {
  for (int s = 0; s < 2; ++s) {
    const __m512i wv = _mm512_loadu_si512(row + k + 32 * s);
    for (int m = 0; m < M; ++m) {
      const __m512i x = _mm512_loadu_si512(xv + m * K + k + 32 * s);
      acc[s][m] = _mm512_dpbf16_ps(acc[s][m], (__m512bh)wv, (__m512bh)x);
    }
  }
}

// The columns after the 64-wide steps (from k = K - K % 64): a 32-wide block and the tail
// (zero-filled lanes add 0 * 0), both into the first set; then each X row's output.
template <int M>
TLT_AVX512BF16 __attribute__((always_inline)) static inline void dot_finish(
    __m512 (&acc)[2][M], const uint16_t* row, const uint16_t* xv, int64_t K, float* out,
    int64_t N, int64_t n) {
  int64_t k = K - K % 64;
  if (k + 32 <= K) {
    const __m512i wv = _mm512_loadu_si512(row + k);
    for (int m = 0; m < M; ++m) {
      const __m512i x = _mm512_loadu_si512(xv + m * K + k);
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)wv, (__m512bh)x);
    }
    k += 32;
  }
  if (const int64_t tail = K - k) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << tail) - 1);
    const __m512i wv = _mm512_maskz_loadu_epi16(mask, row + k);
    for (int m = 0; m < M; ++m) {
      const __m512i x = _mm512_maskz_loadu_epi16(mask, xv + m * K + k);
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)wv, (__m512bh)x);
    }
  }
  for (int m = 0; m < M; ++m)
    out[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]));
}

template <int M>
TLT_AVX512BF16 static void rows_tile_bf16(const uint16_t* w, const uint16_t* xv, float* out,
                                          int64_t N, int64_t K, int64_t begin, int64_t end) {
  constexpr bool ahead = M >= 3;
  for (int64_t n = begin; n < end; ++n) {
    const uint16_t* row = w + n * K;
    const char* next = reinterpret_cast<const char*>(w + std::min(n + kPrefetchRows, N - 1) * K);
    __m512 acc[2][M];
    for (int s = 0; s < 2; ++s)
      for (int m = 0; m < M; ++m) acc[s][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k + 64 <= K; k += 64) {
      if (ahead) {  // the two cache lines this step's 64 weights take, 16 rows on
        _mm_prefetch(next + 2 * k, _MM_HINT_T1);
        _mm_prefetch(next + 2 * k + 64, _MM_HINT_T1);
      }
      dot_step64<M>(acc, row, xv, K, k);
    }
    dot_finish<M>(acc, row, xv, K, out, N, n);
  }
}

// Long rows (K > kLongK: an MLP's down projection in models of 1.5B and up, K = 8192-8960):
// 8 rows of X take 8 x K x 2 bytes, 128 KB at K = 8192, past the L1 cache, and every dot
// product then loads its X operand from L2 (8 rows x 8192 x 2048 weight rows: 1.68 ms here
// against 0.75 ms for the same multiply-adds at K = 2048, and 1.1 ms for torch's GEMM, weights
// in cache). So K is walked in blocks of kBlockK columns (8 rows: 16 KB, L1-resident) across
// the whole tile of weight rows, each (weight row, X row) pair's two accumulators kept in
// memory between blocks (1 KB a weight row at 8 rows, loaded and stored once per block of
// 16 x 16 products). The steps are dot_step64's and dot_finish's, in the same order: the same
// bits, whatever K. One or two rows (16-32 KB at K = 8192) stream each weight row whole, which
// the hardware prefetcher follows better (1 row, 2048 x 8192 weights from memory: 0.63 ms
// whole, 0.80 ms blocked).
constexpr int64_t kLongK = 2048;
constexpr int kLongRows = 3;
constexpr int64_t kBlockK = 1024;  // a multiple of 64
constexpr int64_t kTile = 64;  // weight rows a thread walks at a time (over_tiles)

template <int M>
TLT_AVX512BF16 static void rows_tile_bf16_long(const uint16_t* w, const uint16_t* xv, float* out,
                                               int64_t N, int64_t K, int64_t begin, int64_t end) {
  const int64_t rows = end - begin;  // <= kTile
  const int64_t body = K - K % 64;  // the 64-wide steps
  alignas(64) __m512 kept[kTile][2][M];  // [weight row, accumulator set, X row]
  for (int64_t r = 0; r < rows; ++r)
    for (int s = 0; s < 2; ++s)
      for (int m = 0; m < M; ++m) kept[r][s][m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < body; k0 += kBlockK) {
    const int64_t k1 = std::min(body, k0 + kBlockK);
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* row = w + (begin + r) * K;
      // the next weight row's block (after the last row, the first row's next block)
      const char* next = reinterpret_cast<const char*>(
          r + 1 < rows ? row + K : w + begin * K + kBlockK);
      __m512 acc[2][M];
      for (int s = 0; s < 2; ++s)
        for (int m = 0; m < M; ++m) acc[s][m] = kept[r][s][m];
      for (int64_t k = k0; k < k1; k += 64) {
        if (r + 1 < rows || k + kBlockK < body) {  // (the first row's next block is in K)
          _mm_prefetch(next + 2 * k, _MM_HINT_T0);
          _mm_prefetch(next + 2 * k + 64, _MM_HINT_T0);
        }
        dot_step64<M>(acc, row, xv, K, k);
      }
      for (int s = 0; s < 2; ++s)
        for (int m = 0; m < M; ++m) kept[r][s][m] = acc[s][m];
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    dot_finish<M>(kept[r], w + (begin + r) * K, xv, K, out, N, begin + r);
}

template <int M>
TLT_AVX512BF16 static void rows_any_bf16(const uint16_t* w, const uint16_t* xv, float* out,
                                         int64_t N, int64_t K, int64_t begin, int64_t end) {
  if (M >= kLongRows && K > kLongK)
    rows_tile_bf16_long<M>(w, xv, out, N, K, begin, end);
  else
    rows_tile_bf16<M>(w, xv, out, N, K, begin, end);
}

TLT_AVX512BF16 static void rows_block_bf16(const uint16_t* w, const uint16_t* xv, float* out,
                                           int64_t M, int64_t N, int64_t K, int64_t begin, int64_t end) {
  for (int64_t c = 0; c < M; c += 8) {
    const uint16_t* x = xv + c * K;
    float* o = out + c * N;
    switch (std::min<int64_t>(8, M - c)) {
      case 1: rows_any_bf16<1>(w, x, o, N, K, begin, end); break;
      case 2: rows_any_bf16<2>(w, x, o, N, K, begin, end); break;
      case 3: rows_any_bf16<3>(w, x, o, N, K, begin, end); break;
      case 4: rows_any_bf16<4>(w, x, o, N, K, begin, end); break;
      case 5: rows_any_bf16<5>(w, x, o, N, K, begin, end); break;
      case 6: rows_any_bf16<6>(w, x, o, N, K, begin, end); break;
      case 7: rows_any_bf16<7>(w, x, o, N, K, begin, end); break;
      default: rows_any_bf16<8>(w, x, o, N, K, begin, end); break;
    }
  }
}

bool avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

// Weight rows [0, N) split over threads, each thread walking its rows in tiles of 64.
template <typename X, typename Block>
static void over_tiles(Block block, const uint16_t* w, const X* xv, float* out, int64_t M,
                       int64_t N, int64_t K) {
  at::parallel_for(0, N, kTile, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n += kTile) block(w, xv, out, M, N, K, n, std::min(end, n + kTile));
  });
}

// x: [M, K] fp32 or bf16 (any M >= 1) or [K]; returns [M, N] (or [N]) fp32. Weight rows are
// split over threads; each thread walks its rows in tiles of 64 (<= 64 x K bf16, L2-resident)
// and multiplies all of X into a tile before moving on (on the AVX2 path by blocks of rows,
// rows_block; AVX512-BF16: 8 rows at a time), so W is read from memory once whatever M is.
// bf16 x on a CPU with AVX512-BF16 takes the dot-product path above (unless avx2_only);
// otherwise x is widened to fp32 (exactly) for the AVX2 path. The result may be rounded to
// bf16 (out_bf16, round to nearest even as torch's cast): the same values as casting around
// the call in Python, without two Python-level ops per product (a step at batch 1 has ~120).
at::Tensor gemv_bf16_impl(const at::Tensor& weight, const at::Tensor& x_in, bool out_bf16,
                          int path) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16,
              "weight must be a contiguous 2-D bf16 tensor");
  TORCH_CHECK((x_in.dim() == 1 || x_in.dim() == 2) &&
              (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "x must be a 1-D or 2-D fp32 or bf16 tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t M = x_in.dim() == 1 ? 1 : x_in.size(0);
  TORCH_CHECK(x_in.size(-1) == K, "x has ", x_in.size(-1), " columns, weight has ", K);
  TORCH_CHECK(M >= 1, "x must have at least one row");
  const auto* w = bf16_data(weight);
  const bool bf16_rows = path != kProductAvx2 && x_in.scalar_type() == at::kBFloat16;
  const auto shape = x_in.dim() == 1 ? std::vector<int64_t>{N} : std::vector<int64_t>{M, N};
  if (bf16_rows && path == kProductBest && amx_fits(N, K) && amx_ready()) {
    const auto x = x_in.contiguous();
    auto y = at::empty(shape, x_in.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
    amx_product(w, bf16_data(x), out_bf16 ? nullptr : y.data_ptr<float>(),
                out_bf16 ? bf16_data(y) : nullptr, M, N, K);
    return y;
  }
  auto y = at::empty(shape, x_in.options().dtype(at::kFloat));
  float* out = y.data_ptr<float>();
  if (bf16_rows && avx512_bf16()) {
    const auto x = x_in.contiguous();
    const auto* xv = bf16_data(x);
    over_tiles(rows_block_bf16, w, xv, out, M, N, K);
  } else {
    const auto x = x_in.to(at::kFloat).contiguous();
    over_tiles(rows_block, w, x.data_ptr<float>(), out, M, N, K);
  }
  return out_bf16 ? y.to(at::kBFloat16) : y;
}

at::Tensor gemv_bf16(const at::Tensor& weight, const at::Tensor& x, bool out_bf16) {
  return gemv_bf16_impl(weight, x, out_bf16, kProductBest);
}

at::Tensor gemv_bf16_dot(const at::Tensor& weight, const at::Tensor& x, bool out_bf16) {
  return gemv_bf16_impl(weight, x, out_bf16, kProductDot);
}

at::Tensor gemv_bf16_avx2(const at::Tensor& weight, const at::Tensor& x, bool out_bf16) {
  return gemv_bf16_impl(weight, x, out_bf16, kProductAvx2);
}



// The sums of squares of M rows (H apart) into ss[M], each row's one chain in column order:
// the chains of M rows interleaved instead of one waiting on every add's latency (8 rows of
// 576: ~6 us one by one). A row's sum is the same whatever M.
template <int M>
static void sum_squares(const uint16_t* x, int64_t H, float* ss) {
  float acc[M] = {};
  for (int64_t h = 0; h < H; ++h)
    for (int r = 0; r < M; ++r) {
      const float v = bf16_to_f32(x[r * H + h]);
      acc[r] += v * v;
    }
  for (int r = 0; r < M; ++r) ss[r] = acc[r];
}

// RMSNorm of bf16 rows [R, H] with a bf16 weight [H], in HF's order: normalise in fp32, round
// to bf16, multiply by the weight, round to bf16. One pass per row instead of the seven ops
// (casts, pow, mean, rsqrt, two products) torch runs for bf16 input on CPU.
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be contiguous bf16");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16,
              "weight must be a contiguous 1-D bf16 tensor");
  const int64_t H = weight.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == H, "x has ", x.size(-1), " features, weight has ", H);
  auto y = at::empty_like(x);
  const int64_t R = x.numel() / H;
  const auto* xv = bf16_data(x);
  const auto* wv = bf16_data(weight);
  auto* out = bf16_data(y);
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = begin; r0 < end; r0 += 8) {
      const int64_t m = std::min<int64_t>(8, end - r0);
      float ss[8];
      const uint16_t* rows = xv + r0 * H;
      switch (m) {
        case 8: sum_squares<8>(rows, H, ss); break;
        case 7: sum_squares<7>(rows, H, ss); break;
        case 6: sum_squares<6>(rows, H, ss); break;
        case 5: sum_squares<5>(rows, H, ss); break;
        case 4: sum_squares<4>(rows, H, ss); break;
        case 3: sum_squares<3>(rows, H, ss); break;
        case 2: sum_squares<2>(rows, H, ss); break;
        default: sum_squares<1>(rows, H, ss); break;
      }
      for (int64_t i = 0; i < m; ++i) {
        const float scale = 1.f / std::sqrt(ss[i] / static_cast<float>(H) + static_cast<float>(eps));
        const uint16_t* row = rows + i * H;
        uint16_t* o = out + (r0 + i) * H;
        const __m256 sc = _mm256_set1_ps(scale);
        int64_t h = 0;
        for (; h + 8 <= H; h += 8) {
          const __m256 normed = round_bf16x8(_mm256_mul_ps(load_bf16x8(row + h), sc));
          store_bf16x8(o + h, _mm256_mul_ps(normed, load_bf16x8(wv + h)));
        }
        for (; h < H; ++h) {
          const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(row[h]) * scale));
          o[h] = f32_to_bf16(normed * bf16_to_f32(wv[h]));
        }
      }
    }
  });
  return y;
}

// The first two hadd levels over 4 vectors' lanes (lanes: a[0..3]'s low-half sums, then their
// high-half sums), and the last level that joins two such: hsum8 is built from them, and so is
// any sum of 8 keys taken 4 at a time (qk_scores_group), to the same bits.
static inline __m256 hadd4(const __m256* a) {
  return _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
}
static inline __m256 halves_sum(__m256 u0, __m256 u1) {
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The 8 horizontal sums of a[0..7] as one vector (lane i = sum of a[i]).
static inline __m256 hsum8(const __m256* a) { return halves_sum(hadd4(a), hadd4(a + 4)); }

// Which cache column holds a query's j-th visible key. Causal rows see columns [0, n):
// Contiguous. A tree node sees the first n0 columns, then a few chosen ones (its ancestors and
// itself, ascending): Gathered. The j-th key is scored and summed the same way in both, so a
// token gets the same bits whichever layout its keys came in.
struct Contiguous {
  int64_t operator()(int64_t j) const { return j; }
};
struct Gathered {
  int64_t n0;
  const int64_t* extra;  // columns of keys n0, n0 + 1, ..
  int64_t operator()(int64_t j) const { return j < n0 ? j : extra[j - n0]; }
};

// Scores of one query q[D] (fp32, pre-scaled) against keys K[col(j), D] (bf16), j < n, into
// s[n]: 8 keys per pass, their sums reduced together.
template <typename Col>
static inline void qk_scores(const float* q, const uint16_t* K, int64_t n, int64_t D, Col col,
                             float* s) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 acc[8];
    const uint16_t* kr[8];
    for (int kk = 0; kk < 8; ++kk) {
      acc[kk] = _mm256_setzero_ps();
      kr[kk] = K + col(j + kk) * D;
    }
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int kk = 0; kk < 8; ++kk)
        acc[kk] = _mm256_fmadd_ps(load_bf16x8(kr[kk] + d), qv, acc[kk]);
    }
    _mm256_storeu_ps(s + j, hsum8(acc));
  }
  for (; j < n; ++j) {
    const uint16_t* kr = K + col(j) * D;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8)
      acc = _mm256_fmadd_ps(load_bf16x8(kr + d), _mm256_loadu_ps(q + d), acc);
    s[j] = hsum(acc);
  }
}

// s[0..n) ← softmax(s) in place.
static inline void softmax_inplace(float* s, int64_t n) {
  const float mx = row_max(s, n);
  const __m256 m8 = _mm256_set1_ps(mx);
  int64_t j;
  __m256 sum8 = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m8));
    _mm256_storeu_ps(s + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; j < n; ++j) { s[j] = std::exp(s[j] - mx); sum += s[j]; }
  const float inv = 1.f / sum;
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv8));
  for (; j < n; ++j) s[j] *= inv;
}

// o[D] (bf16) ← Σ_j s[j] · V[col(j), :] over n value rows (bf16), fp32 accumulation. D8 = D / 8
// known at compile time keeps the accumulators in registers (0: any D, from memory).
template <int D8, typename Col>
static inline void pv_sum(const float* s, const uint16_t* V, int64_t n, int64_t D, Col col,
                          uint16_t* o) {
  constexpr int R = D8 > 0 ? D8 : 32;
  const int64_t d8 = D8 > 0 ? D8 : D / 8;
  __m256 acc[R];
  for (int64_t d = 0; d < d8; ++d) acc[d] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 p = _mm256_set1_ps(s[j]);
    const uint16_t* vrow = V + col(j) * D;
    for (int64_t d = 0; d < d8; ++d) acc[d] = _mm256_fmadd_ps(p, load_bf16x8(vrow + 8 * d), acc[d]);
  }
  alignas(32) float tmp[8];
  for (int64_t d = 0; d < d8; ++d) {
    _mm256_store_ps(tmp, acc[d]);
    for (int e = 0; e < 8; ++e) o[8 * d + e] = f32_to_bf16(tmp[e]);
  }
}

// One (query token, KV head): G query heads (fp32, pre-scaled) over n keys at col(j).
template <typename Col>
static void attend_head(const float (*qf)[256], const uint16_t* K, const uint16_t* V, int64_t n,
                        int64_t G, int64_t D, Col col, std::vector<float>& scores, uint16_t* Ot) {
  scores.resize(static_cast<size_t>(G * n));
  for (int64_t g = 0; g < G; ++g) {
    qk_scores(qf[g], K, n, D, col, scores.data() + g * n);
    softmax_inplace(scores.data() + g * n, n);
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* s = scores.data() + g * n;
    uint16_t* o = Ot + g * D;
    if (D == 64) pv_sum<8>(s, V, n, D, col, o);
    else if (D == 128) pv_sum<16>(s, V, n, D, col, o);
    else pv_sum<0>(s, V, n, D, col, o);
  }
}

// ---- AVX2 with heads in groups of up to 3: each key and value row widened once per group, not
// once per head. A group's scores take 8 keys in two halves of 4 (4 keys x 3 heads = 12
// accumulators of the 16 registers); a key's 8-lane partial sum is built by the same FMAs in
// the same order as qk_scores, and the halves are joined by hsum8's own hadd4 and
// halves_sum, so every score is qk_scores' bits. The weighted sum runs over the value rows once
// per 32 columns (4 registers x 3 heads) with each element's FMAs in pv_sum's order: the same
// bits again (tested against the head-by-head path, attention_bf16_avx2_heads).

// Scores of GB heads (qf[0..GB)) against keys col(j), j < n: s[g * stride + j].
template <int GB, typename Col>
static void qk_scores_group(const float (*qf)[256], const uint16_t* K, int64_t n, int64_t D,
                            Col col, float* s, int64_t stride) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 u[2][GB];
    for (int half = 0; half < 2; ++half) {
      const uint16_t* kr[4];
      for (int kk = 0; kk < 4; ++kk) kr[kk] = K + col(j + 4 * half + kk) * D;
      __m256 acc[GB][4];
      for (int g = 0; g < GB; ++g)
        for (int kk = 0; kk < 4; ++kk) acc[g][kk] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        __m256 qv[GB];
        for (int g = 0; g < GB; ++g) qv[g] = _mm256_loadu_ps(qf[g] + d);
        for (int kk = 0; kk < 4; ++kk) {
          const __m256 kv = load_bf16x8(kr[kk] + d);
          for (int g = 0; g < GB; ++g) acc[g][kk] = _mm256_fmadd_ps(kv, qv[g], acc[g][kk]);
        }
      }
      for (int g = 0; g < GB; ++g) u[half][g] = hadd4(acc[g]);
    }
    for (int g = 0; g < GB; ++g) _mm256_storeu_ps(s + g * stride + j, halves_sum(u[0][g], u[1][g]));
  }
  if (j < n)
    for (int g = 0; g < GB; ++g) {
      float tail[8];
      qk_scores(qf[g], K, n - j, D, [&](int64_t i) { return col(j + i); }, tail);
      std::copy(tail, tail + (n - j), s + g * stride + j);
    }
}

// O[g] (bf16) ← Σ_j s[g * stride + j] · V[col(j)] for GB heads, D = 8 * D8, 32 columns a pass.
template <int D8, int GB, typename Col>
static void pv_sum_group(const float* s, int64_t stride, const uint16_t* V, int64_t n, Col col,
                         uint16_t* O) {
  constexpr int64_t D = 8 * D8;
  static_assert(D8 % 4 == 0, "32 columns a pass");
  for (int64_t c = 0; c < D8; c += 4) {
    __m256 acc[GB][4];
    for (int g = 0; g < GB; ++g)
      for (int d = 0; d < 4; ++d) acc[g][d] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* vrow = V + col(j) * D + 8 * c;
      __m256 p[GB];
      for (int g = 0; g < GB; ++g) p[g] = _mm256_set1_ps(s[g * stride + j]);
      for (int d = 0; d < 4; ++d) {
        const __m256 vv = load_bf16x8(vrow + 8 * d);
        for (int g = 0; g < GB; ++g) acc[g][d] = _mm256_fmadd_ps(p[g], vv, acc[g][d]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int d = 0; d < 4; ++d) store_bf16x8(O + g * D + 8 * (c + d), acc[g][d]);
  }
}

// All G heads of one (query token, KV head) on AVX2, D = 8 * D8, heads in groups of 3.
template <int D8, typename Col>
static void attend_head_grouped(const float (*qf)[256], const uint16_t* K, const uint16_t* V,
                                int64_t n, int64_t G, Col col, std::vector<float>& scores,
                                uint16_t* Ot) {
  constexpr int64_t D = 8 * D8;
  scores.resize(static_cast<size_t>(G * n));
  float* sc = scores.data();
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const int64_t gb = std::min<int64_t>(3, G - g0);
    if (gb == 3) qk_scores_group<3>(qf + g0, K, n, D, col, sc + g0 * n, n);
    else if (gb == 2) qk_scores_group<2>(qf + g0, K, n, D, col, sc + g0 * n, n);
    else qk_scores(qf[g0], K, n, D, col, sc + g0 * n);
  }
  for (int64_t g = 0; g < G; ++g) softmax_inplace(sc + g * n, n);
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const int64_t gb = std::min<int64_t>(3, G - g0);
    if (gb == 3) pv_sum_group<D8, 3>(sc + g0 * n, n, V, n, col, Ot + g0 * D);
    else if (gb == 2) pv_sum_group<D8, 2>(sc + g0 * n, n, V, n, col, Ot + g0 * D);
    else pv_sum<D8>(sc + g0 * n, V, n, D, col, Ot + g0 * D);
  }
}

// ---- AVX512: the same attention with each K and V row widened once for all G query heads.
// The AVX2 path above widens a key row once per query head and runs one 8-wide FMA per 8
// products. Here a 16-wide register holds two keys' 8-lane partial sums (lanes 0-7 and 8-15)
// and a value row is widened once into D / 16 registers, then multiplied into every head's
// accumulators. Every lane does the same FMAs in the same order as the AVX2 path's lane, and
// the 8 keys' lanes are reduced by the same hsum8, so the result is the same bits (tested):
// only the number of instructions changes.
#define TLT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

bool avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
}

// Two keys' 8 bf16 (at a and b) widened into one register: lanes 0-7 from a, 8-15 from b.
TLT_AVX512 static inline __m512 load_bf16_pair(const uint16_t* a, const uint16_t* b) {
  const __m256i raw = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Scores of GB query heads (qf[0..GB)) against keys col(j), j < n: s[g * stride + j]. Blocks of
// 8 keys as qk_scores; the keys past the last whole block as qk_scores does them.
template <int GB, typename Col>
TLT_AVX512 static void qk_scores_heads(const float (*qf)[256], const uint16_t* K, int64_t n,
                                       int64_t D, Col col, float* s, int64_t stride) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const uint16_t* kr[8];
    for (int kk = 0; kk < 8; ++kk) kr[kk] = K + col(j + kk) * D;
    __m512 acc[GB][4];
    for (int g = 0; g < GB; ++g)
      for (int p = 0; p < 4; ++p) acc[g][p] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m512 kz[4];
      for (int p = 0; p < 4; ++p) kz[p] = load_bf16_pair(kr[2 * p] + d, kr[2 * p + 1] + d);
      for (int g = 0; g < GB; ++g) {
        const __m512 qz = _mm512_castpd_ps(  // the 8 floats in both halves
            _mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(qf[g] + d))));
        for (int p = 0; p < 4; ++p) acc[g][p] = _mm512_fmadd_ps(kz[p], qz, acc[g][p]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      __m256 a[8];
      for (int p = 0; p < 4; ++p) {
        a[2 * p] = _mm512_castps512_ps256(acc[g][p]);
        a[2 * p + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[g][p]), 1));
      }
      _mm256_storeu_ps(s + g * stride + j, hsum8(a));
    }
  }
  if (j < n)
    for (int g = 0; g < GB; ++g) {
      float tail[8];
      qk_scores(qf[g], K, n - j, D, [&](int64_t i) { return col(j + i); }, tail);
      std::copy(tail, tail + (n - j), s + g * stride + j);
    }
}

// O[g] (bf16) ← Σ_j s[g * stride + j] · V[col(j)] for GB heads; each value row widened once.
template <int D16, int GB, typename Col>
TLT_AVX512 static void pv_sum_heads(const float* s, int64_t stride, const uint16_t* V, int64_t n,
                                    Col col, uint16_t* O) {
  constexpr int64_t D = 16 * D16;
  __m512 acc[GB][D16];
  for (int g = 0; g < GB; ++g)
    for (int d = 0; d < D16; ++d) acc[g][d] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* vrow = V + col(j) * D;
    __m512 vz[D16];
    for (int d = 0; d < D16; ++d)
      vz[d] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow + 16 * d))), 16));
    for (int g = 0; g < GB; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * stride + j]);
      for (int d = 0; d < D16; ++d) acc[g][d] = _mm512_fmadd_ps(p, vz[d], acc[g][d]);
    }
  }
  alignas(64) float tmp[16];
  for (int g = 0; g < GB; ++g)
    for (int d = 0; d < D16; ++d) {
      _mm512_store_ps(tmp, acc[g][d]);
      for (int e = 0; e < 16; ++e) O[g * D + 16 * d + e] = f32_to_bf16(tmp[e]);
    }
}

// Heads [g0, g0 + GB) of one (query token, KV head), D = 16 * D16.
template <int D16, int GB, typename Col>
TLT_AVX512 static void attend_heads(const float (*qf)[256], const uint16_t* K, const uint16_t* V,
                                    int64_t n, Col col, float* scores, uint16_t* Ot) {
  qk_scores_heads<GB>(qf, K, n, 16 * D16, col, scores, n);
  for (int g = 0; g < GB; ++g) softmax_inplace(scores + g * n, n);
  pv_sum_heads<D16, GB>(scores, n, V, n, col, Ot);
}

// All G heads in groups that keep a group's accumulators in registers (<= 24 of 32).
template <int D16, typename Col>
TLT_AVX512 static void attend_head_avx512(const float (*qf)[256], const uint16_t* K,
                                          const uint16_t* V, int64_t n, int64_t G, Col col,
                                          std::vector<float>& scores, uint16_t* Ot) {
  constexpr int64_t most = 24 / D16;  // heads per group: 6 for D = 64, 3 for 128, 1 for 256
  scores.resize(static_cast<size_t>(most * n));
  for (int64_t g0 = 0; g0 < G; g0 += most) {
    const auto* q = qf + g0;
    uint16_t* o = Ot + g0 * 16 * D16;
    switch (std::min(most, G - g0)) {
      case 1: attend_heads<D16, 1>(q, K, V, n, col, scores.data(), o); break;
      case 2: attend_heads<D16, std::min<int>(2, most)>(q, K, V, n, col, scores.data(), o); break;
      case 3: attend_heads<D16, std::min<int>(3, most)>(q, K, V, n, col, scores.data(), o); break;
      case 4: attend_heads<D16, std::min<int>(4, most)>(q, K, V, n, col, scores.data(), o); break;
      case 5: attend_heads<D16, std::min<int>(5, most)>(q, K, V, n, col, scores.data(), o); break;
      default: attend_heads<D16, std::min<int>(6, most)>(q, K, V, n, col, scores.data(), o); break;
    }
  }
}

// The hardware's stream prefetcher stops at every 4 KB page, and a key row is 128-256 bytes: a
// head's keys cross a page every 16-32 keys, each time waiting on memory. The scores fetch
// the keys kKeysAhead on into L1 as they go (AMX Xeon, 2 threads, 30 layers' caches read
// cold: 8 rows x 800 keys 7.45 -> 6.86 ms, 64 x 400 37.5 -> 33.6 ms; 32 to 128 keys ahead
// alike, into L2 or all of the next head's keys gained nothing).
constexpr int64_t kKeysAhead = 64;

// Cache rows [j, j + m) of col's layout (keys or values, D columns each) fetched toward the
// core, one prefetch per 64-byte line: Hint _MM_HINT_T0 into L1, _MM_HINT_T1 into L2.
template <int Hint, typename Col>
static inline void fetch_rows(const uint16_t* base, int64_t D, Col col, int64_t j, int64_t m) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t d = 0; d < D; d += 32)
      _mm_prefetch(reinterpret_cast<const char*>(base + col(j + i) * D + d),
                   static_cast<_mm_hint>(Hint));
}

// ---- AVX512-BF16: the scores by dot products of bf16 pairs (vdpbf16ps), no widening.
// The query and the keys are bf16 already, so each pair's products are exact in fp32 as on the
// paths above; only the order of the sums differs: a key's 32-wide blocks go into one 16-lane
// accumulator (lane i: d = 2i, 2i + 1 of each block, in block order), the two halves are
// added (lane i + lane i + 8), then hsum8's tree, then the scale. Every key is summed so,
// whichever block of 8 it falls in, so a token's scores do not depend on how its keys are
// batched (decode, verify, tree nodes). Half the instructions of the widening path per score
// (scores of 128 rows x 1024 keys: 1.6 -> 0.7 ms a layer on a Zen 5 EPYC, 2 threads).
template <int D32, typename Col>
TLT_AVX512BF16 static inline __m256 key_dot8(const __m512i* qv, const uint16_t* K, int64_t j,
                                             int64_t m, Col col) {
  constexpr int64_t D = 32 * D32;
  __m256 part[8];
  for (int kk = 0; kk < 8; ++kk) {
    if (kk >= m) {  // past the last key: a zero lane
      part[kk] = _mm256_setzero_ps();
      continue;
    }
    const uint16_t* kr = K + col(j + kk) * D;
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < D32; ++b)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kr + 32 * b), (__m512bh)qv[b]);
    part[kk] = _mm256_add_ps(_mm512_castps512_ps256(acc),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
  }
  return hsum8(part);
}

// Scores of G query heads (Qh [G, D] bf16, unscaled) against keys col(j), j < n:
// s[g * n + j] = scale * q_g . k_j. While the first head streams the keys from memory, the
// value rows the weighted sum reads next are fetched into L2 beside them (two streams in
// flight instead of one after the other).
template <int D32, typename Col>
TLT_AVX512BF16 static void qk_scores_dot(const uint16_t* Qh, const uint16_t* K,
                                         const uint16_t* V, int64_t n, int64_t G, Col col,
                                         float scale, float* s) {
  constexpr int64_t D = 32 * D32;
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    __m512i qv[D32];
    for (int b = 0; b < D32; ++b) qv[b] = _mm512_loadu_si512(Qh + g * D + 32 * b);
    float* sg = s + g * n;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      if (g == 0) {
        if (j + kKeysAhead + 8 <= n) fetch_rows<_MM_HINT_T0>(K, D, col, j + kKeysAhead, 8);
        fetch_rows<_MM_HINT_T1>(V, D, col, j, 8);
      }
      _mm256_storeu_ps(sg + j, _mm256_mul_ps(key_dot8<D32>(qv, K, j, 8, col), sc));
    }
    if (j < n) {
      alignas(32) float tail[8];
      _mm256_store_ps(tail, _mm256_mul_ps(key_dot8<D32>(qv, K, j, n - j, col), sc));
      std::copy(tail, tail + (n - j), sg + j);
    }
  }
}

// ---- AMX: the scores on tiles (tdpbf16ps), where the CPU has them and D is 64 or 128.
// An A tile is 16 keys x 32 of their columns, read in place from the cache (row stride D); a B
// tile the G query heads' same 32 columns as pairs (16 pairs x 16 heads, heads past G zero); a
// C tile 16 keys x 16 heads. A key's score is the sum of its D / 32 blocks' dot products, each
// block's 16 pair products summed by the tile unit, in one order whichever keys share the tile:
// a token gets the same scores alone or batched, decoded, verified, as a tree node or in a
// prefill. The products are the exact fp32 products of the other paths; only the summation
// order differs from the dot-product path (outputs agree within bf16 rounding, tested).
// The dot-product path spends ~8 vector instructions per key and head on the scores, the
// CPU's two vector ports its bound; the tile unit takes 16 keys x every head per instruction.
// Tiles: 0-1 C (two blocks of 16 keys), 2-3 A, 4.. B (one per 32 columns).
// Block KB of 32 columns of both key tiles (a[1] may be absent) against B tile BT (tile
// numbers must be literals: the instructions encode them).
#define TLT_AMX_KEY_BLOCK(KB, BT)                    \
  do {                                               \
    _tile_loadd(2, a[0] + 32 * (KB), D * 2);         \
    _tile_dpbf16ps(0, 2, BT);                        \
    if (a[1] != nullptr) {                           \
      _tile_loadd(3, a[1] + 32 * (KB), D * 2);       \
      _tile_dpbf16ps(1, 3, BT);                      \
    }                                                \
  } while (0)

template <int D32, typename Col>
TLT_AMX static void qk_scores_amx(const uint16_t* Qh, const uint16_t* K, const uint16_t* V,
                                  int64_t n, int64_t G, Col col, float scale, float* s) {
  static_assert(D32 == 2 || D32 == 4, "the tiles take head sizes 64 and 128");
  constexpr int64_t D = 32 * D32;
  alignas(64) uint32_t qp[D32][16][16] = {};  // [block][pair][head]: bf16 pairs as 32 bits
  for (int64_t g = 0; g < G; ++g) {
    const auto* q = reinterpret_cast<const uint32_t*>(Qh + g * D);
    for (int kb = 0; kb < D32; ++kb)
      for (int p = 0; p < 16; ++p) qp[kb][p][g] = q[kb * 16 + p];
  }
  _tile_loadd(4, qp[0], 64);
  _tile_loadd(5, qp[1], 64);
  if constexpr (D32 == 4) {
    _tile_loadd(6, qp[2], 64);
    _tile_loadd(7, qp[3], 64);
  }
  alignas(64) float c[2][16][16];  // [block][key][head]
  alignas(64) uint16_t pad[2][16][D];  // keys that are not 16 consecutive cache rows
  const __m512i heads = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5,
                                                            4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < n; j += 32) {
    const uint16_t* a[2] = {nullptr, nullptr};
    int64_t m[2];
    for (int t = 0; t < 2; ++t) {
      const int64_t jt = j + 16 * t;
      m[t] = std::clamp<int64_t>(n - jt, 0, 16);
      if (m[t] == 0) continue;
      if (m[t] == 16 && col(jt + 15) == col(jt) + 15) {  // in place
        a[t] = K + col(jt) * D;
      } else {  // the last keys, or a tree node's gathered ones; rows past them zero
        for (int64_t i = 0; i < 16; ++i)
          if (i < m[t]) std::memcpy(pad[t][i], K + col(jt + i) * D, D * 2);
          else std::memset(pad[t][i], 0, D * 2);
        a[t] = pad[t][0];
      }
      if (m[t] == 16 && jt + kKeysAhead + 16 <= n)
        fetch_rows<_MM_HINT_T0>(K, D, col, jt + kKeysAhead, 16);
      fetch_rows<_MM_HINT_T1>(V, D, col, jt, m[t]);  // the value rows the weighted sum reads next
    }
    _tile_zero(0);
    _tile_zero(1);
    TLT_AMX_KEY_BLOCK(0, 4);
    TLT_AMX_KEY_BLOCK(1, 5);
    if constexpr (D32 == 4) {
      TLT_AMX_KEY_BLOCK(2, 6);
      TLT_AMX_KEY_BLOCK(3, 7);
    }
    _tile_stored(0, c[0], 64);
    if (a[1] != nullptr) _tile_stored(1, c[1], 64);
    for (int t = 0; t < 2 && m[t] > 0; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const __m512 v = _mm512_mul_ps(_mm512_i32gather_ps(heads, &c[t][0][g], 4), sc);
        _mm512_mask_storeu_ps(s + g * n + j + 16 * t, static_cast<__mmask16>((1u << m[t]) - 1), v);
      }
  }
}

// All G heads of one (query token, KV head): dot-product scores (on tiles where tiles), then
// the widening path's softmax and weighted sum (values and weights in fp32), heads in register
// groups.
template <int D16, bool tiles, typename Col>
TLT_AVX512BF16 static void attend_head_dot(const uint16_t* Qh, const uint16_t* K,
                                           const uint16_t* V, int64_t n, int64_t G, float scale,
                                           Col col, std::vector<float>& scores, uint16_t* Ot) {
  constexpr int64_t D = 16 * D16, most = 24 / D16;
  scores.resize(static_cast<size_t>(G * n));
  if constexpr (tiles) qk_scores_amx<D16 / 2>(Qh, K, V, n, G, col, scale, scores.data());
  else qk_scores_dot<D16 / 2>(Qh, K, V, n, G, col, scale, scores.data());
  for (int64_t g = 0; g < G; ++g) softmax_inplace(scores.data() + g * n, n);
  for (int64_t g0 = 0; g0 < G; g0 += most) {
    const float* s = scores.data() + g0 * n;
    uint16_t* o = Ot + g0 * D;
    switch (std::min(most, G - g0)) {
      case 1: pv_sum_heads<D16, 1>(s, n, V, n, col, o); break;
      case 2: pv_sum_heads<D16, std::min<int>(2, most)>(s, n, V, n, col, o); break;
      case 3: pv_sum_heads<D16, std::min<int>(3, most)>(s, n, V, n, col, o); break;
      case 4: pv_sum_heads<D16, std::min<int>(4, most)>(s, n, V, n, col, o); break;
      case 5: pv_sum_heads<D16, std::min<int>(5, most)>(s, n, V, n, col, o); break;
      default: pv_sum_heads<D16, std::min<int>(6, most)>(s, n, V, n, col, o); break;
    }
  }
}

// How a call's (query token, KV head) pairs are computed, decided once per call from the path
// asked for (kAttention*), the CPU and the head size: scores on AMX tiles, AVX512-BF16
// dot-product scores, keys widened on AVX512 (the AVX2 path's bits), the AVX2 path with heads
// in groups (head sizes 64 and 128), or the AVX2 path head by head (the same bits).
enum class HeadKernel { tiles, dot, widened512, avx2_grouped, avx2 };

static HeadKernel head_kernel(int path, int64_t D) {
  const bool sized = D == 64 || D == 128 || D == 256;
  if (path == kAttentionBest && (D == 64 || D == 128) && amx_ready()) return HeadKernel::tiles;
  if ((path == kAttentionBest || path == kAttentionDot) && sized && avx512_bf16() && avx512())
    return HeadKernel::dot;
  if (path != kAttentionAvx2 && path != kAttentionAvx2Heads && sized && avx512())
    return HeadKernel::widened512;
  if (path != kAttentionAvx2Heads && (D == 64 || D == 128)) return HeadKernel::avx2_grouped;
  return HeadKernel::avx2;
}

// One (query token, KV head): Qh [G, D] bf16 for the dot path, qf its fp32 pre-scaled copy for
// the others.
template <typename Col>
static void attend_head_any(HeadKernel how, const uint16_t* Qh, const float (*qf)[256],
                            const uint16_t* K, const uint16_t* V, int64_t n, int64_t G,
                            int64_t D, float scale, Col col, std::vector<float>& scores,
                            uint16_t* Ot) {
  if (how == HeadKernel::tiles) {
    if (D == 64) return attend_head_dot<4, true>(Qh, K, V, n, G, scale, col, scores, Ot);
    return attend_head_dot<8, true>(Qh, K, V, n, G, scale, col, scores, Ot);
  }
  if (how == HeadKernel::dot) {
    if (D == 64) return attend_head_dot<4, false>(Qh, K, V, n, G, scale, col, scores, Ot);
    if (D == 128) return attend_head_dot<8, false>(Qh, K, V, n, G, scale, col, scores, Ot);
    return attend_head_dot<16, false>(Qh, K, V, n, G, scale, col, scores, Ot);
  }
  if (how == HeadKernel::widened512) {
    if (D == 64) return attend_head_avx512<4>(qf, K, V, n, G, col, scores, Ot);
    if (D == 128) return attend_head_avx512<8>(qf, K, V, n, G, col, scores, Ot);
    return attend_head_avx512<16>(qf, K, V, n, G, col, scores, Ot);
  }
  if (how == HeadKernel::avx2_grouped) {
    if (D == 64) return attend_head_grouped<8>(qf, K, V, n, G, col, scores, Ot);
    return attend_head_grouped<16>(qf, K, V, n, G, col, scores, Ot);
  }
  attend_head(qf, K, V, n, G, D, col, scores, Ot);
}

// Causal attention of query tokens over their rows' cached keys (decode: one per row; chain
// verification and drafter catch-up: last token + drafts; prefills), GQA without expanding
// K/V: q [B, Q, kvH, G, D] bf16 (G query heads share a KV head), caches [S, kvH, L, D] bf16,
// rows row_lo.. of the batch; query (b, j) sees key columns [0, lens[b, j]) (0: a padding
// query, output zeros). With tree bits (a tree node: tree verification, tree drafting) query t
// with bits[t] != 0 sees lens[t] keys: columns [0, n0) and n0 + i for each set bit i, n0 =
// lens[t] - popcount(bits[t]) (its ancestors and itself). fp32 scores, softmax and weighted sum;
// output [B, Q, kvH, G, D] rounded to bf16 once. Each (query, KV head) is computed alone, the same
// way whatever the batch: a token scored in a verify step or a prefill gets exactly the output it
// gets in a decode step (except runs of block_queries tokens or more, which go by blocks on AMX
// tiles or AVX512-BF16: prefill_attention.cpp). Per layer at 300 cached tokens here: 24 vs 50-75 us
// for torch's SDPA at batch 1, 238 vs 657 us at batch 16. The threads take contiguous ranges of the
// work, and in a prefill token j of a row sees j + 1 keys: each row's tokens taken in the order 0,
// n - 1, 1, n - 2, .. give every range as many short queries as long ones (one 2048-token prefill
// on 2 threads: the later half was 3/4 of it), and a row's keys stay in cache between its tokens.
void attend_tokens(const uint16_t* qv, int64_t q_stride, const uint16_t* kc, const uint16_t* vc,
                   const int64_t* rows, const int64_t* lens, const int64_t* bits, int64_t T,
                   int64_t kvH, int64_t G, int64_t D, int64_t L, double scale, uint16_t* ov,
                   int64_t o_stride, int path, int64_t block_queries) {
  const HeadKernel how = head_kernel(path, D);
  // Blocks on tiles, or by dot products where the best path takes those (the CPU is the
  // path's; a run's tokens then get the blocks' bits, not their decode steps').
  const bool tiles = how == HeadKernel::tiles;
  const bool blocks = (tiles || (how == HeadKernel::dot && path == kAttentionBest)) &&
                      block_attention_fits(D);
  // Token by token, each row's tokens in the order 0, n - 1, 1, n - 2, ..; runs to blocks.
  std::vector<int64_t> order;
  std::vector<QueryRun> runs;
  order.reserve(static_cast<size_t>(T));
  for (int64_t s = 0; s < T;) {
    int64_t e = s + 1, real = lens[s] > 0;
    bool tree = bits != nullptr && bits[s] != 0;
    for (; e < T && rows[e] == rows[s]; ++e) {
      real += lens[e] > 0;
      tree = tree || (bits != nullptr && bits[e] != 0);
    }
    if (blocks && !tree && real >= block_queries) {
      runs.push_back({s, e - s, rows[s]});
    } else {
      for (int64_t i = 0, n = e - s; i < n; ++i)
        order.push_back(s + from_both_ends(i, n));
    }
    s = e;
  }
  if (!runs.empty())
    attend_runs(qv, q_stride, kc, vc, runs, lens, kvH, G, D, L, scale, ov, o_stride, tiles);
  if (order.empty()) return;
  int64_t keys = 0;
  for (const int64_t t : order) keys += lens[t];
  const int64_t work = static_cast<int64_t>(order.size()) * kvH;  // (token, KV head)
  // Small problems (batch 1, short rows) are cheaper on one thread than waking the pool.
  const int64_t grain = keys * kvH * G * D < (1 << 16) ? work : 1;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, work, grain, [&](int64_t begin, int64_t end) {
    if (how == HeadKernel::tiles) amx_configure();
    std::vector<float> scores;
    float qf[16][256];
    int64_t extra[64];
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = order[static_cast<size_t>(w / kvH)], h = w % kvH, n = lens[t];
      uint16_t* Ot = ov + t * o_stride + h * G * D;  // [G, D]
      if (n == 0) {
        std::fill(Ot, Ot + G * D, static_cast<uint16_t>(0));
        continue;
      }
      const uint16_t* K = kc + (rows[t] * kvH + h) * L * D;  // [L, D]
      const uint16_t* V = vc + (rows[t] * kvH + h) * L * D;
      const uint16_t* Qh = qv + t * q_stride + h * G * D;  // [G, D]
      if (how != HeadKernel::dot)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d) qf[g][d] = bf16_to_f32(Qh[g * D + d]) * fscale;
      const uint64_t b = bits != nullptr ? static_cast<uint64_t>(bits[t]) : 0;
      if (b == 0) {
        attend_head_any(how, Qh, qf, K, V, n, G, D, fscale, Contiguous{}, scores, Ot);
        continue;
      }
      const int64_t n0 = n - __builtin_popcountll(b);  // the shared prefix, then the set bits
      int64_t m = 0;
      for (int i = 0; i < 64; ++i)
        if (b >> i & 1u) extra[m++] = n0 + i;
      attend_head_any(how, Qh, qf, K, V, n, G, D, fscale, Gathered{n0, extra}, scores, Ot);
    }
    if (how == HeadKernel::tiles) amx_release();
  });
}

void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t kvH,
                  int64_t G, int64_t D) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
              k_cache.sizes() == v_cache.sizes(), "caches must be equal contiguous 4-D bf16");
  TORCH_CHECK(k_cache.size(1) == kvH && k_cache.size(3) == D, "q and caches disagree");
  TORCH_CHECK(D % 8 == 0 && D <= 256 && G <= 16, "head_dim must be a multiple of 8 <= 256, G <= 16");
}

at::Tensor tree_bits(const at::Tensor& bits_in, const at::Tensor& lens) {
  if (bits_in.numel() == 0) return bits_in;
  const auto bits = bits_in.to(at::kLong).contiguous();
  TORCH_CHECK(bits.numel() == lens.numel(), "tree bits must have one entry per query (as lens)");
  const int64_t *bv = bits.data_ptr<int64_t>(), *lv = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < bits.numel(); ++i)
    TORCH_CHECK(__builtin_popcountll(static_cast<uint64_t>(bv[i])) <= lv[i] &&
                    (bv[i] == 0 || lv[i] > 0),
                "tree bits: more visible tree columns than keys");
  return bits;
}

static at::Tensor attention_impl(const at::Tensor& q_in, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, int64_t row_lo,
                                 const at::Tensor& lens_in, const at::Tensor& bits_in,
                                 double scale, int path, int64_t block_queries) {
  TORCH_CHECK(q_in.dim() == 5 && q_in.scalar_type() == at::kBFloat16, "q must be 5-D bf16");
  const auto q = q_in.contiguous();
  const int64_t B = q.size(0), Q = q.size(1), kvH = q.size(2), G = q.size(3), D = q.size(4);
  check_caches(k_cache, v_cache, kvH, G, D);
  const int64_t L = k_cache.size(2);
  TORCH_CHECK(row_lo >= 0 && row_lo + B <= k_cache.size(0), "rows out of range");
  const auto lens = lens_in.to(at::kLong).contiguous();
  TORCH_CHECK(lens.dim() == 2 && lens.size(0) == B && lens.size(1) == Q,
              "lens must be [B, Q]: one entry per query");
  const int64_t* lv = lens.data_ptr<int64_t>();
  const auto bits = tree_bits(bits_in, lens);
  const int64_t* bv = bits.numel() ? bits.data_ptr<int64_t>() : nullptr;
  std::vector<int64_t> rows(static_cast<size_t>(B * Q));
  for (int64_t i = 0; i < B * Q; ++i) {
    TORCH_CHECK(lv[i] >= 0 && lv[i] <= L, "lens out of range");
    rows[static_cast<size_t>(i)] = row_lo + i / Q;
  }
  auto out = at::empty_like(q);
  const int64_t stride = kvH * G * D;  // one query token's heads
  attend_tokens(bf16_data(q), stride, bf16_data(k_cache), bf16_data(v_cache), rows.data(), lv,
                bv, B * Q, kvH, G, D, L, scale, bf16_data(out), stride, path, block_queries);
  return out;
}

// The attention by one path (kAttention*): only the best path's tiles take runs by blocks.
template <int Path>
at::Tensor attention_path(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, int64_t row_lo,
                          const at::Tensor& lens, const at::Tensor& bits, double scale,
                          int64_t block_queries) {
  TORCH_CHECK(block_queries >= 1, "block_queries must be at least 1");
  return attention_impl(q, k_cache, v_cache, row_lo, lens, bits, scale, Path, block_queries);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_bf16", &gemv_bf16,
        "bf16 matrix × fp32 or bf16 rows, fp32 accumulation (AVX512-BF16 for bf16 rows where the "
        "CPU has it, else AVX2)",
        pybind11::arg("weight"), pybind11::arg("x"), pybind11::arg("out_bf16") = false);
  m.def("gemv_bf16_dot", &gemv_bf16_dot,
        "gemv_bf16 without AMX tiles (AVX512-BF16 where the CPU has it; for comparisons)",
        pybind11::arg("weight"), pybind11::arg("x"), pybind11::arg("out_bf16") = false);
  m.def("amx", &amx_ready, "whether gemv_bf16 multiplies bf16 rows on AMX tiles here");
  m.def("gemv_bf16_avx2", &gemv_bf16_avx2, "gemv_bf16 on the AVX2 path only (for comparisons)",
        pybind11::arg("weight"), pybind11::arg("x"), pybind11::arg("out_bf16") = false);
  m.def("avx512", &avx512, "whether the attention with keys widened takes its AVX512 path");
  m.def("avx512_bf16", &avx512_bf16,
        "whether gemv_bf16 (bf16 rows) and attention_bf16 (scores) take AVX512-BF16 dot products");
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm of bf16 rows, fp32 math, HF's rounding order");
  m.def("silu_mul_bf16", &silu_mul_bf16,
        "silu(gate) * up of a bf16 gate/up product [R, 2I], as torch's ops round it "
        "(decoder_layer.cpp)");
  m.def("log_softmax_rank", &log_softmax_rank,
        "per row of fp32 logits: its maximum, log(sum(exp(x - max))) and its target's rank "
        "(sampling.cpp)");
  m.def("sample_rows", &sample_rows,
        "a token per row of fp32 logits (greedy: the first maximum, else the inverse CDF at u) "
        "and its logprob at the row's temperature (sampling.cpp)");
  m.def("token_logprobs", &token_logprobs,
        "the logprobs sample_rows reports, of given tokens at the rows' temperatures");
#define TLT_ATTENTION_ARGS                                                                  \
  pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),                  \
      pybind11::arg("row_lo"), pybind11::arg("lens"), pybind11::arg("bits"),               \
      pybind11::arg("scale"), pybind11::arg("block_queries") = kNoBlocks
  m.def("attention_bf16", &attention_path<kAttentionBest>,
        "attention of query tokens over their rows' bf16 caches (decode, verify, trees, prefills); "
        "a row of at least block_queries query tokens (a prefill) by blocks of 16 on AMX tiles "
        "where the CPU has them (prefill_attention.cpp)",
        TLT_ATTENTION_ARGS);
  m.def("attention_bf16_dot", &attention_path<kAttentionDot>,
        "attention_bf16 without AMX tiles (AVX512-BF16 dot-product scores where the CPU has "
        "them; for comparisons)",
        TLT_ATTENTION_ARGS);
  m.def("attention_bf16_widened", &attention_path<kAttentionWidened>,
        "attention_bf16 with keys widened to fp32 (AVX512 where the CPU has it, else AVX2): "
        "the AVX2 path's bits; for comparisons",
        TLT_ATTENTION_ARGS);
  m.def("attention_bf16_avx2", &attention_path<kAttentionAvx2>,
        "attention on the AVX2 path only (the bits of attention_bf16_widened; for comparisons)",
        TLT_ATTENTION_ARGS);
  m.def("attention_bf16_avx2_heads", &attention_path<kAttentionAvx2Heads>,
        "attention_bf16_avx2 one query head at a time, each key and value row widened per head "
        "(the same bits; for comparisons)",
        TLT_ATTENTION_ARGS);
#undef TLT_ATTENTION_ARGS
  m.def("write_rows", &write_rows,
        "dst.view(-1, D)[index[r]] = src[r], a row copy each (keys or values into a cache; "
        "decoder_layer.cpp)");
  m.def("decoder_layer_bf16", &decoder_layer_bf16,
        "one decoder layer for rows of a few causal query tokens (decoder_layer.cpp)");
  m.def("decoder_stack_bf16", &decoder_stack_bf16,
        "every decoder layer of a model in one call, as decoder_layer_bf16 computes each; the "
        "GIL released while it runs (decoder_layer.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
