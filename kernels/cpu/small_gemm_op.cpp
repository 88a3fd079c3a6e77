// The operators over the kernel in small_gemm.c; their callers (kernels/cpu/small_gemm.py, expert_gemm.py) define
// the schemas and check dtypes, layouts and shapes; this file checks again whatever would make the kernel read out
// of bounds.
// - `kdamesh_cpu::small_gemm(Tensor x, Tensor w) -> Tensor`: x [rows, in] fp32 (made contiguous), w [out, in] fp32
//   or bf16 (widened exactly in the kernel) stored input-major (`w.t()` contiguous) -> [rows, out], 1..8 rows.
// - `kdamesh_cpu::expert_gemm(Tensor x, Tensor w, Tensor ids) -> Tensor`: x [T, K], w [E, K, N] (each expert
//   input-major; fp32 or bf16), ids [T, c] int64 in [0, E) -> [T, c, N], row (t, j) = x[t] @ w[ids[t, j]].
// - `kdamesh_cpu::expert_gemm_sum(Tensor h, Tensor w, Tensor ids) -> Tensor`: h [T, c, K], w [E, K, N], ids [T, c]
//   -> [T, N], row t = sum over j of h[t, j] @ w[ids[t, j]], the choices added in order j = 0, 1, ...
// - `kdamesh_cpu::kda_decode_(Tensor(a!) pool, Tensor idx, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta,
//   float scale) -> Tensor`: pool [S, H, K, V] fp32 contiguous, idx [N] int64 distinct slots in [0, S), q, k, g
//   [N, H, K], v [N, H, V], beta [N, H] fp32 -> o [N, H, V]; the states pool[idx[n]] step in place (kda_step.c).
// - `kdamesh_cpu::kda_verify_(Tensor(a!) pool, Tensor in_idx, Tensor out_slots, Tensor q, Tensor k, Tensor v,
//   Tensor g, Tensor beta, float scale) -> Tensor`: N sequences of Q tokens each (q ... [N*Q, ...]) step from
//   pool[in_idx[n]], the state after token t written to pool[out_slots[n*Q + t]]; in-slots untouched unless an
//   out-slot names one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <vector>

#include "small_gemm.c"
#include "kda_step.c"

// Weight elements per thread's share, at least (64 KB of fp32, 32 KB of bf16). 2^17 ran most of demo-k3's products
// on one thread at two; 2^14 took its compiled batch-1 step at two threads from 1.81 / 1.86 ms to 1.78 / 1.68
// (2^12: 1.72 / 1.72; Intel Xeon, wave 3 session 16). One thread never forks, whatever the share.
static constexpr int64_t kMinShareFloats = 1 << 14;
static constexpr int64_t kColumnUnit = 16;           // threads split the outputs in 64-byte runs of a row of out

// The kernel for the weight's element type (small_gemm.c): fp32, or bf16 widened exactly as it is loaded.
static inline void product(const float *x, size_t m, const float *wt, size_t n_out, size_t k_len, float *out,
                           size_t n_begin, size_t n_end) {
  small_gemm_f32(x, m, wt, n_out, k_len, out, n_begin, n_end);
}
static inline void product(const float *x, size_t m, const uint16_t *wt, size_t n_out, size_t k_len, float *out,
                           size_t n_begin, size_t n_end) {
  small_gemm_bf16(x, m, wt, n_out, k_len, out, n_begin, n_end);
}

static bool is_weight_type(const at::Tensor &w) {
  return w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16;
}

// Calls fn with the weight's data as `const float *` or `const uint16_t *` (bf16's bits).
template <typename Fn>
static void with_weight_data(const at::Tensor &w, Fn fn) {
  if (w.scalar_type() == at::kBFloat16)
    fn(reinterpret_cast<const uint16_t *>(w.data_ptr<at::BFloat16>()));
  else
    fn(w.data_ptr<float>());
}

static at::Tensor small_gemm_cpu(const at::Tensor &x, const at::Tensor &w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_gemm: shapes ", x.sizes(), " x ",
              w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && is_weight_type(w) && w.t().is_contiguous(),
              "small_gemm: fp32 x, an fp32 or bf16 input-major weight (w.t() contiguous), got ", w.scalar_type(),
              " strides ", w.strides());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "small_gemm: 1..8 rows, got ", x.size(0));
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({xc.size(0), w.size(0)}, xc.options());
  const float *x_data = xc.data_ptr<float>();
  float *out_data = out.data_ptr<float>();
  const int64_t rows = xc.size(0), n_out = w.size(0), k_len = w.size(1);
  // Output columns split over torch's threads in kColumnUnit runs, each share at least kMinShareFloats of weight,
  // so a small product runs on the calling thread alone (a fork would cost more than it saves).
  const int64_t units = (n_out + kColumnUnit - 1) / kColumnUnit;
  const int64_t grain = std::max<int64_t>(1, kMinShareFloats / (kColumnUnit * std::max<int64_t>(k_len, 1)));
  with_weight_data(w, [&](const auto *wt_data) {
    at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
      product(x_data, rows, wt_data, n_out, k_len, out_data, begin * kColumnUnit, std::min(end * kColumnUnit, n_out));
    });
  });
  return out;
}

static void check_experts(const at::Tensor &x, const at::Tensor &w, const at::Tensor &ids, int64_t rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && is_weight_type(w) && w.dim() == 3 && w.is_contiguous(),
              "expert_gemm: fp32 x and contiguous fp32 or bf16 experts [E, K, N], got ", w.scalar_type(), " ",
              w.sizes(), " strides ", w.strides());
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == rows, "expert_gemm: ids [T, c] ",
              "int64 for ", rows, " rows, got ", ids.sizes());
  const at::Tensor idc = ids.contiguous();
  const int64_t *id_data = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < idc.numel(); i++)
    TORCH_CHECK(id_data[i] >= 0 && id_data[i] < w.size(0), "expert_gemm: expert id ", id_data[i], " outside [0, ",
                w.size(0), ")");
}

// The assignments (flat indices a = t * c + j) grouped by expert, in order within an expert, each group at most
// kMaxRows: a group's rows read their expert's weight once (two tokens of a verification that chose one expert).
static std::vector<std::vector<int64_t>> expert_groups(const int64_t *ids, int64_t n_assign) {
  static constexpr int64_t kMaxRows = 8;
  std::vector<std::vector<int64_t>> groups;
  std::vector<int64_t> order(n_assign);
  for (int64_t a = 0; a < n_assign; a++) order[a] = a;
  std::stable_sort(order.begin(), order.end(), [&](int64_t l, int64_t r) { return ids[l] < ids[r]; });
  for (int64_t i = 0; i < n_assign; i++) {
    if (i == 0 || ids[order[i]] != ids[order[i - 1]] || (int64_t)groups.back().size() == kMaxRows)
      groups.emplace_back();
    groups.back().push_back(order[i]);
  }
  return groups;
}

// rows_of(a) -> the input row of assignment a; writes assignment a's product to products + a * n_out. Groups split
// over threads, a share at least kMinShareFloats of weight. A row's result is the same sequence of multiply-adds
// whatever its group (small_gemm.c), so grouping never changes a value.
template <typename WT, typename RowOf>
static void grouped_products(const WT *w_data, const int64_t *ids, int64_t n_assign, int64_t k_len,
                             int64_t n_out, RowOf rows_of, float *products) {
  const auto groups = expert_groups(ids, n_assign);
  const int64_t grain = std::max<int64_t>(1, kMinShareFloats / std::max<int64_t>(k_len * n_out, 1));
  at::parallel_for(0, (int64_t)groups.size(), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> x_rows(8 * k_len), out_rows(8 * n_out);
    for (int64_t g = begin; g < end; g++) {
      const auto &group = groups[g];
      const int64_t m = group.size();
      for (int64_t r = 0; r < m; r++) std::copy_n(rows_of(group[r]), k_len, x_rows.data() + r * k_len);
      product(x_rows.data(), m, w_data + ids[group[0]] * k_len * n_out, n_out, k_len, out_rows.data(), 0,
                 n_out);
      for (int64_t r = 0; r < m; r++) std::copy_n(out_rows.data() + r * n_out, n_out, products + group[r] * n_out);
    }
  });
}

static at::Tensor expert_gemm_cpu(const at::Tensor &x, const at::Tensor &w, const at::Tensor &ids) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(1), "expert_gemm: shapes ", x.sizes(), " x ",
              w.sizes());
  check_experts(x, w, ids, x.size(0));
  at::Tensor xc = x.contiguous(), idc = ids.contiguous();
  const int64_t rows = xc.size(0), choices = idc.size(1), k_len = w.size(1), n_out = w.size(2);
  at::Tensor out = at::empty({rows, choices, n_out}, xc.options());
  const float *x_data = xc.data_ptr<float>();
  with_weight_data(w, [&](const auto *w_data) {
    grouped_products(w_data, idc.data_ptr<int64_t>(), rows * choices, k_len, n_out,
                     [&](int64_t a) { return x_data + (a / choices) * k_len; }, out.data_ptr<float>());
  });
  return out;
}

static at::Tensor expert_gemm_sum_cpu(const at::Tensor &h, const at::Tensor &w, const at::Tensor &ids) {
  TORCH_CHECK(h.dim() == 3 && w.dim() == 3 && h.size(2) == w.size(1) && h.size(1) == ids.size(-1),
              "expert_gemm_sum: shapes ", h.sizes(), " x ", w.sizes(), " with ids ", ids.sizes());
  check_experts(h, w, ids, h.size(0));
  at::Tensor hc = h.contiguous(), idc = ids.contiguous();
  const int64_t rows = hc.size(0), choices = hc.size(1), k_len = w.size(1), n_out = w.size(2);
  at::Tensor products = at::empty({rows, choices, n_out}, hc.options());
  const float *h_data = hc.data_ptr<float>();
  float *p_data = products.data_ptr<float>();
  with_weight_data(w, [&](const auto *w_data) {
    grouped_products(w_data, idc.data_ptr<int64_t>(), rows * choices, k_len, n_out,
                     [&](int64_t a) { return h_data + a * k_len; }, p_data);
  });
  at::Tensor out = at::empty({rows, n_out}, hc.options());
  float *out_data = out.data_ptr<float>();
  for (int64_t t = 0; t < rows; t++) {  // a token's choices added in order j = 0, 1, ...
    float *o = out_data + t * n_out;
    std::copy_n(p_data + t * choices * n_out, n_out, o);
    for (int64_t j = 1; j < choices; j++)
      for (int64_t n = 0; n < n_out; n++) o[n] += p_data[(t * choices + j) * n_out + n];
  }
  return out;
}

// Checks a KDA step's operands against pool [S, H, K, V] for `rows` tokens; -> (heads, k_len, v_len).
static std::array<int64_t, 3> check_kda(const char *op, const at::Tensor &pool, int64_t rows, const at::Tensor &q,
                                        const at::Tensor &k, const at::Tensor &v, const at::Tensor &g,
                                        const at::Tensor &beta) {
  TORCH_CHECK(pool.dim() == 4 && pool.scalar_type() == at::kFloat && pool.is_contiguous(), op,
              ": a contiguous fp32 pool [S, H, K, V], got ", pool.sizes(), " ", pool.scalar_type());
  const int64_t heads = pool.size(1), k_len = pool.size(2), v_len = pool.size(3);
  TORCH_CHECK(v_len % VEC_FLOATS == 0, op, ": value width ", v_len, " not a multiple of ", VEC_FLOATS);
  for (const at::Tensor *t : {&q, &k, &g})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->sizes() == at::IntArrayRef({rows, heads, k_len}), op,
                ": q, k, g fp32 [", rows, ", ", heads, ", ", k_len, "], got ", t->sizes());
  TORCH_CHECK(v.scalar_type() == at::kFloat && v.sizes() == at::IntArrayRef({rows, heads, v_len}), op, ": v fp32 [",
              rows, ", ", heads, ", ", v_len, "], got ", v.sizes());
  TORCH_CHECK(beta.scalar_type() == at::kFloat && beta.sizes() == at::IntArrayRef({rows, heads}), op,
              ": beta fp32 [", rows, ", ", heads, "], got ", beta.sizes());
  return {heads, k_len, v_len};
}

static void check_slots(const char *op, const at::Tensor &slots, int64_t pool_slots) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, op, ": slots [N] int64, got ", slots.sizes());
  const int64_t *slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); i++)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < pool_slots, op, ": slot ", slot[i], " outside [0, ", pool_slots, ")");
}

static at::Tensor kda_decode_cpu(at::Tensor &pool, const at::Tensor &idx, const at::Tensor &q, const at::Tensor &k,
                                 const at::Tensor &v, const at::Tensor &g, const at::Tensor &beta, double scale) {
  const int64_t n = idx.numel();
  const auto [heads, k_len, v_len] = check_kda("kda_decode_", pool, n, q, k, v, g, beta);
  const at::Tensor idc = idx.contiguous(), qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(),
                   gc = g.contiguous(), bc = beta.contiguous();
  check_slots("kda_decode_", idc, pool.size(0));
  const int64_t *slot = idc.data_ptr<int64_t>();
  at::Tensor o = at::empty({n, heads, v_len}, vc.options());
  float *pool_data = pool.data_ptr<float>(), *o_data = o.data_ptr<float>();
  const float *q_data = qc.data_ptr<float>(), *k_data = kc.data_ptr<float>(), *v_data = vc.data_ptr<float>(),
              *g_data = gc.data_ptr<float>(), *b_data = bc.data_ptr<float>();
  // (sequence, head) pairs split over threads, a share at least kMinShareFloats / 2 of state.
  const int64_t grain = std::max<int64_t>(1, kMinShareFloats / 2 / std::max<int64_t>(k_len * v_len, 1));
  at::parallel_for(0, n * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(k_len + v_len);
    for (int64_t a = begin; a < end; a++) {
      const int64_t s = a / heads, h = a % heads;
      kda_step_head(pool_data + (slot[s] * heads + h) * k_len * v_len, k_len, v_len, q_data + a * k_len,
                    k_data + a * k_len, g_data + a * k_len, v_data + a * v_len, b_data[a], (float)scale,
                    scratch.data(), scratch.data() + k_len, o_data + a * v_len);
    }
  });
  return o;
}

// Verification: sequence n steps Q = rows / N tokens from pool[in_idx[n]]; the state after its token t goes to
// pool[out_slots[n * Q + t]]. Every in-state is copied before any out-slot is written (an out-slot may be an
// in-slot), then each (sequence, head) steps its Q tokens in a private copy that stays in L1/L2.
static at::Tensor kda_verify_cpu(at::Tensor &pool, const at::Tensor &in_idx, const at::Tensor &out_slots,
                                 const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &g,
                                 const at::Tensor &beta, double scale) {
  const int64_t rows = q.size(0), n = in_idx.numel();
  TORCH_CHECK(n > 0 && rows % n == 0 && out_slots.numel() == rows, "kda_verify_: ", rows, " tokens, ", n,
              " sequences, ", out_slots.numel(), " out-slots");
  const auto [heads, k_len, v_len] = check_kda("kda_verify_", pool, rows, q, k, v, g, beta);
  const at::Tensor inc = in_idx.contiguous(), outc = out_slots.contiguous();
  check_slots("kda_verify_", inc, pool.size(0));
  check_slots("kda_verify_", outc, pool.size(0));
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous(),
                   bc = beta.contiguous();
  const int64_t tokens = rows / n, head_floats = k_len * v_len;
  const int64_t *in = inc.data_ptr<int64_t>(), *out = outc.data_ptr<int64_t>();
  float *pool_data = pool.data_ptr<float>();
  at::Tensor states = at::empty({n, heads, k_len, v_len}, pool.options());  // the in-states, read first
  float *state_data = states.data_ptr<float>();
  for (int64_t s = 0; s < n; s++)
    std::copy_n(pool_data + in[s] * heads * head_floats, heads * head_floats, state_data + s * heads * head_floats);
  at::Tensor o = at::empty({rows, heads, v_len}, vc.options());
  float *o_data = o.data_ptr<float>();
  const float *q_data = qc.data_ptr<float>(), *k_data = kc.data_ptr<float>(), *v_data = vc.data_ptr<float>(),
              *g_data = gc.data_ptr<float>(), *b_data = bc.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kMinShareFloats / 2 / std::max<int64_t>(head_floats * tokens, 1));
  at::parallel_for(0, n * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(k_len + v_len);
    for (int64_t pair = begin; pair < end; pair++) {
      const int64_t s = pair / heads, h = pair % heads;
      float *S = state_data + pair * head_floats;
      for (int64_t t = 0; t < tokens; t++) {
        const int64_t a = (s * tokens + t) * heads + h;  // (token, head)
        kda_step_head(S, k_len, v_len, q_data + a * k_len, k_data + a * k_len, g_data + a * k_len,
                      v_data + a * v_len, b_data[a], (float)scale, scratch.data(), scratch.data() + k_len,
                      o_data + a * v_len);
        std::copy_n(S, head_floats, pool_data + (out[s * tokens + t] * heads + h) * head_floats);
      }
    }
  });
  return o;
}

TORCH_LIBRARY_IMPL(kdamesh_cpu, CPU, m) {
  m.impl("small_gemm", &small_gemm_cpu);
  m.impl("expert_gemm", &expert_gemm_cpu);
  m.impl("expert_gemm_sum", &expert_gemm_sum_cpu);
  m.impl("kda_decode_", &kda_decode_cpu);
  m.impl("kda_verify_", &kda_verify_cpu);
}
