/* Decode attention for the CPU: one query row per head over one sequence's keys, float32.
 * GQA: head h reads KV head h / (H / KVH). The math is muser.attention.dense_ref's
 * attention_decode: softmax((q * scale) . k) weighted sum of v, max-subtracted. Reductions
 * are `omp simd` (vectorized in a fixed order for a given build). */
#include <math.h>
#include <stdint.h>

/* q: [H, D]; k, v: S rows `stride_s` apart, KV heads `stride_h` apart, unit inner stride;
 * scores: [H, S] scratch; out: [H, D]. */
void muser_decode_attention(const float *q, int64_t H, int64_t KVH, int64_t D, const float *k,
                            const float *v, int64_t S, int64_t stride_s, int64_t stride_h,
                            float scale, float *scores, float *out)
{
    const int64_t group = H / KVH;
#pragma omp parallel for num_threads(H * S >= 8192 ? 2 : 1) schedule(static)
    for (int64_t h = 0; h < H; h++) {
        const float *qh = q + h * D;
        const int64_t kvh = h / group;
        float *sc = scores + h * S, *o = out + h * D;
        float m = -INFINITY;
        for (int64_t s = 0; s < S; s++) {
            const float *ks = k + s * stride_s + kvh * stride_h;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += (qh[d] * scale) * ks[d];
            sc[s] = dot;
            m = dot > m ? dot : m;
        }
        float sum = 0.0f;
        for (int64_t s = 0; s < S; s++) {
            sc[s] = expf(sc[s] - m);
            sum += sc[s];
        }
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t s = 0; s < S; s++) {
            const float *vs = v + s * stride_s + kvh * stride_h;
            const float p = sc[s] / sum;
            for (int64_t d = 0; d < D; d++) o[d] += p * vs[d];
        }
    }
}
