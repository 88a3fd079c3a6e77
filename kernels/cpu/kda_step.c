/* One Kimi Delta Attention decode step for one head's state, in place, on AVX-512 or AVX2+FMA (the vector macros
 * of small_gemm.c, which this file follows in small_gemm_op.cpp).
 *
 * S [k_len, v_len] fp32 contiguous (a state's head: key rows, value columns), q, k, g [k_len], v [v_len], beta and
 * scale scalars; v_len a multiple of VEC_FLOATS. With decay = exp(g):
 *   read_k = (k * decay)^T S,  read_q = (scale * q * decay)^T S          (pass 1: S read once, both at a time)
 *   u = beta * (v - read_k)
 *   S[i, :] = fma(k[i], u, S[i, :] * decay[i])                          (pass 2: S written once, from L2)
 *   o = read_q + (scale * q . k) * u
 * which is `kernels.kda.recurrent.kda_step`'s math (S' = decay ⊙ S; S' += k u^T; o = q^T S') with two passes over S
 * instead of the five of the torch form (gather, exp-and-read, decay, rank-1 write, scatter). A head's result does
 * not depend on the other heads or sequences of the call. */

/* Value columns per pass-1 tile, two accumulators each: 128 floats with AVX-512's 32 registers, 48 with AVX2's 16. */
#if VEC_FLOATS == 16
#define KDA_TILE_VECS 8
#else
#define KDA_TILE_VECS 6
#endif

void kda_step_head(float *__restrict S, size_t k_len, size_t v_len, const float *__restrict q,
                   const float *__restrict k, const float *__restrict g, const float *__restrict v, float beta,
                   float scale, float *__restrict decay, float *__restrict u, float *__restrict o) {
  float qk = 0.0f;
  for (size_t i = 0; i < k_len; i++) {
    decay[i] = expf(g[i]);
    qk = fmaf(scale * q[i], k[i], qk);
  }
  for (size_t j0 = 0; j0 < v_len; j0 += KDA_TILE_VECS * VEC_FLOATS) {
    const size_t tile = v_len - j0 < KDA_TILE_VECS * VEC_FLOATS ? (v_len - j0) / VEC_FLOATS : KDA_TILE_VECS;
    vec_t acc_k[KDA_TILE_VECS], acc_q[KDA_TILE_VECS];
    for (size_t t = 0; t < KDA_TILE_VECS; t++) acc_k[t] = acc_q[t] = vec_zero();
    for (size_t i = 0; i < k_len; i++) {
      const float kd = k[i] * decay[i], qd = scale * q[i] * decay[i];
      const vec_t kv = vec_broadcast(&kd), qv = vec_broadcast(&qd);
      const float *row = S + i * v_len + j0;
      for (size_t t = 0; t < tile; t++) {
        const vec_t s = vec_load(row + t * VEC_FLOATS);
        acc_k[t] = vec_fmadd(kv, s, acc_k[t]);
        acc_q[t] = vec_fmadd(qv, s, acc_q[t]);
      }
    }
    for (size_t t = 0; t < tile; t++) {
      vec_store(u + j0 + t * VEC_FLOATS, acc_k[t]);
      vec_store(o + j0 + t * VEC_FLOATS, acc_q[t]);
    }
  }
  for (size_t j = 0; j < v_len; j++) u[j] = beta * (v[j] - u[j]);
  for (size_t j = 0; j < v_len; j++) o[j] = fmaf(qk, u[j], o[j]);
  for (size_t i = 0; i < k_len; i++) {
    float *row = S + i * v_len;
    const vec_t d = vec_broadcast(decay + i), ki = vec_broadcast(k + i);
    for (size_t j = 0; j < v_len; j += VEC_FLOATS)
      vec_store(row + j, vec_fmadd(ki, vec_load(u + j), vec_mul(vec_load(row + j), d)));
  }
}
