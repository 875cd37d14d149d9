// Sampling and the logprobs of chosen tokens over fp32 logits [N, V], a row at a time in two
// passes while the row is in cache (the default model's 49152 logits: 192 KB, in L2):
//   1. s = x / T (x itself where T = 1), its maximum m and the first index of m;
//   2. e_j = exp(s_j - m) into the thread's scratch row, summed per block of kBlock tokens in
//      fp32; the total is the blocks' sums added in fp64, in block order.
// A token's logprob is (s_t - m) - log(total), log_softmax's formula; a drawn token is the
// first whose cumulative e (fp64) exceeds u x total: the block first, from the blocks'
// cumulative sums, then the token inside it (the sampler's inverse CDF, unnormalised). A row
// is computed the same way whatever rows it is batched with, so the sampler's draws and
// logprobs and the verifier's agree bit for bit.
// torch's ops for the same (log_softmax written out in full, a max, a softmax written out,
// the inverse CDF's block sums) read and write the [N, V] logits 4-6 times: at 128 rows in a
// decode step here, 7.8 ms of a 110 ms step.
#include "bf16_kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 1024;  // sampler.CDF_BLOCK

struct RowStats {
  float max;
  int64_t argmax;    // the first index of the maximum (of the first NaN where there is one)
  double total;      // sum of exp(s - max)
  float logsum;      // log(total)
};

// 8 of s: x / T, or x where T = 1.
inline __m256 scaled8(const float* x, __m256 t8, bool unit) {
  const __m256 v = _mm256_loadu_ps(x);
  return unit ? v : _mm256_div_ps(v, t8);
}

inline float scaled1(float x, float t, bool unit) { return unit ? x : x / t; }

// Both passes over row x [V]; e (the scratch row, V floats) and sums (ceil(V / kBlock)) filled.
// The second pass (exponentials, bound by the vector units, the row in L2) fetches the next row
// (next, nullable) into L2 beside it: the first pass then reads the cache, not memory (128 rows
// of 49152 logits just written by the head: 4.9 -> 2.9 ms).
RowStats row_pass(const float* x, int64_t V, float t, float* e, float* sums, const float* next) {
  const bool unit = t == 1.f;
  const __m256 tv = _mm256_set1_ps(t);
  // Pass 1: the maximum per lane and the index of its first occurrence per lane.
  int64_t j = 0;
  float mx = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  bool nan = false;
  if (V >= 8) {
    __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256i i8 = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    __m256 unordered = _mm256_setzero_ps();
    for (; j + 8 <= V; j += 8) {
      const __m256 v = scaled8(x + j, tv, unit);
      const __m256 gt = _mm256_cmp_ps(v, m8, _CMP_GT_OQ);  // strictly larger: first kept
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m8 = _mm256_blendv_ps(m8, v, gt);
      i8 = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(i8), _mm256_castsi256_ps(idx), gt));
      idx = _mm256_add_epi32(idx, step);
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    alignas(32) float lm[8];
    alignas(32) int32_t li[8];
    _mm256_store_ps(lm, m8);
    _mm256_store_si256(reinterpret_cast<__m256i*>(li), i8);
    for (int l = 0; l < 8; ++l)
      if (lm[l] > mx || (lm[l] == mx && li[l] < at)) {
        mx = lm[l];
        at = li[l];
      }
  }
  for (; j < V; ++j) {
    const float v = scaled1(x[j], t, unit);
    nan = nan || std::isnan(v);
    if (v > mx) {
      mx = v;
      at = j;
    }
  }
  if (nan) {  // as torch's max: NaN is the largest; no distribution to speak of
    for (j = 0; j < V; ++j)
      if (std::isnan(scaled1(x[j], t, unit))) break;
    const float q = std::numeric_limits<float>::quiet_NaN();
    return {q, j, q, q};
  }
  // Pass 2: exponentials and block sums.
  const __m256 m8 = _mm256_set1_ps(mx);
  const int64_t nb = (V + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
    __m256 acc = _mm256_setzero_ps();
    for (j = lo; j + 8 <= hi; j += 8) {
      if (next != nullptr && (j & 15) == 0)  // a 64-byte line every 16 floats
        _mm_prefetch(reinterpret_cast<const char*>(next + j), _MM_HINT_T1);
      const __m256 ev = exp8(_mm256_sub_ps(scaled8(x + j, tv, unit), m8));
      _mm256_storeu_ps(e + j, ev);
      acc = _mm256_add_ps(acc, ev);
    }
    float sum = hsum(acc);
    for (; j < hi; ++j) {  // the last block's tail, through the same exp
      alignas(32) float one[8] = {scaled1(x[j], t, unit) - mx};
      _mm256_store_ps(one, exp8(_mm256_load_ps(one)));
      e[j] = one[0];
      sum += one[0];
    }
    sums[b] = sum;
    total += sum;
  }
  return {mx, at, total, static_cast<float>(std::log(total))};
}

// The token whose cumulative e first exceeds target (0 <= target < total): its block from the
// cumulative block sums, then inside the block; where rounding leaves the target past the
// block's last cumulative value, the block's last token of nonzero e. Never a token of e = 0.
int64_t inverse_cdf(const float* e, const float* sums, int64_t V, double target) {
  const int64_t nb = (V + kBlock - 1) / kBlock;
  double before = 0.0;
  int64_t b = 0;
  for (; b < nb - 1; ++b) {
    if (before + sums[b] > target) break;
    before += sums[b];
  }
  while (b > 0 && sums[b] == 0.f) before -= sums[--b];  // past the mass: the last block with some
  const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
  int64_t last = lo;
  double c = before;
  for (int64_t j = lo; j < hi; ++j) {
    if (e[j] > 0.f) last = j;
    c += e[j];
    if (c > target && e[j] > 0.f) return j;
  }
  return last;
}

// row_pass over rows [0, N) of xv [N, V] (fp32, or bf16 as uint16_t), split over the threads,
// each row at temps[r] (1 where temps is null); then done(r, x, stats, e, sums) with x the fp32
// row and its scratch filled. A bf16 row is widened (exactly) into the thread's scratch first,
// in cache: the passes read what they would read of the row widened to fp32 in memory,
// without [N, V] fp32 written and read back (the head's logits of 128 prompt positions: 25 MB).
template <typename T, typename Done>
void each_row(const T* xv, int64_t N, int64_t V, const float* temps, Done done) {
  constexpr bool bf16 = std::is_same_v<T, uint16_t>;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(static_cast<size_t>(V)), sums(static_cast<size_t>(V / kBlock + 1));
    std::vector<float> wide(bf16 ? static_cast<size_t>(V) : 0);
    for (int64_t r = begin; r < end; ++r) {
      const float* x;
      const float* next = nullptr;  // the row fetched ahead (fp32 rows only)
      if constexpr (bf16) {
        const uint16_t* row = xv + r * V;
        int64_t j = 0;
        for (; j + 8 <= V; j += 8) _mm256_storeu_ps(wide.data() + j, load_bf16x8(row + j));
        for (; j < V; ++j) wide[static_cast<size_t>(j)] = bf16_to_f32(row[j]);
        x = wide.data();
      } else {
        x = xv + r * V;
        if (r + 1 < end) next = x + V;
      }
      const float t = temps != nullptr ? temps[r] : 1.f;
      const RowStats st = row_pass(x, V, t, e.data(), sums.data(), next);
      done(r, x, st, e.data(), sums.data());
    }
  });
}

// log_softmax's formula for token k of row x at temperature t.
inline float logprob(const float* x, int64_t k, float t, const RowStats& st) {
  return (scaled1(x[k], t, t == 1.f) - st.max) - st.logsum;
}

void check_rows(const at::Tensor& logits, const at::Tensor& temps) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "logits must be [N, V] fp32");
  TORCH_CHECK(logits.size(1) > 0, "logits need at least one column");
  TORCH_CHECK(temps.dim() == 1 && temps.size(0) == logits.size(0) &&
                  temps.scalar_type() == at::kFloat,
              "temps must be [N] fp32");
}

}  // namespace

// One token per row and its logprob: greedy rows (greedy[i]) take the first index of the
// maximum, the others the inverse CDF at u[i] (fp64 in [0, 1)); logprobs at temps[i] (1 for
// greedy rows: raw logits).
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits_in,
                                               const at::Tensor& temps_in,
                                               const at::Tensor& u_in,
                                               const at::Tensor& greedy_in) {
  const auto logits = logits_in.contiguous();
  const auto temps = temps_in.contiguous();
  check_rows(logits, temps);
  const int64_t N = logits.size(0), V = logits.size(1);
  const auto u = u_in.to(at::kDouble).contiguous();
  const auto greedy = greedy_in.to(at::kBool).contiguous();
  TORCH_CHECK(u.numel() == N && greedy.numel() == N, "u and greedy need one entry per row");
  auto tokens = at::empty({N}, logits.options().dtype(at::kLong));
  auto logprobs = at::empty({N}, logits.options());
  const float *xv = logits.data_ptr<float>(), *tv = temps.data_ptr<float>();
  const double* uv = u.data_ptr<double>();
  const bool* gv = greedy.data_ptr<bool>();
  int64_t* ov = tokens.data_ptr<int64_t>();
  float* lv = logprobs.data_ptr<float>();
  each_row(xv, N, V, tv, [&](int64_t r, const float* x, const RowStats& st, const float* e,
                             const float* sums) {
    int64_t tok = st.argmax;
    if (!gv[r] && !std::isnan(st.total) && st.total > 0.0)
      tok = inverse_cdf(e, sums, V, uv[r] * st.total);
    ov[r] = tok;
    lv[r] = logprob(x, tok, tv[r], st);
  });
  return {tokens, logprobs};
}

// The logprob of tokens[i] in row i at temps[i]: what sample_rows reports for it.
at::Tensor token_logprobs(const at::Tensor& logits_in, const at::Tensor& temps_in,
                          const at::Tensor& tokens_in) {
  const auto logits = logits_in.contiguous();
  const auto temps = temps_in.contiguous();
  check_rows(logits, temps);
  const int64_t N = logits.size(0), V = logits.size(1);
  const auto tokens = tokens_in.to(at::kLong).contiguous();
  TORCH_CHECK(tokens.numel() == N, "tokens need one entry per row");
  const int64_t* kv = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) TORCH_CHECK(kv[r] >= 0 && kv[r] < V, "token out of range");
  auto logprobs = at::empty({N}, logits.options());
  const float *xv = logits.data_ptr<float>(), *tv = temps.data_ptr<float>();
  float* lv = logprobs.data_ptr<float>();
  each_row(xv, N, V, tv, [&](int64_t r, const float* x, const RowStats& st, const float*,
                             const float*) { lv[r] = logprob(x, kv[r], tv[r], st); });
  return logprobs;
}

// Scoring given tokens (prompt logprobs): per row of logits [C, V] (fp32, or bf16 widened in
// cache by each_row: the same values), the two parts of its log-softmax as sample_rows
// computes them at T = 1, the maximum m and log(sum(exp(x - m))) (a
// logprob is (x - m) - that: a scored token gets the logprob it was sampled with), and the
// rank of the row's target (1 + how many logits are larger), counted in a third pass over the
// row in cache. What torch takes a log-softmax written out in full ([C, V]), a gather and a
// top-k for (per 256 rows of the default model's 49152 logits: 15 + 8 ms, against ~3 ms).
std::tuple<at::Tensor, at::Tensor, at::Tensor> log_softmax_rank(
    const at::Tensor& logits_in, const at::Tensor& targets_in) {
  const bool bf16 = logits_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(logits_in.dim() == 2 && (bf16 || logits_in.scalar_type() == at::kFloat),
              "logits must be [C, V] fp32 or bf16");
  const auto logits = logits_in.contiguous();
  const auto targets = targets_in.to(at::kLong).contiguous();
  const int64_t C = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && targets.dim() == 1 && targets.size(0) == C, "targets must be [C]");
  const int64_t* tv = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < C; ++r) TORCH_CHECK(tv[r] >= 0 && tv[r] < V, "target out of range");
  const auto fp32 = logits.options().dtype(at::kFloat);
  auto maxima = at::empty({C}, fp32);
  auto logsums = at::empty({C}, fp32);
  auto rank = at::empty({C}, targets.options());
  float *mo = maxima.data_ptr<float>(), *lo = logsums.data_ptr<float>();
  int64_t* ro = rank.data_ptr<int64_t>();
  const auto scored = [&](int64_t r, const float* x, const RowStats& st, const float*,
                          const float*) {
    const float chosen = x[tv[r]];
    const __m256 c8 = _mm256_set1_ps(chosen);
    __m256i above8 = _mm256_setzero_si256();  // lanes count -1 per larger logit
    int64_t j = 0;
    for (; j + 8 <= V; j += 8)
      above8 = _mm256_add_epi32(
          above8, _mm256_castps_si256(_mm256_cmp_ps(_mm256_loadu_ps(x + j), c8, _CMP_GT_OQ)));
    alignas(32) int32_t counts[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(counts), above8);
    int64_t above = 0;
    for (const int32_t c : counts) above -= c;
    for (; j < V; ++j) above += x[j] > chosen;
    mo[r] = st.max;
    lo[r] = st.logsum;
    ro[r] = above + 1;
  };
  if (bf16)
    each_row(bf16_data(logits), C, V, nullptr, scored);
  else
    each_row(logits.data_ptr<float>(), C, V, nullptr, scored);
  return {maxima, logsums, rank};
}
