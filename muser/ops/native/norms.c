/* Decode-width RMSNorm and QK-norm + RoPE for the CPU: a few rows of float32, where torch's
 * per-op dispatch costs more than the arithmetic. Each output row is computed on its own, in a
 * fixed order; the math is muser.ops.ref's: y = x * rsqrt(mean(x^2) + eps) * w, and NeoX RoPE
 * (rotate halves) after the per-head norm. */
#include <math.h>
#include <stdint.h>

static inline float inv_rms(const float *x, int64_t d, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)d + eps);
}

/* y[r] = rms_norm(x[r], w); x rows `stride_x` apart, y contiguous [rows, d]. */
void muser_rms_norm(const float *x, int64_t rows, int64_t d, int64_t stride_x, const float *w,
                    float eps, float *y)
{
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
