/* Paged decode attention for CPUs: one query token per sequence over its paged K/V, read in place.
 *
 * Built and loaded by llmd/kernels/native/build.py (gcc -O3 -march=native -fopenmp; the process's
 * own libgomp, the one torch loaded, so torch and this kernel share one OpenMP team). Called through
 * ctypes by llmd/kernels/cpu_native.py, which documents the arguments' tensors and checks them.
 *
 * For each (decode i, KV head h), one OpenMP task: the group's G = num_heads / kv_heads query rows
 * (in float32, pre-multiplied by the softmax scale) walk the sequence's keys [first[i], seq_len[i])
 * run by run through its block table (a run: a block's slots, at most SUB_RUN of them): a run's K
 * rows are converted to float32 in a small tile (bfloat16 by a 16-bit shift, float16 by conversion,
 * 1-byte codes (int8 / fp8) through a 256-entry table of their values), scored against the G
 * queries (x the token's K scale for quantized caches), folded into an online softmax (running max
 * m and sum l per query row, as in FlashAttention: Dao et al. 2022, "FlashAttention", Algorithm 1;
 * vLLM's paged_attention_v1 reads the cache the same way), and the run's V rows accumulated with
 * the probabilities (x the V scale). Accumulation is in float32 in a fixed key order, so a
 * sequence's result does not depend on what else is in the batch. No key outside the range is read,
 * so no mask is needed.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>

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

#define MAX_TASK_HEADS 32  /* query heads one task holds state for */
#ifndef PF_DIST
#define PF_DIST 1  /* runs ahead to prefetch */
#endif
/* Prefetch locality hint (__builtin_prefetch's third argument): 2 = prefetcht1 (into L2, not L1).
 * On a 2-core AMD EPYC (Zen 4) prefetcht0 (3) made the batch-32 x 512 decode 1.45x slower than 1 or
 * 2 (the next block's rows evicting the current block's from L1); on the AMX Xeon all three
 * measured level. */
#ifndef PF_LOC
#define PF_LOC 2
#endif

/* Lazy rescaling of one query row's online softmax (running max m, sum l, NA accumulators A) for a
 * tile of scores sc: the reference point m moves only when a score passes it by more than RESCALE
 * (then A and l are rescaled once); otherwise the exponentials are taken against a stale m and may
 * reach e^RESCALE, which float32 holds easily. The quotient A / l is the same softmax; the running
 * max's serial chain through every tile (hmax, expf, rescale) is gone from the common case. */
static inline __attribute__((always_inline)) void lazy_rescale(vf sc, float *m, float *l, vf *A, int NA) {
    if (any_gt(sc, *m + RESCALE)) {
        const float mx = hmax(sc) > *m ? hmax(sc) : *m;
        const float corr = *l > 0.0f ? expf(*m - mx) : 0.0f;
        *l *= corr;
        for (int c = 0; c < NA; c++) A[c] *= corr;
        *m = mx;
    }
}

#ifndef SUB_RUN
#define SUB_RUN 16
#endif
/* Runs: the slots a kernel takes in one pass, at most SUB_RUN of one block. A block of more than
 * SUB_RUN slots is taken as consecutive runs, each scored for all of a task's heads before the
 * next, so a pass reads one contiguous span of rows and the next run (the one prefetched) is the
 * span right after it. With whole blocks as the unit, blocks of 64 / 128 slots made the batch-32 x
 * 512 decode 1.4-1.7x the time of its gather read on the Zen 4 (2026-12-07; 1.1x for 16); as runs
 * of 16 they measured level with blocks of 16 (README, "Blocks of up to 128 slots in the C kernels").
 * next_run: the first position of the run after the one holding pos; run_length: the slots of the
 * run at pos (none past seq_len). */
static inline int64_t next_run(int64_t pos, int BS) {
    const int off = (int)(pos % BS), sub = BS < SUB_RUN ? BS : SUB_RUN;
    const int nxt = (off / sub + 1) * sub;
    return pos - off + (nxt < BS ? nxt : BS);
}

static inline int run_length(int64_t pos, int BS, int64_t seq_len) {
    const int64_t end = next_run(pos, BS);
    return (int)((end < seq_len ? end : seq_len) - pos);
}

/* The next run's K and V rows of a task's heads [h0, h1), prefetched one row pair per key the
 * current run scores (spread over the run's work, not a burst that would stall on the miss
 * queue). kv_prefetch_plan finds the run PF_DIST ahead of position pos (none past seq_len);
 * kv_prefetch_row issues the next row pair's lines, if any are left. */
struct kv_prefetch {
    const char *base;  /* the run's first row of head h0, K half */
    int rows, done, hn, row_bytes;
    int64_t row_stride, vbytes;  /* bytes between slots; bytes from K to V */
};

static inline struct kv_prefetch kv_prefetch_plan(const void *kv, int esize, int64_t half, const int32_t *table,
                                                  int64_t pos, int BS, int64_t seq_len, int64_t row, int D,
                                                  int h0, int h1) {
    struct kv_prefetch f = {0, 0, 0, h1 - h0, D * esize, row * esize, half * esize};
    int64_t pf_pos = pos;  /* first position of the run PF_DIST ahead */
    for (int d = 0; d < PF_DIST; d++) pf_pos = next_run(pf_pos, BS);
    if (pf_pos < seq_len) {
        const int64_t nslot = (int64_t)table[pf_pos / BS] * BS + pf_pos % BS;
        const int nn = run_length(pf_pos, BS, seq_len);
        f.base = (const char *)kv + (nslot * row + (int64_t)h0 * D) * esize;
        f.rows = nn * (h1 - h0);
    }
    return f;
}

static inline void kv_prefetch_row(struct kv_prefetch *f) {
    if (f->done < f->rows) {
        const char *a = f->base + (int64_t)(f->done / f->hn) * f->row_stride + (int64_t)(f->done % f->hn) * f->row_bytes;
        for (int b = 0; b < f->row_bytes; b += 64) {
            __builtin_prefetch(a + b, 0, PF_LOC);
            __builtin_prefetch(a + f->vbytes + b, 0, PF_LOC);
        }
        f->done++;
    }
}

/* The K and V rows of heads [h0, h1) in the run holding position pos of a block table (its
 * slots from pos to the run's end), prefetched into L2 in one burst: a task's first run, which
 * no earlier run of the same task prefetches. */
static inline void prefetch_first_block(const void *kv, int esize, int64_t half, const int32_t *table, int64_t pos,
                                        int BS, int kv_heads, int D, int h0, int h1) {
    const int64_t row = (int64_t)kv_heads * D;
    const char *k = (const char *)kv + (((int64_t)table[pos / BS] * BS + pos % BS) * row + (int64_t)h0 * D) * esize;
    const int64_t span = ((int64_t)(next_run(pos, BS) - pos - 1) * row + (int64_t)(h1 - h0) * D) * esize;
    for (int64_t b = 0; b < span; b += 64) {
        __builtin_prefetch(k + b, 0, PF_LOC);
        __builtin_prefetch(k + half * esize + b, 0, PF_LOC);
    }
}

/* A task's results: rows a < H of acc / l (query head a0 + a of token t; D = NC · VL channels)
 * into out (float32 or bfloat16), and log(l) + m into lse when given. */
static inline void write_outputs(const vf (*acc)[NC_MAX], const float *m, const float *l, int H, int NC, int D,
                                 int64_t t, int num_heads, int a0, void *out, int out_dtype, float *lse) {
    for (int a = 0; a < H; a++) {
        const float inv = l[a] > 0.0f ? 1.0f / l[a] : 0.0f;
        const int64_t ooff = (t * num_heads + a0 + a) * (int64_t)D;
        for (int c = 0; c < NC; c++) {
            vf o = acc[a][c] * inv;
            if (out_dtype == Q_F32) {
                memcpy((float *)out + ooff + VL * c, &o, sizeof o);
            } else {
                uint16_t *dst = (uint16_t *)out + ooff + VL * c;
                for (int k = 0; k < VL; k++) dst[k] = f32_to_bf16(o[k]);
            }
        }
        if (lse) lse[t * num_heads + a0 + a] = l[a] > 0.0f ? m[a] + logf(l[a]) : -FLT_MAX;
    }
}

/* A task's query rows, float32 times the softmax scale, and its empty softmax state: rows a < H
 * (decode t's query heads h0 * G + a, NC vectors each) of q, acc, m, l. */
static inline __attribute__((always_inline)) void task_start(const void *query, int q_dtype, int64_t q_row_stride,
                                                             int64_t t, int h0, int G, int H, int NC, float scale,
                                                             vf (*q)[NC_MAX], vf (*acc)[NC_MAX], float *m, float *l) {
    for (int a = 0; a < H; a++) {
        const int64_t qoff = t * q_row_stride + (int64_t)(h0 * G + a) * NC * VL;
        for (int c = 0; c < NC; c++) {
            q[a][c] = loadv(query, qoff + VL * c, q_dtype == Q_F32 ? KV_F32 : KV_BF16, 0) * scale;
            acc[a][c] = (vf){0};
        }
        m[a] = -FLT_MAX;
        l[a] = 0.0f;
    }
}

/* Bytes per cached element of a K/V storage type (KV_*). */
static inline int kv_esize(int kv_dtype) { return kv_dtype == KV_F32 ? 4 : kv_dtype >= KV_INT8 ? 1 : 2; }

/* The keys from position pos to the end of its block or to seq_len: returns how many, and their
 * first slot in *slot0 (through the block table, BS slots per block). */
static inline int block_run(const int32_t *table, int64_t pos, int BS, int64_t seq_len, int64_t *slot0) {
    *slot0 = (int64_t)table[pos / BS] * BS + pos % BS;
    return run_length(pos, BS, seq_len);
}

#if VL == 8 && defined(__AVX2__) && defined(__F16C__)
#include "decode_avx2.h"  /* decode_task's loops for 16 registers of 8 lanes */
#endif

/* The attention of query heads [h0 * G, h1 * G) of decode i (see the file comment). */
static inline __attribute__((always_inline)) void decode_task(
        const void *query, int q_dtype, int64_t q_row_stride, const void *kv, const int kv_dtype, const float *lut,
        const float *scales, int64_t half, int64_t shalf, int BS, int kv_heads, const int NV, const int G,
        const int32_t *table, int64_t t, int64_t first, int64_t seq_len, int h0, int h1, float scale, void *out,
        int out_dtype, float *lse) {
#if VL == 8 && defined(__AVX2__) && defined(__F16C__)
    if (kv_dtype != KV_F32 && avx2_tiles_on()) {  /* float32 caches: measured 1.10x slower there (decode_avx2.h) */
        decode_task_avx2(query, q_dtype, q_row_stride, kv, kv_dtype, lut, scales, half, shalf, BS, kv_heads, NV, G,
                         table, t, first, seq_len, h0, h1, scale, out, out_dtype, lse);
        return;
    }
#endif
    const int D = NV * 16, NC = D / VL, H = (h1 - h0) * G, num_heads = kv_heads * G;
    const int64_t row = (int64_t)kv_heads * D;  /* elements per slot */
    vf q[MAX_TASK_HEADS][NC_MAX], acc[MAX_TASK_HEADS][NC_MAX];
    float m[MAX_TASK_HEADS], l[MAX_TASK_HEADS];
    float p[MAX_GROUP][VL] __attribute__((aligned(64)));
    task_start(query, q_dtype, q_row_stride, t, h0, G, H, NC, scale, q, acc, m, l);
    const int esize = kv_esize(kv_dtype);
    for (int64_t pos = first; pos < seq_len;) {
        int64_t slot0;
        const int n = block_run(table, pos, BS, seq_len, &slot0);
        struct kv_prefetch pf = kv_prefetch_plan(kv, esize, half, table, pos, BS, seq_len, row, D, h0, h1);
        for (int h = h0; h < h1; h++) {
            const int a0 = (h - h0) * G;
            vf Q[MAX_GROUP][NC_MAX], A[MAX_GROUP][NC_MAX];  /* this head's queries and sums */
            for (int g = 0; g < G; g++)
                for (int c = 0; c < NC; c++) {
                    Q[g][c] = q[a0 + g][c];
                    A[g][c] = acc[a0 + g][c];
                }
            for (int j0 = 0; j0 < n; j0 += VL) {  /* tiles of up to VL keys: one score vector per query */
                const int nt = n - j0 < VL ? n - j0 : VL;
                vf part[MAX_GROUP][VL], lane_ok, ksv = (vf){0} + 1.0f, vsv = (vf){0} + 1.0f;
                for (int k = 0; k < VL; k++) lane_ok[k] = k < nt ? 1.0f : 0.0f;
                for (int k = 0; k < VL; k++) {
                    const int j = KEYMAP[k];
                    if (j >= nt) {
                        for (int g = 0; g < G; g++) part[g][k] = (vf){0};
                        continue;
                    }
                    kv_prefetch_row(&pf);
                    const int64_t r = (slot0 + j0 + j) * row + (int64_t)h * D;
                    vf kr[NC_MAX];
                    for (int c = 0; c < NC; c++) kr[c] = loadv(kv, r + VL * c, kv_dtype, lut);
                    for (int g = 0; g < G; g++) {
                        vf sc = Q[g][0] * kr[0];
                        for (int c = 1; c < NC; c++) sc += Q[g][c] * kr[c];
                        part[g][k] = sc;
                    }
                }
                if (scales)
                    for (int j = 0; j < nt; j++) {
                        ksv[j] = scales[(slot0 + j0 + j) * kv_heads + h];
                        vsv[j] = scales[shalf + (slot0 + j0 + j) * kv_heads + h];
                    }
                for (int g = 0; g < G; g++) {
                    const int a = a0 + g;
                    vf sc = reducev(part[g]);
                    if (scales) sc *= ksv;
                    if (nt < VL) sc = sc * lane_ok + (lane_ok - 1.0f) * FLT_MAX;  /* lanes >= nt: -FLT_MAX */
                    lazy_rescale(sc, &m[a], &l[a], A[g], NC);
                    vf e = expv(sc - m[a]);
                    if (nt < VL) e *= lane_ok;
                    l[a] += hsum(e);
                    if (scales) e *= vsv;
                    memcpy(p[g], &e, sizeof e);
                }
                for (int j = 0; j < nt; j++) {
                    const int64_t r = half + (slot0 + j0 + j) * row + (int64_t)h * D;
                    for (int c = 0; c < NC; c++) {
                        const vf v = loadv(kv, r + VL * c, kv_dtype, lut);
                        for (int g = 0; g < G; g++) A[g][c] += p[g][j] * v;
                    }
                }
            }
            for (int g = 0; g < G; g++)
                for (int c = 0; c < NC; c++) acc[a0 + g][c] = A[g][c];
        }
        pos += n;
    }
    write_outputs(acc, m, l, H, NC, D, t, num_heads, h0 * G, out, out_dtype, lse);
}

/* decode_task compiled per K/V storage type, and with the model's (query heads per KV head G,
 * head_dim / 16 NV) as constants when built with -DSPEC_NV=.. -DSPEC_G=.. (build.py does, per
 * model shape), so its loops unroll and a head's sums stay in vector registers (measured on
 * SmolLM2's G = 3, NV = 4: int8 caches 1.44x, bfloat16 1.07x faster than the runtime-shape
 * variant); other shapes take the variant with G and NV as runtime values. */
#define TASK_ARGS const void *query, int q_dtype, int64_t q_row_stride, const void *kv, const float *lut, \
    const float *scales, int64_t half, int64_t shalf, int BS, int kv_heads, int NV, int G, const int32_t *table, \
    int64_t t, int64_t first, int64_t seq_len, int h0, int h1, float scale, void *out, int out_dtype, float *lse
#define PASS(KD, NVV, GV) decode_task(query, q_dtype, q_row_stride, kv, KD, lut, scales, half, shalf, BS, kv_heads, \
    NVV, GV, table, t, first, seq_len, h0, h1, scale, out, out_dtype, lse)
#if defined(SPEC_NV) && defined(SPEC_G)
#define SHAPES(KD) \
    if (NV == SPEC_NV && G == SPEC_G) { PASS(KD, SPEC_NV, SPEC_G); return; } \
    PASS(KD, NV, G);
#else
#define SHAPES(KD) PASS(KD, NV, G);
#endif
static void task_f32(TASK_ARGS) { SHAPES(KV_F32) }
static void task_bf16(TASK_ARGS) { SHAPES(KV_BF16) }
static void task_f16(TASK_ARGS) { SHAPES(KV_F16) }
static void task_int8(TASK_ARGS) { SHAPES(KV_INT8) }
static void task_lut(TASK_ARGS) { SHAPES(KV_LUT) }

static void run_task(const void *query, int q_dtype, int64_t q_row_stride, const void *kv, int kv_dtype,
                     const float *lut, const float *scales, int64_t half, int64_t shalf, int BS, int kv_heads, int NV,
                     int G, const int32_t *table, int64_t t, int64_t first, int64_t seq_len, int h0, int h1,
                     float scale, void *out, int out_dtype, float *lse) {
    void (*fn)(TASK_ARGS) = kv_dtype == KV_F32 ? task_f32 : kv_dtype == KV_BF16 ? task_bf16
                          : kv_dtype == KV_F16 ? task_f16 : kv_dtype == KV_INT8 ? task_int8 : task_lut;
    fn(query, q_dtype, q_row_stride, kv, lut, scales, half, shalf, BS, kv_heads, NV, G, table, t, first, seq_len,
       h0, h1, scale, out, out_dtype, lse);
}

#include "amx_decode.h"
#include "bf16dp_decode.h"

/* Turn decode_avx2.h's loops off (0: decode_task's own) or back on (1) on 8-lane AVX2 builds, for
 * side-by-side measurements in one process; returns whether they are on afterwards (0 on other
 * builds). Call it between kernel calls, not during one. */
int llmd_paged_decode_set_avx2(int on) {
#if VL == 8 && defined(__AVX2__) && defined(__F16C__)
    __atomic_store_n(&avx2_tiles, on ? 1 : 0, __ATOMIC_RELAXED);
    return on ? 1 : 0;
#else
    (void)on;
    return 0;
#endif
}

/* 1 when llmd_paged_decode runs bfloat16 queries over bfloat16 caches (head_dim a multiple of 32)
 * through bf16dp_decode.h (built with AVX512-BF16, LLMD_BF16_DOT not 0; the tile path, where on,
 * goes first), else 0. */
int llmd_paged_decode_dot(void) {
#ifdef HAVE_BF16DP
    return dp_ready();
#else
    return 0;
#endif
}

/* Turn the bf16 dot-product path off (0) or back on (1, where built); returns
 * llmd_paged_decode_dot() after the change. Call it between kernel calls, not during one. */
int llmd_paged_decode_set_dot(int on) {
#ifdef HAVE_BF16DP
    dp_state = on ? 1 : 0;
    return dp_state;
#else
    (void)on;
    return 0;
#endif
}

/* 1 when llmd_paged_decode scores bfloat16 queries over bfloat16 caches on the tile unit
 * (amx_decode.h: built with AMX here, granted by the OS, LLMD_AMX_ATTENTION not 0), else 0. */
int llmd_paged_decode_amx(void) {
#ifdef HAVE_AMX
    return amx_ready();
#else
    return 0;
#endif
}

/* Turn the tile path off (0) or back on (1, where granted), for side-by-side measurements and
 * tests in one process; returns llmd_paged_decode_amx() after the change. Call it between
 * kernel calls, not during one. */
int llmd_paged_decode_set_amx(int on) {
#ifdef HAVE_AMX
    if (!on) {  /* one store: a reader never sees a state that would ask the OS again */
        amx_state = 0;
        return 0;
    }
    amx_state = -1;
    return amx_ready();
#else
    (void)on;
    return 0;
#endif
}

/* kv_plane: elements from a K row to the same slot's V row (the cache's stride between its K and
 * V planes: on the CPU a plane plus a gap, llmd/quant/kv.py's kv_planes); scale_plane: the same
 * for the scales of an 8-bit cache (unused otherwise).
 * Returns 0, or -1 when a size is past this kernel's fixed limits (the caller then falls back).
 * Work split: one task per decode and chunk of KV heads; a chunk is all of a sequence's KV heads
 * (one contiguous read of each block) when there are enough decodes to keep every thread busy,
 * else one KV head (a batch-1 step still uses every thread). On the VDPBF16PS path each thread
 * claims its tasks one ahead from a shared counter (dynamic scheduling still) and prefetches the
 * next task's first block while it runs the current one: a task's later blocks are prefetched
 * by their predecessors, its first one by nothing (measured on the Zen 4 in one process, batch
 * 32 x 512 x 30 layers: 0.95-1.01x, median ~0.97x the time of OpenMP's dynamic schedule). */
int llmd_paged_decode(const void *query, int q_dtype, int64_t q_row_stride,
                      const void *kv, int kv_dtype, const float *lut, const float *scales,
                      int64_t kv_plane, int64_t scale_plane, int block_size, int kv_heads, int head_dim,
                      int num_heads,
                      const int32_t *block_tables, int64_t bt_stride, const int64_t *table_rows,
                      const int64_t *token_idx, const int64_t *first, const int64_t *seq_lens,
                      int num_decodes, float scale, void *out, int out_dtype, float *lse, int num_threads) {
    const int G = num_heads / kv_heads;
    if (G > MAX_GROUP || head_dim > MAX_HEAD_DIM || head_dim % 16 || block_size > MAX_BLOCK
        || G * kv_heads != num_heads) return -1;
    int hc = num_decodes >= 4 * num_threads ? kv_heads : 1;  /* KV heads per task */
    while (hc > 1 && hc * G > MAX_TASK_HEADS) hc--;
    while (kv_heads % hc) hc--;
    const int chunks = kv_heads / hc, tasks = num_decodes * chunks;
    const int64_t half = kv_plane, shalf = scale_plane;
#ifdef HAVE_AMX
    const int ha = kv_dtype == KV_BF16 && q_dtype == Q_BF16 && block_size % 16 == 0
                   ? amx_heads_per_task(kv_heads, head_dim, G, hc) : 0;
    if (ha && amx_ready()) {
        const int achunks = kv_heads / ha;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int task = 0; task < num_decodes * achunks; task++) {
            const int i = task / achunks, a0 = (task % achunks) * ha;
            amx_run((const uint16_t *)query, q_row_stride, (const uint16_t *)kv, half, block_size, kv_heads,
                    head_dim / 16, G, block_tables + table_rows[i] * bt_stride, token_idx[i], first[i], seq_lens[i],
                    a0, a0 + ha, scale, out, out_dtype, lse);
        }
        return 0;
    }
#endif
#ifdef HAVE_BF16DP
    if (kv_dtype == KV_BF16 && q_dtype == Q_BF16 && head_dim % 32 == 0 && !scales && dp_ready()) {
        int next_task = 0;  /* tasks claimed one ahead, so each thread knows its next one and prefetches its first block */
#pragma omp parallel num_threads(num_threads)
        {
            int task = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED);
            while (task < tasks) {
                const int after = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED);
                if (after < tasks && first[after / chunks] < seq_lens[after / chunks])
                    prefetch_first_block(kv, 2, half, block_tables + table_rows[after / chunks] * bt_stride,
                                         first[after / chunks], block_size, kv_heads, head_dim,
                                         (after % chunks) * hc, (after % chunks) * hc + hc);
                const int i = task / chunks, h0 = (task % chunks) * hc;
                dp_run((const uint16_t *)query, q_row_stride, (const uint16_t *)kv, half, block_size, kv_heads,
                       head_dim / 32, G, block_tables + table_rows[i] * bt_stride, token_idx[i], first[i],
                       seq_lens[i], h0, h0 + hc, scale, out, out_dtype, lse);
                task = after;
            }
        }
        return 0;
    }
#endif
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int task = 0; task < tasks; task++) {
        const int i = task / chunks, h0 = (task % chunks) * hc;
        run_task(query, q_dtype, q_row_stride, kv, kv_dtype, lut, scales, half, shalf, block_size, kv_heads,
                 head_dim / 16, G, block_tables + table_rows[i] * bt_stride, token_idx[i], first[i], seq_lens[i],
                 h0, h0 + hc, scale, out, out_dtype, lse);
    }
    return 0;
}
