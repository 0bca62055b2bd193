/* Decode projections over GGUF block codes, for the CPU.
 *
 * A matrix W [M, K] is stored as int8 codes with one float32 scale (and, for K-quants, one
 * offset) per group of `group` columns, so W[m, k] = scales[m, g] * codes[m, k] - mins[m, g]
 * with g = k / group: exactly the float32 weights ggml's dequantization gives. Reading one
 * byte per weight instead of four is what makes decode fast: it is bound by memory traffic.
 *
 *   y[r, m] = sum_g scales[m, g] * (sum_{k in g} codes[m, k] * x[r, k])
 *           - sum_g mins[m, g] * xsum[r, g]          (xsum[r, g] = sum_{k in g} x[r, k])
 *
 * Every output row is computed by the same instruction sequence whatever `rows` is, so a
 * sequence's logits do not depend on how many others share its decode step. Vectors are
 * AVX-512 or AVX2 intrinsics where the compiler targets them, else 4-wide vector extensions.
 */
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 8

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf load_codes(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf load_x(const float *p) { return _mm512_loadu_ps(p); }
static inline vf fma_(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf splat(float s) { return _mm512_set1_ps(s); }
static inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf load_codes(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf load_x(const float *p) { return _mm256_loadu_ps(p); }
static inline vf fma_(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf splat(float s) { return _mm256_set1_ps(s); }
static inline float hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else /* portable: GCC/Clang vector extensions (NEON, SSE, ...) */
#define LANES 4
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
static inline vf vzero(void) { return (vf){0}; }
static inline vf load_codes(const int8_t *p) { return (vf){p[0], p[1], p[2], p[3]}; }
static inline vf load_x(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf fma_(vf a, vf b, vf c) { return a * b + c; }
static inline vf splat(float s) { return (vf){s, s, s, s}; }
static inline float hsum(vf v) { return (v[0] + v[1]) + (v[2] + v[3]); }
#endif

/* One weight row against `rows` activation rows; `rows` and `parts` are constants after
 * inlining, so the accumulators live in registers. (Interleaving several weight rows was
 * measured slower: one core's read rate, not FMA latency, is the limit, ~8 GB/s here.) */
static inline __attribute__((always_inline)) void row_dot(
    const float *x, int rows, int64_t K, const int8_t *c, const float *s, int64_t groups,
    int parts, float *out)
{
    vf acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = vzero();
    for (int64_t g = 0; g < groups; g++) {
        vf part[MAX_ROWS];
        for (int r = 0; r < rows; r++) part[r] = vzero();
        for (int p = 0; p < parts; p++) {
            const vf w = load_codes(c + (g * parts + p) * LANES);
            for (int r = 0; r < rows; r++)
                part[r] = fma_(w, load_x(x + r * K + (g * parts + p) * LANES), part[r]);
        }
        const vf scale = splat(s[g]);
        for (int r = 0; r < rows; r++) acc[r] = fma_(scale, part[r], acc[r]);
    }
    for (int r = 0; r < rows; r++) out[r] = hsum(acc[r]);
}

#define ROWS_CASE(R, P)                                                         \
    case R:                                                                     \
        for (int64_t m = m0; m < m1; m++)                                       \
            row_dot(x, R, K, codes + m * K, scales + m * groups, groups, P,     \
                    dots + (m - m0) * MAX_ROWS);                                \
        break;

#define ALL_ROWS(P)                                                                         \
    switch (rows) {                                                                         \
        ROWS_CASE(1, P) ROWS_CASE(2, P) ROWS_CASE(3, P) ROWS_CASE(4, P)                     \
        ROWS_CASE(5, P) ROWS_CASE(6, P) ROWS_CASE(7, P) ROWS_CASE(8, P)                     \
    }

#define BLOCK 64 /* weight rows per task: small enough to balance 640-row matrices */

/* x: [rows, K] f32; codes: [M, K] int8; scales, mins: [M, K / group] f32 (mins may be NULL);
 * xsum: [rows, K / group] f32 (unused without mins); y: [rows, M] f32. group is 16 or 32,
 * K a multiple of group, 1 <= rows <= 8. Returns 0, or -1 on arguments it does not take. */
int muser_qgemv(const float *x, int64_t rows, int64_t K, const int8_t *codes,
                const float *scales, const float *mins, const float *xsum, int64_t M,
                int64_t group, float *y, int threads)
{
    if (rows < 1 || rows > MAX_ROWS || (group != 16 && group != 32) || K % group) return -1;
    const int64_t groups = K / group;
    const int64_t tasks = (M + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t m0 = t * BLOCK, m1 = m0 + BLOCK < M ? m0 + BLOCK : M;
        float dots[BLOCK * MAX_ROWS];
        if (group == 16) {
            ALL_ROWS(16 / LANES)
        } else {
            ALL_ROWS(32 / LANES)
        }
        for (int64_t m = m0; m < m1; m++) {
            for (int r = 0; r < rows; r++) {
                float v = dots[(m - m0) * MAX_ROWS + r];
                if (mins) {
                    const float *mn = mins + m * groups, *xs = xsum + r * groups;
                    float off = 0.0f;
                    for (int64_t g = 0; g < groups; g++) off += mn[g] * xs[g];
                    v -= off;
                }
                y[r * M + m] = v;
            }
        }
    }
    return 0;
}
