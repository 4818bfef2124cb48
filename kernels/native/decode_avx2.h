/* decode_task for 8-lane builds (AVX2 without AVX-512: AMD Zen 1-3, Intel before Skylake-X), with
 * its loops ordered for 16 vector registers. Included by paged_decode.c, which calls it from
 * decode_task when VL == 8.
 *
 * Why: decode_task keeps a head's G queries and G sums (2 · G · head_dim / 8 vectors: 48 for
 * SmolLM2's G = 3, head_dim 64) and a tile's G · 8 partial dot products in registers, which fits
 * AVX-512's 32 registers of 16 lanes but not AVX2's 16 of 8: on the Zen 3 GCC spilled them to the
 * stack (800 stack accesses in the f16 task) and the batch-32 x 512 decode took 2.3x its
 * KV-read floor. Here every loop holds at most 16 vectors:
 *   scores: per tile of 8 keys, blocks of (up to 3 query rows) x (4 keys): 12 dot-product
 *           accumulators over the head's channel vectors, a query vector per row loaded once per
 *           channel vector and each K vector converted once per block of rows; the 4 keys' sums
 *           reduced by horizontal adds into lanes 0-3 or 4-7 of the row's score vector (key order);
 *   softmax: decode_task's lazy-rescaled online softmax, per row, unchanged;
 *   P.V:    per pair of channel vectors, the rows' sums (up to 3 x 2 vectors) over the tile's keys,
 *           each V vector converted once per block of rows, the probability broadcast once per
 *           (key, row).
 * Same task split, key order (per sequence, in position order), float32 accumulation and outputs
 * as decode_task, so a sequence's result does not depend on its batch (case S4); only the order
 * of the channel sums within a score differs (float32 rounding).
 *
 * Measured on the 2-core Zen 3 (2026-12-06, benchmarks/native_decode.py --dtype float32, batch 32 x
 * 512 keys x 30 layers, both loops alternating in one process): float16 cache 0.78x / 0.83x / 0.91x
 * decode_task's time (19.8 vs 25.4 ms in the quietest run), int8 0.75x (24.2 vs 32.2); a float32
 * cache 1.10-1.12x (its rows twice the bytes, the read already the limit), so float32 caches keep
 * decode_task's loops. */

#define RB 3  /* query rows per block */

/* The A/B switch for measurements: LLMD_AVX2_TILES=0 runs decode_task's own loops instead (the
 * environment read once per process; relaxed atomics, as any thread may be first). */
static int avx2_tiles = -1;
static inline int avx2_tiles_on(void) {
    int on = __atomic_load_n(&avx2_tiles, __ATOMIC_RELAXED);
    if (on < 0) {
        const char *e = getenv("LLMD_AVX2_TILES");
        on = !(e && e[0] == '0');
        __atomic_store_n(&avx2_tiles, on, __ATOMIC_RELAXED);
    }
    return on;
}

/* lanes 0-3 of the result: the full sums of a, b, c, d; lanes 4-7 the same (both 128-bit halves added). */
static inline __m128 sum4(vf a, vf b, vf c, vf d) {
    const __m256 ab = _mm256_hadd_ps((__m256)a, (__m256)b), cd = _mm256_hadd_ps((__m256)c, (__m256)d);
    const __m256 s = _mm256_hadd_ps(ab, cd);  /* [a0 b0 c0 d0 | a1 b1 c1 d1] of the two 128-bit halves */
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* Scores of query rows Q[0..rn) (NC vectors each) against the nt <= 8 keys at K rows kbase + j · row
 * (j < nt): sc[i] lane j = Q[i] . K_j (lanes >= nt: 0). */
static inline __attribute__((always_inline)) void scores8(const vf (*Q)[NC_MAX], int rn, int NC, const void *kv,
                                                          int kv_dtype, const float *lut, int64_t kbase, int64_t row,
                                                          int nt, vf *sc) {
    for (int i = 0; i < rn; i++) sc[i] = (vf){0};
    for (int kb = 0; kb < nt; kb += 4) {
        const int kn = nt - kb < 4 ? nt - kb : 4;
        vf acc[RB][4];
        for (int i = 0; i < RB; i++)
            for (int k = 0; k < 4; k++) acc[i][k] = (vf){0};
        for (int c = 0; c < NC; c++) {
            vf q[RB];
            for (int i = 0; i < RB; i++) q[i] = i < rn ? Q[i][c] : (vf){0};
            for (int k = 0; k < 4; k++) {
                if (k >= kn) break;
                const vf kr = loadv(kv, kbase + (int64_t)(kb + k) * row + VL * c, kv_dtype, lut);
                for (int i = 0; i < RB; i++)
                    if (i < rn) acc[i][k] += q[i] * kr;
            }
        }
        for (int i = 0; i < rn; i++) {
            const __m128 s = sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);  /* keys >= kn summed zeros */
            const __m256 w = kb ? _mm256_insertf128_ps((__m256)sc[i], s, 1) : _mm256_insertf128_ps((__m256)sc[i], s, 0);
            sc[i] = (vf)w;
        }
    }
}

static inline __attribute__((always_inline)) void decode_task_avx2(
        const void *query, int q_dtype, int64_t q_row_stride, const void *kv, const int kv_dtype, const float *lut,
        const float *scales, int64_t half, int64_t shalf, int BS, int kv_heads, const int NV, const int G,
        const int32_t *table, int64_t t, int64_t first, int64_t seq_len, int h0, int h1, float scale, void *out,
        int out_dtype, float *lse) {
    const int D = NV * 16, NC = D / VL, H = (h1 - h0) * G, num_heads = kv_heads * G;
    const int64_t row = (int64_t)kv_heads * D;
    vf q[MAX_TASK_HEADS][NC_MAX], acc[MAX_TASK_HEADS][NC_MAX];
    float m[MAX_TASK_HEADS], l[MAX_TASK_HEADS];
    float p[MAX_GROUP][VL] __attribute__((aligned(32)));
    task_start(query, q_dtype, q_row_stride, t, h0, G, H, NC, scale, q, acc, m, l);
    const int esize = kv_esize(kv_dtype);
    for (int64_t pos = first; pos < seq_len;) {
        int64_t slot0;
        const int n = block_run(table, pos, BS, seq_len, &slot0);
        struct kv_prefetch pf = kv_prefetch_plan(kv, esize, half, table, pos, BS, seq_len, row, D, h0, h1);
        for (int h = h0; h < h1; h++) {
            const int a0 = (h - h0) * G;
            for (int j0 = 0; j0 < n; j0 += VL) {
                const int nt = n - j0 < VL ? n - j0 : VL;
                const int64_t kbase = (slot0 + j0) * row + (int64_t)h * D;
                vf lane_ok, ksv = splat(1.0f), vsv = splat(1.0f);
                for (int k = 0; k < VL; k++) lane_ok[k] = k < nt ? 1.0f : 0.0f;
                if (scales)
                    for (int j = 0; j < nt; j++) {
                        ksv[j] = scales[(slot0 + j0 + j) * kv_heads + h];
                        vsv[j] = scales[shalf + (slot0 + j0 + j) * kv_heads + h];
                    }
                for (int g0 = 0; g0 < G; g0 += RB) {
                    const int rn = G - g0 < RB ? G - g0 : RB;
                    vf sc[RB];
                    scores8((const vf (*)[NC_MAX])&q[a0 + g0], rn, NC, kv, kv_dtype, lut, kbase, row, nt, sc);
                    for (int i = 0; i < rn; i++) {
                        const int a = a0 + g0 + i;
                        vf s = sc[i];
                        if (scales) s *= ksv;
                        if (nt < VL) s = s * lane_ok + (lane_ok - 1.0f) * FLT_MAX;  /* lanes >= nt: -FLT_MAX */
                        lazy_rescale(s, &m[a], &l[a], acc[a], NC);
                        vf e = expv(s - m[a]);
                        if (nt < VL) e *= lane_ok;
                        l[a] += hsum(e);
                        if (scales) e *= vsv;
                        memcpy(p[g0 + i], &e, sizeof e);
                    }
                }
                const int64_t vbase = half + kbase;
                for (int g0 = 0; g0 < G; g0 += RB) {
                    const int rn = G - g0 < RB ? G - g0 : RB;
                    for (int c = 0; c < NC; c += 2) {  /* NC is even: head_dim is a multiple of 16 */
                        vf A0[RB], A1[RB];
                        for (int i = 0; i < RB; i++) {
                            A0[i] = i < rn ? acc[a0 + g0 + i][c] : (vf){0};
                            A1[i] = i < rn ? acc[a0 + g0 + i][c + 1] : (vf){0};
                        }
                        for (int j = 0; j < nt; j++) {
                            if (c == 0 && g0 == 0) kv_prefetch_row(&pf);  /* one row pair per key, spread */
                            const vf v0 = loadv(kv, vbase + (int64_t)j * row + VL * c, kv_dtype, lut);
                            const vf v1 = loadv(kv, vbase + (int64_t)j * row + VL * (c + 1), kv_dtype, lut);
                            for (int i = 0; i < RB; i++)
                                if (i < rn) {
                                    const vf pb = (vf)_mm256_broadcast_ss(&p[g0 + i][j]);
                                    A0[i] += pb * v0;
                                    A1[i] += pb * v1;
                                }
                        }
                        for (int i = 0; i < rn; i++) {
                            acc[a0 + g0 + i][c] = A0[i];
                            acc[a0 + g0 + i][c + 1] = A1[i];
                        }
                    }
                }
            }
        }
        pos += n;
    }
    write_outputs(acc, m, l, H, NC, D, t, num_heads, h0 * G, out, out_dtype, lse);
}
