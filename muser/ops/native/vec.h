/* 16-float vectors for the CPU kernels: one AVX-512 register, two AVX2 registers, or 16 scalar
 * lanes. Every operation is one IEEE operation per lane (FMA fused, correctly rounded), so the
 * three builds compute the same bits. VEC_REGS: 16-float registers available (0: portable);
 * VEC_ISA: the build's name (muser_isa). */
#ifndef MUSER_VEC_H
#define MUSER_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 v16;
static inline v16 vzero(void) { return _mm512_setzero_ps(); }
static inline v16 vload(const float *p) { return _mm512_loadu_ps(p); }
static inline v16 vsplat(float s) { return _mm512_set1_ps(s); }
static inline v16 vfma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 vmul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 vsub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 vdiv(v16 a, v16 b) { return _mm512_div_ps(a, b); }
static inline v16 vcodes(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline v16 vhalf(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline v16 vbf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline void vstore(float *p, v16 v, int n) {
    if (n == 16) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}
/* 16 int32 lanes: packed codes unpacked in registers (gemm.c) */
typedef __m512i vi16;
static inline vi16 vbytes(const uint8_t *p) { /* 16 bytes, zero-extended */
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline vi16 vi_set(int32_t s) { return _mm512_set1_epi32(s); }
static inline vi16 vi_and(vi16 a, vi16 b) { return _mm512_and_si512(a, b); }
static inline vi16 vi_andnot(vi16 a, vi16 b) { return _mm512_andnot_si512(a, b); } /* ~a & b */
static inline vi16 vi_sub(vi16 a, vi16 b) { return _mm512_sub_epi32(a, b); }
#define vi_shl(a, n) _mm512_slli_epi32(a, n)
#define vi_shr(a, n) _mm512_srli_epi32(a, n)
static inline v16 vi_float(vi16 a) { return _mm512_cvtepi32_ps(a); }
/* low - 16 in the lanes r whose bit j of high[r] is clear (a 5-bit code's high bit) */
static inline vi16 vi_high5(vi16 low, const uint8_t *high, int j) {
    const __mmask16 clear = _mm_testn_epi8_mask(_mm_loadu_si128((const __m128i *)high),
                                                _mm_set1_epi8((char)(1 << j)));
    return _mm512_mask_sub_epi32(low, clear, low, _mm512_set1_epi32(16));
}
#define VEC_REGS 32
#define VEC_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
typedef struct { __m256 lo, hi; } v16;
static inline v16 vzero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 vload(const float *p) {
    return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline v16 vsplat(float s) { return (v16){_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
static inline v16 vfma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline v16 vmul(v16 a, v16 b) {
    return (v16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
static inline v16 vsub(v16 a, v16 b) {
    return (v16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
}
static inline v16 vdiv(v16 a, v16 b) {
    return (v16){_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
}
static inline __m256 cvt8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline v16 vcodes(const int8_t *p) { return (v16){cvt8(p), cvt8(p + 8)}; }
static inline v16 vhalf(const uint16_t *p) {
    return (v16){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}
static inline __m256 bf8(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline v16 vbf16(const uint16_t *p) { return (v16){bf8(p), bf8(p + 8)}; }
static inline void vstore(float *p, v16 v, int n) {
    if (n == 16) {
        _mm256_storeu_ps(p, v.lo);
        _mm256_storeu_ps(p + 8, v.hi);
        return;
    }
    float t[16];
    _mm256_storeu_ps(t, v.lo);
    _mm256_storeu_ps(t + 8, v.hi);
    memcpy(p, t, (size_t)n * sizeof(float));
}
typedef struct { __m256i lo, hi; } vi16;
static inline vi16 vbytes(const uint8_t *p) {
    return (vi16){_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                  _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
}
static inline vi16 vi_set(int32_t s) { return (vi16){_mm256_set1_epi32(s), _mm256_set1_epi32(s)}; }
static inline vi16 vi_and(vi16 a, vi16 b) {
    return (vi16){_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)};
}
static inline vi16 vi_andnot(vi16 a, vi16 b) {
    return (vi16){_mm256_andnot_si256(a.lo, b.lo), _mm256_andnot_si256(a.hi, b.hi)};
}
static inline vi16 vi_sub(vi16 a, vi16 b) {
    return (vi16){_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)};
}
#define vi_shl(a, n) ((vi16){_mm256_slli_epi32((a).lo, n), _mm256_slli_epi32((a).hi, n)})
#define vi_shr(a, n) ((vi16){_mm256_srli_epi32((a).lo, n), _mm256_srli_epi32((a).hi, n)})
static inline v16 vi_float(vi16 a) {
    return (v16){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)};
}
static inline vi16 vi_high5(vi16 low, const uint8_t *high, int j) {
    const vi16 h = vbytes(high);
    const vi16 at4 = j <= 4 ? vi_shl(h, 4 - j) : vi_shr(h, j - 4); /* bit j at bit 4 */
    return vi_sub(low, vi_andnot(at4, vi_set(16)));
}
#define VEC_REGS 8
#define VEC_ISA "avx2"
#else /* portable: one fmaf per lane */
typedef struct { float f[16]; } v16;
static inline v16 vzero(void) { v16 v = {{0}}; return v; }
static inline v16 vload(const float *p) { v16 v; memcpy(v.f, p, sizeof v.f); return v; }
static inline v16 vsplat(float s) { v16 v; for (int i = 0; i < 16; i++) v.f[i] = s; return v; }
static inline v16 vfma(v16 a, v16 b, v16 c) {
    for (int i = 0; i < 16; i++) c.f[i] = fmaf(a.f[i], b.f[i], c.f[i]);
    return c;
}
static inline v16 vmul(v16 a, v16 b) { for (int i = 0; i < 16; i++) a.f[i] *= b.f[i]; return a; }
static inline v16 vsub(v16 a, v16 b) { for (int i = 0; i < 16; i++) a.f[i] -= b.f[i]; return a; }
static inline v16 vdiv(v16 a, v16 b) { for (int i = 0; i < 16; i++) a.f[i] /= b.f[i]; return a; }
static inline v16 vcodes(const int8_t *p) {
    v16 v;
    for (int i = 0; i < 16; i++) v.f[i] = p[i];
    return v;
}
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float f = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY)
                     : ldexpf((float)(m | 0x400), (int)e - 25);
    uint32_t u;
    memcpy(&u, &f, 4);
    u |= sign;
    memcpy(&f, &u, 4);
    return f;
}
static inline v16 vhalf(const uint16_t *p) {
    v16 v;
    for (int i = 0; i < 16; i++) v.f[i] = half_to_float(p[i]);
    return v;
}
static inline v16 vbf16(const uint16_t *p) {
    v16 v;
    for (int i = 0; i < 16; i++) { uint32_t u = (uint32_t)p[i] << 16; memcpy(&v.f[i], &u, 4); }
    return v;
}
static inline void vstore(float *p, v16 v, int n) { memcpy(p, v.f, (size_t)n * sizeof(float)); }
typedef struct { int32_t i[16]; } vi16;
static inline vi16 vbytes(const uint8_t *p) { vi16 v; for (int i = 0; i < 16; i++) v.i[i] = p[i]; return v; }
static inline vi16 vi_set(int32_t s) { vi16 v; for (int i = 0; i < 16; i++) v.i[i] = s; return v; }
static inline vi16 vi_and(vi16 a, vi16 b) { for (int i = 0; i < 16; i++) a.i[i] &= b.i[i]; return a; }
static inline vi16 vi_andnot(vi16 a, vi16 b) {
    for (int i = 0; i < 16; i++) a.i[i] = ~a.i[i] & b.i[i];
    return a;
}
static inline vi16 vi_sub(vi16 a, vi16 b) { for (int i = 0; i < 16; i++) a.i[i] -= b.i[i]; return a; }
static inline vi16 vi_shl_(vi16 a, int n) { for (int i = 0; i < 16; i++) a.i[i] <<= n; return a; }
static inline vi16 vi_shr_(vi16 a, int n) {
    for (int i = 0; i < 16; i++) a.i[i] = (int32_t)((uint32_t)a.i[i] >> n);
    return a;
}
#define vi_shl(a, n) vi_shl_(a, n)
#define vi_shr(a, n) vi_shr_(a, n)
static inline v16 vi_float(vi16 a) { v16 v; for (int i = 0; i < 16; i++) v.f[i] = (float)a.i[i]; return v; }
static inline vi16 vi_high5(vi16 low, const uint8_t *high, int j) {
    for (int i = 0; i < 16; i++) low.i[i] -= (high[i] >> j) & 1 ? 0 : 16;
    return low;
}
#define VEC_REGS 0
#define VEC_ISA "portable"
#endif


static inline void vstore16(float *p, v16 v) { vstore(p, v, 16); }

#endif
