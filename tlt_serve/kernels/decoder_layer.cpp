// One whole decoder layer (Llama family without biases or q/k norms) in one call, for decode,
// chain and tree verification, drafter steps and short prefills. At batch 1 a layer's
// products take ~0.3 ms (they stream the weights from memory) and the ~35 torch ops around
// them as much again in dispatch; here they are loops over the rows. Each product takes the
// own kernel up to its row limit and torch's (oneDNN's bf16 GEMM, on AMX tiles where the CPU
// has them) above it, as the op-by-op path's Linear does.
// Every value is rounded as the op-by-op torch path rounds it (the same kernels for products,
// norms and attention, torch's own silu or a table of it, bf16 after each elementwise op), so
// the result is the same bits (tests/test_model.py). decoder_stack_bf16 runs every layer of a
// model so. The elementwise parts (rotary, residual adds, the MLP's activation) run 8 lanes at a
// time: at 8 rows they cost ~2.4 of a ~22 ms stack one by one, on the 2-vCPU AMX Xeon.
#include "bf16_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>  // the fallback silu(gate) * up
#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>
#include <cstring>
#include <vector>

namespace {

inline uint16_t mul_bf16(float a, float b) { return f32_to_bf16(a * b); }

// In place: x[D] rotated as torch's x * cos + cat(-x2, x1) * sin, each op rounded to bf16.
// Eight lanes at a time where they fill (the same roundings per lane), then one by one.
void rotate(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t D) {
  const int64_t half = D / 2;
  int64_t i = 0;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= half; i += 8) {
    const __m256 a = load_bf16x8(x + i), b = load_bf16x8(x + i + half);
    const __m256 lo = _mm256_add_ps(round_bf16x8(_mm256_mul_ps(a, load_bf16x8(cos + i))),
                                    round_bf16x8(_mm256_mul_ps(_mm256_xor_ps(b, sign),
                                                               load_bf16x8(sin + i))));
    const __m256 hi = _mm256_add_ps(round_bf16x8(_mm256_mul_ps(b, load_bf16x8(cos + i + half))),
                                    round_bf16x8(_mm256_mul_ps(a, load_bf16x8(sin + i + half))));
    store_bf16x8(x + i, lo);
    store_bf16x8(x + i + half, hi);
  }
  for (; i < half; ++i) {
    const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
    const float lo = bf16_to_f32(mul_bf16(a, bf16_to_f32(cos[i]))) +
                     bf16_to_f32(mul_bf16(-b, bf16_to_f32(sin[i])));
    const float hi = bf16_to_f32(mul_bf16(b, bf16_to_f32(cos[i + half]))) +
                     bf16_to_f32(mul_bf16(a, bf16_to_f32(sin[i + half])));
    x[i] = f32_to_bf16(lo);
    x[i + half] = f32_to_bf16(hi);
  }
}

// out = a + b, bf16 rows of equal shape, as torch's bf16 add.
at::Tensor add_bf16(const at::Tensor& a, const at::Tensor& b) {
  auto out = at::empty_like(a);
  const uint16_t *av = bf16_data(a), *bv = bf16_data(b);
  uint16_t* ov = bf16_data(out);
  at::parallel_for(0, a.numel(), 1 << 14, [&](int64_t lo, int64_t hi) {
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8)
      store_bf16x8(ov + i, _mm256_add_ps(load_bf16x8(av + i), load_bf16x8(bv + i)));
    for (; i < hi; ++i) ov[i] = f32_to_bf16(bf16_to_f32(av[i]) + bf16_to_f32(bv[i]));
  });
  return out;
}

// torch's silu of every bf16 value, indexed by its bits, as torch's own kernel computes it in
// its vectorized loop (built once, by that kernel). That loop takes every element of a row
// whose length is a multiple of 64 (two vectors of up to 32 bf16 at a time); the elements of a
// shorter remainder take its scalar loop (std::exp), which may round differently, so rows of
// other lengths are left to torch. One entry past the end: a gather reads 4 bytes an entry.
const std::vector<uint16_t>& silu_table() {
  static const std::vector<uint16_t> table = [] {
    auto all = at::empty({1 << 16}, at::TensorOptions().dtype(at::kBFloat16));
    uint16_t* v = bf16_data(all);
    for (int i = 0; i < (1 << 16); ++i) v[i] = static_cast<uint16_t>(i);
    const auto silu = at::silu(all).contiguous();
    std::vector<uint16_t> t((1 << 16) + 1, 0);
    std::memcpy(t.data(), bf16_data(silu), (1 << 16) * sizeof(uint16_t));
    return t;
  }();
  return table;
}

}  // namespace

// silu(gate) * up, rounded to bf16 after each as torch's ops round them; for rows of a
// multiple of 64, silu from silu_table and the product in one pass over the row (torch's
// three ops and two tensors a layer cost ~1 ms of a 25 ms step at 8 rows; see silu_table).
at::Tensor silu_mul_bf16(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.scalar_type() == at::kBFloat16 &&
              gu.size(1) % 2 == 0, "gu must be contiguous [R, 2I] bf16");
  const int64_t R = gu.size(0), I = gu.size(1) / 2;
  if (I % 64 != 0) return (at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I)).contiguous();
  const auto* table = reinterpret_cast<const int*>(silu_table().data());
  auto out = at::empty({R, I}, gu.options());
  const uint16_t* g = bf16_data(gu);
  uint16_t* o = bf16_data(out);
  at::parallel_for(0, R, std::max<int64_t>(1, (1 << 14) / I), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const uint16_t* gate = g + r * 2 * I;
      const uint16_t* up = gate + I;
      uint16_t* row = o + r * I;
      for (int64_t i = 0; i < I; i += 8) {
        const __m256i bits =
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gate + i)));
        // entry `bits` in each lane's low half (little-endian), shifted up into an fp32
        const __m256i entry = _mm256_i32gather_epi32(table, bits, 2);
        const __m256 silu = _mm256_castsi256_ps(_mm256_slli_epi32(entry, 16));
        store_bf16x8(row + i, _mm256_mul_ps(silu, load_bf16x8(up + i)));
      }
    }
  });
  return out;
}

// dst.view(-1, D)[index[r]] = src[r] for each r: a step's keys or values into the cache's rows
// (models.llama.Attention.write, for the steps the whole-layer kernel does not take). torch's
// index_copy_ walks the elements one by one: at 128 decode rows of the default model (384
// rows of 64 bf16 a call) ~140 us a call against ~20 us for a row copy each, ~7% of a step.
// The same bytes moved, whatever the dtype; indices are checked before any is written.
void write_rows(const at::Tensor& dst, const at::Tensor& index, const at::Tensor& src_in) {
  TORCH_CHECK(dst.is_contiguous() && dst.dim() >= 2, "dst must be contiguous, at least 2-D");
  const int64_t D = dst.size(-1), rows = dst.numel() / std::max<int64_t>(D, 1);
  TORCH_CHECK(src_in.dim() == 2 && src_in.size(1) == D && src_in.scalar_type() == dst.scalar_type(),
              "src must be [R, D] of dst's dtype and last size");
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong && index.is_contiguous() &&
              index.numel() == src_in.size(0), "index must be a contiguous [R] long tensor");
  const auto src = src_in.contiguous();
  const int64_t R = src.size(0), bytes = D * src.element_size();
  const int64_t* ix = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ix[r] >= 0 && ix[r] < rows, "index out of range");
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  // at least 8 KB of rows a thread (64 rows of 64 bf16): a batch-1 step's few rows stay on one
  at::parallel_for(0, R, std::max<int64_t>(1, 8192 / std::max<int64_t>(bytes, 1)),
                   [&](int64_t lo, int64_t hi) {
                     for (int64_t r = lo; r < hi; ++r) std::memcpy(d + ix[r] * bytes, s + r * bytes, bytes);
                   });
}

namespace {

// x [R, K] bf16 × weight [N, K] → [R, N] bf16: the own product up to own_rows rows, else
// torch's (what models.llama.Linear runs for a bf16 product of more rows).
at::Tensor product(const at::Tensor& weight, const at::Tensor& x, int64_t own_rows) {
  return x.size(0) <= own_rows ? gemv_bf16_impl(weight, x, true, kProductBest) : at::linear(x, weight);
}

// Where each token of a step goes, the same for every layer: its cache row, the keys it sees,
// its tree bits and the column its own K/V take.
struct TokenPlan {
  at::Tensor slots;  // [R] long (kept alive: sv points into it)
  const int64_t* sv = nullptr;
  std::vector<int64_t> rows, keys, bits, cols;
};

// x [R, H]; slots [R]; lens [T]; bits [T] or empty; caches [S, kvH, L, D].
TokenPlan plan_tokens(const at::Tensor& x, const at::Tensor& k_cache,
                      const at::Tensor& rope, const at::Tensor& slots_in,
                      const at::Tensor& lens_in, const at::Tensor& bits_in, int64_t row_lo,
                      int64_t Q) {
  TORCH_CHECK(x.dim() == 2, "x must be contiguous [R, H] bf16");
  TORCH_CHECK(k_cache.dim() == 4, "caches must be equal contiguous 4-D bf16");
  const int64_t R = x.size(0), D = k_cache.size(3), L = k_cache.size(2);
  TORCH_CHECK(rope.dim() == 3 && rope.is_contiguous() && rope.scalar_type() == at::kBFloat16 &&
              rope.size(1) == 2 && rope.size(2) == D, "rope must be contiguous [T, 2, D] bf16");
  TokenPlan plan;
  plan.slots = slots_in.to(at::kLong).contiguous();
  const auto lens = lens_in.to(at::kLong).contiguous();
  const int64_t T = rope.size(0);
  TORCH_CHECK(plan.slots.numel() == R && lens.numel() == T && Q >= 1 && T % Q == 0,
              "slots must be [R], lens [T] with T = B * Q");
  const auto all_bits = tree_bits(bits_in, lens);
  const int64_t *sv = plan.slots.data_ptr<int64_t>(), *lv = lens.data_ptr<int64_t>();
  const int64_t* abv = all_bits.numel() ? all_bits.data_ptr<int64_t>() : nullptr;
  plan.sv = sv;
  plan.rows.resize(static_cast<size_t>(R));
  plan.keys.resize(static_cast<size_t>(R));
  plan.cols.resize(static_cast<size_t>(R));
  if (abv != nullptr) plan.bits.resize(static_cast<size_t>(R));
  for (int64_t t = 0; t < R; ++t) {
    TORCH_CHECK(sv[t] >= 0 && sv[t] < T, "slots out of range");
    const int64_t row = row_lo + sv[t] / Q, n = lv[sv[t]];
    TORCH_CHECK(row >= 0 && row < k_cache.size(0) && n >= 0 && n <= L, "rows or lens out of range");
    plan.rows[static_cast<size_t>(t)] = row;
    plan.keys[static_cast<size_t>(t)] = n;
    // Its own K/V go to its last visible column: n - 1, or a tree node's highest set bit.
    const uint64_t b = abv != nullptr ? static_cast<uint64_t>(abv[sv[t]]) : 0;
    if (abv != nullptr) plan.bits[static_cast<size_t>(t)] = static_cast<int64_t>(b);
    plan.cols[static_cast<size_t>(t)] =
        b == 0 ? n - 1 : n - __builtin_popcountll(b) + 63 - __builtin_clzll(b);
  }
  return plan;
}

// One layer over the planned tokens (see decoder_layer_bf16).
at::Tensor layer_body(const at::Tensor& x, const at::Tensor& in_norm,
                      const at::Tensor& qkv_w, const at::Tensor& o_w,
                      const at::Tensor& post_norm, const at::Tensor& gate_up_w,
                      const at::Tensor& down_w, double eps, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& rope,
                      const TokenPlan& plan, int64_t num_heads, double scale,
                      const int64_t* own_rows, int64_t block_queries) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be contiguous [R, H] bf16");
  const int64_t R = x.size(0), kvH = k_cache.size(1), D = k_cache.size(3), L = k_cache.size(2);
  TORCH_CHECK(num_heads % kvH == 0, "num_heads must be a multiple of the KV heads");
  const int64_t G = num_heads / kvH, width = (num_heads + 2 * kvH) * D;
  check_caches(k_cache, v_cache, kvH, G, D);
  TORCH_CHECK(qkv_w.size(0) == width, "qkv weight has ", qkv_w.size(0), " rows, expected ", width);
  TORCH_CHECK(static_cast<int64_t>(plan.rows.size()) == R, "x has ", R, " rows, the plan ",
              plan.rows.size());
  const int64_t* sv = plan.sv;

  // Attention block: norm, qkv, rotary, K/V into the cache, attention, o, residual.
  const auto h = in_norm.numel() ? rms_norm_bf16(x, in_norm, eps) : x;
  auto qkv = product(qkv_w, h, own_rows[0]);  // [R, (heads + 2 kvH) D]
  uint16_t* qv = bf16_data(qkv);
  uint16_t* kc = bf16_data(k_cache);
  uint16_t* vc = bf16_data(v_cache);
  const uint16_t* cs = bf16_data(rope);
  // Tokens write distinct cache columns: split over the threads from a few rows on.
  at::parallel_for(0, R, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      uint16_t* tok = qv + t * width;
      const uint16_t* cos = cs + sv[t] * 2 * D;
      for (int64_t hd = 0; hd < num_heads + kvH; ++hd) rotate(tok + hd * D, cos, cos + D, D);
      const int64_t col = plan.cols[static_cast<size_t>(t)];
      const int64_t row = plan.rows[static_cast<size_t>(t)];
      for (int64_t hd = 0; hd < kvH && col >= 0; ++hd) {  // a padding token writes no K/V
        const int64_t at = ((row * kvH + hd) * L + col) * D;
        std::memcpy(kc + at, tok + (num_heads + hd) * D, D * sizeof(uint16_t));
        std::memcpy(vc + at, tok + (num_heads + kvH + hd) * D, D * sizeof(uint16_t));
      }
    }
  });
  auto attn = at::empty({R, num_heads * D}, x.options());
  attend_tokens(qv, width, kc, vc, plan.rows.data(), plan.keys.data(),
                plan.bits.empty() ? nullptr : plan.bits.data(), R, kvH, G, D, L, scale,
                bf16_data(attn), num_heads * D, kAttentionBest, block_queries);
  const auto x1 = add_bf16(x, product(o_w, attn, own_rows[1]));

  // MLP block: norm, gate/up, silu(gate) * up (torch's ops' bits), down, residual.
  const auto gu = product(gate_up_w, rms_norm_bf16(x1, post_norm, eps), own_rows[2]);
  return add_bf16(x1, product(down_w, silu_mul_bf16(gu), own_rows[3]));
}

}  // namespace

// x [R, H] bf16: the residual stream of R real tokens; in_norm [H] (empty: identity, a
// drafter's layer); caches [S, kvH, L, D]; rope [T, 2, D] bf16 (cos, sin) per slot of the
// batch's [B, Q] layout; slots [R]: each token's slot (b * Q + j); lens [T]: keys each slot's
// query sees (its own K/V go to column lens - 1 of cache row row_lo + b; 0: a padding token,
// which writes nothing and attends to nothing); bits [T] or empty: tree nodes, as
// attend_tokens reads them (a node's own K/V go to the column of its highest set bit);
// own_rows [4]: the most rows the own product takes for qkv, o, gate_up, down (more: torch's);
// block_queries: a row of at least that many query tokens attends by blocks (attend_tokens).
// Returns the new residual stream [R, H] and writes the tokens' K/V.
at::Tensor decoder_layer_bf16(const at::Tensor& x, const at::Tensor& in_norm,
                              const at::Tensor& qkv_w, const at::Tensor& o_w,
                              const at::Tensor& post_norm, const at::Tensor& gate_up_w,
                              const at::Tensor& down_w, double eps,
                              const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& rope, const at::Tensor& slots_in,
                              const at::Tensor& lens_in, const at::Tensor& bits_in,
                              int64_t row_lo, int64_t Q, int64_t num_heads, double scale,
                              const std::vector<int64_t>& own_rows, int64_t block_queries) {
  TORCH_CHECK(own_rows.size() == 4, "own_rows must hold 4 row limits (qkv, o, gate_up, down)");
  TORCH_CHECK(block_queries >= 1, "block_queries must be at least 1");
  const auto plan = plan_tokens(x, k_cache, rope, slots_in, lens_in, bits_in, row_lo, Q);
  return layer_body(x, in_norm, qkv_w, o_w, post_norm, gate_up_w, down_w, eps, k_cache, v_cache,
                    rope, plan, num_heads, scale, own_rows.data(), block_queries);
}

// Every layer of a model in one call, each as decoder_layer_bf16 computes it (the same bits):
// at batch 1 the Python around 30 layer calls (arguments gathered, views made, the call bound)
// cost ~3-4 ms of a 17-19 ms step on the 2-vCPU AMX Xeon, and it ran between the layers'
// weight streams. weights: kStackTensors per layer (in_norm, qkv, o, post_norm, gate_up, down, K
// cache, V cache); own_rows: 4 per layer; block_queries: as decoder_layer_bf16's; aux: layer
// indices whose output is also returned.
// Returns [the last layer's output, then each aux layer's, in aux's order].
std::vector<at::Tensor> decoder_stack_bf16(
    const at::Tensor& x, const std::vector<at::Tensor>& weights, double eps,
    const at::Tensor& rope, const at::Tensor& slots_in, const at::Tensor& lens_in,
    const at::Tensor& bits_in, int64_t row_lo, int64_t Q, int64_t num_heads, double scale,
    const std::vector<int64_t>& own_rows, int64_t block_queries, const std::vector<int64_t>& aux) {
  constexpr size_t kStackTensors = 8;
  TORCH_CHECK(block_queries >= 1, "block_queries must be at least 1");
  TORCH_CHECK(!weights.empty() && weights.size() % kStackTensors == 0,
              "weights must hold 8 tensors per layer");
  const size_t layers = weights.size() / kStackTensors;
  TORCH_CHECK(own_rows.size() == 4 * layers, "own_rows must hold 4 row limits per layer");
  const auto& k0 = weights[6];
  const auto plan = plan_tokens(x, k0, rope, slots_in, lens_in, bits_in, row_lo, Q);
  for (size_t i = 1; i < layers; ++i)  // the plan's rows and columns hold for every layer
    TORCH_CHECK(weights[i * kStackTensors + 6].sizes() == k0.sizes(),
                "every layer's caches must have the first layer's shape");
  std::vector<at::Tensor> out(1 + aux.size());
  at::Tensor h = x;
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor* w = &weights[i * kStackTensors];
    h = layer_body(h, w[0], w[1], w[2], w[3], w[4], w[5], eps, w[6], w[7], rope, plan, num_heads,
                   scale, own_rows.data() + 4 * i, block_queries);
    for (size_t a = 0; a < aux.size(); ++a)
      if (aux[a] == static_cast<int64_t>(i)) out[1 + a] = h;
  }
  out[0] = h;
  for (size_t a = 0; a < aux.size(); ++a)
    TORCH_CHECK(out[1 + a].defined(), "aux layer ", aux[a], " is not a layer of the stack");
  return out;
}
