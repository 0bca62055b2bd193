/* Attention for the CPU at every width, float32: query rows over one sequence's keys.
 *
 * Every query row is computed on its own, and its keys are visited by distance from the query
 * (d = 0 is the query's own key, d = 1 the one before, ...), so the arithmetic depends only on
 * the row's visible keys: one chunk, a 64-row chunk, a decode step, the ring in place and the
 * staging shadow give the same bits. For query q at key index `last` seeing keys
 * [first, last] (i = last - d):
 *
 *     s_d = (q * scale) . k_i      16 lanes over head_dim, fixed tree (exp.h)
 *     m   = max_d s_d              exact in any order
 *     e_d = exp(s_d - m)           muser_exp
 *     out = (sum_d e_d v_i) / sum_d e_d      numerator: d = 0, 1, ... in turn per element;
 *                                            denominator: 16 lanes by d mod 16, fixed tree
 *
 * Keys are located through the cache placement of muser.ops.ref.decode_rows (a block table,
 * block size and physical origin), or are contiguous. GQA: head h reads KV head h / (H / KVH).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

typedef struct {
    const float *k, *v;
    int64_t stride_s, stride_h;
    const int64_t *rows; /* physical row of key index i - base; NULL: row = i */
    int64_t base;
} Keys;

static inline int64_t key_row(const Keys *K, int64_t i) {
    return K->rows ? K->rows[i - K->base] : i;
}

/* One query row of one head: keys [first, last] of kv head kvh -> o[D]. */
static void attend_row(const float *qh, int64_t D, const Keys *K, int64_t kvh, int64_t first,
                       int64_t last, float scale, float *qs, float *e, float *o)
{
    const int64_t n = last - first + 1;
    for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
    if (n <= 0) return;
    for (int64_t i = 0; i < D; i++) qs[i] = qh[i] * scale;
    float m = -INFINITY;
    for (int64_t d = 0; d < n; d++) {
        const float *kr = K->k + key_row(K, last - d) * K->stride_s + kvh * K->stride_h;
        float lane[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= D; i += 16)
            for (int l = 0; l < 16; l++) lane[l] += qs[i + l] * kr[i + l];
        for (int l = 0; i + l < D; l++) lane[l] += qs[i + l] * kr[i + l];
        e[d] = muser_tree16(lane);
        m = e[d] > m ? e[d] : m;
    }
    float lane[16] = {0};
    int64_t d = 0;
    for (; d < n; d++) e[d] = muser_exp(e[d] - m);
    for (d = 0; d + 16 <= n; d += 16)
        for (int l = 0; l < 16; l++) lane[l] += e[d + l];
    for (int l = 0; d + l < n; l++) lane[l] += e[d + l];
    const float sum = muser_tree16(lane);
    for (d = 0; d < n; d++) {
        const float *vr = K->v + key_row(K, last - d) * K->stride_s + kvh * K->stride_h;
        const float p = e[d];
        for (int64_t i = 0; i < D; i++) o[i] += p * vr[i];
    }
    for (int64_t i = 0; i < D; i++) o[i] = o[i] / sum;
}

/* q: [T, H, D] (rows `sq_t`, heads `sq_h` apart, unit inner stride); k, v: key rows
 * `stride_s`, KV heads `stride_h` apart. Query t sees key indices
 * [max(first_min, last0 + t - window + 1), last0 + t] (window <= 0: no window limit).
 * Key index i lives at row i, or, with a block table [blocks] of `block_size` rows and a
 * physical origin, at table[j / block_size] * block_size + j % block_size for
 * j = (origin + i) mod (block_size * blocks). out: [T, H, D] contiguous.
 * Returns 0, or -2 when out of memory. */
int muser_attention(const float *q, int64_t T, int64_t H, int64_t D, int64_t sq_t,
                    int64_t sq_h, const float *k, const float *v, int64_t stride_s,
                    int64_t stride_h, int64_t KVH, const int32_t *table, int64_t blocks,
                    int64_t block_size, int64_t origin, int64_t last0, int64_t first_min,
                    int64_t window, float scale, int threads, float *out)
{
    const int64_t group = H / KVH, hi = last0 + T - 1;
    const int64_t lo = window > 0 && last0 - window + 1 > first_min ? last0 - window + 1
                                                                    : first_min;
    const int64_t span = hi - lo + 1 > 0 ? hi - lo + 1 : 0;
    Keys K = {k, v, stride_s, stride_h, NULL, lo};
    int64_t *rows = NULL;
    if (table && span) {
        rows = malloc((size_t)span * sizeof(int64_t));
        if (!rows) return -2;
        const int64_t total = block_size * blocks;
        for (int64_t i = 0; i < span; i++) {
            const int64_t j = ((origin + lo + i) % total + total) % total;
            rows[i] = (int64_t)table[j / block_size] * block_size + j % block_size;
        }
        K.rows = rows;
    }
    int failed = 0;
    const int64_t tasks = T * H;
    if (tasks * span * D < (1 << 18)) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = malloc(((size_t)2 * D + (size_t)span + 1) * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (!scratch) continue;
            const int64_t t = task / H, h = task % H, last = last0 + t;
            int64_t first = first_min;
            if (window > 0 && last - window + 1 > first) first = last - window + 1;
            attend_row(q + t * sq_t + h * sq_h, D, &K, h / group, first, last, scale, scratch,
                       scratch + 2 * D, out + (t * H + h) * D);
        }
        free(scratch);
    }
    free(rows);
    return failed ? -2 : 0;
}
