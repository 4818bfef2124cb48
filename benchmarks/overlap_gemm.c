/* A bfloat16 GEMM for decode-sized batches (M = 32 rows) by VDPBF16PS, which can issue software
 * prefetches of another buffer's cache lines between its multiply-adds: the next layer's KV blocks,
 * fetched into the cache hierarchy while this layer's linears run (benchmarks/overlap_prefetch.py
 * drives it beside oneDNN's linears and llmd's decode kernel). A benchmark, not a kernel llmd runs.
 *
 * Y^T[N, 32] (float32, column n's 32 rows contiguous) = W[N, K] . X[32, K]^T, with
 *  - Xp uint32 [K / 2][32]: row m's channel pair (2p, 2p + 1) as one 32-bit lane (bfloat16 pairs);
 *  - Wp uint32 [N / NT][K / 2][NT]: the same pairs of W's rows, NT = 12 rows per panel.
 * Each panel keeps 12 x 2 accumulators (12 outputs x 32 rows) in registers: per channel pair, two
 * 16-lane loads of X, 12 broadcasts of W, 24 VDPBF16PS. W is read once, in order.
 * Prefetch: `spans` (pointers), each `span_bytes` long; thread t of T takes spans
 * [t n / T, (t + 1) n / T) and prefetches `per_iter` lines every channel pair until they are done.
 *
 *     built by overlap_prefetch.py: cc -O3 -march=native -fopenmp -fPIC -shared
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define NT 12

struct pf {
    const char *const *spans;
    int64_t span, end, off, span_bytes;
};

static inline __attribute__((always_inline)) void pf_line(struct pf *p, int hint) {
    if (p->span >= p->end) return;
    const char *a = p->spans[p->span] + p->off;
    if (hint == 0) _mm_prefetch(a, _MM_HINT_T0);
    else if (hint == 1) _mm_prefetch(a, _MM_HINT_T1);
    else _mm_prefetch(a, _MM_HINT_T2);
    p->off += 64;
    if (p->off >= p->span_bytes) {
        p->off = 0;
        p->span++;
    }
}

static void panel(const uint32_t *Xp, const uint32_t *Wp, float *Yt, int K2, struct pf *p, int per_iter, int hint) {
    __m512 acc[NT][2];
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    for (int k = 0; k < K2; k++) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(Xp + 32 * k);
        const __m512bh x1 = (__m512bh)_mm512_loadu_si512(Xp + 32 * k + 16);
        const uint32_t *w = Wp + (int64_t)NT * k;
#pragma GCC unroll 12
        for (int j = 0; j < NT; j++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)w[j]);
            acc[j][0] = _mm512_dpbf16_ps(acc[j][0], x0, b);
            acc[j][1] = _mm512_dpbf16_ps(acc[j][1], x1, b);
        }
        for (int i = 0; i < per_iter; i++) pf_line(p, hint);
    }
    for (int j = 0; j < NT; j++) {
        _mm512_storeu_ps(Yt + 32 * j, acc[j][0]);
        _mm512_storeu_ps(Yt + 32 * j + 16, acc[j][1]);
    }
}

/* Several GEMMs in one parallel region (one layer's linears): gemm g has Xp[g], Wp[g], Yt[g],
 * K[g], N[g]; each thread takes its share of every GEMM's panels and, across all of them, its
 * share of the spans. */
void layer_gemms(int ng, const uint32_t *const *Xp, const uint32_t *const *Wp, float *const *Yt, const int *K,
                 const int *N, const char *const *spans, int64_t nspans, int64_t span_bytes, int per_iter, int hint,
                 int threads) {
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        struct pf p = {spans, nspans * t / T, nspans * (t + 1) / T, 0, span_bytes};
        for (int g = 0; g < ng; g++) {
            const int np = N[g] / NT, K2 = K[g] / 2;
            for (int b = np * t / T; b < np * (t + 1) / T; b++)
                panel(Xp[g], Wp[g] + (int64_t)b * K2 * NT, Yt[g] + (int64_t)b * NT * 32, K2, &p, per_iter, hint);
        }
        while (p.span < p.end) pf_line(&p, hint);  /* what the panels left (none when per_iter is enough) */
    }
}
