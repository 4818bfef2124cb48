/* Dense bfloat16 linears by VDPBF16PS, for CPUs with AVX512-BF16 and no AMX grant (AMD Zen 4 and
 * later, Intel Cooper Lake): y = x · Wᵀ for the cpu backend's layer weights (kernels/dp_linear.py),
 * every row count from a decode step's few rows to a 512-token prefill chunk.
 *
 * Weights are packed once (quant/prepacked.py, dp_pack) in groups of NT = 12 output columns: W [N, K]
 * → [N / 12][K / 2][12] 32-bit pairs (W[n, 2p], W[n, 2p + 1]), then the last N mod 12 columns
 * (4 or 8: N is a multiple of 32) as [K / 2][N mod 12]; the same bytes as W.
 * Rows go across the vector lanes: x is packed per call into blocks of 32 rows, [K / 2][32] pairs
 * (rows past M zero). Per pair p a block's two 16-row vectors meet the group's 12 broadcast weight
 * pairs in 24 VDPBF16PS (Intel SDM, "VDPBF16PS": per float32 lane, the sum of two exact products
 * of a bfloat16 pair, added to the lane; subnormal inputs and results flushed to zero), so 12
 * columns x 32 rows of float32 sums stay in 24 registers, and each weight is read once per 32 rows
 * (a decode batch of up to 32 reads the weights exactly once, front to back). A call of at most 16
 * rows uses one vector of rows (12 accumulators); one of at most 4 rows puts the columns across the
 * lanes instead (group_few: a memory-bound product, no lanes wasted; the same sums). Sums are float32
 * in input order, rounded once to bfloat16 (round to nearest even); a row's output depends on that
 * row and the weights only, never on how many rows the call has (a sequence's logits do not change
 * with its batch).
 *
 * Work: each thread packs a share of x's rows, then takes a contiguous range of column groups
 * (OpenMP, static). Measured on the 2-core Zen 4: README, "bfloat16 linears by VDPBF16PS".
 * Built everywhere (-march=native); without AVX512-BF16, llmd_dp_linear_ready() is 0 and the product
 * refuses every call.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include <omp.h>

#define NT 12 /* output columns per group */

int llmd_dp_linear_ready(void) { return 1; }

/* The sums of one column group (nt columns, weights wg: [K2][nt] pairs) over one block of rows
 * (xp: [K2][32] pairs; RV = 1 or 2 vectors of 16 rows) into buf [NT][32] float32. */
static inline __attribute__((always_inline)) void group(const uint32_t *xp, const uint32_t *wg, int K2, const int nt,
                                                         const int RV, float *buf) {
    __m512 a0[NT], a1[NT];
    for (int j = 0; j < nt; j++) a0[j] = a1[j] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int p = 0; p < K2; p++) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xp + 32 * p);
        const __m512bh x1 = RV == 2 ? (__m512bh)_mm512_loadu_si512(xp + 32 * p + 16) : x0;
        const uint32_t *w = wg + (int64_t)nt * p;
        for (int j = 0; j < nt; j++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)w[j]);
            a0[j] = _mm512_dpbf16_ps(a0[j], x0, b);
            if (RV == 2) a1[j] = _mm512_dpbf16_ps(a1[j], x1, b);
        }
    }
    for (int j = 0; j < nt; j++) {
        _mm512_store_ps(buf + 32 * j, a0[j]);
        if (RV == 2) _mm512_store_ps(buf + 32 * j + 16, a1[j]);
    }
}

/* Few rows (M <= SMALL_M): columns across the lanes instead, rows broadcast: the group's nt pairs of
 * input pair p as one masked vector, each row's pair broadcast, one VDPBF16PS per row, straight into
 * y. Per lane the same additions in the same order as group()'s (VDPBF16PS is symmetric in its two
 * sources), so a row's output is bit for bit the same whichever path its call takes. One chain per
 * row: latency-bound at ~8 bytes of weights a cycle, above what memory streams. */
#define SMALL_M 4 /* measured: 8, 12 and 16 rows run slower here than in group() */
static inline __attribute__((always_inline)) void group_few(const uint16_t *x, int64_t ldx, const uint32_t *wg,
                                                             int K2, int nt, const int M, uint16_t *y, int64_t ldy) {
    const __mmask16 keep = (__mmask16)((1u << nt) - 1);
    __m512 a[SMALL_M];
    for (int m = 0; m < M; m++) a[m] = _mm512_setzero_ps();
    for (int p = 0; p < K2; p++) {
        const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi32(keep, wg + (int64_t)nt * p);
        for (int m = 0; m < M; m++) {
            int32_t v;
            memcpy(&v, x + m * ldx + 2 * p, sizeof v);
            a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_set1_epi32(v), w);
        }
    }
    for (int m = 0; m < M; m++)
        _mm256_mask_storeu_epi16(y + m * ldy, keep, (__m256i)_mm512_cvtneps_pbh(a[m]));
}

static void group_few_any(const uint16_t *x, int64_t ldx, const uint32_t *wg, int K2, int nt, int M, uint16_t *y,
                          int64_t ldy) {
    switch (M) {
#define FEW(n) \
    case n: group_few(x, ldx, wg, K2, nt, n, y, ldy); break;
        FEW(1) FEW(2) FEW(3) FEW(4)
#undef FEW
    }
}

static void group_any(const uint32_t *xp, const uint32_t *wg, int K2, int nt, int RV, float *buf) {
    if (RV == 2) {
        if (nt == 12) group(xp, wg, K2, 12, 2, buf);
        else if (nt == 8) group(xp, wg, K2, 8, 2, buf);
        else group(xp, wg, K2, 4, 2, buf);
    } else {
        if (nt == 12) group(xp, wg, K2, 12, 1, buf);
        else if (nt == 8) group(xp, wg, K2, 8, 1, buf);
        else group(xp, wg, K2, 4, 1, buf);
    }
}

/* y [M, N] bfloat16 (rows of N) = x [M, K] bfloat16 (row stride ldx elements) · Wᵀ, W packed as
 * above; K and N multiples of 32. Returns 0, or -1 when the shape is not served or the row pack
 * cannot be allocated (nothing written). */
int llmd_dp_linear(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int M, int K, int N,
                   int num_threads) {
    if (M < 1 || K % 32 || N % 32 || K < 32 || N < 32) return -1;
    const int K2 = K / 2, nb = (M + 31) / 32, full = N / NT, tail = N % NT, groups = full + (tail > 0);
    const uint32_t *wp = (const uint32_t *)w;
    if (M <= SMALL_M) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int g = 0; g < groups; g++)
            group_few_any(x, ldx, wp + (int64_t)g * NT * K2, K2, g < full ? NT : tail, M, y + (int64_t)g * NT, N);
        return 0;
    }
    const int RV = M <= 16 ? 1 : 2;
    uint32_t *xp = aligned_alloc(64, (size_t)nb * K2 * 32 * 4);
    if (!xp) return -1;
#pragma omp parallel num_threads(num_threads)
    {
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        for (int r = nb * 32 * me / nt; r < nb * 32 * (me + 1) / nt; r++) { /* this thread's rows of the pack */
            uint32_t *col = xp + (int64_t)(r / 32) * K2 * 32 + r % 32;
            if (r < M) {
                const uint16_t *xr = x + (int64_t)r * ldx;
                for (int p = 0; p < K2; p++) memcpy(col + 32 * p, xr + 2 * p, 4);
            } else {
                for (int p = 0; p < K2; p++) col[32 * p] = 0;
            }
        }
#pragma omp barrier
        float buf[NT * 32] __attribute__((aligned(64)));
        const __m512i idx = _mm512_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 0, 0, 0, 0);
        const int lo = (int)((int64_t)groups * me / nt), hi = (int)((int64_t)groups * (me + 1) / nt);
        for (int g = lo; g < hi; g++) {
            const int cols = g < full ? NT : tail;
            const uint32_t *wg = wp + (int64_t)g * NT * K2;
            const __mmask16 keep = (__mmask16)((1u << cols) - 1);
            for (int b = 0; b < nb; b++) {
                const int rows = M - 32 * b < 32 ? M - 32 * b : 32;
                group_any(xp + (int64_t)b * K2 * 32, wg, K2, cols, rows > 16 ? RV : 1, buf);
                for (int m = 0; m < rows; m++) { /* row m's cols sums: a column of buf */
                    const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keep, idx, buf + m, 4);
                    _mm256_mask_storeu_epi16(y + (int64_t)(32 * b + m) * N + (int64_t)g * NT, keep,
                                             (__m256i)_mm512_cvtneps_pbh(v));
                }
            }
        }
    }
    free(xp);
    return 0;
}
#else
int llmd_dp_linear_ready(void) { return 0; }

int llmd_dp_linear(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int M, int K, int N,
                   int num_threads) {
    (void)x, (void)ldx, (void)w, (void)y, (void)M, (void)K, (void)N, (void)num_threads;
    return -1;
}
#endif
