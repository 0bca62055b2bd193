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
 *   f32 | f16 | bf16  the value itself, widened exactly;
 *   packed codes at the file's own width, unpacked in registers to the same integers:
 *          FMT_Q4_M 4-bit codes 0 .. 15 (Q4_K), float32 scales and mins, bytes
 *          [panels][K / 2][16], byte (p, j, r) = code(2j) | code(2j + 1) << 4;
 *          FMT_Q5_H 5-bit codes -16 .. 15 (Q5_0) held as code + 16, float16 scales, blocks of
 *          8 k [panels][K / 8][80]: 64 bytes of nibbles as FMT_Q4_M's (4 pairs x 16 rows),
 *          then 16 bytes whose bit i is bit 4 of row r's k = 8b + i.
 * Wide calls widen a block of panels into float32 once and run every row tile over it; narrow
 * calls (decode) widen each vector as they go. Both feed the same FMA with the same W[m, k].
 */
#include <stdint.h>
#include <stdlib.h>

enum { FMT_F32 = 0, FMT_F16 = 1, FMT_BF16 = 2, FMT_CODES = 3, FMT_CODES_H = 4,
       FMT_CODES_M = 5 /* inside: FMT_CODES with mins */, FMT_Q4_M = 6, FMT_Q5_H = 7 };
#define PACKED(fmt) ((fmt) == FMT_Q4_M || (fmt) == FMT_Q5_H)
#define PACK_K 8 /* k a packed format unpacks at a time (a group is a multiple of it) */

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
static inline int narrow_panels(int64_t N)
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
    if (fmt == FMT_CODES || fmt == FMT_CODES_M || fmt == FMT_Q4_M)
        G.s = vload((const float *)W->scales + at);
    if (fmt == FMT_CODES_H || fmt == FMT_Q5_H) G.s = vhalf((const uint16_t *)W->scales + at);
    if (fmt == FMT_CODES_M || fmt == FMT_Q4_M) G.m = vload(W->mins + at);
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

/* W[16p .. 16p + 15, kb + j] of a packed format (kb a multiple of PACK_K, j < PACK_K a
 * constant after unrolling): the same float32 values as its int8 codes would give. */
static inline __attribute__((always_inline)) v16 wpacked(const Weights *W, int fmt, int64_t p,
                                                          int64_t kb, int j, const Group *G)
{
    const uint8_t *w = (const uint8_t *)W->w;
    if (fmt == FMT_Q4_M) {
        const vi16 b = vbytes(w + (p * W->K + kb + j - (j & 1)) * 8);
        const vi16 code = (j & 1) ? vi_shr(b, 4) : vi_and(b, vi_set(15));
        return vsub(vmul(vi_float(code), G->s), G->m);
    }
    const uint8_t *block = w + (p * W->K + kb) * 10; /* FMT_Q5_H: 80 bytes per 8 k */
    const vi16 b = vbytes(block + (j >> 1) * 16);
    const vi16 low = (j & 1) ? vi_shr(b, 4) : vi_and(b, vi_set(15));
    /* code + 16 = low + 16 * bit: code = low - 16 where the bit is clear, else low */
    return vmul(vi_float(vi_high5(low, block + 64, j)), G->s);
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
        if (PACKED(fmt)) { /* NOTE: the same FMA chain in k order; only the unpacking differs */
            for (int64_t kb = k0; kb < k0 + step; kb += PACK_K) {
#pragma GCC unroll 8
                for (int j = 0; j < PACK_K; j++) {
                    v16 w[4];
                    for (int i = 0; i < MV; i++) w[i] = wpacked(W, fmt, p0 + i, kb, j, &G[i]);
                    for (int r = 0; r < NR; r++) {
                        const v16 xr = vsplat(x[r * ldx + kb + j]);
                        for (int i = 0; i < MV; i++) acc[i][r] = vfma(w[i], xr, acc[i][r]);
                    }
                }
            }
            continue;
        }
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

/* NOTE: a tile of several panels is built only where a call reaches it (a narrow call of R
 * rows takes narrow_panels(R) panels a task, a wide one WIDE_PANELS of float32): any other is
 * run one panel at a time, the same bits (each output is its own chain), and not compiled */
#define REACHED(R, MV, FMT) \
    ((MV) == 1 || narrow_panels(R) == (MV) || ((FMT) == FMT_F32 && (MV) <= WIDE_PANELS))
#define CASE(R, MV, FMT)                                                          \
    case R:                                                                       \
        if (REACHED(R, MV, FMT)) tile(W, FMT, p0, MV, x, ldx, R, y, ldy, M);      \
        else for (int i = 0; i < (MV); i++) tile(W, FMT, p0 + i, 1, x, ldx, R, y, ldy, M); \
        break;
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
    case FMT_Q4_M: switch (nr) { ROWS_NARROW(MV, FMT_Q4_M) } break;              \
    case FMT_Q5_H: switch (nr) { ROWS_NARROW(MV, FMT_Q5_H) } break;              \
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

/* Panel p of W as float32 into out[K][16]: the values every tile multiplies. */
static void widen(const Weights *W, int64_t p, float *out)
{
    const int64_t step = W->fmt >= FMT_CODES ? W->group : W->K; /* k per group */
    for (int64_t k0 = 0; k0 < W->K; k0 += step) {
        const Group G = wgroup(W, W->fmt, p, k0 / step);
        if (W->fmt == FMT_Q4_M || W->fmt == FMT_Q5_H) {
            for (int64_t kb = k0; kb < k0 + step; kb += PACK_K)
#pragma GCC unroll 8
                for (int j = 0; j < PACK_K; j++)
                    vstore16(out + (kb + j) * 16, W->fmt == FMT_Q4_M
                             ? wpacked(W, FMT_Q4_M, p, kb, j, &G)
                             : wpacked(W, FMT_Q5_H, p, kb, j, &G));
            continue;
        }
        for (int64_t k = k0; k < k0 + step; k++)
            vstore16(out + k * 16, wvec(W, W->fmt, p, k, &G));
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

/* Which vector build this is: "avx512", "avx2" or "portable" (vec.h). */
const char *muser_isa(void) { return VEC_ISA; }

/* x: [N, K] rows `ldx` apart; w: panels [ceil(M / 16), K, 16] of `fmt` (scales / mins:
 * [panels, K / group, 16] for the code formats); y: [N, M] rows `ldy` apart. Returns 0, or -1
 * on arguments it does not take, -2 when out of memory. */
int muser_gemm(const float *x, int64_t N, int64_t K, int64_t ldx, const void *w, int fmt,
               const void *scales, const float *mins, int64_t group, int64_t M, float *y,
               int64_t ldy, int threads)
{
    const int codes = fmt == FMT_CODES || fmt == FMT_CODES_H || PACKED(fmt);
    if (N < 1 || K < 1 || M < 1 || ldx < K || ldy < M) return -1;
    if (fmt < 0 || fmt > FMT_Q5_H || fmt == FMT_CODES_M) return -1;
    if (codes && (group < 1 || K % group || !scales)) return -1;
    if ((fmt == FMT_CODES_H || fmt == FMT_Q5_H) && mins) return -1;
    if (PACKED(fmt) && group % PACK_K) return -1;
    if (fmt == FMT_Q4_M && !mins) return -1;
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
                for (int i = 0; i < mv; i++) widen(&W, p0 + i, buf + (int64_t)i * K * 16);
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
