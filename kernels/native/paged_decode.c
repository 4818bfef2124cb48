/* Paged decode attention for CPUs: one query token per sequence over its paged K/V, read in place.
 *
 * Built and loaded by llmd/kernels/native/build.py (gcc -O3 -march=native -fopenmp; the process's
 * own libgomp, the one torch loaded, so torch and this kernel share one OpenMP team). Called through
 * ctypes by llmd/kernels/cpu_native.py, which documents the arguments' tensors and checks them.
 *
 * For each (decode i, KV head h), one OpenMP task: the group's G = num_heads / kv_heads query rows
 * (in float32, pre-multiplied by the softmax scale) walk the sequence's keys [first[i], seq_len[i])
 * block by block through its block table: a block's K rows are converted to float32 in a small
 * tile (bfloat16 by a 16-bit shift, float16 by conversion, 1-byte codes (int8 / fp8) through a
 * 256-entry table of their values), scored against the G queries (x the token's K scale for
 * quantized caches), folded into an online softmax (running max m and sum l per query row, as in
 * FlashAttention: Dao et al. 2022, "FlashAttention", Algorithm 1; vLLM's paged_attention_v1 reads
 * the cache the same way), and the block's V rows accumulated with the probabilities (x the V
 * scale). Accumulation is in float32 in a fixed key order, so a sequence's result does not depend
 * on what else is in the batch. No key outside the range is read, so no mask is needed.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <float.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_INT8 = 3, KV_LUT = 4 };
enum { Q_F32 = 0, Q_BF16 = 1 };
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 32
#define NV_MAX (MAX_HEAD_DIM / 16)

/* GCC vector extensions: 16 float32 lanes, lowered to whatever vector unit -march=native has */
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef _Float16 v16hf __attribute__((vector_size(32)));
typedef int8_t v16b __attribute__((vector_size(16)));

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

#if defined(__AVX512F__)
#include <immintrin.h>
/* AVX-512: explicit conversions (GCC lowers __builtin_convertvector of 8/16-bit lanes to scalar code) */
static inline v16f load16(const void *base, int64_t off, int kv_dtype, const float *lut) {
    if (kv_dtype == KV_F32) return (v16f)_mm512_loadu_ps((const float *)base + off);
    if (kv_dtype == KV_BF16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)));
        return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
    if (kv_dtype == KV_F16) return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)));
    __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)base + off));
    if (kv_dtype == KV_INT8) return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    return (v16f)_mm512_i32gather_ps(_mm512_cvtepu8_epi32(b), lut, 4);
}

static inline float hsum(v16f v) { return _mm512_reduce_add_ps((__m512)v); }

static inline v16i to_int(v16f x) { return (v16i)_mm512_cvttps_epi32((__m512)x); }
static inline v16f to_float(v16i x) { return (v16f)_mm512_cvtepi32_ps((__m512i)x); }
static inline v16f vmax(v16f a, v16f b) { return (v16f)_mm512_max_ps((__m512)a, (__m512)b); }
#else
/* other CPUs: GCC vector extensions, lowered to whatever vector unit -march=native has */
static inline v16f load16(const void *base, int64_t off, int kv_dtype, const float *lut) {
    v16f r;
    if (kv_dtype == KV_F32) {
        memcpy(&r, (const float *)base + off, 64);
    } else if (kv_dtype == KV_BF16) {
        v16h h;
        memcpy(&h, (const uint16_t *)base + off, 32);
        v16u u = __builtin_convertvector(h, v16u) << 16;
        memcpy(&r, &u, 64);
    } else if (kv_dtype == KV_F16) {
        v16hf h;
        memcpy(&h, (const _Float16 *)base + off, 32);
        r = __builtin_convertvector(h, v16f);
    } else if (kv_dtype == KV_INT8) {
        v16b b;
        memcpy(&b, (const int8_t *)base + off, 16);
        r = __builtin_convertvector(b, v16f);
    } else {
        const uint8_t *s = (const uint8_t *)base + off;
        for (int k = 0; k < 16; k++) r[k] = lut[s[k]];
    }
    return r;
}

static inline float hsum(v16f v) {
    v16f a = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return a[0] + a[1];
}

static inline v16i to_int(v16f x) { return __builtin_convertvector(x, v16i); }
static inline v16f to_float(v16i x) { return __builtin_convertvector(x, v16f); }
static inline v16f vmax(v16f a, v16f b) {
    v16i ai, bi;
    memcpy(&ai, &a, 64);
    memcpy(&bi, &b, 64);
    const v16i lt = a < b;
    ai = (ai & ~lt) | (bi & lt);
    memcpy(&a, &ai, 64);
    return a;
}
#endif

/* exp(x) for x <= 0 (scores minus their running max), 16 lanes: 2^n · p(r) with x = n ln2 + r,
 * |r| <= ln2/2, p a degree-7 Taylor polynomial (relative error ~2e-7, 1-2 float32 ulp; Cephes
 * expf's range reduction with a two-part ln2). x is clamped to -87 (exp(-87) ~ 1.6e-38: no
 * subnormal scale; a key that far below the row's max adds nothing visible to a sum that is >= 1). */
static inline v16f exp16(v16f x) {
    x = vmax(x, (v16f){0} - 87.0f);
    const v16i n = to_int(x * 1.44269504088896341f - 0.5f);  /* round half away: x <= 0 */
    const v16f nf = to_float(n);
    v16f r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    v16f p = (v16f){0} + 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v16i e = (n + 127) << 23;
    v16f two_n;
    memcpy(&two_n, &e, 64);
    return p * two_n;
}

#if defined(__AVX512F__)
static inline float hmax(v16f v) { return _mm512_reduce_max_ps((__m512)v); }
#else
static inline float hmax(v16f v) {
    float r = v[0];
    for (int k = 1; k < 16; k++) r = v[k] > r ? v[k] : r;
    return r;
}
#endif

/* The 16 lane sums of x[0..15] as one vector, lane j = sum of x[BITREV[j]]'s lanes (callers fill
 * x[k] with key BITREV[k]'s partial sums, so lane j is key j). A transpose-and-add tree: 15
 * vector adds and 30 shuffles for 16 dot products instead of 16 separate horizontal sums. */
static const int BITREV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
static inline v16f reduce16(const v16f *x) {
    v16f u[8], v[4], w[2];
    for (int i = 0; i < 8; i++)
        u[i] = __builtin_shufflevector(x[i], x[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(x[i], x[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        v[i] = __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shufflevector(v[i], v[i + 2], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(v[i], v[i + 2], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#define MAX_TASK_HEADS 32  /* query heads one task holds state for */
#ifndef PF_DIST
#define PF_DIST 1  /* blocks ahead to prefetch */
#endif

/* The attention of query heads [h0 * G, h1 * G) of decode i (see the file comment). */
static inline __attribute__((always_inline)) void decode_task(
        const void *query, int q_dtype, int64_t q_row_stride, const void *kv, const int kv_dtype, const float *lut,
        const float *scales, int64_t half, int64_t shalf, int BS, int kv_heads, const int NV, const int G,
        const int32_t *table, int64_t t, int64_t first, int64_t seq_len, int h0, int h1, float scale, void *out,
        int out_dtype, float *lse) {
    const int D = NV * 16, H = (h1 - h0) * G, num_heads = kv_heads * G;
    const int64_t row = (int64_t)kv_heads * D;  /* elements per slot */
    v16f q[MAX_TASK_HEADS][NV_MAX], acc[MAX_TASK_HEADS][NV_MAX];
    float m[MAX_TASK_HEADS], l[MAX_TASK_HEADS];
    float p[MAX_GROUP][16] __attribute__((aligned(64)));
    for (int a = 0; a < H; a++) {
        const int64_t qoff = t * q_row_stride + (int64_t)(h0 * G + a) * D;
        for (int c = 0; c < NV; c++) {
            q[a][c] = load16(query, qoff + 16 * c, q_dtype == Q_F32 ? KV_F32 : KV_BF16, 0) * scale;
            acc[a][c] = (v16f){0};
        }
        m[a] = -FLT_MAX;
        l[a] = 0.0f;
    }
    const int esize = kv_dtype == KV_F32 ? 4 : kv_dtype >= KV_INT8 ? 1 : 2;
    for (int64_t pos = first; pos < seq_len;) {
        const int64_t blk = table[pos / BS];
        const int off = (int)(pos % BS);
        const int n = (int)((BS - off) < (seq_len - pos) ? (BS - off) : (seq_len - pos));
        const int64_t slot0 = blk * BS + off;
        /* the next block's K and V rows of these heads are prefetched one row pair per key this block
         * scores (spread over the block's work, not a burst that would stall on the miss queue) */
        const char *pf = 0;
        int pf_rows = 0, pf_done = 0;
        const int64_t pf_pos = (pos / BS + PF_DIST) * BS;  /* first position of the block PF_DIST ahead */
        if (pf_pos < seq_len) {
            const int64_t nslot = (int64_t)table[pf_pos / BS] * BS;
            const int nn = (int)((seq_len - pf_pos) < BS ? (seq_len - pf_pos) : BS);
            pf = (const char *)kv + (nslot * row + (int64_t)h0 * D) * esize;
            pf_rows = nn * (h1 - h0);
        }
        const int hn = h1 - h0, row_bytes = D * esize;
        const int64_t vbytes = half * esize;
        for (int h = h0; h < h1; h++) {
            const int a0 = (h - h0) * G;
            v16f Q[MAX_GROUP][NV_MAX], A[MAX_GROUP][NV_MAX];  /* this head's queries and sums */
            for (int g = 0; g < G; g++)
                for (int c = 0; c < NV; c++) {
                    Q[g][c] = q[a0 + g][c];
                    A[g][c] = acc[a0 + g][c];
                }
            for (int j0 = 0; j0 < n; j0 += 16) {  /* tiles of up to 16 keys: one score vector per query */
                const int nt = n - j0 < 16 ? n - j0 : 16;
                v16f part[MAX_GROUP][16], lane_ok, ksv = (v16f){0} + 1.0f, vsv = (v16f){0} + 1.0f;
                for (int k = 0; k < 16; k++) lane_ok[k] = k < nt ? 1.0f : 0.0f;
                for (int k = 0; k < 16; k++) {
                    const int j = BITREV[k];
                    if (j >= nt) {
                        for (int g = 0; g < G; g++) part[g][k] = (v16f){0};
                        continue;
                    }
                    if (pf_done < pf_rows) {
                        const char *a = pf + ((int64_t)(pf_done / hn) * row + (pf_done % hn) * D) * esize;
                        for (int b = 0; b < row_bytes; b += 64) {
                            __builtin_prefetch(a + b);
                            __builtin_prefetch(a + vbytes + b);
                        }
                        pf_done++;
                    }
                    const int64_t r = (slot0 + j0 + j) * row + (int64_t)h * D;
                    v16f kr[NV_MAX];
                    for (int c = 0; c < NV; c++) kr[c] = load16(kv, r + 16 * c, kv_dtype, lut);
                    for (int g = 0; g < G; g++) {
                        v16f sc = Q[g][0] * kr[0];
                        for (int c = 1; c < NV; c++) sc += Q[g][c] * kr[c];
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
                    const v16f sc = reduce16(part[g]) * ksv;
                    const v16f masked = sc * lane_ok + (lane_ok - 1.0f) * FLT_MAX;  /* lanes >= nt: -FLT_MAX */
                    const float mx = hmax(masked) > m[a] ? hmax(masked) : m[a];
                    const float corr = l[a] > 0.0f ? expf(m[a] - mx) : 0.0f;
                    const v16f e = exp16(masked - mx) * lane_ok;
                    l[a] = l[a] * corr + hsum(e);
                    m[a] = mx;
                    if (corr != 1.0f)
                        for (int c = 0; c < NV; c++) A[g][c] *= corr;
                    const v16f pv = e * vsv;
                    memcpy(p[g], &pv, 64);
                }
                for (int j = 0; j < nt; j++) {
                    const int64_t r = half + (slot0 + j0 + j) * row + (int64_t)h * D;
                    for (int c = 0; c < NV; c++) {
                        const v16f v = load16(kv, r + 16 * c, kv_dtype, lut);
                        for (int g = 0; g < G; g++) A[g][c] += p[g][j] * v;
                    }
                }
            }
            for (int g = 0; g < G; g++)
                for (int c = 0; c < NV; c++) acc[a0 + g][c] = A[g][c];
        }
        pos += n;
    }
    for (int a = 0; a < H; a++) {
        const float inv = l[a] > 0.0f ? 1.0f / l[a] : 0.0f;
        const int64_t ooff = (t * num_heads + h0 * G + a) * (int64_t)D;
        for (int c = 0; c < NV; c++) {
            v16f o = acc[a][c] * inv;
            if (out_dtype == Q_F32) {
                memcpy((float *)out + ooff + 16 * c, &o, 64);
            } else {
                uint16_t *dst = (uint16_t *)out + ooff + 16 * c;
                for (int k = 0; k < 16; k++) dst[k] = f32_to_bf16(o[k]);
            }
        }
        if (lse) lse[t * num_heads + h0 * G + a] = l[a] > 0.0f ? m[a] + logf(l[a]) : -FLT_MAX;
    }
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


/* Returns 0, or -1 when a size is past this kernel's fixed limits (the caller then falls back).
 * Work split: one task per decode and chunk of KV heads; a chunk is all of a sequence's KV heads
 * (one contiguous read of each block) when there are enough decodes to keep every thread busy,
 * else one KV head (a batch-1 step still uses every thread). */
int llmd_paged_decode(const void *query, int q_dtype, int64_t q_row_stride,
                      const void *kv, int kv_dtype, const float *lut, const float *scales,
                      int64_t num_blocks, int block_size, int kv_heads, int head_dim, int num_heads,
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
    const int64_t half = num_blocks * block_size * kv_heads * (int64_t)head_dim;  /* elements of K before V */
    const int64_t shalf = num_blocks * block_size * (int64_t)kv_heads;            /* scales of K before V */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int task = 0; task < tasks; task++) {
        const int i = task / chunks, h0 = (task % chunks) * hc;
        run_task(query, q_dtype, q_row_stride, kv, kv_dtype, lut, scales, half, shalf, block_size, kv_heads,
                 head_dim / 16, G, block_tables + table_rows[i] * bt_stride, token_idx[i], first[i], seq_lens[i],
                 h0, h0 + hc, scale, out, out_dtype, lse);
    }
    return 0;
}
