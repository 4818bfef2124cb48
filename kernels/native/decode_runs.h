/* The per-task pieces of the CPU decode kernels shared by every path (paged_decode.c's decode_task,
 * bf16dp_decode.h, amx_decode.h, fused_decode.c): the task's head limit, the software prefetch of the
 * next run's K/V rows, the online softmax's lazy rescale, runs of at most SUB_RUN slots through a
 * block, and the task's output rows. Needs decode_vec.h. Included once, by paged_decode.c. */
#ifndef LLMD_DECODE_RUNS_H
#define LLMD_DECODE_RUNS_H

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

#endif
