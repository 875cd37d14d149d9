// Shared by the kernel sources: bf16 <-> fp32 and the entry points one source calls in another.
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include <cstring>
#include <vector>

static inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A bf16 tensor's elements as raw 16-bit values.
static inline uint16_t* bf16_data(const torch::Tensor& t) {
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

// Which path the product takes: the fastest this CPU has (AMX tiles for bf16 rows where the
// shapes fit, else AVX512-BF16 dot products, else AVX2), the dot products without tiles, or
// AVX2 only. The last two are kept for comparisons.
constexpr int kProductBest = 0, kProductDot = 1, kProductAvx2 = 2;
// bf16 weight [N, K] x rows [M, K] (fp32 or bf16) -> [M, N] fp32, or bf16 when out_bf16.
torch::Tensor gemv_bf16_impl(const torch::Tensor& weight, const torch::Tensor& x_in, bool out_bf16,
                             int path);
// AMX tiles (amx_product.cpp): whether this CPU has them and the OS lets this process use
// them; whether a weight [N, K] fits their blocks; weight [N, K] x bf16 rows [M, K] -> [M, N]
// at out (fp32) or, where out16 is given, at out16 (bf16, rounded once).
#define TLT_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512bf16,avx512vl")))
bool amx_ready();
// The calling thread's eight tiles as 16 rows of 64 bytes (what both the product and the
// attention's scores use), and their release when the thread is done with them.
void amx_configure();
void amx_release();
bool avx512_bf16();  // bf16_gemv.cpp: whether the CPU has AVX512-BF16 (and AVX512F/BW)
bool amx_fits(int64_t N, int64_t K);
void amx_product(const uint16_t* w, const uint16_t* x, float* out, uint16_t* out16, int64_t M,
                 int64_t N, int64_t K);
// RMSNorm of bf16 rows in HF's rounding order.
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps);
// Which attention path attend_tokens takes: the fastest this CPU has (scores on AMX tiles for
// head sizes 64 and 128, else AVX512-BF16 dot products, else AVX512 or AVX2 with keys widened
// to fp32), the dot products without tiles, keys widened (AVX512 or AVX2: the same bits), or
// AVX2 only. The last three are kept for comparisons.
constexpr int kAttentionBest = 0, kAttentionWidened = 1, kAttentionAvx2 = 2, kAttentionDot = 3;
// Attention of T query tokens: token t (q at q + t * q_stride, kvH x G heads of D) sees key
// columns [0, lens[t]) of cache row rows[t] or, where bits (nullable) has bits[t] != 0, the
// first lens[t] - popcount(bits[t]) columns and then that base + i for each set bit i (a tree
// node: its ancestors and itself); output at out + t * o_stride, bf16, by ``path``.
void attend_tokens(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache,
                   const uint16_t* v_cache, const int64_t* rows, const int64_t* lens,
                   const int64_t* bits, int64_t T, int64_t kvH, int64_t G, int64_t D, int64_t L,
                   double scale, uint16_t* out, int64_t o_stride, int path = kAttentionBest);
// bits_in as contiguous int64 (one per entry of lens), checked against lens; empty: no tree.
torch::Tensor tree_bits(const torch::Tensor& bits_in, const torch::Tensor& lens);
void check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t kvH,
                  int64_t G, int64_t D);
// One whole decoder layer for causal rows (decoder_layer.cpp).
torch::Tensor decoder_layer_bf16(const torch::Tensor& x, const torch::Tensor& in_norm,
                                 const torch::Tensor& qkv_w, const torch::Tensor& o_w,
                                 const torch::Tensor& post_norm, const torch::Tensor& gate_up_w,
                                 const torch::Tensor& down_w, double eps,
                                 const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const torch::Tensor& rope, const torch::Tensor& slots,
                                 const torch::Tensor& lens, const torch::Tensor& bits,
                                 int64_t row_lo, int64_t Q, int64_t num_heads, double scale,
                                 const std::vector<int64_t>& own_rows);
