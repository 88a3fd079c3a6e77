// The operator `kdamesh_cpu::small_gemm(Tensor x, Tensor w) -> Tensor` over the kernel in small_gemm.c: x [rows, in]
// fp32 (made contiguous), w [out, in] fp32 row-major contiguous -> [rows, out]. The caller (small_gemm.py `runs`)
// defines the schema and checks dtypes, layout and row count; this file only checks what would make the kernel read out of bounds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "small_gemm.c"

static constexpr int64_t kMinBlockFloats = 1 << 17;  // 512 KB of weight per thread's share, at least

static at::Tensor small_gemm_cpu(const at::Tensor &x, const at::Tensor &w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_gemm: shapes ", x.sizes(), " x ",
              w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "small_gemm: fp32 and a contiguous weight");
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({xc.size(0), w.size(0)}, xc.options());
  const float *x_data = xc.data_ptr<float>(), *w_data = w.data_ptr<float>();
  float *out_data = out.data_ptr<float>();
  const int64_t rows = xc.size(0), n_out = w.size(0), k_len = w.size(1);
  // Output rows split over torch's threads in blocks of four, each block at least kMinBlockFloats of weight, so a
  // small product runs on the calling thread alone (a fork costs more than it saves).
  const int64_t blocks = (n_out + 3) / 4, grain = std::max<int64_t>(1, kMinBlockFloats / (4 * k_len));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    small_gemm(x_data, rows, w_data, n_out, k_len, out_data, begin * 4, std::min(end * 4, n_out));
  });
  return out;
}

TORCH_LIBRARY_IMPL(kdamesh_cpu, CPU, m) { m.impl("small_gemm", &small_gemm_cpu); }
