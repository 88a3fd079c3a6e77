// The operators over the kernel in small_gemm.c; their callers (kernels/cpu/small_gemm.py, expert_gemm.py) define
// the schemas and check dtypes, layouts and shapes; this file checks again whatever would make the kernel read out
// of bounds.
// - `kdamesh_cpu::small_gemm(Tensor x, Tensor w) -> Tensor`: x [rows, in] fp32 (made contiguous), w [out, in] fp32
//   stored input-major (`w.t()` contiguous) -> [rows, out], 1..8 rows.
// - `kdamesh_cpu::expert_gemm(Tensor x, Tensor w, Tensor ids) -> Tensor`: x [T, K], w [E, K, N] (each expert
//   input-major), ids [T, c] int64 in [0, E) -> [T, c, N], row (t, j) = x[t] @ w[ids[t, j]].
// - `kdamesh_cpu::expert_gemm_sum(Tensor h, Tensor w, Tensor ids) -> Tensor`: h [T, c, K], w [E, K, N], ids [T, c]
//   -> [T, N], row t = sum over j of h[t, j] @ w[ids[t, j]], the choices added in order j = 0, 1, ...
// - `kdamesh_cpu::kda_decode_(Tensor(a!) pool, Tensor idx, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta,
//   float scale) -> Tensor`: pool [S, H, K, V] fp32 contiguous, idx [N] int64 distinct slots in [0, S), q, k, g
//   [N, H, K], v [N, H, V], beta [N, H] fp32 -> o [N, H, V]; the states pool[idx[n]] step in place (kda_step.c).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "small_gemm.c"
#include "kda_step.c"

static constexpr int64_t kMinShareFloats = 1 << 17;  // 512 KB of weight per thread's share, at least
static constexpr int64_t kColumnUnit = 16;           // threads split the outputs in 64-byte runs of a row of out

static at::Tensor small_gemm_cpu(const at::Tensor &x, const at::Tensor &w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_gemm: shapes ", x.sizes(), " x ",
              w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.t().is_contiguous(),
              "small_gemm: fp32 and an input-major weight (w.t() contiguous), got strides ", w.strides());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "small_gemm: 1..8 rows, got ", x.size(0));
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({xc.size(0), w.size(0)}, xc.options());
  const float *x_data = xc.data_ptr<float>(), *wt_data = w.data_ptr<float>();
  float *out_data = out.data_ptr<float>();
  const int64_t rows = xc.size(0), n_out = w.size(0), k_len = w.size(1);
  // Output columns split over torch's threads in kColumnUnit runs, each share at least kMinShareFloats of weight,
  // so a small product runs on the calling thread alone (a fork costs more than it saves).
  const int64_t units = (n_out + kColumnUnit - 1) / kColumnUnit;
  const int64_t grain = std::max<int64_t>(1, kMinShareFloats / (kColumnUnit * std::max<int64_t>(k_len, 1)));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    small_gemm(x_data, rows, wt_data, n_out, k_len, out_data, begin * kColumnUnit,
               std::min(end * kColumnUnit, n_out));
  });
  return out;
}

static void check_experts(const at::Tensor &x, const at::Tensor &w, const at::Tensor &ids, int64_t rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 3 && w.is_contiguous(),
              "expert_gemm: fp32 and contiguous experts [E, K, N], got ", w.sizes(), " strides ", w.strides());
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == rows, "expert_gemm: ids [T, c] ",
              "int64 for ", rows, " rows, got ", ids.sizes());
  const at::Tensor idc = ids.contiguous();
  const int64_t *id_data = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < idc.numel(); i++)
    TORCH_CHECK(id_data[i] >= 0 && id_data[i] < w.size(0), "expert_gemm: expert id ", id_data[i], " outside [0, ",
                w.size(0), ")");
}

static at::Tensor expert_gemm_cpu(const at::Tensor &x, const at::Tensor &w, const at::Tensor &ids) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(1), "expert_gemm: shapes ", x.sizes(), " x ",
              w.sizes());
  check_experts(x, w, ids, x.size(0));
  at::Tensor xc = x.contiguous(), idc = ids.contiguous();
  const int64_t rows = xc.size(0), choices = idc.size(1), k_len = w.size(1), n_out = w.size(2);
  at::Tensor out = at::empty({rows, choices, n_out}, xc.options());
  const float *x_data = xc.data_ptr<float>(), *w_data = w.data_ptr<float>();
  const int64_t *id_data = idc.data_ptr<int64_t>();
  float *out_data = out.data_ptr<float>();
  // Each (row, choice) reads one expert's K x N weight: the assignments are split over threads, a share at least
  // kMinShareFloats of weight.
  const int64_t grain = std::max<int64_t>(1, kMinShareFloats / std::max<int64_t>(k_len * n_out, 1));
  at::parallel_for(0, rows * choices, grain, [&](int64_t begin, int64_t end) {
    for (int64_t a = begin; a < end; a++)
      small_gemm(x_data + (a / choices) * k_len, 1, w_data + id_data[a] * k_len * n_out, n_out, k_len,
                 out_data + a * n_out, 0, n_out);
  });
  return out;
}

static at::Tensor expert_gemm_sum_cpu(const at::Tensor &h, const at::Tensor &w, const at::Tensor &ids) {
  TORCH_CHECK(h.dim() == 3 && w.dim() == 3 && h.size(2) == w.size(1) && h.size(1) == ids.size(-1),
              "expert_gemm_sum: shapes ", h.sizes(), " x ", w.sizes(), " with ids ", ids.sizes());
  check_experts(h, w, ids, h.size(0));
  at::Tensor hc = h.contiguous(), idc = ids.contiguous();
  const int64_t rows = hc.size(0), choices = hc.size(1), k_len = w.size(1), n_out = w.size(2);
  at::Tensor out = at::empty({rows, n_out}, hc.options());
  const float *h_data = hc.data_ptr<float>(), *w_data = w.data_ptr<float>();
  const int64_t *id_data = idc.data_ptr<int64_t>();
  float *out_data = out.data_ptr<float>();
  // Output columns split over threads (each share reads its columns of every chosen expert, at least
  // kMinShareFloats of weight); a choice's product lands in a scratch row and is added in choice order.
  const int64_t units = (n_out + kColumnUnit - 1) / kColumnUnit;
  const int64_t grain = std::max<int64_t>(1, kMinShareFloats / (kColumnUnit * std::max<int64_t>(choices * k_len, 1)));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kColumnUnit, n1 = std::min(end * kColumnUnit, n_out);
    std::vector<float> scratch(n_out);
    for (int64_t t = 0; t < rows; t++) {
      float *o = out_data + t * n_out;
      for (int64_t j = 0; j < choices; j++) {
        const int64_t a = t * choices + j;
        float *target = j == 0 ? o : scratch.data();
        small_gemm(h_data + a * k_len, 1, w_data + id_data[a] * k_len * n_out, n_out, k_len, target, n0, n1);
        if (j > 0)
          for (int64_t n = n0; n < n1; n++) o[n] += scratch[n];
      }
    }
  });
  return out;
}

static at::Tensor kda_decode_cpu(at::Tensor &pool, const at::Tensor &idx, const at::Tensor &q, const at::Tensor &k,
                                 const at::Tensor &v, const at::Tensor &g, const at::Tensor &beta, double scale) {
  TORCH_CHECK(pool.dim() == 4 && pool.scalar_type() == at::kFloat && pool.is_contiguous(),
              "kda_decode_: a contiguous fp32 pool [S, H, K, V], got ", pool.sizes(), " ", pool.scalar_type());
  const int64_t slots = pool.size(0), heads = pool.size(1), k_len = pool.size(2), v_len = pool.size(3);
  const int64_t n = idx.numel();
  TORCH_CHECK(v_len % VEC_FLOATS == 0, "kda_decode_: value width ", v_len, " not a multiple of ", VEC_FLOATS);
  for (const at::Tensor *t : {&q, &k, &g})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->sizes() == at::IntArrayRef({n, heads, k_len}),
                "kda_decode_: q, k, g fp32 [", n, ", ", heads, ", ", k_len, "], got ", t->sizes());
  TORCH_CHECK(v.scalar_type() == at::kFloat && v.sizes() == at::IntArrayRef({n, heads, v_len}),
              "kda_decode_: v fp32 [", n, ", ", heads, ", ", v_len, "], got ", v.sizes());
  TORCH_CHECK(beta.scalar_type() == at::kFloat && beta.sizes() == at::IntArrayRef({n, heads}),
              "kda_decode_: beta fp32 [", n, ", ", heads, "], got ", beta.sizes());
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 1, "kda_decode_: idx [N] int64, got ", idx.sizes());
  const at::Tensor idc = idx.contiguous(), qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(),
                   gc = g.contiguous(), bc = beta.contiguous();
  const int64_t *slot = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; i++)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < slots, "kda_decode_: slot ", slot[i], " outside [0, ", slots, ")");
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

TORCH_LIBRARY_IMPL(kdamesh_cpu, CPU, m) {
  m.impl("small_gemm", &small_gemm_cpu);
  m.impl("expert_gemm", &expert_gemm_cpu);
  m.impl("expert_gemm_sum", &expert_gemm_sum_cpu);
  m.impl("kda_decode_", &kda_decode_cpu);
}
