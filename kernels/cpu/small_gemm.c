/* Small-batch fp32 products on AVX-512 or AVX2+FMA: out[m, n] = sum_k x[m, k] * wt[k, n] for 1..8 rows of x.
 *
 * wt is the weight input-major, [k_len, n_out] contiguous (a linear's `weight.t()`), x [m, k_len] and
 * out [m, n_out] contiguous. The weight is fp32 (small_gemm_f32) or bf16 (small_gemm_bf16): a bf16 weight is
 * widened to fp32 as it is loaded, exactly (its 16 bits become the float's high half), so the bf16 form of a weight
 * whose values are bf16 gives bitwise the fp32 form's result while reading half the bytes. Two orders, both
 * reading the weight once for all m rows:
 * - wide_W_MM (wide outputs; on AVX-512 every product of 2+ rows): a tile of MM rows x WIDE_P_MM vectors of outputs
 *   held in registers while eight weight rows (sixteen for one-vector tiles) go through it (each weight vector
 *   loaded once, multiplied into every row), then stored; the next rows add to it. The MM x P multiply-adds of a
 *   weight row are independent chains, so the FMA latency is hidden (the axpy order this replaced ran each row's
 *   eight multiply-adds as one dependent chain and paid it).
 * - stream_W_MM (narrow outputs, see STREAM_MAX_FLOATS and STREAM_MAX_ROWS): one weight row at a time, in memory
 *   order.
 * Every output is the same sequence of fused multiply-adds, k = 0, 1, 2, ... in order, whatever the order or the
 * number of rows, so a row's result does not depend on the rows beside it. Built at first use by
 * kernels/cpu/small_gemm.py with -O3 -march=native (included by small_gemm_op.cpp, which registers it as torch
 * operators); it refuses to build on a CPU with neither AVX-512F nor AVX2 and FMA. */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

/* Weight loads by the weight's element type: a vector of fp32 from fp32 or bf16 elements, and one scalar. */
#if defined(__AVX512F__)
#define vec_load_bf16(p) \
  _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#else
#define vec_load_bf16(p) \
  _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif
#define vec_load_f32(p) vec_load(p)
#define scalar_f32(p) (*(p))
#define scalar_bf16(p) bf16_to_float(*(p))
typedef float weight_f32;
typedef uint16_t weight_bf16;

static inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = (uint32_t)bits << 16;
  float value;
  memcpy(&value, &widened, sizeof value);
  return value;
}

/* out[m, n0:n1] = x[m, :] @ wt[:, n0:n1] for MM rows, (n1 - n0) a multiple of P * VEC_FLOATS: register tiles of
 * MM x P vectors, K_ROWS weight rows per pass (the tile loaded and stored once a pass; see the file's comment).
 * AMD EPYC (AVX2), one thread, cold weights, against the eight-row axpys it replaced: [5, 256] x [256, 8192]
 * 1.02 ms vs 1.59, [1, 256] x [256, 1104] 90 us vs 126 (streamed), [4, 768] x [768, 4880] 1.31 ms vs 1.79. */
#define TILE_KERNEL(NAME, W, MM, P, K_ROWS)                                                                           \
  static void NAME(const float *__restrict x, const weight_##W *__restrict wt, size_t k_len, size_t n_out,           \
                   float *__restrict out, size_t n0, size_t n1) {                                                    \
    for (size_t kb = 0; kb < k_len; kb += K_ROWS) {                                                                  \
      const size_t ke = kb + K_ROWS < k_len ? kb + K_ROWS : k_len;                                                   \
      for (size_t j = n0; j < n1; j += P * VEC_FLOATS) {                                                             \
        vec_t acc[MM][P];                                                                                            \
        for (int m = 0; m < MM; m++)                                                                                 \
          for (int p = 0; p < P; p++)                                                                                \
            acc[m][p] = kb == 0 ? vec_zero() : vec_load(out + m * n_out + j + p * VEC_FLOATS);                       \
        for (size_t k = kb; k < ke; k++) {                                                                           \
          vec_t wv[P];                                                                                               \
          for (int p = 0; p < P; p++) wv[p] = vec_load_##W(wt + k * n_out + j + p * VEC_FLOATS);                     \
          if (PREFETCH_AHEAD(W, MM) && k + K_ROWS < k_len)                                                            \
            for (int p = 0; p < P; p++) _mm_prefetch((const char *)(wt + (k + K_ROWS) * n_out + j + p * VEC_FLOATS), \
                                                     _MM_HINT_T1);                                                    \
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
/* Whether a tile prefetches, into L2, the weight rows its next pass reads (the same columns K_ROWS rows on): on
 * AVX-512 for every tile but fp32 one-row ones. Intel Xeon (AVX-512, AMX machine of wave 3 session 16), one thread,
 * weights from memory: the multi-row products had run at 70-80% of one row's bandwidth (the multiply-adds hold back
 * the loads that would have kept enough misses in flight) and now run at one row's: [4, 256] x [256, 768] fp32
 * 79 -> 54 us, [5, 256] x [256, 512] bf16 44 -> 24, [4, 768] x [768, 8192] fp32 1.98 -> 1.72 ms; one-row bf16
 * 333 -> 283 us ([1, 256] x [256, 8192]); one-row fp32 3-6% slower with it, so without; in cache unchanged within
 * noise. AVX2 builds are unmeasured with it, so without. */
#if defined(__AVX512F__)
#define PREFETCH_AHEAD(W, MM) (MM > 1 || sizeof(weight_##W) == 2)
#else
#define PREFETCH_AHEAD(W, MM) 0
#endif
/* The wide tile's width in vectors (WIDE_P_MM) per row count, its weight rows a pass (WIDE_K: eight, sixteen for
 * one-vector tiles) and the most rows a streamed product has (STREAM_MAX_ROWS).
 * - AVX2 (16 registers): MM x P accumulators + P weight vectors + a broadcast within 16; sixteen weight rows a pass
 *   for the one-vector tiles of 7 and 8 rows, which hold fewer chains per weight load ([8, 256] x [256, 8192]
 *   1.71 ms at sixteen against 1.92 at eight and 2.36 in axpys); narrow products of 2-8 rows stream.
 * - AVX-512 (32 registers; AMD EPYC Zen 4, one thread, wave 3 session 15): four vectors up to 6 rows, three at 7-8
 *   (24 accumulators), and only one-row products stream: a multi-row stream loads and stores its outputs for every
 *   multiply-add, and with weights in cache that bound it ([5, 256] x [256, 512] bf16 41 us streamed vs 15 tiled,
 *   [5, 768] x [768, 256] 44 vs 22); the LM head [8, 256] x [256, 8192] 641 -> 522 us. demo-k3's 5-row
 *   verification step 4.33 -> 3.60 ms (from memory some fp32 ones of 3-5 rows run slower tiled: [5, 256] x
 *   [256, 512] 36 -> 53 us; small-k3's verification did not move). Thirty-two weight rows a pass ran faster with
 *   weights in cache but up to 2x slower from memory (the prefetcher loses 32 interleaved rows), so eight. */
#if defined(__AVX512F__)
#define WIDE_P_1 4
#define WIDE_P_2 4
#define WIDE_P_3 4
#define WIDE_P_4 4
#define WIDE_P_5 4
#define WIDE_P_6 4
#define WIDE_P_7 3
#define WIDE_P_8 3
#define STREAM_MAX_ROWS 1
#else
#define WIDE_P_1 4
#define WIDE_P_2 4
#define WIDE_P_3 3
#define WIDE_P_4 2
#define WIDE_P_5 2
#define WIDE_P_6 2
#define WIDE_P_7 1
#define WIDE_P_8 1
#define STREAM_MAX_ROWS 8
#endif
#define WIDE_K(MM) (WIDE_P_##MM == 1 ? 16 : 8)
#define TILE_KERNELS(W)                                                                                              \
  TILE_KERNEL(wide_##W##_1, W, 1, WIDE_P_1, WIDE_K(1))                                                               \
  TILE_KERNEL(wide_##W##_2, W, 2, WIDE_P_2, WIDE_K(2))                                                               \
  TILE_KERNEL(wide_##W##_3, W, 3, WIDE_P_3, WIDE_K(3))                                                               \
  TILE_KERNEL(wide_##W##_4, W, 4, WIDE_P_4, WIDE_K(4))                                                               \
  TILE_KERNEL(wide_##W##_5, W, 5, WIDE_P_5, WIDE_K(5))                                                               \
  TILE_KERNEL(wide_##W##_6, W, 6, WIDE_P_6, WIDE_K(6))                                                               \
  TILE_KERNEL(wide_##W##_7, W, 7, WIDE_P_7, WIDE_K(7))                                                               \
  TILE_KERNEL(wide_##W##_8, W, 8, WIDE_P_8, WIDE_K(8))                                                               \
  TILE_KERNEL(one_vector_##W##_1, W, 1, 1, 8)                                                                        \
  TILE_KERNEL(one_vector_##W##_2, W, 2, 1, 8)                                                                        \
  TILE_KERNEL(one_vector_##W##_3, W, 3, 1, 8)                                                                        \
  TILE_KERNEL(one_vector_##W##_4, W, 4, 1, 8)                                                                        \
  TILE_KERNEL(one_vector_##W##_5, W, 5, 1, 8)                                                                        \
  TILE_KERNEL(one_vector_##W##_6, W, 6, 1, 8)                                                                        \
  TILE_KERNEL(one_vector_##W##_7, W, 7, 1, 16)                                                                       \
  TILE_KERNEL(one_vector_##W##_8, W, 8, 1, 16)

#define STREAM_MAX_FLOATS 4096 /* rows x outputs of a streamed product: its outputs stay in L1 */
#define STREAM_ROW_PAD 16      /* floats between rows of a multi-row stream's outputs (see stream_W_MM) */
#define STREAM_MIN_TILED_COLUMNS 1024 /* outputs per row from which the tiles run instead, fitting or not */

/* out[m, n0:n1] = x[m, :] @ wt[:, n0:n1] for MM rows, one weight row at a time: with n0 = 0 and n1 = n_out the
 * weight is read in memory order, one stream the hardware prefetcher follows (eight interleaved rows of a narrow
 * weight are too short for it to learn); the outputs stay in L1. Two or more rows accumulate in a local buffer
 * whose rows are STREAM_ROW_PAD floats apart, copied out at the end: rows of out a multiple of 4 KB apart (1,024
 * outputs) alias in the load/store unit, and [4, 768] x [768, 1024] ran 464 us in place against 137 for one row.
 * The same multiply-adds in the same order as the tiles, so the result is bitwise the same. Keep the form: the
 * broadcasts held in an array and the inner loop over rows keep gcc -O3 from running the nest column-first (written
 * as a plain k/j nest, the one-row build ran [1, 768] x [768, 256] in 84 us instead of 52). Outputs of 1,024 or
 * more a row take the tiles even when they fit (STREAM_MIN_TILED_COLUMNS): [1, 256] x [256, 1536] 106 us tiled vs
 * 165 streamed; 256 outputs stream faster (4 x 256 in 44 us vs 56). */
#define STREAM_KERNEL(W, MM)                                                                                     \
  static void stream_##W##_##MM(const float *__restrict x, const weight_##W *__restrict wt, size_t k_len,       \
                                size_t n_out, float *__restrict out, size_t n0, size_t n1) {                     \
    const size_t stride = MM == 1 ? n_out : n1 + STREAM_ROW_PAD;                                               \
    float padded[MM == 1 ? 1 : MM * (STREAM_MAX_FLOATS / MM + STREAM_ROW_PAD)];                                \
    float *acc = MM == 1 ? out : padded;                                                                         \
    for (int m = 0; m < MM; m++)                                                                                 \
      for (size_t j = n0; j < n1; j += VEC_FLOATS) vec_store(acc + m * stride + j, vec_zero());                  \
    for (size_t k = 0; k < k_len; k++) {                                                                         \
      const weight_##W *w = wt + k * n_out;                                                                      \
      vec_t xb[MM];                                                                                              \
      for (int m = 0; m < MM; m++) xb[m] = vec_broadcast(x + m * k_len + k);                                     \
      for (size_t j = n0; j < n1; j += VEC_FLOATS) {                                                             \
        vec_t wv = vec_load_##W(w + j);                                                                          \
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
#define STREAM_KERNELS(W)                                                                                        \
  STREAM_KERNEL(W, 1) STREAM_KERNEL(W, 2) STREAM_KERNEL(W, 3) STREAM_KERNEL(W, 4)                                \
  STREAM_KERNEL(W, 5) STREAM_KERNEL(W, 6) STREAM_KERNEL(W, 7) STREAM_KERNEL(W, 8)

/* Per row count: its widest tile, that tile's width in vectors, and its one-vector tile for what is left; and the
 * streamed order. */
#define PRODUCT_TABLES(W)                                                                                        \
  typedef void (*product_##W)(const float *, const weight_##W *, size_t, size_t, float *, size_t, size_t);       \
  typedef struct {                                                                                               \
    product_##W wide;                                                                                            \
    size_t vectors;                                                                                              \
    product_##W one_vector;                                                                                      \
  } tiles_##W;                                                                                                   \
  static const product_##W STREAM_##W[9] = {0, stream_##W##_1, stream_##W##_2, stream_##W##_3, stream_##W##_4,  \
                                            stream_##W##_5, stream_##W##_6, stream_##W##_7, stream_##W##_8};    \
  static const tiles_##W TILES_##W[9] = {                                                                        \
      {0, 0, 0},                                                                                                 \
      {wide_##W##_1, WIDE_P_1, one_vector_##W##_1}, {wide_##W##_2, WIDE_P_2, one_vector_##W##_2},                \
      {wide_##W##_3, WIDE_P_3, one_vector_##W##_3}, {wide_##W##_4, WIDE_P_4, one_vector_##W##_4},                \
      {wide_##W##_5, WIDE_P_5, one_vector_##W##_5}, {wide_##W##_6, WIDE_P_6, one_vector_##W##_6},                \
      {wide_##W##_7, WIDE_P_7, one_vector_##W##_7}, {wide_##W##_8, WIDE_P_8, one_vector_##W##_8}};

/* Output columns [n_begin, n_end) of out [m_rows, n_out] = x [m_rows, k_len] @ wt [k_len, n_out], 1 <= m_rows <= 8;
 * n_begin a multiple of VEC_FLOATS. Whole rows of narrow outputs stream the weight (stream_W_MM), else register
 * tiles of P vectors, then of one vector for what is left of whole vectors. Columns past the last whole vector are
 * scalar, in the same k order. */
#define SMALL_GEMM(W)                                                                                            \
  void small_gemm_##W(const float *x, size_t m_rows, const weight_##W *wt, size_t n_out, size_t k_len,           \
                      float *out, size_t n_begin, size_t n_end) {                                                \
    const size_t vec_end = n_begin + (n_end - n_begin) / VEC_FLOATS * VEC_FLOATS;                                \
    if (n_begin == 0 && n_end == n_out && m_rows <= STREAM_MAX_ROWS && m_rows * n_out <= STREAM_MAX_FLOATS &&     \
        n_out < STREAM_MIN_TILED_COLUMNS) {                                                                      \
      STREAM_##W[m_rows](x, wt, k_len, n_out, out, 0, vec_end);                                                  \
    } else {                                                                                                     \
      const tiles_##W *tiles = &TILES_##W[m_rows];                                                               \
      const size_t panel = tiles->vectors * VEC_FLOATS;                                                          \
      const size_t panel_end = n_begin + (vec_end - n_begin) / panel * panel;                                    \
      tiles->wide(x, wt, k_len, n_out, out, n_begin, panel_end);                                                 \
      if (panel_end < vec_end) tiles->one_vector(x, wt, k_len, n_out, out, panel_end, vec_end);                  \
    }                                                                                                            \
    for (size_t n = vec_end; n < n_end; n++)                                                                     \
      for (size_t m = 0; m < m_rows; m++) {                                                                      \
        float s = 0.0f;                                                                                          \
        for (size_t k = 0; k < k_len; k++) s = fmaf(scalar_##W(wt + k * n_out + n), x[m * k_len + k], s);       \
        out[m * n_out + n] = s;                                                                                  \
      }                                                                                                          \
  }

/* The two families: fp32 weights and bf16 weights, the same kernels and tables. */
TILE_KERNELS(f32)
STREAM_KERNELS(f32)
PRODUCT_TABLES(f32)
SMALL_GEMM(f32)
TILE_KERNELS(bf16)
STREAM_KERNELS(bf16)
PRODUCT_TABLES(bf16)
SMALL_GEMM(bf16)
