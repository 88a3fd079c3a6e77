// The operator `kdamesh_cpu::small_gemm(Tensor x, Tensor w) -> Tensor` over the kernel in small_gemm.c: x [rows, in]
// fp32 (made contiguous), w [out, in] fp32 stored input-major (`w.t()` contiguous) -> [rows, out], 1..8 rows. The
// caller (small_gemm.py `runs`) defines the schema and checks dtypes, layout and row count; this file checks again
// whatever would make the kernel read out of bounds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "small_gemm.c"

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

TORCH_LIBRARY_IMPL(kdamesh_cpu, CPU, m) { m.impl("small_gemm", &small_gemm_cpu); }
