/* One decode token of a Llama-architecture model in one call: every layer's RMSNorm, 4-bit / 8-bit
 * weight matrix-vector products, RoPE, K/V store into the paged cache, paged attention, SwiGLU and
 * residual adds, then the final norm and the LM head's logits (single-stream decode, batch 1).
 *
 * Why: at batch 1 a step of the torch path is ~27 small kernels per layer plus torch's weight-only
 * int4/int8 matmuls; those alone (~6.8 ms for SmolLM2) cost about what llama.cpp spends on a whole
 * token. Here the step is one OpenMP parallel region (torch's thread team, see build.py) with one
 * barrier per matrix-vector product.
 *
 * Weights (packed by llmd/quant/native_packs.py from the GGUF's own blocks, which documents the
 * layout): tiles of 16 output rows; per tile and block of 32 weights along K, the 16 rows' codes in
 * steps of 4 (vpdpbusd's 4-byte groups), so one 16-lane accumulator holds a tile's 16 dot products
 * and no horizontal sum is needed. Q4 (codes 0..15, two per byte: w = code * scale + min, GGUF
 * Q4_0 / Q4_1 / Q4_K) and Q8 (int8, w = code * scale, Q8_0); scales and mins float16 per (row, block).
 *
 * Activations: each product's input vector is quantized per block of 32 to int8 (symmetric, scale
 * = absmax / 127, round to nearest even), as llama.cpp does (ggml-quants.c quantize_row_q8_1 for
 * its Q4_1 x Q8_1 dots); with act_levels = 2 (llmd's default) the rounding residual gets int8 codes
 * of its own in steps of scale / 254 and a second vpdpbusd over the same weight bytes, so the
 * product sees x to ~1/64,000 of the block's absmax (measured on SmolLM2: teacher-forced dNLL vs the
 * float32 model +0.015 %, top-1 98.9 %, against +0.205 % / 95.5 % with one level). Q4 products use
 * centred codes, w = (q - 8) scale + (min + 8 scale): the integer dot sum (q - 8) xq carries the
 * quantized x and the small offset term multiplies the block's exact float sum, so the two float
 * terms do not cancel (the uncentred form lost ~3 digits on Q4_1's min ~ -8 scale). Q8 weights are
 * made unsigned by +128 and their dot corrected by -128 * sum(xq). Everything else is float32: the
 * residual stream, norms, RoPE, softmax (paged_decode.c's decode_task), SwiGLU. The new K/V row is
 * written in the cache's dtype (float32, or bfloat16 rounded to nearest even).
 *
 * Work split: one OpenMP region per step; each product's row tiles split statically between the
 * threads, then a barrier; attention one KV head per iteration (its RoPE and K/V store included).
 * Each thread quantizes the next input itself (a few microseconds) instead of waiting at another
 * barrier. Weights stream from DRAM with the next tiles' lines prefetched block by block (a burst
 * per tile stalled on the fill buffers: 6.3 -> 4.1 ms per SmolLM2 step).
 *
 * Built where the compiler targets AVX512-VNNI, -BW and -VL (fused_avx512.h's products) or AVX2 with FMA
 * and F16C (fused_avx2.h: the same integer sums on 8-lane vectors); elsewhere llmd_fused_supported()
 * returns 0 and llmd keeps the torch path.
 */
#include "paged_decode.c"

#include <omp.h>

typedef struct {
    const uint8_t *codes;    /* Q4: [N, K/2]; Q8: [N, K] int8 */
    const uint16_t *scales;  /* [N, K/32] float16 */
    const uint16_t *mins;    /* [N, K/32] float16 (Q4), NULL for Q8 */
    int64_t rows, cols;
    int kind;                /* 0 = Q4, 1 = Q8 */
} llmd_mat;

typedef struct {
    const float *attn_norm, *ffn_norm;  /* [hidden] float32 */
    llmd_mat qkv, o, gate_up, down;     /* qkv rows: q heads, then k heads, then v heads; gate_up: gate, then up */
    void *kv;                           /* the layer's cache data [2, blocks, block_size, kv_heads, head_dim] */
    int64_t kv_plane;                   /* elements from the K plane to the V plane (the cache's stride(0)) */
    int window;                         /* sliding window (tokens), 0 = none */
} llmd_layer;

typedef struct {
    int hidden, heads, kv_heads, head_dim, inter, num_layers, block_size, kv_dtype;  /* KV_F32 / KV_BF16 / KV_F16 */
    float eps, attn_scale;
    int act_levels;          /* 1: int8 activations; 2: plus an int8 code of each one's rounding residual */
    const float *inv_freq;   /* [head_dim / 2] RoPE inverse frequencies */
    const float *final_norm; /* [hidden] */
    llmd_mat head;           /* [vocab, hidden] */
} llmd_model;

#define MAX_K 16384
#ifndef PF_TILES
#define PF_TILES 4  /* row tiles ahead whose weights each tile prefetches */
#endif

/* Per-thread copy of the quantized input of the next product (no barrier to share it). */
typedef struct {
    int8_t xq[2][MAX_K] __attribute__((aligned(64)));  /* codes, and the codes of the residual (2 levels) */
    float dx[MAX_K / 32] __attribute__((aligned(64)));
    float sx[MAX_K / 32] __attribute__((aligned(64)));
    int32_t sq[2][MAX_K / 32] __attribute__((aligned(64)));  /* each block's sum of codes, per level */
} qvec;

#define RESIDUAL_STEPS 254.0f  /* the residual's codes step dx / 254: |residual| <= dx / 2 fits in +-127 */
#define ROWS 16                /* rows per tile of the packed layouts (one 16-lane accumulator) */

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FUSED_OK 1
#include "fused_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
/* (AVX-512F without VNNI, e.g. Skylake-SP / x86-64-v4: paged_decode.c's vectors are 16 lanes there,
 * which fused_avx2.h's 8-lane code does not take; the build reports the kernel unsupported) */
#define FUSED_OK 1
#include "fused_avx2.h"
#endif

#ifdef FUSED_OK
static void matvec_1(const llmd_mat *w, int64_t t0, int64_t t1, const qvec *q, float *out, int acc) {
    matvec_impl(w, t0, t1, q, out, acc, 1);
}
static void matvec_2(const llmd_mat *w, int64_t t0, int64_t t1, const qvec *q, float *out, int acc) {
    matvec_impl(w, t0, t1, q, out, acc, 2);
}

/* This thread's share of a product (a static split of the row tiles), then the team's barrier. */
static void matvec(const llmd_mat *w, const qvec *q, float *out, int accumulate, int levels) {
    const int64_t tiles = w->rows / ROWS;
    void (*fn)(const llmd_mat *, int64_t, int64_t, const qvec *, float *, int) = levels == 2 ? matvec_2 : matvec_1;
    const int nt = omp_get_num_threads(), me = omp_get_thread_num();
    fn(w, tiles * me / nt, tiles * (me + 1) / nt, q, out, accumulate);
#pragma omp barrier
}

/* out = x / rms(x) * wt, VL lanes (paged_decode.c's vf; v * v + s contracts to an FMA). */
static void rms_norm(const float *x, const float *wt, int n, float eps, float *out) {
    vf s = {0};
    for (int i = 0; i < n; i += VL) {
        const vf v = loadv(x, i, KV_F32, 0);
        s = v * v + s;
    }
    const float r = 1.0f / sqrtf(hsum(s) / (float)n + eps);
    for (int i = 0; i < n; i += VL) {
        const vf o = loadv(x, i, KV_F32, 0) * r * loadv(wt, i, KV_F32, 0);
        memcpy(out + i, &o, sizeof o);
    }
}

/* NEOX rotate-half RoPE of one head in place: x1' = x1 c - x2 s, x2' = x2 c + x1 s. */
static void rope(float *v, const float *cs, const float *sn, int D) {
    const int h = D / 2;
    for (int i = 0; i < h; i++) {
        const float a = v[i], b = v[i + h];
        v[i] = a * cs[i] - b * sn[i];
        v[i + h] = b * cs[i] + a * sn[i];
    }
}

static void store_row(void *kv, int64_t off, const float *src, int D, int kv_dtype) {
    if (kv_dtype == KV_F32) {
        memcpy((float *)kv + off, src, (size_t)D * 4);
    } else if (kv_dtype == KV_F16) {  /* round to nearest even, as torch's .to(float16) */
        _Float16 *dst = (_Float16 *)kv + off;
        for (int i = 0; i < D; i++) dst[i] = (_Float16)src[i];
    } else {
        uint16_t *dst = (uint16_t *)kv + off;
        for (int i = 0; i < D; i++) dst[i] = f32_to_bf16(src[i]);
    }
}


/* Shared work buffers (floats): x [hidden], qkv [(heads + 2 kv_heads) D], attn [heads D], gu [2 inter],
 * rope cos/sin [D/2 each]; each thread's norm / SwiGLU output and quantized vector are its own. */
int llmd_fused_decode(const llmd_model *m, const llmd_layer *layers, const void *embed_row, int embed_dtype,
                      int64_t position, int64_t slot, const int32_t *block_table, int64_t seq_len,
                      float *logits, float *work, int num_threads) {
    const int H = m->hidden, D = m->head_dim, Hq = m->heads, Hk = m->kv_heads, I = m->inter;
    const int G = Hq / Hk, NV = D / 16, LVL = m->act_levels == 2 ? 2 : 1;
    if (H > MAX_K || I > MAX_K || H % 32 || I % 32 || (Hq * D) % 32 || D % 16 || D > MAX_HEAD_DIM || G > MAX_GROUP
        || m->block_size > MAX_BLOCK || G * Hk != Hq)
        return -1;
    float *x = work, *qkv = x + H, *attn = qkv + (Hq + 2 * Hk) * D, *gu = attn + Hq * D;
    float *cs = gu + 2 * I, *sn = cs + D / 2;
    for (int i = 0; i < H; i++)
        x[i] = embed_dtype == Q_F32 ? ((const float *)embed_row)[i] : bf16_to_f32(((const uint16_t *)embed_row)[i]);
    for (int i = 0; i < D / 2; i++) {
        const float a = (float)position * m->inv_freq[i];
        cs[i] = cosf(a);
        sn[i] = sinf(a);
    }
    qvec *qs = NULL;
    const int nt = num_threads < 1 ? 1 : num_threads;
    if (posix_memalign((void **)&qs, 64, sizeof(qvec) * (size_t)nt)) return -2;
    const int64_t row = (int64_t)Hk * D, bs = m->block_size;
#pragma omp parallel num_threads(nt)
    {
        qvec *q = qs + omp_get_thread_num();
        float normed[MAX_K] __attribute__((aligned(64)));
        for (int l = 0; l < m->num_layers; l++) {
            const llmd_layer *L = layers + l;
            rms_norm(x, L->attn_norm, H, m->eps, normed);
            quantize(normed, H, q, LVL);
            matvec(&L->qkv, q, qkv, 0, LVL);
            const int64_t half = L->kv_plane, first = L->window > 0 && seq_len > L->window
                                                                    ? seq_len - L->window : 0;
#pragma omp for schedule(dynamic, 1)
            for (int h = 0; h < Hk; h++) {
                float *k = qkv + (Hq + h) * D, *v = qkv + (Hq + Hk + h) * D;
                for (int a = 0; a < G; a++) rope(qkv + (h * G + a) * D, cs, sn, D);
                rope(k, cs, sn, D);
                store_row(L->kv, slot * row + (int64_t)h * D, k, D, m->kv_dtype);
                store_row(L->kv, half + slot * row + (int64_t)h * D, v, D, m->kv_dtype);
                run_task(qkv, Q_F32, 0, L->kv, m->kv_dtype, NULL, NULL, half, 0, (int)bs, Hk, NV, G, block_table,
                         0, first, seq_len, h, h + 1, m->attn_scale, attn, Q_F32, NULL);
            }
            quantize(attn, Hq * D, q, LVL);
            matvec(&L->o, q, x, 1, LVL);
            rms_norm(x, L->ffn_norm, H, m->eps, normed);
            quantize(normed, H, q, LVL);
            matvec(&L->gate_up, q, gu, 0, LVL);
            swiglu(gu, I, normed);
            quantize(normed, I, q, LVL);
            matvec(&L->down, q, x, 1, LVL);
        }
        rms_norm(x, m->final_norm, H, m->eps, normed);
        quantize(normed, H, q, LVL);
        matvec(&m->head, q, logits, 0, LVL);
    }
    free(qs);
    return 0;
}

int llmd_fused_supported(void) { return 1; }
#else
int llmd_fused_decode(const llmd_model *m, const llmd_layer *layers, const void *embed_row, int embed_dtype,
                      int64_t position, int64_t slot, const int32_t *block_table, int64_t seq_len,
                      float *logits, float *work, int num_threads) {
    (void)m; (void)layers; (void)embed_row; (void)embed_dtype; (void)position; (void)slot; (void)block_table;
    (void)seq_len; (void)logits; (void)work; (void)num_threads;
    return -3;
}

int llmd_fused_supported(void) { return 0; }
#endif
