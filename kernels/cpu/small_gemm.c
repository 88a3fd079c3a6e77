/* Small-batch fp32 products on AVX-512 or AVX2+FMA: out[m, n] = sum_k x[m, k] * wt[k, n] for 1..8 rows of x.
 *
 * wt is the weight input-major, [k_len, n_out] contiguous (a linear's `weight.t()`), x [m, k_len] and
 * out [m, n_out] contiguous. Two orders, both reading the weight once for all m rows:
 * - tile_MM_P (wide outputs): a tile of MM rows x P vectors of outputs held in registers while eight weight rows
 *   (sixteen for 7-8 rows) go through it (each weight vector loaded once, multiplied into every row), then stored;
 *   the next rows add to it. The MM x P multiply-adds of a weight row are independent chains, so the FMA latency
 *   is hidden (the axpy order this replaced ran each row's eight multiply-adds as one dependent chain and paid it).
 * - stream_MM (narrow outputs, see STREAM_MAX_FLOATS): one weight row at a time, in memory order.
 * Every output is the same sequence of fused multiply-adds, k = 0, 1, 2, ... in order, whatever the order or the
 * number of rows, so a row's result does not depend on the rows beside it. Built at first use by
 * kernels/cpu/small_gemm.py with -O3 -march=native (included by small_gemm_op.cpp, which registers it as torch
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

/* out[m, n0:n1] = x[m, :] @ wt[:, n0:n1] for MM rows, (n1 - n0) a multiple of P * VEC_FLOATS: register tiles of
 * MM x P vectors, K_ROWS weight rows per pass (the tile loaded and stored once a pass; see the file's comment).
 * AMD EPYC (AVX2), one thread, cold weights, against the eight-row axpys it replaced: [5, 256] x [256, 8192]
 * 1.02 ms vs 1.59, [1, 256] x [256, 1104] 90 us vs 126 (streamed), [4, 768] x [768, 4880] 1.31 ms vs 1.79. */
#define TILE_KERNEL(MM, P, K_ROWS)                                                                                   \
  static void tile_##MM##_##P(const float *__restrict x, const float *__restrict wt, size_t k_len, size_t n_out,     \
                              float *__restrict out, size_t n0, size_t n1) {                                         \
    for (size_t kb = 0; kb < k_len; kb += K_ROWS) {                                                                  \
      const size_t ke = kb + K_ROWS < k_len ? kb + K_ROWS : k_len;                                                   \
      for (size_t j = n0; j < n1; j += P * VEC_FLOATS) {                                                             \
        vec_t acc[MM][P];                                                                                            \
        for (int m = 0; m < MM; m++)                                                                                 \
          for (int p = 0; p < P; p++)                                                                                \
            acc[m][p] = kb == 0 ? vec_zero() : vec_load(out + m * n_out + j + p * VEC_FLOATS);                       \
        for (size_t k = kb; k < ke; k++) {                                                                           \
          vec_t wv[P];                                                                                               \
          for (int p = 0; p < P; p++) wv[p] = vec_load(wt + k * n_out + j + p * VEC_FLOATS);                         \
          for (int m = 0; m < MM; m++) {                                                                             \
            const vec_t xb = vec_broadcast(x + m * k_len + k);                                                       \
            for (int p = 0; p < P; p++) acc[m][p] = vec_fmadd(wv[p], xb, acc[m][p]);                                 \
          }                                                                                                          \
        }                                                                                                            \
        for (int m = 0; m < MM; m++)                                                                                 \
          for (int p = 0; p < P; p++) vec_store(out + m * n_out + j + p * VEC_FLOATS, acc[m][p]);                    \
      }                                                                                                              \
    }                                                                                                                \
  }
/* P per row count: MM x P accumulators + P weight vectors + a broadcast within AVX2's 16 registers. Eight weight
 * rows a pass; sixteen for the one-vector tiles of 7 and 8 rows, which hold fewer chains per weight load
 * ([8, 256] x [256, 8192] 1.71 ms at sixteen against 1.92 at eight and 2.36 in axpys). */
TILE_KERNEL(1, 4, 8)
TILE_KERNEL(2, 4, 8)
TILE_KERNEL(3, 3, 8)
TILE_KERNEL(4, 2, 8)
TILE_KERNEL(5, 2, 8)
TILE_KERNEL(6, 2, 8)
TILE_KERNEL(7, 1, 16)
TILE_KERNEL(8, 1, 16)
TILE_KERNEL(1, 1, 8)
TILE_KERNEL(2, 1, 8)
TILE_KERNEL(3, 1, 8)
TILE_KERNEL(4, 1, 8)
TILE_KERNEL(5, 1, 8)
TILE_KERNEL(6, 1, 8)

#define STREAM_MAX_FLOATS 4096 /* rows x outputs of a streamed product: its outputs stay in L1 */
#define STREAM_ROW_PAD 16      /* floats between rows of a multi-row stream's outputs (see stream_MM) */
#define STREAM_MIN_TILED_COLUMNS 1024 /* outputs per row from which the tiles run instead, fitting or not */

/* out[m, n0:n1] = x[m, :] @ wt[:, n0:n1] for MM rows, one weight row at a time: with n0 = 0 and n1 = n_out the
 * weight is read in memory order, one stream the hardware prefetcher follows (eight interleaved rows of a narrow
 * weight are too short for it to learn); the outputs stay in L1. Two or more rows accumulate in a local buffer
 * whose rows are STREAM_ROW_PAD floats apart, copied out at the end: rows of out a multiple of 4 KB apart (1,024
 * outputs) alias in the load/store unit, and [4, 768] x [768, 1024] ran 464 us in place against 137 for one row.
 * The same multiply-adds in the same order as tile_MM_P, so the result is bitwise the same. Keep the form: the
 * broadcasts held in an array and the inner loop over rows keep gcc -O3 from running the nest column-first (written
 * as a plain k/j nest, the one-row build ran [1, 768] x [768, 256] in 84 us instead of 52). Outputs of 1,024 or
 * more a row take the tiles even when they fit (STREAM_MIN_TILED_COLUMNS): [1, 256] x [256, 1536] 106 us tiled vs
 * 165 streamed; 256 outputs stream faster (4 x 256 in 44 us vs 56). */
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

typedef void (*product_fn)(const float *, const float *, size_t, size_t, float *, size_t, size_t);
static const product_fn STREAM[9] = {0, stream_1, stream_2, stream_3, stream_4, stream_5, stream_6, stream_7,
                                     stream_8};
/* Per row count: its widest tile, that tile's width in vectors, and its one-vector tile for what is left. */
typedef struct {
  product_fn wide;
  size_t vectors;
  product_fn one_vector;
} tiles_t;
static const tiles_t TILES[9] = {
    {0, 0, 0},
    {tile_1_4, 4, tile_1_1}, {tile_2_4, 4, tile_2_1}, {tile_3_3, 3, tile_3_1}, {tile_4_2, 2, tile_4_1},
    {tile_5_2, 2, tile_5_1}, {tile_6_2, 2, tile_6_1}, {tile_7_1, 1, tile_7_1}, {tile_8_1, 1, tile_8_1}};

/* Output columns [n_begin, n_end) of out [m_rows, n_out] = x [m_rows, k_len] @ wt [k_len, n_out], 1 <= m_rows <= 8;
 * n_begin a multiple of VEC_FLOATS. Whole rows of narrow outputs stream the weight (stream_MM), else register
 * tiles of P vectors, then of one vector for what is left of whole vectors. Columns past the last whole vector are
 * scalar, in the same k order. */
void small_gemm(const float *x, size_t m_rows, const float *wt, size_t n_out, size_t k_len, float *out,
                size_t n_begin, size_t n_end) {
  const size_t vec_end = n_begin + (n_end - n_begin) / VEC_FLOATS * VEC_FLOATS;
  if (n_begin == 0 && n_end == n_out && m_rows * n_out <= STREAM_MAX_FLOATS && n_out < STREAM_MIN_TILED_COLUMNS) {
    STREAM[m_rows](x, wt, k_len, n_out, out, 0, vec_end);
  } else {
    const tiles_t *tiles = &TILES[m_rows];
    const size_t panel = tiles->vectors * VEC_FLOATS;
    const size_t panel_end = n_begin + (vec_end - n_begin) / panel * panel;
    tiles->wide(x, wt, k_len, n_out, out, n_begin, panel_end);
    if (panel_end < vec_end) tiles->one_vector(x, wt, k_len, n_out, out, panel_end, vec_end);
  }
  for (size_t n = vec_end; n < n_end; n++)
    for (size_t m = 0; m < m_rows; m++) {
      float s = 0.0f;
      for (size_t k = 0; k < k_len; k++) s = fmaf(wt[k * n_out + n], x[m * k_len + k], s);
      out[m * n_out + n] = s;
    }
}
