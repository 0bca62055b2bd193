/* Row-wise float32 ops for the CPU at every width: RMSNorm (with the residual add), per-head
 * QK-norm + RoPE, RoPE angles and GeGLU. Each output row is a function of its own input row
 * alone, in a fixed order, so a row's bits do not depend on how many rows share the call.
 *
 * Sums run in 16 lanes (lane i takes elements i, i + 16, ...) combined by a fixed tree, so the
 * compiler may vectorize them without reordering anything. The math is muser.ops.ref's:
 * y = x * (1 / sqrt(mean(x^2) + eps)) * w, NeoX RoPE (rotate halves) after the per-head norm,
 * and gelu_tanh(gate) * up with tanh from muser_exp (exp.h).
 */
#include <math.h>
#include <stdint.h>

#include "exp.h"

static float inv_rms(const float *x, int64_t d, float eps) {
    float lane[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        for (int l = 0; l < 16; l++) lane[l] += x[i + l] * x[i + l];
    for (int l = 0; i + l < d; l++) lane[l] += x[i + l] * x[i + l];
    const float ss = muser_tree16(lane);
    return 1.0f / sqrtf(ss / (float)d + eps);
}

static int threads_for(int64_t rows, int64_t d) { return rows * d >= 65536 ? 2 : 1; }

/* y[r] = rms_norm(x[r], w); x rows `stride_x` apart, y contiguous [rows, d]. */
void muser_rms_norm(const float *x, int64_t rows, int64_t d, int64_t stride_x, const float *w,
                    float eps, float *y)
{
#pragma omp parallel for num_threads(threads_for(rows, d)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride_x;
        const float inv = inv_rms(xr, d, eps);
        for (int64_t i = 0; i < d; i++) y[r * d + i] = xr[i] * inv * w[i];
    }
}

/* h = res + rms_norm(x, post); y = rms_norm(h, next); all [rows, d] contiguous. */
void muser_add_rms_norm(const float *res, const float *x, int64_t rows, int64_t d,
                        const float *post, const float *next, float eps, float *h, float *y)
{
#pragma omp parallel for num_threads(threads_for(rows, d)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d, *rr = res + r * d;
        float *hr = h + r * d;
        const float inv = inv_rms(xr, d, eps);
        for (int64_t i = 0; i < d; i++) hr[i] = rr[i] + xr[i] * inv * post[i];
        const float inv2 = inv_rms(hr, d, eps);
        for (int64_t i = 0; i < d; i++) y[r * d + i] = hr[i] * inv2 * next[i];
    }
}

/* out[r, h] = rope(rms_norm(x[r, h], w)); x: rows `stride_r`, heads `stride_h` apart, unit
 * inner stride; cos/sin: [rows, hd / 2]; out: contiguous [rows, heads, hd]. */
void muser_qk_norm_rope(const float *x, int64_t rows, int64_t heads, int64_t hd,
                        int64_t stride_r, int64_t stride_h, const float *w, const float *cos,
                        const float *sin, float eps, float *out)
{
    const int64_t half = hd / 2;
#pragma omp parallel for num_threads(threads_for(rows, heads * hd)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + r * stride_r + h * stride_h;
            float *o = out + (r * heads + h) * hd;
            const float inv = inv_rms(xh, hd, eps);
            for (int64_t i = 0; i < half; i++) {
                const float x1 = xh[i] * inv * w[i], x2 = xh[half + i] * inv * w[half + i];
                o[i] = x1 * c[i] - x2 * s[i];
                o[half + i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* cos/sin[r, i] of the angle (float)positions[r] * inv_freq[i]; [rows, half] each. */
void muser_rope_cos_sin(const int64_t *positions, int64_t rows, const float *inv_freq,
                        int64_t half, float *cos_out, float *sin_out)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < half; i++) {
            const float a = (float)positions[r] * inv_freq[i];
            cos_out[r * half + i] = cosf(a);
            sin_out[r * half + i] = sinf(a);
        }
}

/* y[r] = gelu_tanh(g) * u for g = x[r, :d], u = x[r, d:]; x: [rows, 2d], y: [rows, d]. */
void muser_geglu(const float *x, int64_t rows, int64_t d, float *y)
{
    const float k0 = 0.7978845608028654f, k1 = 0.044715f; /* sqrt(2 / pi) */
#pragma omp parallel for num_threads(threads_for(rows, d)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * 2 * d, *u = g + d;
        for (int64_t i = 0; i < d; i++) {
            const float v = g[i];
            const float t = muser_tanh(k0 * (v + k1 * v * v * v));
            y[r * d + i] = 0.5f * v * (1.0f + t) * u[i];
        }
    }
}
