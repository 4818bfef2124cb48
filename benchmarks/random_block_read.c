/* One core reading a paged KV cache's blocks: how many GB/s a single thread gets from spans of
 * 6 KiB (one block's K rows of SmolLM2: 16 slots x 3 KV heads x 64 dims x 2 bytes) and the matching
 * V spans, in position order ("contiguous") or in a shuffled order (a served pool: blocks are not
 * adjacent), with and without the software prefetch the decode kernel uses (kernels/native/
 * decode_runs.h: every line of the run `dist` runs ahead, prefetcht1), and with prefetches of only
 * the first lines of each run (enough to start a hardware stream prefetcher, if one follows).
 * Nothing but the loads and a float add per line, so the figure is the read alone.
 *
 *     cc -O2 -march=native -o /tmp/random_block_read benchmarks/random_block_read.c && /tmp/random_block_read
 *
 * Why: the batch-32 decode attention reads its blocks at a rate set by how many cache misses a
 * core keeps in flight, not by the DRAM bandwidth x.sum() measures (README, "The attention's
 * read ceiling per core"). 368 MB are read per row (30,000 runs of 12 KiB) from a 1 GiB buffer.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RUN 6144
#define USE 30000

static char *K, *V;
volatile float sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* GB/s reading runs order[0..USE) (K span then V span, line by line); dist > 0 prefetches run
 * i + dist while reading run i: all its lines (first = 0) or its first `first` bytes only. */
static double read_runs(const uint32_t *order, int dist, int first) {
    __m512 a = _mm512_setzero_ps();
    const double t0 = now();
    for (size_t i = 0; i < USE; i++) {
        const char *k = K + (size_t)order[i] * RUN, *v = V + (size_t)order[i] * RUN;
        const int pf = dist > 0 && i + dist < USE;
        const char *pk = pf ? K + (size_t)order[i + dist] * RUN : 0, *pv = pf ? V + (size_t)order[i + dist] * RUN : 0;
        for (int b = 0; b < RUN; b += 64) {
            if (pf && (!first || b < first)) {
                __builtin_prefetch(pk + b, 0, 2);
                __builtin_prefetch(pv + b, 0, 2);
            }
            a = _mm512_add_ps(a, _mm512_loadu_ps((const float *)(k + b)));
            a = _mm512_add_ps(a, _mm512_loadu_ps((const float *)(v + b)));
        }
    }
    const double t = now() - t0;
    float s[16];
    _mm512_storeu_ps(s, a);
    sink = s[0];
    return USE * 2.0 * RUN / t / 1e9;
}

int main(void) {
    const size_t nruns = (1ull << 30) / (2 * RUN);
    char *buf = aligned_alloc(4096, nruns * 2 * RUN + 8192);
    memset(buf, 1, nruns * 2 * RUN + 8192);
    K = buf;
    V = buf + nruns * RUN + 2048;  /* the V plane 2 KiB past a page multiple, as quant/kv_alloc.py lays it */
    uint32_t *shuffled = malloc(nruns * 4), *ordered = malloc(nruns * 4);
    for (size_t i = 0; i < nruns; i++) shuffled[i] = ordered[i] = (uint32_t)i;
    srand(1);
    for (size_t i = nruns - 1; i > 0; i--) {
        const size_t j = (size_t)rand() % (i + 1);
        const uint32_t t = shuffled[i];
        shuffled[i] = shuffled[j];
        shuffled[j] = t;
    }
    printf("one thread, GB/s (368 MB per figure)\n");
    for (int rep = 0; rep < 2; rep++) {
        printf("contiguous: no prefetch %5.1f, prefetch 1 run ahead %5.1f\n", read_runs(ordered, 0, 0),
               read_runs(ordered, 1, 0));
        printf("shuffled:   no prefetch %5.1f, prefetch 1 / 2 / 4 / 8 runs ahead %5.1f / %5.1f / %5.1f / %5.1f, "
               "first 4 lines only (2 ahead) %5.1f\n", read_runs(shuffled, 0, 0), read_runs(shuffled, 1, 0),
               read_runs(shuffled, 2, 0), read_runs(shuffled, 4, 0), read_runs(shuffled, 8, 0),
               read_runs(shuffled, 2, 256));
    }
    return 0;
}
