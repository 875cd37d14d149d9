// Prefill attention on AMX tiles, 16 query tokens at a time (head sizes 64 and 128); without
// tiles the same blocks by AVX512-BF16 dot products (scores_dot, weighted_sum_dot).
//
// The attention of bf16_gemv.cpp computes each (query token, KV head) alone: its scores take
// one tile product per 16 keys for the group's G query heads (3 of the tile's 16 columns on the
// default model), then the softmax and the weighted sum in fp32 vector code, two FMAs per key,
// head and 16 dimensions. In a prefill that weighted sum is most of the step: 64 prompts of 512
// tokens spent ~4.1 s of an 8.5 s prefill in the attention (2-vCPU AMX Xeon), against ~2.8 s
// for every product of the layers.
//
// Here a row's query tokens go 16 at a time (one tile's rows), two query heads at a time (each
// tile loaded serves two products):
//   scores   S [16 tokens, keys] = Q [16, D] · K^T    (A: the queries, read in place; B: the
//            keys transposed as bf16 pairs, packed once per row and KV head)
//   softmax  each token over its own keys (columns [0, lens)), fp32; the weights rounded to
//            bf16 (their sum taken before rounding, as torch's CPU attention does)
//   output   O [16, D] = P [16, keys] · V               (A: the weights; B: two keys' values
//            interleaved, packed once per row and KV head), then O / sum rounded to bf16.
// The weights enter the product as bf16, as in torch's and vLLM's CPU attention; the
// token-by-token path keeps them fp32, so a token's output here differs from its decode step's
// within bf16 rounding. Every output depends on its own query and keys only: each score and
// each output element is one sum in a fixed order (key blocks from column 0, keys past the
// token's own adding exact zeros), whichever tokens share its tiles and wherever its step's
// run of tokens starts, as long as that run takes the blocks (a run of fewer tokens, such as
// the rest of a prompt after a cached prefix, goes token by token).
//
// 4 prompts of 512 tokens, the default model's heads (G = 3, D = 64), 2-vCPU AMX Xeon: a
// layer's attention 1.7-1.9 ms against 7.5-8.6 ms token by token and 3.7-4.1 ms for torch's
// SDPA (causal, K and V expanded to every head; docs/PERFORMANCE.md).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "bf16_kernels.h"

namespace {

constexpr int64_t kRows = 16;  // query tokens per block: a tile's rows

// One row's keys and values laid out as B tiles, for the columns [0, keys) a run reads.
struct Packed {
  int64_t run = -1, head = -1;  // whose they are
  std::vector<uint32_t> kt;  // [keys / 16][D / 32][16 pairs][16 keys]: K^T as bf16 pairs
  std::vector<uint32_t> vp;  // [keys / 32][16 pairs][D]: the values of keys 2p and 2p + 1 in
                             // each 32-bit pair (low: 2p)
};

// 2^x of 16 floats, x <= 0 (and anything in lanes the caller masks off): 2^round(x) times a
// degree-5 polynomial of the remainder (relative error ~4e-6, far below the bf16 rounding the
// weights then take); large negative x gives 0.
TLT_AMX inline __m512 exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  __m512 y = _mm512_set1_ps(1.3333558146e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108665e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650696e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718056e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// Cache rows [0, n) of one (row, KV head), K and V [L, D], packed for columns [0, keys): keys
// and values past n are zeros (a cache row past its tokens may hold anything, even NaNs, and
// a zero weight times a NaN is a NaN).
TLT_AMX void pack(const uint16_t* K, const uint16_t* V, int64_t n, int64_t keys, int64_t D,
                  Packed& p) {
  const int64_t DB = D / 32;
  p.kt.resize(static_cast<size_t>(keys * D / 2));
  p.vp.resize(static_cast<size_t>(keys * D / 2));
  alignas(64) uint16_t part[16][32];
  for (int64_t kb = 0; kb < keys / 16; ++kb) {
    const int64_t valid = std::clamp<int64_t>(n - kb * 16, 0, 16);
    for (int64_t db = 0; db < DB; ++db) {
      const uint16_t* src = K + kb * 16 * D + db * 32;
      int64_t stride = D;
      if (valid < 16) {
        for (int64_t i = 0; i < 16; ++i)
          if (i < valid) std::memcpy(part[i], src + i * D, 64);
          else std::memset(part[i], 0, 64);
        src = part[0];
        stride = 32;
      }
      __m512 r[16];  // r[pair] = that pair of dimensions of each of the 16 keys
      transpose16(reinterpret_cast<const float*>(src), stride / 2, r);
      float* dst = reinterpret_cast<float*>(p.kt.data()) + (kb * DB + db) * 256;
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * 16, r[i]);
    }
  }
  // 32 bf16 of key a then of key b → 16 pairs (a, b) of dimensions d..d+15, then d+16..d+31.
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 32; ++i) {
    lo_idx[i] = static_cast<uint16_t>((i & 1 ? 32 : 0) + (i >> 1));
    hi_idx[i] = static_cast<uint16_t>(lo_idx[i] + 16);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 0; j < keys; j += 2) {
    uint32_t* dst = p.vp.data() + (j / 2) * D;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = j < n ? _mm512_loadu_si512(V + j * D + d) : zero;
      const __m512i b = j + 1 < n ? _mm512_loadu_si512(V + (j + 1) * D + d) : zero;
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// Queries of one head for the A tiles: in place (row stride q_stride) when the block has 16
// tokens, else copied into pad with zero rows past m. Returns the rows and their stride.
template <int64_t D>
const uint16_t* queries(const uint16_t* q, int64_t q_stride, int64_t m, uint16_t* pad,
                        int64_t& stride) {
  stride = q_stride;
  if (m == kRows) return q;
  for (int64_t i = 0; i < kRows; ++i)
    if (i < m) std::memcpy(pad + i * D, q + i * q_stride, D * 2);
    else std::memset(pad + i * D, 0, D * 2);
  stride = D;
  return pad;
}

// Scores [16, width] (unscaled) of two query heads' blocks (q1: none when g0 is the last
// head) against keys [0, width), 32 keys at a time: C tiles 0-3 (head x 16 keys), A tiles 4-5
// (the heads' 32 columns), B tiles 6-7 (two 16-key blocks): each tile loaded serves two
// products.
template <int DB>
TLT_AMX void scores(const Packed& p, const uint16_t* q0, const uint16_t* q1, int64_t qs,
                    int64_t width, float* s0, float* s1) {
  for (int64_t kb = 0; kb < width / 16; kb += 2) {
    const uint32_t* kt = p.kt.data() + kb * DB * 256;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int db = 0; db < DB; ++db) {
      _tile_loadd(4, q0 + db * 32, qs * 2);
      _tile_loadd(6, kt + db * 256, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, kt + (DB + db) * 256, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (q1 != nullptr) {
        _tile_loadd(5, q1 + db * 32, qs * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, s0 + kb * 16, width * 4);
    _tile_stored(1, s0 + kb * 16 + 16, width * 4);
    if (q1 != nullptr) {
      _tile_stored(2, s1 + kb * 16, width * 4);
      _tile_stored(3, s1 + kb * 16 + 16, width * 4);
    }
  }
}

// Lanes [0, k) of 16, k clamped to [0, 16].
inline __mmask16 first_lanes(int64_t k) {
  return static_cast<__mmask16>((1u << std::clamp<int64_t>(k, 0, 16)) - 1);
}

// A scores row s [width] → bf16 weights 2^(c s - c max) over its n keys, c = scale / ln 2,
// zeros to width; returns 1 / the sum of the weights (0 for a padding token, n = 0).
TLT_AMX float weights(const float* s, int64_t n, int64_t width, float scale, uint16_t* w) {
  if (n == 0) {
    std::memset(w, 0, width * 2);
    return 0.f;
  }
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
  if (j < n) mx = _mm512_mask_max_ps(mx, first_lanes(n - j), mx, _mm512_loadu_ps(s + j));
  const float c = scale * 1.44269504088896341f;
  const __m512 cv = _mm512_set1_ps(c), m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * c);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j < width; j += 32) {
    __m512 e0 = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), cv, m));
    __m512 e1 = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16), cv, m));
    if (j + 32 > n) {  // the last keys: lanes past n are zeros
      e0 = _mm512_maskz_mov_ps(first_lanes(n - j), e0);
      e1 = _mm512_maskz_mov_ps(first_lanes(n - j - 16), e1);
    }
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
    // 32 weights rounded to nearest even, in key order
    _mm512_storeu_si512(w + j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// O [16, 32] (dimensions d0..d0+31) of two heads = their weights [16, width] (w1: none) ·
// values, into o0 and o1 ([16][32] fp32 each): C tiles 0-3 (head x 16 dimensions), A tiles
// 4-5 (the heads' weights of 32 keys), B tiles 6-7 (those keys' values, two 16-dimension
// blocks).
TLT_AMX void weighted_sum(const Packed& p, const uint16_t* w0, const uint16_t* w1, int64_t width,
                          int64_t D, int64_t d0, float* o0, float* o1) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < width / 32; ++kb) {
    const uint32_t* v = p.vp.data() + kb * 16 * D + d0;
    _tile_loadd(4, w0 + kb * 32, width * 2);
    _tile_loadd(6, v, D * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, v + 16, D * 4);
    _tile_dpbf16ps(1, 4, 7);
    if (w1 != nullptr) {
      _tile_loadd(5, w1 + kb * 32, width * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, o0, 32 * 4);
  _tile_stored(1, o0 + 16, 32 * 4);
  if (w1 != nullptr) {
    _tile_stored(2, o1, 32 * 4);
    _tile_stored(3, o1 + 16, 32 * 4);
  }
}

// Without tiles the blocks run the functions below, compiled for TLT_AMX like the rest of this
// file but issuing no tile instruction (attend_block<DB, false>): AVX512-BF16 dot products.
//
// Scores [16, width] (unscaled) of one head's block q
// (row stride qs) against keys [0, width), 16 keys at a time: one accumulator per token, one
// lane per key, each key's score summed over the pairs of dimensions in order (a token's
// scores depend on its own query and keys only).
template <int DB>
TLT_AMX void scores_dot(const Packed& p, const uint16_t* q, int64_t qs, int64_t width, float* s) {
  for (int64_t kb = 0; kb < width / 16; ++kb) {
    const uint32_t* kt = p.kt.data() + kb * DB * 256;
    __m512 acc[kRows];
    for (__m512& a : acc) a = _mm512_setzero_ps();
    for (int db = 0; db < DB; ++db)
      for (int i = 0; i < 16; ++i) {  // pair db * 16 + i of every key in the block
        const __m512bh k = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kt + db * 256 + i * 16));
        for (int64_t t = 0; t < kRows; ++t) {
          uint32_t pair;
          std::memcpy(&pair, q + t * qs + db * 32 + 2 * i, 4);
          acc[t] = _mm512_dpbf16_ps(
              acc[t], k, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair))));
        }
      }
    for (int64_t t = 0; t < kRows; ++t) _mm512_storeu_ps(s + t * width + kb * 16, acc[t]);
  }
}

// Without tiles: O [16, 32] (dimensions d0..d0+31) of one head = its weights [16, width] ·
// values, into o ([16][32] fp32), 8 tokens at a time: two 16-dimension accumulators per token,
// summed over the pairs of keys in order.
TLT_AMX void weighted_sum_dot(const Packed& p, const uint16_t* w, int64_t width, int64_t D,
                              int64_t d0, float* o) {
  for (int64_t t0 = 0; t0 < kRows; t0 += 8) {
    __m512 acc[8][2];
    for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < width / 2; ++kp) {  // keys 2 kp and 2 kp + 1
      const uint32_t* v = p.vp.data() + kp * D + d0;
      const __m512bh v0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(v));
      const __m512bh v1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(v + 16));
      for (int64_t t = 0; t < 8; ++t) {
        uint32_t pair;
        std::memcpy(&pair, w + (t0 + t) * width + 2 * kp, 4);
        const __m512bh wt = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
        acc[t][0] = _mm512_dpbf16_ps(acc[t][0], v0, wt);
        acc[t][1] = _mm512_dpbf16_ps(acc[t][1], v1, wt);
      }
    }
    for (int64_t t = 0; t < 8; ++t) {
      _mm512_storeu_ps(o + (t0 + t) * 32, acc[t][0]);
      _mm512_storeu_ps(o + (t0 + t) * 32 + 16, acc[t][1]);
    }
  }
}

// Rows [0, m) of o [16][32] times their 1 / sum, rounded to bf16, at out + i * o_stride.
TLT_AMX void store_out(const float (*o)[32], const float* inv, int64_t m, uint16_t* out,
                       int64_t o_stride) {
  for (int64_t i = 0; i < m; ++i) {
    const __m512 f = _mm512_set1_ps(inv[i]);
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o[i] + 16), f),
                                           _mm512_mul_ps(_mm512_loadu_ps(o[i]), f));
    _mm512_storeu_si512(out + i * o_stride, reinterpret_cast<__m512i>(b));
  }
}

// Per-thread buffers of attend_block: two heads' scores and weights [16, width] each.
struct Scratch {
  std::vector<float> s;
  std::vector<uint16_t> w;
};

// One block: tokens [t, t + m) of a run, every query head of KV head h, two heads at a time.
template <int DB, bool Tiles>
TLT_AMX void attend_block(const uint16_t* qv, int64_t q_stride, const Packed& p,
                          const int64_t* lens, int64_t t, int64_t m, int64_t h, int64_t G,
                          float scale, uint16_t* ov, int64_t o_stride, Scratch& x) {
  constexpr int64_t D = 32 * DB;
  int64_t most = 0;
  for (int64_t i = 0; i < m; ++i) most = std::max(most, lens[t + i]);
  const int64_t width = (most + 31) / 32 * 32;  // keys the block reads, in 32s
  if (width == 0) {  // padding tokens only: zeros
    for (int64_t i = 0; i < m; ++i)
      std::memset(ov + (t + i) * o_stride + h * G * D, 0, G * D * 2);
    return;
  }
  x.s.resize(static_cast<size_t>(2 * kRows * width));
  x.w.resize(static_cast<size_t>(2 * kRows * width));
  float* s[2] = {x.s.data(), x.s.data() + kRows * width};
  uint16_t* w[2] = {x.w.data(), x.w.data() + kRows * width};
  alignas(64) uint16_t pad[2][kRows * D];
  alignas(64) float o[2][kRows][32];
  float inv[2][kRows];
  for (int64_t g0 = 0; g0 < G; g0 += 2) {
    const int64_t heads = std::min<int64_t>(2, G - g0);
    const uint16_t* q[2] = {nullptr, nullptr};
    int64_t qs = q_stride;
    for (int64_t k = 0; k < heads; ++k)
      q[k] = queries<D>(qv + t * q_stride + (h * G + g0 + k) * D, q_stride, m, pad[k], qs);
    if constexpr (Tiles)
      scores<DB>(p, q[0], q[1], qs, width, s[0], s[1]);
    else
      for (int64_t k = 0; k < heads; ++k) scores_dot<DB>(p, q[k], qs, width, s[k]);
    for (int64_t k = 0; k < heads; ++k)
      for (int64_t i = 0; i < kRows; ++i)
        inv[k][i] = weights(s[k] + i * width, i < m ? lens[t + i] : 0, width, scale,
                            w[k] + i * width);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      if constexpr (Tiles)
        weighted_sum(p, w[0], heads == 2 ? w[1] : nullptr, width, D, d0, o[0][0], o[1][0]);
      else
        for (int64_t k = 0; k < heads; ++k) weighted_sum_dot(p, w[k], width, D, d0, o[k][0]);
      for (int64_t k = 0; k < heads; ++k)
        store_out(o[k], inv[k], m, ov + t * o_stride + (h * G + g0 + k) * D + d0, o_stride);
    }
  }
}

}  // namespace

bool block_attention_fits(int64_t D) { return D == 64 || D == 128; }

void attend_runs(const uint16_t* qv, int64_t q_stride, const uint16_t* kc, const uint16_t* vc,
                 const std::vector<QueryRun>& runs, const int64_t* lens, int64_t kvH, int64_t G,
                 int64_t D, int64_t L, double scale, uint16_t* ov, int64_t o_stride, bool tiles) {
  // Work items (run, KV head, block), each (run, head)'s blocks from both ends.
  struct Item { int64_t run, head, block; };
  std::vector<Item> items;
  std::vector<int64_t> most(runs.size());  // columns each run's tokens see, at most
  for (size_t r = 0; r < runs.size(); ++r) {
    for (int64_t i = 0; i < runs[r].n; ++i) most[r] = std::max(most[r], lens[runs[r].t0 + i]);
    const int64_t nb = (runs[r].n + kRows - 1) / kRows;
    for (int64_t h = 0; h < kvH; ++h)
      for (int64_t i = 0; i < nb; ++i)
        items.push_back({static_cast<int64_t>(r), h, from_both_ends(i, nb)});
  }
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    if (tiles) amx_configure();
    Packed p;
    Scratch scratch;
    for (int64_t it = begin; it < end; ++it) {
      const Item& item = items[static_cast<size_t>(it)];
      const QueryRun& run = runs[static_cast<size_t>(item.run)];
      if (p.run != item.run || p.head != item.head) {
        const int64_t base = (run.row * kvH + item.head) * L * D;
        const int64_t n = most[static_cast<size_t>(item.run)];
        pack(kc + base, vc + base, n, (n + 31) / 32 * 32, D, p);
        p.run = item.run;
        p.head = item.head;
      }
      const int64_t t = run.t0 + item.block * kRows, m = std::min(kRows, run.t0 + run.n - t);
      const auto block = D == 64 ? (tiles ? attend_block<2, true> : attend_block<2, false>)
                                 : (tiles ? attend_block<4, true> : attend_block<4, false>);
      block(qv, q_stride, p, lens, t, m, item.head, G, fscale, ov, o_stride, scratch);
    }
    if (tiles) amx_release();
  });
}
