/* Shared by the CPU kernels: exp and tanh built from basic float ops only, and the fixed
 * 16-lane summation tree. No libm call and no reassociation: a loop over these vectorizes
 * without changing one bit, and every build computes the same function. */
#ifndef MUSER_EXP_H
#define MUSER_EXP_H

#include <stdint.h>
#include <string.h>

/* exp(x) for float32 (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial;
 * ~1 ulp); 0 below -87, x clamped to 88 above. */
static inline float muser_exp(float x) {
    const float lo = -87.0f, hi = 88.0f;
    const float xc = x < lo ? lo : (x > hi ? hi : x);
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (xc * 1.44269504088896341f + magic) - magic;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    const float z = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * z + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < lo ? 0.0f : p * scale;
}

/* tanh(u) = sign(u) (1 - 2 / (exp(2|u|) + 1)); absolute error ~1e-7. */
static inline float muser_tanh(float u) {
    const float a = u < 0.0f ? -u : u;
    const float t = 1.0f - 2.0f / (muser_exp(2.0f * a) + 1.0f);
    return u < 0.0f ? -t : t;
}

/* lane[0] + ... + lane[15] as the tree (i, i + 8), (i, i + 4), (i, i + 2), (i, i + 1). */
static inline float muser_tree16(float *lane) {
    for (int s = 8; s >= 1; s /= 2)
        for (int i = 0; i < s; i++) lane[i] += lane[i + s];
    return lane[0];
}

#endif
