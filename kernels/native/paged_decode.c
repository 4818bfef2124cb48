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

#include "decode_vec.h"   /* dtype codes, tile limits, VL-lane vectors, reductions, exp */
#include "decode_runs.h"  /* runs through a block, prefetch, lazy rescale, output rows */

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
#include "decode_switches.h"  /* the paths' probes and on/off switches (llmd_paged_decode_set_amx, ...) */

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
