/* Small-batch fp32 products on AVX-512 or AVX2+FMA: out[m, n] = sum_k x[m, k] * wt[k, n] for 1..8 rows of x.
 *
 * wt is the weight input-major, [k_len, n_out] contiguous (a linear's `weight.t()`), x [m, k_len] and
 * out [m, n_out] contiguous. The product runs as axpys: for a block of up to BLOCK_COLUMNS outputs, ROWS_AT_ONCE
 * weight rows k..k+7 (each a contiguous run of the block's columns) are read once and multiplied into every row of x,
 * the block's outputs of all rows staying in L1/L2, so m rows cost one pass over the weight from memory instead
 * of m, and no output needs a horizontal sum (short rows cost nothing extra). Every output is the same sequence
 * of fused multiply-adds, k = 0, 1, 2, ... in order, whatever the number of rows, so a row's result does not
 * depend on the rows beside it. Rows whose outputs fit STREAM_MAX_FLOATS, computed whole by one thread, take the
 * weight one row at a time instead (stream_MM: in memory order, the same multiply-adds). Built at first use
 * by kernels/cpu/small_gemm.py with -O3 -march=native (included by small_gemm_op.cpp, which registers it as torch
 * operators); it refuses to build on a CPU with neither AVX-512F nor AVX2 and FMA. */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>

#if defined(__AVX512F__)
typedef __m512 vec_t;
#define VEC_FLOATS 16
#define vec_zero() _mm512_setzero_ps()
#define vec_load(p) _mm512_loadu_ps(p)
#define vec_store(p, v) _mm512_storeu_ps(p, v)
#define vec_broadcast(p) _mm512_set1_ps(*(p))
#define vec_fmadd(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vec_mul(a, b) _mm512_mul_ps(a, b)
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec_t;
#define VEC_FLOATS 8
#define vec_zero() _mm256_setzero_ps()
#define vec_load(p) _mm256_loadu_ps(p)
#define vec_store(p, v) _mm256_storeu_ps(p, v)
#define vec_broadcast(p) _mm256_broadcast_ss(p)
#define vec_fmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vec_mul(a, b) _mm256_mul_ps(a, b)
#else
#error "small_gemm needs AVX-512F, or AVX2 and FMA"
#endif

#define BLOCK_COLUMNS 8192 /* outputs per pass over the weight rows: 32 KB of each row of out */
#define ROWS_AT_ONCE 8     /* weight rows multiplied in per round trip of an output vector through L1 */

/* out[m, n0:n1] = x[m, :] @ wt[:, n0:n1] for MM rows, (n1 - n0) a multiple of VEC_FLOATS. */
#define AXPY_KERNEL(MM)                                                                                          \
  static void axpy_##MM(const float *__restrict x, const float *__restrict wt, size_t k_len, size_t n_out,       \
                        float *__restrict out, size_t n0, size_t n1) {                                           \
    for (int m = 0; m < MM; m++)                                                                                 \
      for (size_t j = n0; j < n1; j += VEC_FLOATS) vec_store(out + m * n_out + j, vec_zero());                   \
    size_t k = 0;                                                                                                \
    for (; k + ROWS_AT_ONCE <= k_len; k += ROWS_AT_ONCE) {                                                      \
      const float *w = wt + k * n_out;                                                                           \
      for (size_t j = n0; j < n1; j += VEC_FLOATS) {                                                             \
        vec_t wv[ROWS_AT_ONCE];                                                                                  \
        for (int r = 0; r < ROWS_AT_ONCE; r++) wv[r] = vec_load(w + r * n_out + j);                              \
        for (int m = 0; m < MM; m++) {                                                                           \
          const float *xm = x + m * k_len + k;                                                                   \
          float *o = out + m * n_out + j;                                                                        \
          vec_t acc = vec_load(o);                                                                               \
          for (int r = 0; r < ROWS_AT_ONCE; r++) acc = vec_fmadd(wv[r], vec_broadcast(xm + r), acc);             \
          vec_store(o, acc);                                                                                     \
        }                                                                                                        \
      }                                                                                                          \
    }                                                                                                            \
    for (; k < k_len; k++)                                                                                       \
      for (size_t j = n0; j < n1; j += VEC_FLOATS) {                                                             \
        vec_t a = vec_load(wt + k * n_out + j);                                                                  \
        for (int m = 0; m < MM; m++) {                                                                           \
          float *o = out + m * n_out + j;                                                                        \
          vec_store(o, vec_fmadd(a, vec_broadcast(x + m * k_len + k), vec_load(o)));                             \
        }                                                                                                        \
      }                                                                                                          \
  }
AXPY_KERNEL(1)
AXPY_KERNEL(2)
AXPY_KERNEL(3)
AXPY_KERNEL(4)
AXPY_KERNEL(5)
AXPY_KERNEL(6)
AXPY_KERNEL(7)
AXPY_KERNEL(8)

#define STREAM_MAX_FLOATS 4096 /* rows x outputs of a streamed product: its outputs stay in L1 */
#define STREAM_ROW_PAD 16      /* floats between rows of a multi-row stream's outputs (see stream_MM) */

/* out[m, n0:n1] = x[m, :] @ wt[:, n0:n1] for MM rows, one weight row at a time: with n0 = 0 and n1 = n_out the
 * weight is read in memory order, one stream the hardware prefetcher follows (eight interleaved rows of a narrow
 * weight are too short for it to learn); the outputs stay in L1. Two or more rows accumulate in a local buffer
 * whose rows are STREAM_ROW_PAD floats apart, copied out at the end: rows of out a multiple of 4 KB apart (1,024
 * outputs) alias in the load/store unit, and [4, 768] x [768, 1024] ran 464 us in place against 137 for one row. The same multiply-adds in the same order as
 * axpy_MM, so the result is bitwise the same. Keep the form: the broadcasts held in an array and the inner loop
 * over rows keep gcc -O3 from running the nest column-first (written as a plain k/j nest, the one-row build ran
 * [1, 768] x [768, 256] in 84 us instead of 52, as slow as axpy_1). Measured up to 4,096 outputs in all: 4 x 1,440
 * streamed ran 2x slower than axpy_4. */
#define STREAM_KERNEL(MM)                                                                                        \
  static void stream_##MM(const float *__restrict x, const float *__restrict wt, size_t k_len, size_t n_out,     \
                          float *__restrict out, size_t n0, size_t n1) {                                         \
    const size_t stride = MM == 1 ? n_out : n1 + STREAM_ROW_PAD;                                               \
    float padded[MM == 1 ? 1 : MM * (STREAM_MAX_FLOATS / MM + STREAM_ROW_PAD)];                                \
    float *acc = MM == 1 ? out : padded;                                                                         \
    for (int m = 0; m < MM; m++)                                                                                 \
      for (size_t j = n0; j < n1; j += VEC_FLOATS) vec_store(acc + m * stride + j, vec_zero());                  \
    for (size_t k = 0; k < k_len; k++) {                                                                         \
      const float *w = wt + k * n_out;                                                                           \
      vec_t xb[MM];                                                                                              \
      for (int m = 0; m < MM; m++) xb[m] = vec_broadcast(x + m * k_len + k);                                     \
      for (size_t j = n0; j < n1; j += VEC_FLOATS) {                                                             \
        vec_t wv = vec_load(w + j);                                                                              \
        for (int m = 0; m < MM; m++) {                                                                           \
          float *o = acc + m * stride + j;                                                                       \
          vec_store(o, vec_fmadd(wv, xb[m], vec_load(o)));                                                       \
        }                                                                                                        \
      }                                                                                                          \
    }                                                                                                            \
    if (MM > 1)                                                                                                  \
      for (int m = 0; m < MM; m++)                                                                               \
        for (size_t j = n0; j < n1; j += VEC_FLOATS) vec_store(out + m * n_out + j, vec_load(acc + m * stride + j)); \
  }
STREAM_KERNEL(1)
STREAM_KERNEL(2)
STREAM_KERNEL(3)
STREAM_KERNEL(4)
STREAM_KERNEL(5)
STREAM_KERNEL(6)
STREAM_KERNEL(7)
STREAM_KERNEL(8)

typedef void (*axpy_fn)(const float *, const float *, size_t, size_t, float *, size_t, size_t);
static const axpy_fn AXPY[9] = {0, axpy_1, axpy_2, axpy_3, axpy_4, axpy_5, axpy_6, axpy_7, axpy_8};
static const axpy_fn STREAM[9] = {0, stream_1, stream_2, stream_3, stream_4, stream_5, stream_6, stream_7, stream_8};

/* Output columns [n_begin, n_end) of out [m_rows, n_out] = x [m_rows, k_len] @ wt [k_len, n_out], 1 <= m_rows <= 8;
 * n_begin a multiple of VEC_FLOATS. Whole rows of narrow outputs stream the weight (stream_MM), else the eight-row
 * axpys. Columns past the last whole vector are scalar, in the same k order. */
void small_gemm(const float *x, size_t m_rows, const float *wt, size_t n_out, size_t k_len, float *out,
                size_t n_begin, size_t n_end) {
  size_t vec_end = n_begin + (n_end - n_begin) / VEC_FLOATS * VEC_FLOATS;
  if (n_begin == 0 && n_end == n_out && m_rows * n_out <= STREAM_MAX_FLOATS)
    STREAM[m_rows](x, wt, k_len, n_out, out, 0, vec_end);
  else
    for (size_t n = n_begin; n < vec_end; n += BLOCK_COLUMNS)
      AXPY[m_rows](x, wt, k_len, n_out, out, n, n + BLOCK_COLUMNS < vec_end ? n + BLOCK_COLUMNS : vec_end);
  for (size_t n = vec_end; n < n_end; n++)
    for (size_t m = 0; m < m_rows; m++) {
      float s = 0.0f;
      for (size_t k = 0; k < k_len; k++) s = fmaf(wt[k * n_out + n], x[m * k_len + k], s);
      out[m * n_out + n] = s;
    }
}
