/* Projections for the CPU at every width: y[N, M] = x[N, K] . W[M, K]^T, float32.
 *
 * One reduction order per output element, whatever N is: y[r, m] is the FMA chain
 *
 *     acc = 0;  for k = 0 .. K-1:  acc = fma(W[m, k], x[r, k], acc)
 *
 * so a row's bits do not depend on how many rows share the call, how they are tiled or which
 * thread computes them: a decode step, a 64-row chunk and a 512-row chunk agree bitwise. FMA is
 * correctly rounded, so the AVX-512, AVX2 and portable builds agree too.
 *
 * W is stored in panels of 16 rows, element (m, k) at w[m / 16][k][m % 16]: vectors run across
 * 16 output rows, never along k, so no horizontal sum reorders a dot product. W[m, k] is one of
 *   codes  int8 code * scale - min (mul, then sub: ggml's float32 dequantization), scales and
 *          mins [panels][K / group][16] float32 (mins may be NULL); FMT_CODES_H: scales held
 *          as float16 (Q8_0, Q4_0, Q5_0 scales are float16 values in the file), no mins;
 *   f32 | f16 | bf16  the value itself, widened exactly.
 * Wide calls widen a block of panels into float32 once and run every row tile over it; narrow
 * calls (decode) widen each vector as they go. Both feed the same FMA with the same W[m, k].
 */
#include <stdint.h>
#include <stdlib.h>

enum { FMT_F32 = 0, FMT_F16 = 1, FMT_BF16 = 2, FMT_CODES = 3, FMT_CODES_H = 4,
       FMT_CODES_M = 5 /* inside: FMT_CODES with mins */ };

#include "vec.h"

/* WIDE_PANELS x NR_WIDE: panels per task and rows per tile of a wide call (AVX-512: 2 x 12 = 24
 * accumulators; AVX2: 1 x 6 = 12 of its 16 registers). NR_NARROW: the most rows per tile of a
 * narrow call, which takes as few panels a task as keep CHAINS independent FMA chains going
 * (rows x panels x the registers of a 16-float vector: the FMA latency covered), so each
 * panel's weights are widened once per tile and its accumulators, weight vectors and group
 * scales stay in registers (bench/cpu_ab.py, bench/results/cpu_ab.json, docs/cpu.md); AVX-512's
 * narrow tiles follow the same rule (one row: 4 panels). */
#if VEC_REGS >= 32
#define WIDE_PANELS 2
#define NR_WIDE 12
#define NR_NARROW 8
#define V16_REGS 1
#elif VEC_REGS >= 8
#define WIDE_PANELS 1
#define NR_WIDE 6
#define NR_NARROW 4
#define V16_REGS 2
#else
#define WIDE_PANELS 2
#define NR_WIDE 4
#define NR_NARROW 4
#define V16_REGS 16 /* scalar lanes: no latency to cover */
#endif
#define CHAINS 4

/* Panels a task of a narrow call of N rows: 1, 2 or 4. */
static int narrow_panels(int64_t N)
{
    const int64_t per_panel = (N < NR_NARROW ? N : NR_NARROW) * V16_REGS;
    return per_panel >= CHAINS ? 1 : 2 * per_panel >= CHAINS ? 2 : 4;
}

#define WIDE_ROWS 16 /* calls with at least this many rows widen their panels once */

typedef struct {
    const void *w;
    int fmt;
    const void *scales;
    const float *mins;
    int64_t K, groups, group;
} Weights;

/* The scales (and mins) of panel p's group g as float32 vectors: loaded once per group. */
typedef struct {
    v16 s, m;
} Group;

static inline __attribute__((always_inline)) Group wgroup(const Weights *W, int fmt, int64_t p,
                                                          int64_t g)
{
    Group G = {vzero(), vzero()};
    const int64_t at = (p * W->groups + g) * 16;
    if (fmt == FMT_CODES || fmt == FMT_CODES_M) G.s = vload((const float *)W->scales + at);
    if (fmt == FMT_CODES_H) G.s = vhalf((const uint16_t *)W->scales + at);
    if (fmt == FMT_CODES_M) G.m = vload(W->mins + at);
    return G;
}

/* W[16p .. 16p + 15, k] as float32 (G: the group of k, for the code formats). */
static inline __attribute__((always_inline)) v16 wvec(const Weights *W, int fmt, int64_t p,
                                                       int64_t k, const Group *G)
{
    const int64_t at = (p * W->K + k) * 16;
    switch (fmt) {
    case FMT_F16: return vhalf((const uint16_t *)W->w + at);
    case FMT_BF16: return vbf16((const uint16_t *)W->w + at);
    case FMT_CODES:
    case FMT_CODES_H: return vmul(vcodes((const int8_t *)W->w + at), G->s);
    case FMT_CODES_M: return vsub(vmul(vcodes((const int8_t *)W->w + at), G->s), G->m);
    default: return vload((const float *)W->w + at);
    }
}

/* Rows x[0 .. NR) against panels p0 .. p0 + MV; every loop bound but K is a constant after
 * inlining, so the accumulators stay in registers. x[r, k] is x[r * ldx + k], or, with
 * ldx == 0, x[k * NR_WIDE + r] (a row tile packed by pack_rows). */
static inline __attribute__((always_inline)) void tile(
    const Weights *W, int fmt, int64_t p0, int MV, const float *x, int64_t ldx, int NR,
    float *y, int64_t ldy, int64_t M)
{
    v16 acc[4][12]; /* the widest case of ROWS12; a build uses at most NR_WIDE */
    for (int i = 0; i < MV; i++)
        for (int r = 0; r < NR; r++) acc[i][r] = vzero();
    const int64_t step = fmt >= FMT_CODES ? W->group : W->K; /* k per group */
    for (int64_t k0 = 0; k0 < W->K; k0 += step) {
        Group G[4];
        for (int i = 0; i < MV; i++) G[i] = wgroup(W, fmt, p0 + i, k0 / step);
        for (int64_t k = k0; k < k0 + step; k++) {
            v16 w[4];
            for (int i = 0; i < MV; i++) w[i] = wvec(W, fmt, p0 + i, k, &G[i]);
            for (int r = 0; r < NR; r++) {
                const v16 xr = vsplat(ldx ? x[r * ldx + k] : x[k * NR_WIDE + r]);
                for (int i = 0; i < MV; i++) acc[i][r] = vfma(w[i], xr, acc[i][r]);
            }
        }
    }
    for (int i = 0; i < MV; i++) {
        const int64_t m = (p0 + i) * 16;
        const int n = M - m < 16 ? (int)(M - m) : 16;
        for (int r = 0; r < NR; r++) vstore(y + r * ldy + m, acc[i][r], n);
    }
}

#define CASE(R, MV, FMT) \
    case R: tile(W, FMT, p0, MV, x, ldx, R, y, ldy, M); break;
#define ROWS8(MV, FMT)                                                                \
    CASE(1, MV, FMT) CASE(2, MV, FMT) CASE(3, MV, FMT) CASE(4, MV, FMT)               \
    CASE(5, MV, FMT) CASE(6, MV, FMT) CASE(7, MV, FMT) CASE(8, MV, FMT)
#define ROWS12(MV, FMT) ROWS8(MV, FMT) CASE(9, MV, FMT) CASE(10, MV, FMT)              \
    CASE(11, MV, FMT) CASE(12, MV, FMT)
/* NOTE: a tile of more than NR_NARROW rows is only ever float32 (a wide call's widened or
 * float32 panels), so only float32 has those cases: the other formats' would be dead code
 * that costs most of the build's time */
#if NR_NARROW <= 4
#define ROWS_NARROW(MV, FMT) CASE(1, MV, FMT) CASE(2, MV, FMT) CASE(3, MV, FMT) CASE(4, MV, FMT)
#else
#define ROWS_NARROW(MV, FMT) ROWS8(MV, FMT)
#endif
#if NR_WIDE <= 4
#define ROWS_WIDE(MV, FMT) CASE(1, MV, FMT) CASE(2, MV, FMT) CASE(3, MV, FMT) CASE(4, MV, FMT)
#elif NR_WIDE <= 6
#define ROWS_WIDE(MV, FMT) ROWS_NARROW(MV, FMT) CASE(5, MV, FMT) CASE(6, MV, FMT)
#else
#define ROWS_WIDE(MV, FMT) ROWS12(MV, FMT)
#endif

/* One row tile (nr <= NR_WIDE for float32, else nr <= NR_NARROW) over `mv` panels from p0,
 * weights of format `fmt`. */
static void run_tile(const Weights *W, int64_t p0, int mv, const float *x, int64_t ldx, int nr,
                     float *y, int64_t ldy, int64_t M)
{
    const int fmt = W->fmt;
#define FORMATS(MV, F32_ROWS)                                                    \
    switch (fmt) {                                                               \
    case FMT_CODES: switch (nr) { ROWS_NARROW(MV, FMT_CODES) } break;            \
    case FMT_CODES_M: switch (nr) { ROWS_NARROW(MV, FMT_CODES_M) } break;        \
    case FMT_CODES_H: switch (nr) { ROWS_NARROW(MV, FMT_CODES_H) } break;        \
    case FMT_F16: switch (nr) { ROWS_NARROW(MV, FMT_F16) } break;                \
    case FMT_BF16: switch (nr) { ROWS_NARROW(MV, FMT_BF16) } break;              \
    default: switch (nr) { F32_ROWS(MV, FMT_F32) } break;                        \
    }
    if (mv == 4) { FORMATS(4, ROWS_NARROW) } /* NOTE: 4 panels a task: narrow calls only */
    else if (mv == 2) { FORMATS(2, ROWS_WIDE) }
    else { FORMATS(1, ROWS_WIDE) }
#undef FORMATS
}

/* Every row tile of x over panels [p0, p0 + mv), at most `tile_rows` rows at a time, in tiles
 * of equal size but the last (x rows `ldx` apart), or (ldx == 0) of NR_WIDE rows as pack_rows
 * packs them. */
static void run_rows(const Weights *W, int64_t p0, int mv, const float *x, int64_t N,
                     int64_t ldx, int tile_rows, float *y, int64_t ldy, int64_t M)
{
    if (ldx) { /* 5 rows by 4: 3 + 2, not 4 + 1 (a one-row tile is one FMA chain a panel) */
        const int64_t tiles = (N + tile_rows - 1) / tile_rows;
        tile_rows = (int)((N + tiles - 1) / tiles);
    }
    for (int64_t r = 0; r < N; r += tile_rows) {
        const int nr = N - r < tile_rows ? (int)(N - r) : tile_rows;
        const float *xt = ldx ? x + r * ldx : x + r * W->K;
        if (mv == 4 || mv == 2 || mv == 1) {
            run_tile(W, p0, mv, xt, ldx, nr, y + r * ldy, ldy, M);
        } else {
            for (int i = 0; i < mv; i++)
                run_tile(W, p0 + i, 1, xt, ldx, nr, y + r * ldy, ldy, M);
        }
    }
}

/* xp[t][k][r] = x[t * NR_WIDE + r, k] for row tile t (rows past N are zero): each k of a tile
 * is one contiguous run of NR_WIDE values, which the tile broadcasts from one base. */
static void pack_rows(const float *x, int64_t N, int64_t K, int64_t ldx, float *xp)
{
    const int64_t tiles = (N + NR_WIDE - 1) / NR_WIDE;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        float *dst = xp + t * K * NR_WIDE;
        for (int64_t k = 0; k < K; k++)
            for (int r = 0; r < NR_WIDE; r++) {
                const int64_t row = t * NR_WIDE + r;
                dst[k * NR_WIDE + r] = row < N ? x[row * ldx + k] : 0.0f;
            }
    }
}

/* x: [N, K] rows `ldx` apart; w: panels [ceil(M / 16), K, 16] of `fmt` (scales / mins:
 * [panels, K / group, 16] for the code formats); y: [N, M] rows `ldy` apart. Returns 0, or -1
 * on arguments it does not take, -2 when out of memory. */
int muser_gemm(const float *x, int64_t N, int64_t K, int64_t ldx, const void *w, int fmt,
               const void *scales, const float *mins, int64_t group, int64_t M, float *y,
               int64_t ldy, int threads)
{
    const int codes = fmt == FMT_CODES || fmt == FMT_CODES_H;
    if (N < 1 || K < 1 || M < 1 || ldx < K || ldy < M) return -1;
    if (fmt < 0 || fmt > FMT_CODES_H) return -1;
    if (codes && (group < 1 || K % group || !scales)) return -1;
    if (fmt == FMT_CODES_H && mins) return -1;
    const Weights W = {w, fmt == FMT_CODES && mins ? FMT_CODES_M : fmt, scales, mins, K,
                       codes ? K / group : 0, group};
    const int64_t panels = (M + 15) / 16;
    const int wide = N >= WIDE_ROWS;
    const int per_task = wide ? WIDE_PANELS : narrow_panels(N);
    const int64_t tasks = (panels + per_task - 1) / per_task;
    int failed = 0;
    if (threads > tasks) threads = (int)tasks;
    const int64_t row_tiles = (N + NR_WIDE - 1) / NR_WIDE;
    float *xp = wide ? malloc((size_t)row_tiles * K * NR_WIDE * sizeof(float)) : NULL;
    if (wide && !xp) return -2;
#pragma omp parallel num_threads(threads)
    {
        if (wide) pack_rows(x, N, K, ldx, xp); /* ends with the loop's barrier */
        /* a wide call widens its panels into float32 once per task (not for f32 weights) */
        float *buf = NULL;
        if (wide && fmt != FMT_F32) {
            buf = malloc((size_t)per_task * K * 16 * sizeof(float));
            if (!buf) {
#pragma omp atomic write
                failed = 1;
            }
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t p0 = t * per_task;
            const int mv = panels - p0 < per_task ? (int)(panels - p0) : per_task;
            if (!wide) {
                run_rows(&W, p0, mv, x, N, ldx, NR_NARROW, y, ldy, M);
            } else if (fmt == FMT_F32) {
                run_rows(&W, p0, mv, xp, N, 0, NR_WIDE, y, ldy, M);
            } else if (buf) {
                const int64_t step = codes ? group : K; /* k per group */
                for (int i = 0; i < mv; i++)
                    for (int64_t k0 = 0; k0 < K; k0 += step) {
                        const Group G = wgroup(&W, W.fmt, p0 + i, k0 / step);
                        for (int64_t k = k0; k < k0 + step; k++)
                            vstore(buf + ((int64_t)i * K + k) * 16,
                                   wvec(&W, W.fmt, p0 + i, k, &G), 16);
                    }
                const Weights F = {buf, FMT_F32, NULL, NULL, K, 0, 0};
                /* panels of buf are numbered from 0; shift y so its columns line up */
                run_rows(&F, 0, mv, xp, N, 0, NR_WIDE, y + p0 * 16, ldy, M - p0 * 16);
            }
        }
        free(buf);
    }
    free(xp);
    return failed ? -2 : 0;
}
