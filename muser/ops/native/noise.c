/* The sampler's draw for the CPU (muser/sampler.py `gumbel_argmax`, its torch reference): per
 * row, the kept token that maximizes
 *
 *     score = logit / temperature + g,   g = -log(-log u),
 *     u = ((mix(key + t * G) >> 12) + 1/2) * 2^-52,
 *
 * for token id t, with mix splitmix64's finalizer, G its odd increment and all integer
 * arithmetic mod 2^64: the same u, bit for bit, as the torch expression. Ties go to the first
 * index, as torch.argmax's do. The logs are libm's; torch's may differ from them in the last
 * bit, which could change a token only between two scores ~1e-16 apart.
 *
 * Most tokens are ruled out without a log. With E = -log u, g > d needs E < exp(-d), and
 * E >= 1 - u (log x <= x - 1). 1 - u is exact in a double; let 2^e <= 1 - u. If
 * d >= (1 - e) ln 2, then exp(-d) <= 2^(e-1) <= (1 - u) / 2 <= E / 2, so g <= d - ln 2: a token
 * whose a = logit / temperature is that far below the best score so far, S (d = S - a), scores
 * at least ln 2 below S and can be neither the best nor a tie, whatever the last bits of any
 * rounding (~1e-15 of |S|). Since 1 - u >= 2^-53, a token with d >= 54 ln 2 is ruled out
 * before its hash. The scan starts from the exact score of the row's largest kept logit, so S
 * is near the final best from the first token on.
 */
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline uint64_t mix(uint64_t x)
{
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static inline double uniform(uint64_t key, int64_t token)
{
    const uint64_t gamma = 0x9E3779B97F4A7C15ull;
    return ((double)(mix(key + (uint64_t)token * gamma) >> 12) + 0.5) * 0x1p-52;
}

typedef struct {
    double score;
    int64_t at; /* -1: none */
} Best;

/* b beats a: a higher score, or the same at a lower index. */
static inline int beats(Best b, Best a)
{
    return a.at < 0 || b.score > a.score || (b.score == a.score && b.at < a.at);
}

/* out[r] = ids[r][j] of the best kept j (with none kept, ids[r][0], as torch.argmax over a row
 * of -inf gives). Rows `*_stride` elements apart, unit stride within a row. */
void muser_gumbel_argmax(const float *values, int64_t values_stride, const int64_t *ids,
                         int64_t ids_stride, const uint8_t *keep, int64_t keep_stride,
                         int64_t rows, int64_t n, const int64_t *keys, const double *temperature,
                         int threads, int64_t *out)
{
    const double ln2 = 0.69314718055994530942;
    for (int64_t r = 0; r < rows; r++) {
        const float *v = values + r * values_stride;
        const int64_t *t = ids + r * ids_stride;
        const uint8_t *k = keep + r * keep_stride;
        const uint64_t key = (uint64_t)keys[r];
        const double temp = temperature[r];
        int64_t top = -1;
        for (int64_t j = 0; j < n; j++)
            if (k[j] && (top < 0 || v[j] > v[top])) top = j;
        if (top < 0) {
            out[r] = t[0];
            continue;
        }
        const Best first = {(double)v[top] / temp + -log(-log(uniform(key, t[top]))), top};
        const int team = n < 16384 ? 1 : threads < 64 ? threads : 64;
        Best part[64];
        for (int i = 0; i < team; i++) part[i] = first;
#pragma omp parallel num_threads(team)
        {
            Best best = first;
#pragma omp for schedule(static) nowait
            for (int64_t j = 0; j < n; j++) {
                if (!k[j] || j == top) continue;
                const double a = (double)v[j] / temp;
                const double d = best.score - a;
                if (d >= 54 * ln2) continue;
                const double u = uniform(key, t[j]);
                int e;
                frexp(1.0 - u, &e); /* 1 - u in [2^(e-1), 2^e) */
                if (d >= (2 - e) * ln2) continue;
                const Best here = {a + -log(-log(u)), j};
                if (beats(here, best)) best = here;
            }
#ifdef _OPENMP
            part[omp_get_thread_num()] = best;
#else
            part[0] = best;
#endif
        }
        Best best = first;
        for (int i = 0; i < team; i++)
            if (beats(part[i], best)) best = part[i];
        out[r] = t[best.at];
    }
}
