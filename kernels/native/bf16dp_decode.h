/* Decode attention for bfloat16 queries over a bfloat16 paged cache on CPUs with AVX512-BF16 and
 * no AMX grant (AMD Zen 4 and later, Intel Cooper Lake; on Sapphire Rapids the tile path of
 * amx_decode.h goes first). Included by paged_decode.c (uses decode_vec.h's vf, reducev, expv, hsum,
 * KEYMAP and MAX_* limits and decode_runs.h's write_outputs, lazy_rescale, kv_prefetch_plan /
 * kv_prefetch_row); built only where
 * -march=native enables AVX512-BF16 with 16-lane vectors.
 *
 * Same task split, key order and online softmax as decode_task (FlashAttention's running max and
 * sum: Dao et al. 2022, Algorithm 1), two differences in the arithmetic:
 *  - scores: VDPBF16PS (Intel SDM, "VDPBF16PS": per float32 lane, the sum of two exact products of
 *    bfloat16 pairs; it ignores MXCSR and flushes subnormal inputs and results to zero) on the raw
 *    bfloat16 query and K rows, 32 channels per instruction, no widening; the 16 lanes of a key
 *    are then summed in float32 (reducev) and the softmax scale applied to the sum, as on the tile
 *    path. Products are exact, so the scores differ from decode_task's only by float32 rounding
 *    order;
 *  - P·V: float32 as in decode_task, but each V row of 32 bfloat16 channels is widened by two bit
 *    operations (even channels: << 16, odd channels: & 0xffff0000) instead of a shuffle, so the
 *    accumulators hold channels in even/odd order until one permute per head at the end.
 * A full tile of 16 keys is scored two keys at a time, fully unrolled, and the lane-sum tree
 * (decode_vec.h's red1..red4, adjacent slots pairing up) is folded in as the pairs come, so
 * the partial sums stay in registers instead of a 16 x G array on the stack (measured on the
 * Zen 4, SmolLM2 batch 32 x 512: K/V in L1 7.8 vs 9.4 ms per 30 layers; read from DRAM 0.96-0.98x
 * in one process, where the KV read dominates). A tile's last keys (nt < 16) take the array
 * and reducev, the same additions in the same order.
 * Keys are read in position order per sequence, so a sequence's output does not depend on its
 * batch (case S4). Measured on a 2-core AMD EPYC (Zen 4), SmolLM2's shapes, batch 32 x 512:
 * compute ~13 % under decode_task's (L3-resident K/V); see README "The CPU fast path". Against float64:
 * <= 2.1e-7 relative with float32 outputs on tests/kernels/test_cpu_native.py's cases, as decode_task.
 * LLMD_BF16_DOT=0 (or llmd_paged_decode_set_dot(0)) turns it off for side-by-side measurement.
 */
#if defined(__AVX512BF16__) && VL == 16
#define HAVE_BF16DP 1
#define DP_MAX_Z (MAX_HEAD_DIM / 32)  /* 32-channel chunks per head */

static int dp_state = -1;  /* -1: LLMD_BF16_DOT not read yet; 0: off; 1: on */

static int dp_ready(void) {
    if (dp_state < 0) {
        const char *env = getenv("LLMD_BF16_DOT");
        dp_state = !(env && env[0] == '0');
    }
    return dp_state;
}

/* The G partial score vectors of key row kr (NZ chunks of 32 bfloat16 channels): s[g] lane i =
 * the sum over chunks of channels (2i, 2i + 1)'s products with query row g (reducev folds them). */
static inline __attribute__((always_inline)) void dp_key(const uint16_t *kr, const __m512bh (*Q)[DP_MAX_Z], const int NZ,
                                                          const int G, vf *s) {
    __m512bh K[DP_MAX_Z];
    for (int z = 0; z < NZ; z++) K[z] = (__m512bh)_mm512_loadu_si512(kr + 32 * z);
    for (int g = 0; g < G; g++) {
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), Q[g][0], K[0]);
        for (int z = 1; z < NZ; z++) t = _mm512_dpbf16_ps(t, Q[g][z], K[z]);
        s[g] = (vf)t;
    }
}

/* One task: decode token t's query heads [h0 * G, h1 * G) over keys [first, seq_len) of its block
 * table (NZ = head_dim / 32; arguments as decode_task's, the query and cache as raw bfloat16). */

static inline __attribute__((always_inline)) void dp_task(
        const uint16_t *query, int64_t q_row_stride, const uint16_t *kv, int64_t half, int BS, int kv_heads,
        const int NZ, const int G, const int32_t *table, int64_t t, int64_t first, int64_t seq_len, int h0, int h1,
        float scale, void *out, int out_dtype, float *lse) {
    const int D = NZ * 32, H = (h1 - h0) * G, num_heads = kv_heads * G;
    const int64_t row = (int64_t)kv_heads * D;
    __m512bh q[MAX_TASK_HEADS][DP_MAX_Z];
    vf acc[MAX_TASK_HEADS][NC_MAX];  /* channel order per 32: even channels, then odd */
    float m[MAX_TASK_HEADS], l[MAX_TASK_HEADS];
    float p[MAX_GROUP][VL] __attribute__((aligned(64)));
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    for (int a = 0; a < H; a++) {
        const uint16_t *qr = query + t * q_row_stride + (int64_t)(h0 * G + a) * D;
        for (int z = 0; z < NZ; z++) {
            q[a][z] = (__m512bh)_mm512_loadu_si512(qr + 32 * z);
            acc[a][2 * z] = acc[a][2 * z + 1] = (vf){0};
        }
        m[a] = -FLT_MAX;
        l[a] = 0.0f;
    }
    for (int64_t pos = first; pos < seq_len;) {
        int64_t slot0;
        const int n = block_run(table, pos, BS, seq_len, &slot0);
        struct kv_prefetch pf = kv_prefetch_plan(kv, 2, half, table, pos, BS, seq_len, row, D, h0, h1);
        for (int h = h0; h < h1; h++) {
            const int a0 = (h - h0) * G;
            __m512bh Q[MAX_GROUP][DP_MAX_Z];
            vf A[MAX_GROUP][NC_MAX];
            for (int g = 0; g < G; g++)
                for (int z = 0; z < NZ; z++) {
                    Q[g][z] = q[a0 + g][z];
                    A[g][2 * z] = acc[a0 + g][2 * z];
                    A[g][2 * z + 1] = acc[a0 + g][2 * z + 1];
                }
            for (int j0 = 0; j0 < n; j0 += VL) {
                const int nt = n - j0 < VL ? n - j0 : VL;
                vf lane_ok, red[MAX_GROUP];
                for (int k = 0; k < VL; k++) lane_ok[k] = k < nt ? 1.0f : 0.0f;
                if (nt == VL) {  /* a full tile: keys scored in slot pairs, the tree folded in as they come */
                    vf u[MAX_GROUP][8], v[MAX_GROUP][4], w[MAX_GROUP][2];
#pragma GCC unroll 16
                    for (int k = 0; k < VL; k += 2) {
                        vf s0[MAX_GROUP], s1[MAX_GROUP];
                        dp_key(kv + (slot0 + j0 + KEYMAP[k]) * row + (int64_t)h * D, Q, NZ, G, s0);
                        dp_key(kv + (slot0 + j0 + KEYMAP[k + 1]) * row + (int64_t)h * D, Q, NZ, G, s1);
                        kv_prefetch_row(&pf);
                        kv_prefetch_row(&pf);
                        for (int g = 0; g < G; g++) u[g][k / 2] = red1(s0[g], s1[g]);
                        if (k % 4 == 2)
                            for (int g = 0; g < G; g++) v[g][k / 4] = red2(u[g][k / 2 - 1], u[g][k / 2]);
                        if (k % 8 == 6)
                            for (int g = 0; g < G; g++) w[g][k / 8] = red3(v[g][k / 4 - 1], v[g][k / 4]);
                    }
                    for (int g = 0; g < G; g++) red[g] = red4(w[g][0], w[g][1]);
                } else {  /* the last keys of a block: slots past nt score zero */
                    vf part[MAX_GROUP][VL], s_tmp[MAX_GROUP];
                    for (int k = 0; k < VL; k++) {
                        if (KEYMAP[k] >= nt) {
                            for (int g = 0; g < G; g++) part[g][k] = (vf){0};
                            continue;
                        }
                        kv_prefetch_row(&pf);
                        dp_key(kv + (slot0 + j0 + KEYMAP[k]) * row + (int64_t)h * D, Q, NZ, G, s_tmp);
                        for (int g = 0; g < G; g++) part[g][k] = s_tmp[g];
                    }
                    for (int g = 0; g < G; g++) red[g] = reducev(part[g]);
                }
                for (int g = 0; g < G; g++) {
                    const int a = a0 + g;
                    vf sc = red[g] * scale;
                    if (nt < VL) sc = sc * lane_ok + (lane_ok - 1.0f) * FLT_MAX;
                    lazy_rescale(sc, &m[a], &l[a], A[g], 2 * NZ);
                    vf e = expv(sc - m[a]);
                    if (nt < VL) e *= lane_ok;
                    l[a] += hsum(e);
                    memcpy(p[g], &e, sizeof e);
                }
                for (int j = 0; j < nt; j++) {
                    const uint16_t *vr = kv + half + (slot0 + j0 + j) * row + (int64_t)h * D;
                    for (int z = 0; z < NZ; z++) {
                        const __m512i v = _mm512_loadu_si512(vr + 32 * z);
                        const vf ve = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                        const vf vo = (vf)_mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
                        for (int g = 0; g < G; g++) {
                            A[g][2 * z] += p[g][j] * ve;
                            A[g][2 * z + 1] += p[g][j] * vo;
                        }
                    }
                }
            }
            for (int g = 0; g < G; g++)
                for (int c = 0; c < 2 * NZ; c++) acc[a0 + g][c] = A[g][c];
        }
        pos += n;
    }
    /* even/odd back to channel order */
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int a = 0; a < H; a++)
        for (int z = 0; z < NZ; z++) {
            const __m512 e = (__m512)acc[a][2 * z], o = (__m512)acc[a][2 * z + 1];
            acc[a][2 * z] = (vf)_mm512_permutex2var_ps(e, lo_idx, o);
            acc[a][2 * z + 1] = (vf)_mm512_permutex2var_ps(e, hi_idx, o);
        }
    write_outputs((const vf (*)[NC_MAX])acc, m, l, H, 2 * NZ, D, t, num_heads, h0 * G, out, out_dtype, lse);
}

/* dp_task with the shape of this build's -DSPEC_NV / -DSPEC_G as compile-time constants when it
 * matches (fully unrolled channel and group loops), else with runtime NZ and G. */
#define DP_ARGS const uint16_t *query, int64_t q_row_stride, const uint16_t *kv, int64_t half, int BS, int kv_heads, \
    int NZ, int G, const int32_t *table, int64_t t, int64_t first, int64_t seq_len, int h0, int h1, float scale, \
    void *out, int out_dtype, float *lse
static void dp_run(DP_ARGS) {
#if defined(SPEC_NV) && defined(SPEC_G) && SPEC_NV % 2 == 0
    if (NZ == SPEC_NV / 2 && G == SPEC_G) {
        dp_task(query, q_row_stride, kv, half, BS, kv_heads, SPEC_NV / 2, SPEC_G, table, t, first, seq_len, h0, h1,
                scale, out, out_dtype, lse);
        return;
    }
#endif
    dp_task(query, q_row_stride, kv, half, BS, kv_heads, NZ, G, table, t, first, seq_len, h0, h1, scale, out,
            out_dtype, lse);
}
#endif
