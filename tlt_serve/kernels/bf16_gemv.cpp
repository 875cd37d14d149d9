// y = W[N, K] · x for bf16 W (row-major) and fp32 rows x, fp32 accumulation.
// torch's own bf16 matrix-vector kernel reaches about half of this machine's memory bandwidth
// on AVX2-only CPUs; a step at batch 1 is a chain of such products, so it is worth owning.
// Rows of W are split over torch's threads by at::parallel_for, which needs this file to be
// compiled with OpenMP (see tlt_serve/kernels/__init__.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>

static inline __m256 load_bf16x8(const uint16_t* p) {
  // bf16 is the top half of an fp32: widen to 32 bits and shift left by 16.
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

static inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Y[M, N] = X[M, K] · W[N, K]^T for M <= 8 rows: each bf16 weight row is read once and
// multiplied into all M rows (a verify step at batch 1 scores a handful of tokens, and
// reading bf16 once beats an fp32 GEMM that reads twice the bytes). Up to 4 rows, alternate
// 8-wide blocks go to a second set of accumulators: with M chains of dependent FMAs the loop
// waits on FMA latency (2-4 rows: 10-20% faster measured here; more rows have chains enough).
template <int M>
static void rows_kernel(const uint16_t* w, const float* xv, float* out, int64_t N, int64_t K,
                        int64_t begin, int64_t end) {
  constexpr int S = M <= 4 ? 2 : 1;  // accumulator sets
  for (int64_t n = begin; n < end; ++n) {
    const uint16_t* row = w + n * K;
    __m256 acc[S][M];
    for (int s = 0; s < S; ++s)
      for (int m = 0; m < M; ++m) acc[s][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 * S <= K; k += 8 * S) {
      for (int s = 0; s < S; ++s) {
        const __m256 wv = load_bf16x8(row + k + 8 * s);
        for (int m = 0; m < M; ++m)
          acc[s][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xv + m * K + k + 8 * s), acc[s][m]);
      }
    }
    for (; k + 8 <= K; k += 8) {
      const __m256 wv = load_bf16x8(row + k);
      for (int m = 0; m < M; ++m) acc[0][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xv + m * K + k), acc[0][m]);
    }
    for (int m = 0; m < M; ++m) {
      __m256 total = acc[0][m];
      for (int s = 1; s < S; ++s) total = _mm256_add_ps(total, acc[s][m]);
      float sum = hsum(total);
      for (int64_t j = k; j < K; ++j) sum += bf16_to_f32(row[j]) * xv[m * K + j];
      out[m * N + n] = sum;
    }
  }
}

static void gemv_kernel(const uint16_t* w, const float* xv, float* out, int64_t K,
                        int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const uint16_t* row = w + n * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      a0 = _mm256_fmadd_ps(load_bf16x8(row + k), _mm256_loadu_ps(xv + k), a0);
      a1 = _mm256_fmadd_ps(load_bf16x8(row + k + 8), _mm256_loadu_ps(xv + k + 8), a1);
      a2 = _mm256_fmadd_ps(load_bf16x8(row + k + 16), _mm256_loadu_ps(xv + k + 16), a2);
      a3 = _mm256_fmadd_ps(load_bf16x8(row + k + 24), _mm256_loadu_ps(xv + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) {
      a0 = _mm256_fmadd_ps(load_bf16x8(row + k), _mm256_loadu_ps(xv + k), a0);
    }
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; ++k) s += bf16_to_f32(row[k]) * xv[k];
    out[n] = s;
  }
}

// Rows [0, M) of X times weight rows [begin, end), 8 rows of X at a time.
static void rows_block(const uint16_t* w, const float* xv, float* out, int64_t M, int64_t N,
                       int64_t K, int64_t begin, int64_t end) {
  for (int64_t c = 0; c < M; c += 8) {
    const float* x = xv + c * K;
    float* o = out + c * N;
    switch (std::min<int64_t>(8, M - c)) {
      case 1: gemv_kernel(w, x, o, K, begin, end); break;
      case 2: rows_kernel<2>(w, x, o, N, K, begin, end); break;
      case 3: rows_kernel<3>(w, x, o, N, K, begin, end); break;
      case 4: rows_kernel<4>(w, x, o, N, K, begin, end); break;
      case 5: rows_kernel<5>(w, x, o, N, K, begin, end); break;
      case 6: rows_kernel<6>(w, x, o, N, K, begin, end); break;
      case 7: rows_kernel<7>(w, x, o, N, K, begin, end); break;
      default: rows_kernel<8>(w, x, o, N, K, begin, end); break;
    }
  }
}

// x: [M, K] fp32 (any M >= 1) or [K]; returns [M, N] (or [N]) fp32. Weight rows are split
// over threads; each thread walks its rows in tiles of 64 (<= 64 x K bf16, L2-resident) and
// multiplies every 8-row chunk of X into a tile before moving on, so W is read from memory
// once whatever M is.
torch::Tensor gemv_bf16(const torch::Tensor& weight, const torch::Tensor& x) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16,
              "weight must be a contiguous 2-D bf16 tensor");
  TORCH_CHECK((x.dim() == 1 || x.dim() == 2) && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be a contiguous 1-D or 2-D fp32 tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t M = x.dim() == 1 ? 1 : x.size(0);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " columns, weight has ", K);
  TORCH_CHECK(M >= 1, "x must have at least one row");
  auto y = x.dim() == 1 ? torch::empty({N}, x.options()) : torch::empty({M, N}, x.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const float* xv = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  constexpr int64_t tile = 64;
  at::parallel_for(0, N, tile, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n += tile)
      rows_block(w, xv, out, M, N, K, n, std::min(end, n + tile));
  });
  return y;
}


static inline uint16_t f32_to_bf16(float f) {
  // Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays NaN.
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// RMSNorm of bf16 rows [R, H] with a bf16 weight [H], in HF's order: normalise in fp32, round
// to bf16, multiply by the weight, round to bf16. One pass per row instead of the seven ops
// (casts, pow, mean, rsqrt, two products) torch runs for bf16 input on CPU.
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be contiguous bf16");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16,
              "weight must be a contiguous 1-D bf16 tensor");
  const int64_t H = weight.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == H, "x has ", x.size(-1), " features, weight has ", H);
  auto y = torch::empty_like(x);
  const int64_t R = x.numel() / H;
  const auto* xv = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wv = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, R, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xv + r * H;
      float ss = 0.f;
      for (int64_t h = 0; h < H; ++h) {
        const float v = bf16_to_f32(row[h]);
        ss += v * v;
      }
      const float scale = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      uint16_t* o = out + r * H;
      for (int64_t h = 0; h < H; ++h) {
        const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(row[h]) * scale));
        o[h] = f32_to_bf16(normed * bf16_to_f32(wv[h]));
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_bf16", &gemv_bf16, "bf16 matrix × fp32 rows (AVX2, fp32 accumulation)");
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm of bf16 rows, fp32 math, HF's rounding order");
}
