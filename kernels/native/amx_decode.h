/* Decode attention scores on Intel AMX (Sapphire Rapids and later) for bfloat16 queries over a
 * bfloat16 paged cache; the softmax and P·V stay on the vector units as in decode_task. Included
 * by paged_decode.c (uses decode_vec.h's vf, loadv, expv, hsum, MAX_* limits and decode_runs.h's lazy_rescale); built
 * only where -march=native enables AMX-TILE, AMX-BF16 and AVX-512, and used only after the kernel
 * granted the process the tile state (Linux arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
 * Intel's "Architecture Instruction Set Extensions Programming Reference", ch. 3, and the kernel's
 * Documentation/arch/x86/xstate.rst).
 * Measured (benchmarks/native_decode.py, batch 32 x 512, SmolLM2's shapes, 2-core AMX Xeon): 0.85-0.92x
 * the vector kernel's time, alternated in one process.
 *
 * One task per (decode, chunk of KV heads [h0, h1)); keys [first, seq_len) in 16-slot groups
 * aligned within their block (block sizes a multiple of 16; a group's rows outside the key range
 * are read by the tile load but masked: score -FLT_MAX, probability 0, V never loaded).
 * Scores: S^T[16 keys][HG] = K[16 keys][heads · D] · Qd, one TDPBF16PS per 32 channels of the
 * heads' contiguous K rows (tile rows = slots, stride = a slot's bytes: the block read as stored),
 * against Qd, the chunk's queries transposed into the tile unit's pair layout block-diagonally
 * (chunk j of head a feeds only head a's G columns), built once per task (K and Qd tiles go
 * through rings of three tile registers, so a load need not wait for the previous product). The
 * tile unit scores group i + 1 while the vector units fold group i in. The products of bfloat16 values are exact and summed in float32 (in the tile unit's
 * order; it flushes bfloat16 subnormal inputs to zero); the softmax scale is applied to the sums.
 * Each (head, query) row's 16 scores are gathered from the stored tile; the rest is decode_task's
 * online softmax (lazy rescaling) and float32 P·V in position order, so a sequence's output does
 * not depend on its batch.
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && VL == 16
#define HAVE_AMX 1
#include <stdlib.h>
#include "amx_tiles.h"

#define AMX_CHUNKS 8  /* 32-channel K chunks per task (the Qd tiles of up to 16 columns) */
#define TILE_BARRIER() __asm__ volatile("" ::: "memory")  /* tileloadd's asm does not say it reads memory */

static int amx_state = -1;  /* -1: not asked yet; 0: unavailable or LLMD_AMX_ATTENTION=0; 1: granted */

/* 1 when this process may use the tile unit (asked once, from the calling thread before any
 * OpenMP region: the grant is process-wide). */
static int amx_ready(void) {
    if (amx_state < 0) {
        const char *env = getenv("LLMD_AMX_ATTENTION");
        amx_state = env && env[0] == '0' ? 0 : amx_request_tiles();
    }
    return amx_state;
}

/* KV heads per AMX task for a shape, or 0 when the tile path does not take it: hc heads whose
 * hc · D / 32 K chunks fit AMX_CHUNKS and whose hc · G query rows fit a tile's 16 columns. */
static int amx_heads_per_task(int kv_heads, int D, int G, int want) {
    if (D % 32 || G > 16) return 0;
    int hc = want;
    while (hc > 1 && (hc * D / 32 > AMX_CHUNKS || hc * G > 16 || kv_heads % hc)) hc--;
    return hc * D / 32 <= AMX_CHUNKS && hc * G <= 16 ? hc : 0;
}

/* chunk j: its K rows into tk and its Qd tile into tq (rings of three registers each, so that a
 * load need not wait for the previous product to release its register), then S^T += K · Qd */
#define K_DOT(j, tk, tq) if (NJ > j) { _tile_loadd(tk, krow + 32 * j, rstride); _tile_loadd(tq, qd[j], 64); \
                                       _tile_dpbf16ps(0, tk, tq); }

/* Query heads [h0 G, h1 G) of decode t over KV heads [h0, h1) (decode_task's arguments; query and
 * K/V bfloat16, (h1 - h0) D / 32 <= AMX_CHUNKS, (h1 - h0) G <= 16, BS a multiple of 16). */
static inline __attribute__((always_inline)) void amx_task(
        const uint16_t *query, int64_t q_row_stride, const uint16_t *kv, int64_t half, int BS, int kv_heads,
        const int NV, const int G, const int32_t *table, int64_t t, int64_t first, int64_t seq_len, int h0, int h1,
        float scale, void *out, int out_dtype, float *lse) {
    const int D = NV * 16, NC = D / VL, H = (h1 - h0) * G, HG = H, NJ = (h1 - h0) * D / 32, num_heads = kv_heads * G;
    const int64_t row = (int64_t)kv_heads * D, rstride = row * 2;  /* elements, bytes per slot */
    vf acc[16][NC_MAX];
    float m[16], l[16];
    float p[16][VL] __attribute__((aligned(64)));
    float cs[2][16][16] __attribute__((aligned(64)));                  /* S^T tiles: [key][head, query] */
    uint16_t qd[AMX_CHUNKS][16][32] __attribute__((aligned(64)));      /* Qd: [chunk][pair row][column, 2] */
    memset(qd, 0, sizeof(uint16_t) * 16 * 32 * NJ);
    for (int j = 0; j < NJ; j++) {
        const int a = j / (D / 32), k = j % (D / 32);
        for (int g = 0; g < G; g++) {
            const uint16_t *q = query + t * q_row_stride + (int64_t)((h0 + a) * G + g) * D + 32 * k;
            for (int r = 0; r < 16; r++) {
                qd[j][r][2 * (a * G + g)] = q[2 * r];
                qd[j][r][2 * (a * G + g) + 1] = q[2 * r + 1];
            }
        }
    }
    for (int a = 0; a < H; a++) {
        for (int c = 0; c < NC; c++) acc[a][c] = (vf){0};
        m[a] = -FLT_MAX;
        l[a] = 0.0f;
    }
    struct amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = HG * 4;  /* tmm0: S^T accumulator */
    for (int j = 1; j <= 3; j++) cfg.rows[j] = 16, cfg.colsb[j] = 64;          /* tmm1..3: 16 slots' K, 32 channels */
    for (int j = 4; j <= 6; j++) cfg.rows[j] = 16, cfg.colsb[j] = HG * 4;      /* tmm4..6: Qd chunks */
    _tile_loadconfig(&cfg);
    TILE_BARRIER();
    const __m512i cols = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    const int hn = h1 - h0, row_bytes = D * 2;
    const int64_t vbytes = half * 2;
    /* scores of the group at gp into cs[b] (the tile unit works on the next group's while the
     * vector units fold this one in) */
#define SCORES(gp, b) do { \
        const uint16_t *krow = kv + ((int64_t)table[(gp) / BS] * BS + (gp) % BS) * row + (int64_t)h0 * D; \
        _tile_zero(0); \
        K_DOT(0, 1, 4); K_DOT(1, 2, 5); K_DOT(2, 3, 6); K_DOT(3, 1, 4); \
        K_DOT(4, 2, 5); K_DOT(5, 3, 6); K_DOT(6, 1, 4); K_DOT(7, 2, 5); \
        _tile_stored(0, cs[b], 64); \
    } while (0)
    const int64_t gfirst = first / 16 * 16;
    if (gfirst < seq_len) SCORES(gfirst, 0);  /* no keys (first >= seq_len): no tile read */
    for (int64_t gp = gfirst; gp < seq_len; gp += 16) {
        const int cur = (int)((gp - gfirst) / 16) & 1;
        if (gp + 16 < seq_len) SCORES(gp + 16, cur ^ 1);
        const int lo = first > gp ? (int)(first - gp) : 0;
        const int hi = seq_len - gp < 16 ? (int)(seq_len - gp) : 16;
        const __mmask16 ok = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
        const int64_t slot0 = (int64_t)table[gp / BS] * BS + gp % BS;
        /* K and V rows of the group two ahead (the next one is being scored already), one row pair
         * per key this group folds in */
        const char *pf = 0;
        int pf_rows = 0, pf_done = 0;
        if (gp + 32 < seq_len) {
            const int64_t np = gp + 32;
            pf = (const char *)(kv + ((int64_t)table[np / BS] * BS + np % BS) * row + (int64_t)h0 * D);
            pf_rows = (int)((seq_len - np) < 16 ? (seq_len - np) : 16) * hn;
        }
        for (int h = h0; h < h1; h++) {
            const int a0 = (h - h0) * G;
            vf A[MAX_GROUP][NC_MAX];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < NC; c++) A[g][c] = acc[a0 + g][c];
            for (int g = 0; g < G; g++) {
                const int a = a0 + g;
                vf sc = (vf)_mm512_i32gather_ps(cols, &cs[cur][0][a], 4) * scale;
                sc = (vf)_mm512_mask_blend_ps(ok, _mm512_set1_ps(-FLT_MAX), (__m512)sc);
                lazy_rescale(sc, &m[a], &l[a], A[g], NC);
                const vf e = (vf)_mm512_maskz_mov_ps(ok, (__m512)expv(sc - m[a]));
                l[a] += hsum(e);
                memcpy(p[g], &e, sizeof e);
            }
            for (int j = lo; j < hi; j++) {
                if (pf_done < pf_rows) {
                    const char *b = pf + ((int64_t)(pf_done / hn) * row + (pf_done % hn) * D) * 2;
                    for (int x = 0; x < row_bytes; x += 64) {
                        __builtin_prefetch(b + x);
                        __builtin_prefetch(b + vbytes + x);
                    }
                    pf_done++;
                }
                const int64_t r = half + (slot0 + j) * row + (int64_t)h * D;
                for (int c = 0; c < NC; c++) {
                    const vf v = loadv(kv, r + VL * c, KV_BF16, 0);
                    for (int g = 0; g < G; g++) A[g][c] += p[g][j] * v;
                }
            }
            for (int g = 0; g < G; g++)
                for (int c = 0; c < NC; c++) acc[a0 + g][c] = A[g][c];
        }
    }
    _tile_release();
    write_outputs(acc, m, l, H, NC, D, t, num_heads, h0 * G, out, out_dtype, lse);
}

#define AMX_ARGS const uint16_t *query, int64_t q_row_stride, const uint16_t *kv, int64_t half, int BS, \
    int kv_heads, int NV, int G, const int32_t *table, int64_t t, int64_t first, int64_t seq_len, int h0, int h1, \
    float scale, void *out, int out_dtype, float *lse
/* amx_task with the model's shape as constants where built for it (as task_bf16), else at run time */
static void amx_run(AMX_ARGS) {
#if defined(SPEC_NV) && defined(SPEC_G)
    if (NV == SPEC_NV && G == SPEC_G) {
        amx_task(query, q_row_stride, kv, half, BS, kv_heads, SPEC_NV, SPEC_G, table, t, first, seq_len, h0, h1,
                 scale, out, out_dtype, lse);
        return;
    }
#endif
    amx_task(query, q_row_stride, kv, half, BS, kv_heads, NV, G, table, t, first, seq_len, h0, h1, scale, out,
             out_dtype, lse);
}
#endif
