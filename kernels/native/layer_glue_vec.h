/* layer_glue.c's per-vector pieces: bfloat16 loads, rounding and stores, the sum of squares of
 * an RMSNorm row, and SiLU (computed, and looked up for bfloat16 inputs). Included once, by
 * layer_glue.c after paged_decode.c (decode_vec.h's VL-lane vectors and expv). */
#ifndef LLMD_LAYER_GLUE_VEC_H
#define LLMD_LAYER_GLUE_VEC_H

static inline vf bf16v(const uint16_t *p) { return loadv(p, 0, KV_BF16, 0); }

/* VL float32 lanes -> VL bfloat16, round to nearest even (finite inputs). */
static inline void store_bf16v(uint16_t *dst, vf v) {
    vu u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16((__m512i)u));
#elif defined(__AVX2__)
    const __m256i w = (__m256i)u;
    const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
    _mm_storeu_si128((__m128i *)dst, _mm_packus_epi32(lo, hi));
#else
    for (int k = 0; k < VL; k++) dst[k] = (uint16_t)u[k];
#endif
}

/* store_bf16v of a to dst[0, VL) (store1) and of b to dst[VL, 2 VL) (store2). With AVX512-BF16 by
 * the conversion instruction: its rounding (nearest even) is store_bf16v's bit for bit but for
 * subnormal lanes (flushed to zero) and NaN lanes (quieted), so a vector with any of those (one
 * fpclass test: QNaN 0x01 | subnormal 0x20 | SNaN 0x80) takes store_bf16v. */
#if defined(__AVX512BF16__)
static inline int special_lanes(vf a) { return _mm512_fpclass_ps_mask((__m512)a, 0xa1) != 0; }
static inline void store1_bf16v(uint16_t *dst, vf a) {
    if (special_lanes(a)) store_bf16v(dst, a);
    else _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh((__m512)a));
}
static inline void store2_bf16v(uint16_t *dst, vf a, vf b) {
    if (special_lanes(a) | special_lanes(b)) {
        store_bf16v(dst, a);
        store_bf16v(dst + VL, b);
    } else {
        _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a));
    }
}
#else
static inline void store1_bf16v(uint16_t *dst, vf a) { store_bf16v(dst, a); }
static inline void store2_bf16v(uint16_t *dst, vf a, vf b) {
    store_bf16v(dst, a);
    store_bf16v(dst + VL, b);
}
#endif

static inline float rbf(float f) { return bf16_to_f32(f32_to_bf16(f)); }  /* round to bfloat16 and back */
static inline vf rbfv(vf v) {
    vu u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Σx² of a bfloat16 row in double (x² is exact in float32): 8 partial sums, acc[j] += x[i + j]²
 * for i = 0, 8, 16, ... in order, the last dim % 8 into acc[0], combined as below, so the float32
 * mean is the correctly rounded one but in ties of ~1e-9 relative. sumsq_rest goes on from
 * element i (a multiple of 8); sumsq's AVX-512 loop before it keeps that order lane for lane
 * (lane j of one double vector is acc[j]: x[i + j]², then x[i + 8 + j]²). */
static inline double sumsq_rest(double *acc, const uint16_t *xr, int i, int dim) {
    for (; i + 8 <= dim; i += 8)
        for (int j = 0; j < 8; j++) {
            const float v = bf16_to_f32(xr[i + j]);
            acc[j] += (double)(v * v);
        }
    for (; i < dim; i++) {
        const float v = bf16_to_f32(xr[i]);
        acc[0] += (double)(v * v);
    }
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static inline double sumsq(const uint16_t *xr, int dim) {
    double acc[8] = {0};
    int i = 0;
#if defined(__AVX512F__)
    __m512d a = _mm512_setzero_pd();
    for (; i + 16 <= dim; i += 16) {
        const vf v = bf16v(xr + i);
        const __m512 s = (__m512)(v * v);
        a = _mm512_add_pd(a, _mm512_cvtps_pd(_mm512_castps512_ps256(s)));
        a = _mm512_add_pd(a, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1))));
    }
    _mm512_storeu_pd(acc, a);
#endif
    return sumsq_rest(acc, xr, i, dim);
}

static inline float silu1(float g) {  /* g / (1 + exp(-g)), through exp(-|g|) as below */
    if (g < -87.0f) return g * 0.0f;
    const float e = expf(-fabsf(g));
    return g >= 0.0f ? g / (1.0f + e) : g * e / (1.0f + e);
}

/* silu(x) = x / (1 + exp(-x)) per lane, through exp(-|x|) (no overflow): x / (1 + e) for x >= 0,
 * x e / (1 + e) below; 0 for x < -87, where exp(-|x|) is clamped (silu is x · exp(x) < 1e-36). */
static inline vf siluv(vf x) {
    const vf ax = vmax(x, (vf){0} - x);
    const vf e = expv((vf){0} - ax); /* exp(-|x|) in (0, 1] */
    const vf xe = x * e;
    vi ge = (vi)(x >= 0.0f); /* lanes of all ones where x >= 0 */
    vi pi, ni;
    memcpy(&pi, &x, sizeof pi);
    memcpy(&ni, &xe, sizeof ni);
    ni &= (vi)(x >= -87.0f);
    vi si = (pi & ge) | (ni & ~ge);
    vf num;
    memcpy(&num, &si, sizeof num);
    return num / (1.0f + e);
}

/* rbfv(siluv(g)) >> 16 for each of the 65536 bfloat16 g: a bfloat16 SwiGLU's silu(gate), rounded,
 * is a lookup (siluv's bits: one vector path for every lane, no lane-dependent code). Filled as
 * the library loads (~0.1 ms), under the loading thread's MXCSR (torch's default, no FTZ/DAZ). */
static uint16_t silu_tab[65536];

__attribute__((constructor)) static void silu_tab_init(void) {
    for (int i = 0; i < 65536; i += VL) {
        vu u;
        for (int k = 0; k < VL; k++) u[k] = (uint32_t)(i + k) << 16;
        vf g;
        memcpy(&g, &u, sizeof g);
        g = rbfv(siluv(g));
        memcpy(&u, &g, sizeof u);
        for (int k = 0; k < VL; k++) silu_tab[i + k] = (uint16_t)(u[k] >> 16);
    }
}

/* rbfv(siluv(bf16v(g))) by lookup, four indices per 64-bit load (the 16-lane gather instruction
 * took ~2x as long on Zen 4). */
static inline vf silu_tabv(const uint16_t *g) {
    uint64_t t[VL / 4];
    for (int k = 0; k < VL / 4; k++) {
        uint64_t q;
        memcpy(&q, g + 4 * k, 8);
        t[k] = (uint64_t)silu_tab[q & 0xffff] | (uint64_t)silu_tab[(q >> 16) & 0xffff] << 16
             | (uint64_t)silu_tab[(q >> 32) & 0xffff] << 32 | (uint64_t)silu_tab[q >> 48] << 48;
    }
    return bf16v((const uint16_t *)t);
}

#endif
