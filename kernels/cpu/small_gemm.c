/* Small-batch fp32 products on AVX-512: out[m, n] = sum_k x[m, k] * w[n, k] for 1..8 rows of x.
 *
 * w is row-major [n_out, k] (the checkpoint's layout), x [m, k] and out [m, n_out] are contiguous. Four output
 * rows are computed at once: their weights are four adjacent rows of w, read once, front to back, and each is
 * multiplied into every row of x (held in L1), so m rows cost about one pass over the weight instead of m.
 * Software prefetch runs PREFETCH_FLOATS ahead on each of the four streams (a slower loop otherwise lets the
 * hardware prefetcher fall behind at 4+ rows). Built at first use by kernels/cpu/small_gemm.py with
 * -O3 -march=native (included by small_gemm_op.cpp, which registers it as a torch operator); it refuses to build
 * without AVX-512F. */
#include <immintrin.h>
#include <stddef.h>

#ifndef __AVX512F__
#error "small_gemm needs AVX-512F"
#endif

#define PREFETCH_FLOATS 512

static inline void prefetch4(const float *w, size_t k_len, size_t k) {
  _mm_prefetch((const char *)(w + k + PREFETCH_FLOATS), _MM_HINT_T0);
  _mm_prefetch((const char *)(w + k_len + k + PREFETCH_FLOATS), _MM_HINT_T0);
  _mm_prefetch((const char *)(w + 2 * k_len + k + PREFETCH_FLOATS), _MM_HINT_T0);
  _mm_prefetch((const char *)(w + 3 * k_len + k + PREFETCH_FLOATS), _MM_HINT_T0);
}

/* Four output rows (w: their first weight row) for MM rows of x; out: the first of the four columns of row 0. */
#define FOUR_ROWS_KERNEL(MM)                                                                                   \
  static void four_rows_##MM(const float *x, const float *w, size_t k_len, float *out, size_t n_out) {       \
    __m512 acc[MM][4];                                                                                         \
    for (int m = 0; m < MM; m++)                                                                               \
      for (int r = 0; r < 4; r++) acc[m][r] = _mm512_setzero_ps();                                             \
    size_t k = 0;                                                                                              \
    for (; k + 16 <= k_len; k += 16) {                                                                         \
      prefetch4(w, k_len, k);                                                                                  \
      __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + k_len + k);                                 \
      __m512 w2 = _mm512_loadu_ps(w + 2 * k_len + k), w3 = _mm512_loadu_ps(w + 3 * k_len + k);                 \
      for (int m = 0; m < MM; m++) {                                                                           \
        __m512 xv = _mm512_loadu_ps(x + m * k_len + k);                                                        \
        acc[m][0] = _mm512_fmadd_ps(w0, xv, acc[m][0]);                                                        \
        acc[m][1] = _mm512_fmadd_ps(w1, xv, acc[m][1]);                                                        \
        acc[m][2] = _mm512_fmadd_ps(w2, xv, acc[m][2]);                                                        \
        acc[m][3] = _mm512_fmadd_ps(w3, xv, acc[m][3]);                                                        \
      }                                                                                                        \
    }                                                                                                          \
    for (int m = 0; m < MM; m++)                                                                               \
      for (int r = 0; r < 4; r++) {                                                                            \
        float s = _mm512_reduce_add_ps(acc[m][r]);                                                             \
        for (size_t kk = k; kk < k_len; kk++) s += w[r * k_len + kk] * x[m * k_len + kk];                      \
        out[m * n_out + r] = s;                                                                                \
      }                                                                                                        \
  }
FOUR_ROWS_KERNEL(1)
FOUR_ROWS_KERNEL(2)
FOUR_ROWS_KERNEL(3)
FOUR_ROWS_KERNEL(4)

static void four_rows(const float *x, size_t m_rows, const float *w, size_t k_len, float *out, size_t n_out) {
  size_t m = 0;
  for (; m + 4 <= m_rows; m += 4) four_rows_4(x + m * k_len, w, k_len, out + m * n_out, n_out);
  switch (m_rows - m) {
    case 3: four_rows_3(x + m * k_len, w, k_len, out + m * n_out, n_out); break;
    case 2: four_rows_2(x + m * k_len, w, k_len, out + m * n_out, n_out); break;
    case 1: four_rows_1(x + m * k_len, w, k_len, out + m * n_out, n_out); break;
  }
}

/* Output columns [n_begin, n_end) of out [m_rows, n_out] = x [m_rows, k_len] @ w[n_out, k_len]^T. */
void small_gemm(const float *x, size_t m_rows, const float *w, size_t n_out, size_t k_len, float *out,
                size_t n_begin, size_t n_end) {
  size_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) four_rows(x, m_rows, w + n * k_len, k_len, out + n, n_out);
  for (; n < n_end; n++)
    for (size_t m = 0; m < m_rows; m++) {
      float s = 0.0f;
      for (size_t k = 0; k < k_len; k++) s += w[n * k_len + k] * x[m * k_len + k];
      out[m * n_out + n] = s;
    }
}
