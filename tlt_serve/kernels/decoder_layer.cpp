// One whole decoder layer (Llama family without biases or q/k norms) in one call, for decode,
// chain and tree verification, drafter steps and short prefills. At batch 1 a layer's
// products take ~0.3 ms (they stream the weights from memory) and the ~35 torch ops around
// them as much again in dispatch; here they are loops over the rows. Each product takes the
// own kernel up to its row limit and torch's (oneDNN's bf16 GEMM, on AMX tiles where the CPU
// has them) above it, as the op-by-op path's Linear does.
// Every value is rounded as the op-by-op torch path rounds it (the same kernels for products,
// norms and attention, torch's own silu, bf16 after each elementwise op), so the result is
// the same bits (tests/test_model.py).
#include "bf16_kernels.h"

#include <ATen/Parallel.h>
#include <vector>

namespace {

inline uint16_t mul_bf16(float a, float b) { return f32_to_bf16(a * b); }

// In place: x[D] rotated as torch's x * cos + cat(-x2, x1) * sin, each op rounded to bf16.
void rotate(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
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
torch::Tensor add_bf16(const torch::Tensor& a, const torch::Tensor& b) {
  auto out = torch::empty_like(a);
  const uint16_t *av = bf16_data(a), *bv = bf16_data(b);
  uint16_t* ov = bf16_data(out);
  at::parallel_for(0, a.numel(), 1 << 14, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) ov[i] = f32_to_bf16(bf16_to_f32(av[i]) + bf16_to_f32(bv[i]));
  });
  return out;
}

// x [R, K] bf16 × weight [N, K] → [R, N] bf16: the own product up to own_rows rows, else
// torch's (what models.llama.Linear runs for a bf16 product of more rows).
torch::Tensor product(const torch::Tensor& weight, const torch::Tensor& x, int64_t own_rows) {
  return x.size(0) <= own_rows ? gemv_bf16_impl(weight, x, true, kProductBest) : at::linear(x, weight);
}

}  // namespace

// x [R, H] bf16: the residual stream of R real tokens; in_norm [H] (empty: identity, a
// drafter's layer); caches [S, kvH, L, D]; rope [T, 2, D] bf16 (cos, sin) per slot of the
// batch's [B, Q] layout; slots [R]: each token's slot (b * Q + j); lens [T]: keys each slot's
// query sees (its own K/V go to column lens - 1 of cache row row_lo + b; 0: a padding token,
// which writes nothing and attends to nothing); bits [T] or empty: tree nodes, as
// attend_tokens reads them (a node's own K/V go to the column of its highest set bit);
// own_rows [4]: the most rows the own product takes for qkv, o, gate_up, down (more: torch's).
// Returns the new residual stream [R, H] and writes the tokens' K/V.
torch::Tensor decoder_layer_bf16(const torch::Tensor& x, const torch::Tensor& in_norm,
                                 const torch::Tensor& qkv_w, const torch::Tensor& o_w,
                                 const torch::Tensor& post_norm, const torch::Tensor& gate_up_w,
                                 const torch::Tensor& down_w, double eps,
                                 const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const torch::Tensor& rope, const torch::Tensor& slots_in,
                                 const torch::Tensor& lens_in, const torch::Tensor& bits_in,
                                 int64_t row_lo, int64_t Q, int64_t num_heads, double scale,
                                 const std::vector<int64_t>& own_rows) {
  TORCH_CHECK(own_rows.size() == 4, "own_rows must hold 4 row limits (qkv, o, gate_up, down)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be contiguous [R, H] bf16");
  const int64_t R = x.size(0), kvH = k_cache.size(1), D = k_cache.size(3), L = k_cache.size(2);
  TORCH_CHECK(num_heads % kvH == 0, "num_heads must be a multiple of the KV heads");
  const int64_t G = num_heads / kvH, width = (num_heads + 2 * kvH) * D;
  check_caches(k_cache, v_cache, kvH, G, D);
  TORCH_CHECK(qkv_w.size(0) == width, "qkv weight has ", qkv_w.size(0), " rows, expected ", width);
  TORCH_CHECK(rope.dim() == 3 && rope.is_contiguous() && rope.scalar_type() == at::kBFloat16 &&
              rope.size(1) == 2 && rope.size(2) == D, "rope must be contiguous [T, 2, D] bf16");
  const auto slots = slots_in.to(at::kLong).contiguous();
  const auto lens = lens_in.to(at::kLong).contiguous();
  const int64_t T = rope.size(0);
  TORCH_CHECK(slots.numel() == R && lens.numel() == T && Q >= 1 && T % Q == 0,
              "slots must be [R], lens [T] with T = B * Q");
  const auto all_bits = tree_bits(bits_in, lens);
  const int64_t *sv = slots.data_ptr<int64_t>(), *lv = lens.data_ptr<int64_t>();
  const int64_t* abv = all_bits.numel() ? all_bits.data_ptr<int64_t>() : nullptr;
  std::vector<int64_t> rows(static_cast<size_t>(R)), keys(static_cast<size_t>(R));
  std::vector<int64_t> bits(abv != nullptr ? static_cast<size_t>(R) : 0), cols(static_cast<size_t>(R));
  for (int64_t t = 0; t < R; ++t) {
    TORCH_CHECK(sv[t] >= 0 && sv[t] < T, "slots out of range");
    const int64_t row = row_lo + sv[t] / Q, n = lv[sv[t]];
    TORCH_CHECK(row >= 0 && row < k_cache.size(0) && n >= 0 && n <= L, "rows or lens out of range");
    rows[static_cast<size_t>(t)] = row;
    keys[static_cast<size_t>(t)] = n;
    // Its own K/V go to its last visible column: n - 1, or a tree node's highest set bit.
    const uint64_t b = abv != nullptr ? static_cast<uint64_t>(abv[sv[t]]) : 0;
    if (abv != nullptr) bits[static_cast<size_t>(t)] = static_cast<int64_t>(b);
    cols[static_cast<size_t>(t)] =
        b == 0 ? n - 1 : n - __builtin_popcountll(b) + 63 - __builtin_clzll(b);
  }

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
      const int64_t col = cols[static_cast<size_t>(t)], row = rows[static_cast<size_t>(t)];
      for (int64_t hd = 0; hd < kvH && col >= 0; ++hd) {  // a padding token writes no K/V
        const int64_t at = ((row * kvH + hd) * L + col) * D;
        std::memcpy(kc + at, tok + (num_heads + hd) * D, D * sizeof(uint16_t));
        std::memcpy(vc + at, tok + (num_heads + kvH + hd) * D, D * sizeof(uint16_t));
      }
    }
  });
  auto attn = torch::empty({R, num_heads * D}, x.options());
  attend_tokens(qv, width, kc, vc, rows.data(), keys.data(), bits.empty() ? nullptr : bits.data(),
                R, kvH, G, D, L, scale,
                bf16_data(attn), num_heads * D);
  const auto x1 = add_bf16(x, product(o_w, attn, own_rows[1]));

  // MLP block: norm, gate/up, silu(gate) * up (torch's ops), down, residual.
  const auto gu = product(gate_up_w, rms_norm_bf16(x1, post_norm, eps), own_rows[2]);
  const int64_t I = gu.size(1) / 2;
  const auto act = (at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I)).contiguous();
  return add_bf16(x1, product(down_w, act, own_rows[3]));
}
