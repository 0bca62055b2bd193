/* Attention for the CPU at every width, float32: query rows over one sequence's keys.
 *
 * Every query row is computed on its own, and its keys are visited by distance from the query
 * (d = 0 is the query's own key, d = 1 the one before, ...), so the arithmetic depends only on
 * the row's visible keys: one chunk, a 64-row chunk, a decode step, the ring in place and the
 * staging shadow give the same bits. For query q at key index `last` seeing keys
 * [first, last] (i = last - d):
 *
 *     s_d = (q * scale) . k_i      FMA chains in 16 lanes over head_dim, fixed tree (exp.h)
 *     m   = max_d s_d              exact in any order
 *     e_d = exp(s_d - m)           muser_exp
 *     out = (sum_d e_d v_i) / sum_d e_d      numerator: an FMA chain over d = 0, 1, ... per
 *                                            element; denominator: 16 lanes by d mod 16, tree
 *
 * The heads that share a KV head are computed together (each key row is read once for all of
 * them), which changes no head's arithmetic. Tiles of rows and KV heads are shared out among
 * the threads; when there are fewer than threads (a decode step), the threads share each one
 * instead: keys for the scores, heads for the softmax, head dims for the weighted values, each
 * a set of whole outputs computed as above. Keys are located through the cache placement of
 * muser.ops.ref.decode_rows (a block table, block size and physical origin), or are
 * contiguous. GQA: head h reads KV head h / (H / KVH).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "exp.h"
#include "vec.h"

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 }; /* the cache's element type: gemm.c's FMT_* */

typedef struct {
    const void *k, *v; /* KV_F32: float; KV_F16, KV_BF16: uint16_t */
    int64_t stride_s, stride_h; /* in elements */
    const int64_t *rows; /* physical row of key index i - base; NULL: row = i */
    int64_t base;
} Keys;

static inline int64_t key_row(const Keys *K, int64_t i) {
    return K->rows ? K->rows[i - K->base] : i;
}

/* Elements at .. at + 15 of a key or value row as float32 (16-bit ones widened, exactly). */
static inline __attribute__((always_inline)) v16 kv_load(const void *p, int64_t at, int kind)
{
    if (kind == KV_F16) return vhalf((const uint16_t *)p + at);
    if (kind == KV_BF16) return vbf16((const uint16_t *)p + at);
    return vload((const float *)p + at);
}

static inline float hsum(v16 v) {
    float lane[16];
    vstore16(lane, v);
    return muser_tree16(lane);
}

/* out[j] = hsum(v[j]) for four vectors at once, by the same additions: each level adds the
 * same pairs of lanes as muser_tree16 ((i, i + 8), (i, i + 4), (i, i + 2), (i, i + 1)). */
static inline void hsum4(const v16 *v, float *out) {
#if defined(__AVX512F__)
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44),
                                   _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
    const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44),
                                   _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
    __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(u, w, 0x88), _mm512_shuffle_f32x4(u, w, 0xDD));
    x = _mm512_add_ps(x, _mm512_shuffle_ps(x, x, 0x4E));
    x = _mm512_add_ps(x, _mm512_shuffle_ps(x, x, 0xB1));
    float lane[16];
    _mm512_storeu_ps(lane, x);
    for (int j = 0; j < 4; j++) out[j] = lane[4 * j];
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    __m256 a[4]; /* (i, i + 8) */
    for (int j = 0; j < 4; j++) a[j] = _mm256_add_ps(v[j].lo, v[j].hi);
    /* (i, i + 4): v[0] | v[1] and v[2] | v[3] in the two 128-bit halves */
    const __m256 u = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20),
                                   _mm256_permute2f128_ps(a[0], a[1], 0x31));
    const __m256 w = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20),
                                   _mm256_permute2f128_ps(a[2], a[3], 0x31));
    /* (i, i + 2), then (i, i + 1): v[0], v[2] in elements 0, 2; v[1], v[3] in 4, 6 */
    __m256 x = _mm256_add_ps(_mm256_shuffle_ps(u, w, 0x44), _mm256_shuffle_ps(u, w, 0xEE));
    x = _mm256_add_ps(x, _mm256_shuffle_ps(x, x, 0xB1));
    float lane[8];
    _mm256_storeu_ps(lane, x);
    out[0] = lane[0], out[1] = lane[4], out[2] = lane[2], out[3] = lane[6];
#else
    for (int j = 0; j < 4; j++) out[j] = hsum(v[j]);
#endif
}

#define TILE_ROWS 8 /* query rows that share each key row read (the arithmetic is per row) */

typedef struct { /* one query row of a tile: its visible keys [first, last] */
    int64_t first, last, n;
    const float *q; /* [G] rows sq_h apart */
    float *qs, *e, *o; /* [G, D] scaled queries; [G, n] scores; [G, D] output */
} Row;

/* e[g * n + (last - i)] = qs_g . k_i for every row of the tile that sees key i. */
static inline __attribute__((always_inline)) void scores(
    Row *rows, int nr, int G, int64_t D, const Keys *K, int kind, int64_t kvh, int64_t lo,
    int64_t hi)
{
    for (int64_t i = hi; i >= lo; i--) {
        const int64_t kr = key_row(K, i) * K->stride_s + kvh * K->stride_h;
        for (int r = 0; r < nr; r++) {
            Row *w = &rows[r];
            if (i < w->first || i > w->last) continue;
            v16 acc[8];
            for (int g = 0; g < G; g++) acc[g] = vzero();
            for (int64_t x = 0; x < D; x += 16) {
                const v16 kv = kv_load(K->k, kr + x, kind);
                for (int g = 0; g < G; g++) acc[g] = vfma(vload(w->qs + g * D + x), kv, acc[g]);
            }
            const int64_t d = w->last - i;
            if (G % 4 == 0) {
                float sc[4];
                for (int g = 0; g < G; g += 4) {
                    hsum4(acc + g, sc);
                    for (int j = 0; j < 4; j++) w->e[(g + j) * w->n + d] = sc[j];
                }
            } else {
                for (int g = 0; g < G; g++) w->e[g * w->n + d] = hsum(acc[g]);
            }
        }
    }
}

#define KEY_BLOCK 128 /* keys whose value rows stay in L2 while every row of a tile reads them */
#define TEAM_KEYS 32  /* keys per share of a team's scores */
#define TEAM_WORK (1 << 17) /* T * H * keys * D from which a team shares a task */

/* o[g] += sum_d e[g * n + d] v_{last - d} over the row's keys in [i_lo, i_hi], in turn over d
 * (keys from i_hi down), for dims [x_lo, x_hi), 16 * DB at a time: the G x DB accumulators
 * stay in registers, loaded from and stored back to o exactly, so a sum split across key
 * blocks is the same chain. */
static inline __attribute__((always_inline)) void weighted_values(
    const Row *w, int G, int DB, int64_t D, const Keys *K, int kind, int64_t kvh, int64_t i_lo,
    int64_t i_hi, int64_t x_lo, int64_t x_hi)
{
    const int64_t top = w->last < i_hi ? w->last : i_hi;
    const int64_t bottom = w->first > i_lo ? w->first : i_lo;
    for (int64_t x0 = x_lo; x0 < x_hi; x0 += 16 * DB) {
        v16 acc[8][4];
        for (int g = 0; g < G; g++)
            for (int b = 0; b < DB; b++) acc[g][b] = vload(w->o + g * D + x0 + 16 * b);
        for (int64_t i = top; i >= bottom; i--) {
            const int64_t vr = key_row(K, i) * K->stride_s + kvh * K->stride_h;
            v16 vv[4];
            for (int b = 0; b < DB; b++) vv[b] = kv_load(K->v, vr + x0 + 16 * b, kind);
            for (int g = 0; g < G; g++) {
                const v16 p = vsplat(w->e[g * w->n + (w->last - i)]);
                for (int b = 0; b < DB; b++) acc[g][b] = vfma(p, vv[b], acc[g][b]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int b = 0; b < DB; b++) vstore16(w->o + g * D + x0 + 16 * b, acc[g][b]);
    }
}

/* Softmax weights of one head's n scores in place (e_d = exp(s_d - m)) -> their sum. */
static float softmax(float *e, int64_t n)
{
    float top[16]; /* the max in 16 lanes (exact in any order) */
    for (int l = 0; l < 16; l++) top[l] = -INFINITY;
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        for (int l = 0; l < 16; l++) top[l] = e[d + l] > top[l] ? e[d + l] : top[l];
    for (int l = 0; d + l < n; l++) top[l] = e[d + l] > top[l] ? e[d + l] : top[l];
    float m = top[0];
    for (int l = 1; l < 16; l++) m = top[l] > m ? top[l] : m;
    for (d = 0; d < n; d++) e[d] = muser_exp(e[d] - m);
    float lane[16] = {0};
    for (d = 0; d + 16 <= n; d += 16)
        for (int l = 0; l < 16; l++) lane[l] += e[d + l];
    for (int l = 0; d + l < n; l++) lane[l] += e[d + l];
    return muser_tree16(lane);
}

/* Value dims per step of weighted_values: its G x DB accumulators and DB value vectors stay
 * in registers. */
static inline int value_block(int G, int64_t D)
{
#if VEC_REGS >= 32
    return D % 64 == 0 && G <= 4 ? 4 : D % 32 == 0 ? 2 : 1;
#else /* within 16 registers (AVX2) */
    return D % 32 == 0 && G <= 2 ? 2 : 1;
#endif
}

/* The smallest and largest key index any row of the tile sees (lo > hi: none). */
static void key_span(const Row *rows, int nr, int64_t *lo, int64_t *hi)
{
    *lo = INT64_MAX, *hi = INT64_MIN;
    for (int r = 0; r < nr; r++)
        if (rows[r].n > 0) {
            *lo = rows[r].first < *lo ? rows[r].first : *lo;
            *hi = rows[r].last > *hi ? rows[r].last : *hi;
        }
}

/* o = (sum_d e_d v) / sum for every row of the tile, dims [x_lo, x_hi) of each head. */
static inline __attribute__((always_inline)) void outputs(
    Row *rows, int nr, int G, int64_t D, const Keys *K, int kind, int64_t kvh, int64_t lo,
    int64_t hi, float (*sums)[8], int64_t x_lo, int64_t x_hi)
{
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < G; g++)
            for (int64_t x = x_lo; x < x_hi; x++) rows[r].o[g * D + x] = 0.0f;
    const int db = value_block(G, D);
    for (int64_t i_hi = hi; i_hi >= lo; i_hi -= KEY_BLOCK) {
        const int64_t i_lo = i_hi - KEY_BLOCK + 1 > lo ? i_hi - KEY_BLOCK + 1 : lo;
        for (int r = 0; r < nr; r++) {
            const Row *w = &rows[r];
            if (w->n <= 0 || w->last < i_lo || w->first > i_hi) continue;
            if (db == 4) weighted_values(w, G, 4, D, K, kind, kvh, i_lo, i_hi, x_lo, x_hi);
            else if (db == 2) weighted_values(w, G, 2, D, K, kind, kvh, i_lo, i_hi, x_lo, x_hi);
            else weighted_values(w, G, 1, D, K, kind, kvh, i_lo, i_hi, x_lo, x_hi);
        }
    }
    for (int r = 0; r < nr; r++) {
        if (rows[r].n <= 0) continue; /* o stays zero: no visible key */
        for (int g = 0; g < G; g++) {
            float *o = rows[r].o + g * D;
            const v16 s = vsplat(sums[r][g]);
            for (int64_t x = x_lo; x < x_hi; x += 16) vstore16(o + x, vdiv(vload(o + x), s));
        }
    }
}

/* A tile of query rows (each with its G heads) over their keys -> each row's o. */
static inline __attribute__((always_inline)) void attend(
    Row *rows, int nr, int64_t sq_h, int G, int64_t D, const Keys *K, int kind, int64_t kvh,
    float scale)
{
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < G; g++)
            for (int64_t x = 0; x < D; x++)
                rows[r].qs[g * D + x] = rows[r].q[g * sq_h + x] * scale;
    int64_t lo, hi;
    key_span(rows, nr, &lo, &hi);
    scores(rows, nr, G, D, K, kind, kvh, lo, hi);
    float sums[TILE_ROWS][8];
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < G; g++) sums[r][g] = softmax(rows[r].e + g * rows[r].n, rows[r].n);
    outputs(rows, nr, G, D, K, kind, kvh, lo, hi, sums, 0, D);
}

/* attend() by every thread of the team together, for a tile too few to share out (a decode
 * step): the keys split for the scores, the heads for the softmax, the head dims for the
 * weighted values. Each part computes whole outputs by attend()'s arithmetic, so the bits are
 * the same. sums: shared by the team. */
static inline __attribute__((always_inline)) void attend_team(
    Row *rows, int nr, int64_t sq_h, int G, int64_t D, const Keys *K, int kind, int64_t kvh,
    float scale, float (*sums)[8])
{
#pragma omp for schedule(static)
    for (int rg = 0; rg < nr * G; rg++) {
        const Row *w = &rows[rg / G];
        const int g = rg % G;
        for (int64_t x = 0; x < D; x++) w->qs[g * D + x] = w->q[g * sq_h + x] * scale;
    }
    int64_t lo, hi;
    key_span(rows, nr, &lo, &hi);
    const int64_t chunks = hi >= lo ? (hi - lo) / TEAM_KEYS + 1 : 0;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t top = hi - c * TEAM_KEYS;
        const int64_t bottom = top - TEAM_KEYS + 1 > lo ? top - TEAM_KEYS + 1 : lo;
        scores(rows, nr, G, D, K, kind, kvh, bottom, top);
    }
#pragma omp for schedule(static)
    for (int rg = 0; rg < nr * G; rg++) {
        const Row *w = &rows[rg / G];
        sums[rg / G][rg % G] = softmax(w->e + (rg % G) * w->n, w->n);
    }
    /* each thread's dims in one range: its part of a key block's value rows stays in L2
     * while it runs every step of its dims over them */
    const int64_t step = 16 * value_block(G, D), steps = D / step;
    const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();
    const int64_t x_lo = steps * me / team * step, x_hi = steps * (me + 1) / team * step;
    if (x_lo < x_hi) outputs(rows, nr, G, D, K, kind, kvh, lo, hi, sums, x_lo, x_hi);
#pragma omp barrier
}

/* attend() with G and the cache's element type constants (the accumulators stay in
 * registers, the loads are of one kind). */
#define BY_KIND(KIND, CALL)                                                                 \
    switch (KIND) {                                                                         \
    case KV_F16: { const int kind_ = KV_F16; CALL; } break;                                \
    case KV_BF16: { const int kind_ = KV_BF16; CALL; } break;                              \
    default: { const int kind_ = KV_F32; CALL; }                                           \
    }

static void attend_any(Row *rows, int nr, int64_t sq_h, int G, int64_t D, const Keys *K,
                       int kind, int64_t kvh, float scale)
{
    switch (G) {
    case 1: BY_KIND(kind, attend(rows, nr, sq_h, 1, D, K, kind_, kvh, scale)) break;
    case 2: BY_KIND(kind, attend(rows, nr, sq_h, 2, D, K, kind_, kvh, scale)) break;
    case 4: BY_KIND(kind, attend(rows, nr, sq_h, 4, D, K, kind_, kvh, scale)) break;
    case 8: BY_KIND(kind, attend(rows, nr, sq_h, 8, D, K, kind_, kvh, scale)) break;
    default: { /* one head at a time: the same arithmetic per head */
        Row one[TILE_ROWS];
        for (int g = 0; g < G; g++) {
            for (int r = 0; r < nr; r++) {
                one[r] = rows[r];
                one[r].q = rows[r].q + g * sq_h;
                one[r].o = rows[r].o + g * D;
            }
            BY_KIND(kind, attend(one, nr, sq_h, 1, D, K, kind_, kvh, scale))
        }
    }
    }
}

static void attend_team_any(Row *rows, int nr, int64_t sq_h, int G, int64_t D,
                            const Keys *K, int kind, int64_t kvh, float scale,
                            float (*sums)[8])
{
    switch (G) { /* muser_attention forms a team for these G only */
    case 1: BY_KIND(kind, attend_team(rows, nr, sq_h, 1, D, K, kind_, kvh, scale, sums)) break;
    case 2: BY_KIND(kind, attend_team(rows, nr, sq_h, 2, D, K, kind_, kvh, scale, sums)) break;
    case 4: BY_KIND(kind, attend_team(rows, nr, sq_h, 4, D, K, kind_, kvh, scale, sums)) break;
    case 8: BY_KIND(kind, attend_team(rows, nr, sq_h, 8, D, K, kind_, kvh, scale, sums)) break;
    }
}

/* The rows of task `task` (a tile of TILE_ROWS query rows, one KV head) in `tile`, their
 * scaled queries and scores in `scratch` -> the number of rows. */
static int make_tile(Row *tile, int64_t task, int64_t T, int64_t H, int G, int64_t D,
                     int64_t KVH, const float *q, int64_t sq_t, int64_t sq_h, int64_t last0,
                     int64_t first_min, int64_t window, float *scratch, float *out)
{
    const int64_t t0 = task / KVH * TILE_ROWS, kvh = task % KVH;
    const int nr = T - t0 < TILE_ROWS ? (int)(T - t0) : TILE_ROWS;
    for (int r = 0; r < nr; r++) {
        const int64_t t = t0 + r, last = last0 + t;
        int64_t first = first_min;
        if (window > 0 && last - window + 1 > first) first = last - window + 1;
        tile[r] = (Row){first, last, last - first + 1, q + t * sq_t + kvh * G * sq_h, scratch,
                        scratch + (size_t)G * D, out + (t * H + kvh * G) * D};
        scratch += (size_t)G * D + (size_t)G * (tile[r].n > 0 ? tile[r].n : 0);
    }
    return nr;
}

/* q: [T, H, D] (rows `sq_t`, heads `sq_h` apart, unit inner stride); k, v: key rows
 * `stride_s`, KV heads `stride_h` apart (in elements), of float32, float16 or bfloat16
 * (`kind`; widened exactly as read). Query t sees key indices
 * [max(first_min, last0 + t - window + 1), last0 + t] (window <= 0: no window limit).
 * Key index i lives at row i, or, with a block table [blocks] of `block_size` rows and a
 * physical origin, at table[j / block_size] * block_size + j % block_size for
 * j = (origin + i) mod (block_size * blocks). out: [T, H, D] contiguous. D is a multiple of
 * 16. Returns 0, -1 on arguments it does not take, or -2 when out of memory. */
int muser_attention(const float *q, int64_t T, int64_t H, int64_t D, int64_t sq_t,
                    int64_t sq_h, const void *k, const void *v, int kind, int64_t stride_s,
                    int64_t stride_h, int64_t KVH, const int32_t *table, int64_t blocks,
                    int64_t block_size, int64_t origin, int64_t last0, int64_t first_min,
                    int64_t window, float scale, int threads, float *out)
{
    if (D % 16 || KVH < 1 || H % KVH || kind < KV_F32 || kind > KV_BF16) return -1;
    const int G = (int)(H / KVH);
    const int64_t hi = last0 + T - 1;
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
    const int64_t tiles = (T + TILE_ROWS - 1) / TILE_ROWS, tasks = tiles * KVH;
    const int64_t work = T * H * span * D;
    /* fewer tasks than threads (a decode step): the team shares each task */
    const int team = threads > 1 && tasks < threads && work >= TEAM_WORK
                     && (G == 1 || G == 2 || G == 4 || G == 8);
    if (!team && (tasks < 2 || work < (1 << 18))) threads = 1;
    /* per row of a tile: scaled queries and output [G, D] (o is `out` itself), scores */
    const size_t scratch_floats = (size_t)(T < TILE_ROWS ? T : TILE_ROWS)
                                  * ((size_t)G * D + (size_t)G * span + 16);
    float *shared = team ? malloc(scratch_floats * sizeof(float)) : NULL;
    if (team && !shared) {
        free(rows);
        return -2;
    }
    float sums[TILE_ROWS][8]; /* the team's softmax sums */
#pragma omp parallel num_threads(threads)
    {
        float *scratch = team ? shared : malloc(scratch_floats * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        if (team) {
            for (int64_t task = 0; task < tasks; task++) {
                Row tile[TILE_ROWS];
                const int nr = make_tile(tile, task, T, H, G, D, KVH, q, sq_t, sq_h, last0,
                                         first_min, window, scratch, out);
                attend_team_any(tile, nr, sq_h, G, D, &K, kind, task % KVH, scale, sums);
            }
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < tasks; task++) {
                if (!scratch) continue;
                Row tile[TILE_ROWS];
                const int nr = make_tile(tile, task, T, H, G, D, KVH, q, sq_t, sq_h, last0,
                                         first_min, window, scratch, out);
                attend_any(tile, nr, sq_h, G, D, &K, kind, task % KVH, scale);
            }
            free(scratch);
        }
    }
    free(shared);
    free(rows);
    return failed ? -2 : 0;
}

/* Sequence b's decode row for muser_decode_attention, on `threads` threads. */
static int decode_row(const float *q, int64_t b, int64_t H, int64_t D, int64_t sq_b,
                      int64_t sq_h, const void *k, const void *v, int kind, int64_t stride_s,
                      int64_t stride_h, int64_t KVH, const int32_t *tables, int64_t blocks,
                      int64_t block_size, const int32_t *starts, const int32_t *lens,
                      const int32_t *origins, float scale, int threads, float *out)
{
    float *o = out + b * H * D;
    if (lens[b] <= starts[b]) {
        for (int64_t x = 0; x < H * D; x++) o[x] = 0.0f;
        return 0;
    }
    return muser_attention(q + b * sq_b, 1, H, D, sq_b, sq_h, k, v, kind, stride_s, stride_h,
                           KVH, tables + b * blocks, blocks, block_size, origins[b],
                           lens[b] - 1, starts[b], 0, scale, threads, o);
}

/* One decode row for each of B sequences of a paged cache: row b, q[b] (rows `sq_b` apart),
 * sees key indices [starts[b], lens[b] - 1] placed by tables[b] ([B, blocks]) and origins[b]
 * as in muser_attention; a row with lens[b] <= starts[b] sees nothing and is zero. With at
 * least as many sequences as threads each thread takes whole sequences, else the threads share
 * each in turn: muser_attention of the row either way, so the bits are the same. out: [B, H, D]
 * contiguous. Returns 0, -1 or -2 as muser_attention. */
int muser_decode_attention(const float *q, int64_t B, int64_t H, int64_t D, int64_t sq_b,
                           int64_t sq_h, const void *k, const void *v, int kind,
                           int64_t stride_s,
                           int64_t stride_h, int64_t KVH, const int32_t *tables, int64_t blocks,
                           int64_t block_size, const int32_t *starts, const int32_t *lens,
                           const int32_t *origins, float scale, int threads, float *out)
{
    int rc = 0;
    if (B < threads) { /* the threads share each sequence in turn */
        for (int64_t b = 0; b < B && !rc; b++)
            rc = decode_row(q, b, H, D, sq_b, sq_h, k, v, kind, stride_s, stride_h, KVH, tables,
                            blocks, block_size, starts, lens, origins, scale, threads, out);
        return rc;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t b = 0; b < B; b++) { /* whole sequences a thread */
        const int r = decode_row(q, b, H, D, sq_b, sq_h, k, v, kind, stride_s, stride_h, KVH,
                                 tables, blocks, block_size, starts, lens, origins, scale, 1,
                                 out);
        if (r) {
#pragma omp atomic write
            rc = r;
        }
    }
    return rc;
}
