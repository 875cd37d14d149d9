// Shared by the kernel sources: bf16 <-> fp32 and the entry points one source calls in another.
#pragma once
#include <immintrin.h>
// ATen's tensor and the few operators the sources call, not <torch/extension.h>: that header
// (pybind11, the whole C++ frontend) took ~50 s of each source's compile; only bf16_gemv.cpp,
// which holds the Python bindings, includes pybind11's torch casters.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

static inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A bf16 tensor's elements as raw 16-bit values.
static inline uint16_t* bf16_data(const at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

static inline uint16_t f32_to_bf16(float f) {
  // Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays NaN.
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// 8 bf16 at p widened to fp32 (exact: bf16 is the top half of an fp32).
static inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The bf16 bits of 8 fp32 lanes (in each 32-bit lane's low half), rounded as f32_to_bf16.
static inline __m256i bf16_bits8(__m256 f) {
  const __m256i b = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(nan));
}

// 8 fp32 lanes rounded to bf16 and widened back (each as bf16_to_f32(f32_to_bf16(x))).
static inline __m256 round_bf16x8(__m256 f) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(f), 16));
}

// 8 fp32 lanes stored at p as bf16, each rounded as f32_to_bf16.
static inline void store_bf16x8(uint16_t* p, __m256 f) {
  const __m256i b = bf16_bits8(f);  // < 2^16 per lane: the unsigned pack keeps every value
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// The sum of 8 lanes.
static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// exp of 8 floats (Cephes' expf: range reduction by ln 2, degree-5 polynomial; ~1 ulp for
// the softmax's arguments <= 0, which are clamped at -88 where exp underflows anyway).
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.37626f)), _mm256_set1_ps(-88.37626f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// The largest of x[0..n), n >= 1, 8 lanes at a time: the same value as a scalar walk (a maximum
// is exact in any order); the scalar walk was ~12% of a prefill's attention.
static inline float row_max(const float* x, int64_t n) {
  float mx = x[0];
  int64_t j = 0;
  if (n >= 8) {
    __m256 m8 = _mm256_loadu_ps(x);
    for (j = 8; j + 8 <= n; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m8);
    for (const float v : lanes) mx = std::max(mx, v);
  }
  for (; j < n; ++j) mx = std::max(mx, x[j]);
  return mx;
}

// Which path the product takes: the fastest this CPU has (AMX tiles for bf16 rows where the
// shapes fit, else AVX512-BF16 dot products, else AVX2), the dot products without tiles, or
// AVX2 only. The last two are kept for comparisons.
constexpr int kProductBest = 0, kProductDot = 1, kProductAvx2 = 2;
// bf16 weight [N, K] x rows [M, K] (fp32 or bf16) -> [M, N] fp32, or bf16 when out_bf16.
at::Tensor gemv_bf16_impl(const at::Tensor& weight, const at::Tensor& x_in, bool out_bf16,
                          int path);
// AMX tiles (amx_product.cpp): whether this CPU has them and the OS lets this process use
// them; whether a weight [N, K] fits their blocks; weight [N, K] x bf16 rows [M, K] -> [M, N]
// at out (fp32) or, where out16 is given, at out16 (bf16, rounded once).
#define TLT_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512bf16,avx512vl")))
bool amx_ready();
// The i-th of n items taken from both ends in turn (0, n - 1, 1, n - 2, ..): in a prefill a
// token's (or a block's) cost grows with its position, and threads take contiguous ranges.
inline int64_t from_both_ends(int64_t i, int64_t n) {
  return (i & 1) ? n - 1 - (i >> 1) : i >> 1;
}

// The 16 x 16 transpose of 32-bit values: r[i] ← column i of the rows at in (row stride is).
TLT_AMX inline void transpose16(const float* in, int64_t is, __m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * is);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// The calling thread's eight tiles as 16 rows of 64 bytes (what both the product and the
// attention's scores use), and their release when the thread is done with them.
void amx_configure();
void amx_release();
bool avx512_bf16();  // bf16_gemv.cpp: whether the CPU has AVX512-BF16 (and AVX512F/BW)
bool amx_fits(int64_t N, int64_t K);
void amx_product(const uint16_t* w, const uint16_t* x, float* out, uint16_t* out16, int64_t M,
                 int64_t N, int64_t K);
// RMSNorm of bf16 rows in HF's rounding order.
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps);
// gu [R, 2I] bf16 (a gate/up product) -> silu(gu[:, :I]) * gu[:, I:] [R, I], as torch's two
// ops round it (decoder_layer.cpp).
at::Tensor silu_mul_bf16(const at::Tensor& gu);
// dst.view(-1, D)[index[r]] = src[r]: rows copied into a cache (decoder_layer.cpp).
void write_rows(const at::Tensor& dst, const at::Tensor& index, const at::Tensor& src);
// Which attention path attend_tokens takes: the fastest this CPU has (scores on AMX tiles for
// head sizes 64 and 128, else AVX512-BF16 dot products, else AVX512 or AVX2 with keys widened
// to fp32), the dot products without tiles, keys widened (AVX512 or AVX2: the same bits), AVX2
// only, or AVX2 one query head at a time (the same bits). The last four are kept for
// comparisons.
constexpr int kAttentionBest = 0, kAttentionWidened = 1, kAttentionAvx2 = 2, kAttentionDot = 3,
              kAttentionAvx2Heads = 4;
// Attention of T query tokens: token t (q at q + t * q_stride, kvH x G heads of D) sees key
// columns [0, lens[t]) of cache row rows[t] or, where bits (nullable) has bits[t] != 0, the
// first lens[t] - popcount(bits[t]) columns and then that base + i for each set bit i (a tree
// node: its ancestors and itself); output at out + t * o_stride, bf16, by ``path``. A row's
// run of at least block_queries real query tokens without tree bits (a prefill) goes by blocks
// (attend_runs) where the path is the best one and the blocks take D.
constexpr int64_t kNoBlocks = INT64_MAX;
void attend_tokens(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache,
                   const uint16_t* v_cache, const int64_t* rows, const int64_t* lens,
                   const int64_t* bits, int64_t T, int64_t kvH, int64_t G, int64_t D, int64_t L,
                   double scale, uint16_t* out, int64_t o_stride, int path = kAttentionBest,
                   int64_t block_queries = kNoBlocks);
// Prefill attention by blocks of 16 query tokens (prefill_attention.cpp), on AMX tiles (tiles)
// or by AVX512-BF16 dot products (the CPU as attend_tokens chose its path): whether it takes
// head size D; and the tokens of each run (query tokens t0 .. t0 + n - 1, all of cache row
// ``row``, causal: no tree bits) as attend_tokens would, the weights rounded to bf16 for the
// weighted sum.
struct QueryRun {
  int64_t t0, n, row;
};
bool block_attention_fits(int64_t D);
void attend_runs(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache,
                 const uint16_t* v_cache, const std::vector<QueryRun>& runs, const int64_t* lens,
                 int64_t kvH, int64_t G, int64_t D, int64_t L, double scale, uint16_t* out,
                 int64_t o_stride, bool tiles);
// bits_in as contiguous int64 (one per entry of lens), checked against lens; empty: no tree.
at::Tensor tree_bits(const at::Tensor& bits_in, const at::Tensor& lens);
void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t kvH,
                  int64_t G, int64_t D);
// One whole decoder layer for causal rows (decoder_layer.cpp).
at::Tensor decoder_layer_bf16(const at::Tensor& x, const at::Tensor& in_norm,
                              const at::Tensor& qkv_w, const at::Tensor& o_w,
                              const at::Tensor& post_norm, const at::Tensor& gate_up_w,
                              const at::Tensor& down_w, double eps,
                              const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& rope, const at::Tensor& slots,
                              const at::Tensor& lens, const at::Tensor& bits,
                              int64_t row_lo, int64_t Q, int64_t num_heads, double scale,
                              const std::vector<int64_t>& own_rows, int64_t block_queries);
// Every layer of a model in one call (decoder_layer.cpp): 8 tensors per layer in weights.
std::vector<at::Tensor> decoder_stack_bf16(
    const at::Tensor& x, const std::vector<at::Tensor>& weights, double eps,
    const at::Tensor& rope, const at::Tensor& slots, const at::Tensor& lens,
    const at::Tensor& bits, int64_t row_lo, int64_t Q, int64_t num_heads, double scale,
    const std::vector<int64_t>& own_rows, int64_t block_queries, const std::vector<int64_t>& aux);
// Sampling (sampling.cpp): a token per row (greedy rows the first maximum, the others the
// inverse CDF at u) and its logprob at the row's temperature; the logprobs of given tokens;
// per row of scored logits its maximum, log-sum and the target's rank.
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits,
                                               const at::Tensor& temps,
                                               const at::Tensor& u,
                                               const at::Tensor& greedy);
at::Tensor token_logprobs(const at::Tensor& logits, const at::Tensor& temps,
                          const at::Tensor& tokens);
std::tuple<at::Tensor, at::Tensor, at::Tensor> log_softmax_rank(
    const at::Tensor& logits, const at::Tensor& targets);
