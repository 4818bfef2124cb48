/* Vector primitives of the CPU decode kernels (paged_decode.c and what includes it): the KV and
 * query dtype codes, the fixed tile limits, VL-lane float32 vectors (16 lanes with AVX-512, 8
 * otherwise) with their loads, horizontal reductions and exp, and the transpose-and-add tree that
 * sums VL dot products at once (reducev). Included once, by paged_decode.c, after its libc headers. */
#ifndef LLMD_DECODE_VEC_H
#define LLMD_DECODE_VEC_H

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_INT8 = 3, KV_LUT = 4 };
enum { Q_F32 = 0, Q_BF16 = 1 };
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 128  /* the largest block size tested (vLLM's CPU default with IPEX); runs keep the tiles small */

/* VL float32 lanes per vector: 16 with AVX-512 (one zmm), 8 otherwise (one ymm with AVX2, a pair of
 * xmm elsewhere). Key tiles are VL keys wide (one score vector per query row). With GCC's
 * 64-byte vector type on an AVX2-only CPU (Zen 3) the whole kernel went through the stack (a
 * 120 KiB frame, element-wise spills): 13x the AVX-512 build's time per decode; 8 lanes there. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#define NC_MAX (MAX_HEAD_DIM / VL)  /* vectors per head */

typedef float vf __attribute__((vector_size(4 * VL)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));
typedef uint16_t vh __attribute__((vector_size(2 * VL)));
typedef _Float16 vhf __attribute__((vector_size(2 * VL)));
typedef int8_t vb __attribute__((vector_size(VL)));

static inline float bf16_to_f32(uint16_t h) {
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even (NaN not expected) */
    uint32_t x;
    memcpy(&x, &f, 4);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static inline vf splat(float s) { return (vf){0} + s; }

#if defined(__AVX512F__)
#include <immintrin.h>
/* AVX-512: explicit conversions (GCC lowers __builtin_convertvector of 8/16-bit lanes to scalar code) */
static inline vf loadv(const void *base, int64_t off, int kv_dtype, const float *lut) {
    if (kv_dtype == KV_F32) return (vf)_mm512_loadu_ps((const float *)base + off);
    if (kv_dtype == KV_BF16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)));
        return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
    if (kv_dtype == KV_F16) return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)));
    __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)base + off));
    if (kv_dtype == KV_INT8) return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    return (vf)_mm512_i32gather_ps(_mm512_cvtepu8_epi32(b), lut, 4);
}
static inline float hsum(vf v) { return _mm512_reduce_add_ps((__m512)v); }
static inline float hmax(vf v) { return _mm512_reduce_max_ps((__m512)v); }
static inline int any_gt(vf v, float s) { return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(s), _CMP_GT_OQ) != 0; }
static inline vi to_int(vf x) { return (vi)_mm512_cvttps_epi32((__m512)x); }
static inline vf to_float(vi x) { return (vf)_mm512_cvtepi32_ps((__m512i)x); }
static inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
/* AVX2 (+F16C: Zen 1-3, Intel before AVX-512): the same conversions on 8 lanes */
static inline vf loadv(const void *base, int64_t off, int kv_dtype, const float *lut) {
    if (kv_dtype == KV_F32) return (vf)_mm256_loadu_ps((const float *)base + off);
    if (kv_dtype == KV_BF16)
        return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + off))), 16));
    if (kv_dtype == KV_F16) return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + off)));
    const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)base + off));
    if (kv_dtype == KV_INT8) return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    return (vf)_mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(b), 4);
}
static inline float hsum(vf v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
static inline float hmax(vf v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
}
static inline int any_gt(vf v, float s) { return _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(s), _CMP_GT_OQ)); }
static inline vi to_int(vf x) { return (vi)_mm256_cvttps_epi32((__m256)x); }
static inline vf to_float(vi x) { return (vf)_mm256_cvtepi32_ps((__m256i)x); }
static inline vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
#else
/* other CPUs: GCC vector extensions, lowered to whatever vector unit -march=native has */
static inline vf loadv(const void *base, int64_t off, int kv_dtype, const float *lut) {
    vf r;
    if (kv_dtype == KV_F32) {
        memcpy(&r, (const float *)base + off, sizeof r);
    } else if (kv_dtype == KV_BF16) {
        vh h;
        memcpy(&h, (const uint16_t *)base + off, sizeof h);
        vu u = __builtin_convertvector(h, vu) << 16;
        memcpy(&r, &u, sizeof r);
    } else if (kv_dtype == KV_F16) {
        vhf h;
        memcpy(&h, (const _Float16 *)base + off, sizeof h);
        r = __builtin_convertvector(h, vf);
    } else if (kv_dtype == KV_INT8) {
        vb b;
        memcpy(&b, (const int8_t *)base + off, sizeof b);
        r = __builtin_convertvector(b, vf);
    } else {
        const uint8_t *s = (const uint8_t *)base + off;
        for (int k = 0; k < VL; k++) r[k] = lut[s[k]];
    }
    return r;
}
static inline float hsum(vf v) {
    float r = 0.0f;
    for (int k = 0; k < VL; k++) r += v[k];
    return r;
}
static inline float hmax(vf v) {
    float r = v[0];
    for (int k = 1; k < VL; k++) r = v[k] > r ? v[k] : r;
    return r;
}
static inline int any_gt(vf v, float s) { return hmax(v) > s; }
static inline vi to_int(vf x) { return __builtin_convertvector(x, vi); }
static inline vf to_float(vi x) { return __builtin_convertvector(x, vf); }
static inline vf vmax(vf a, vf b) {
    vi ai, bi;
    memcpy(&ai, &a, sizeof a);
    memcpy(&bi, &b, sizeof b);
    const vi lt = a < b;
    ai = (ai & ~lt) | (bi & lt);
    memcpy(&a, &ai, sizeof a);
    return a;
}
#endif
#define RESCALE 8.0f  /* natural-log units: exponentials against a stale max stay below e^8 ~ 2981 */

/* exp(x) for x <= RESCALE (scores minus their running max, or a stale one: see decode_task), VL
 * lanes: 2^n · p(r) with x = n ln2 + r, |r| <= ln2/2, p a degree-7 Taylor polynomial (relative
 * error ~2e-7, 1-2 float32 ulp; Cephes expf's range reduction with a two-part ln2). x is clamped to
 * -87 (exp(-87) ~ 1.6e-38: no subnormal scale; a key that far below the row's max adds nothing
 * visible to a sum that is >= 1). */
static inline vf expv(vf x) {
    x = vmax(x, splat(-87.0f));
    const vi n = to_int(x * 1.44269504088896341f + 1024.5f) - 1024;  /* nearest (x >= -87: truncation = floor) */
    const vf nf = to_float(n);
    vf r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    vf p = splat(1.0f / 5040);
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi e = (n + 127) << 23;
    vf two_n;
    memcpy(&two_n, &e, sizeof two_n);
    return p * two_n;
}

/* The VL lane sums of x[0..VL-1] as one vector, lane j = sum of x[KEYMAP[j]]'s lanes (callers fill
 * x[k] with key KEYMAP[k]'s partial sums, so lane j is key j). A transpose-and-add tree: VL - 1
 * vector adds and 2 (VL - 1) shuffles for VL dot products instead of VL horizontal sums. */
#if VL == 16
static const int KEYMAP[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
/* The tree's four steps (each halves the partial sums per key; adjacent slots pair up), all lane
 * shuffles with immediates: 128-bit blocks for the first two, in-block for the last two. */
static inline vf red1(vf a, vf b) {
    return (vf)_mm512_add_ps(_mm512_shuffle_f32x4((__m512)a, (__m512)b, 0x44), _mm512_shuffle_f32x4((__m512)a, (__m512)b, 0xEE));
}
static inline vf red2(vf a, vf b) {
    return (vf)_mm512_add_ps(_mm512_shuffle_f32x4((__m512)a, (__m512)b, 0x88), _mm512_shuffle_f32x4((__m512)a, (__m512)b, 0xDD));
}
static inline vf red3(vf a, vf b) {
    return (vf)_mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd((__m512)a), _mm512_castps_pd((__m512)b))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd((__m512)a), _mm512_castps_pd((__m512)b))));
}
static inline vf red4(vf a, vf b) {
    return (vf)_mm512_add_ps(_mm512_shuffle_ps((__m512)a, (__m512)b, 0x88), _mm512_shuffle_ps((__m512)a, (__m512)b, 0xDD));
}
static inline vf reducev(const vf *x) {
    vf u[8], v[4], w[2];
    for (int i = 0; i < 8; i++) u[i] = red1(x[2 * i], x[2 * i + 1]);
    for (int i = 0; i < 4; i++) v[i] = red2(u[2 * i], u[2 * i + 1]);
    for (int i = 0; i < 2; i++) w[i] = red3(v[2 * i], v[2 * i + 1]);
    return red4(w[0], w[1]);
}
#else
static const int KEYMAP[8] = {0, 1, 2, 3, 4, 5, 6, 7};
static inline vf reducev(const vf *x) {
    vf u[4], v[2];
    for (int i = 0; i < 4; i++)
        u[i] = __builtin_shufflevector(x[i], x[i + 4], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(x[i], x[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        v[i] = __builtin_shufflevector(u[i], u[i + 2], 0, 1, 8, 9, 4, 5, 12, 13)
             + __builtin_shufflevector(u[i], u[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(v[0], v[1], 0, 8, 2, 10, 4, 12, 6, 14)
         + __builtin_shufflevector(v[0], v[1], 1, 9, 3, 11, 5, 13, 7, 15);
}
#endif

#endif
