/* Attention scores of bfloat16 queries and keys in float32, for the cpu backend's prefill chunks,
 * cascades' shared prefixes and chunk tails (kernels/cpu_scores.py; kernels/cpu_attention.py's
 * _attend):
 *
 *     S[b, m, n] = alpha · Σ_d Q[b, m, d] · K[b, n, d]  (+ bias[b, m, n])
 *
 * Why: torch's CPU bmm of two bfloat16 tensors returns bfloat16 (its float32 sums rounded to 8
 * bits, too coarse for logits that go into a softmax), and it has no bfloat16 → float32 out_dtype
 * on the CPU, so the backend converted K to float32 and ran a float32 baddbmm, ~4x slower than
 * oneDNN's bfloat16 bmm of the same shape and a quarter of a long prefill's time.
 *
 * How: VDPBF16PS (Intel SDM: per float32 lane, the sum of two exact products of bfloat16 pairs;
 * subnormal inputs and results flushed to zero) over K packed once per batch entry into
 * pair-major tiles of 16 keys (tile t, channel pair p: the 16 keys' (2p, 2p + 1) channels side by
 * side, one 64-byte vector), each row's channel pair broadcast against them. A register block of
 * MR rows × 2 tiles (32 keys) accumulates over head_dim / 2 pairs, then is scaled, added to the
 * bias and stored. Numerics: the products are exact and the sums float32 (pairs, then in channel
 * order), like a float32 matmul of the widened values up to the order of the additions; tested
 * against float64 (tests/kernels/test_cpu_scores.py). Keys past N in the last tile are zeros and
 * never stored.
 *
 * llmd_bf16_attn_probs goes on to the softmax inside each task (softmax_row): the block's rows are
 * scored into a per-thread float32 scratch and leave as bfloat16 probabilities, so the [B, M, N]
 * float32 scores, torch's softmax pass over them and the bfloat16 copy for probs @ V are gone.
 *
 * Threads: the packing and the (batch entry, row block) tasks are split over an OpenMP team
 * (torch's libgomp, as the other kernels: build.py).
 */
#include "paged_decode.c"  /* vf, expv (its exp), hsum, hmax; OpenMP */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_SCORES 1
#ifndef MR
#define MR 4  /* rows per register block (4: measured faster than 8 or 12 with a mask to add) */
#endif
#define MAX_D 256   /* head_dim limit (pairs per row: MAX_D / 2) */

/* Lanes of a 16-key tile that hold keys when `left` keys remain. */
static inline __mmask16 tail_mask(int left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

/* K[b] [N, D] (row stride kn) -> dst [tiles][D / 2][16 keys][2], keys past N zero. */
static void pack_keys(const uint16_t *k, int64_t kn, int N, int D, uint16_t *dst) {
    const int tiles = (N + 15) / 16, P = D / 2;
    for (int t = 0; t < tiles; t++) {
        uint32_t *tile = (uint32_t *)(dst + (int64_t)t * 16 * D);  /* [P][16] channel pairs */
        for (int j = 0; j < 16; j++) {
            const int n = t * 16 + j;
            if (n < N) {
                const uint32_t *row = (const uint32_t *)(k + (int64_t)n * kn);
                for (int p = 0; p < P; p++) tile[p * 16 + j] = row[p];
            } else {
                for (int p = 0; p < P; p++) tile[p * 16 + j] = 0;
            }
        }
    }
}

/* rows [m0, m0 + mr) of batch entry b against every key tile (mr <= MR). */
static inline __attribute__((always_inline)) void row_block(
        const uint16_t *q, int64_t qm, const uint16_t *kp, int N, int D, float alpha, const float *bias,
        int64_t bm, int brows, float *out, int64_t om, int m0, const int mr) {  /* q, out: at row m0 */
    const int tiles = (N + 15) / 16, P = D / 2;
    const __m512 va = _mm512_set1_ps(alpha);
    for (int t = 0; t < tiles; t += 2) {
        const int two = t + 1 < tiles;
        __m512 acc[MR][2];
        for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const uint16_t *k0 = kp + (int64_t)t * 16 * D, *k1 = k0 + 16 * D;
        for (int p = 0; p < P; p++) {
            const __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + 32 * p);
            const __m512bh c = two ? (__m512bh)_mm512_loadu_si512(k1 + 32 * p) : (__m512bh)_mm512_setzero_si512();
            for (int r = 0; r < MR; r++) {
                if (r >= mr) break;
                int32_t pair;
                memcpy(&pair, q + (int64_t)r * qm + 2 * p, 4);
                const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, a);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, c);
            }
        }
        for (int r = 0; r < mr; r++) {
            for (int h = 0; h < 1 + two; h++) {
                const int n0 = (t + h) * 16;
                const __mmask16 keep = tail_mask(N - n0);
                __m512 s = _mm512_mul_ps(acc[r][h], va);
                if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(keep, bias + (int64_t)((m0 + r) % brows) * bm + n0));
                _mm512_mask_storeu_ps(out + (int64_t)r * om + n0, keep, s);
            }
        }
    }
}

/* row_block for rows [m0, m0 + mr) of entry b, the full block (mr == MR) with its row loop unrolled. */
static inline __attribute__((always_inline)) void rows_of_entry(
        const uint16_t *q, int64_t qm, const uint16_t *kp, int N, int D, float alpha, const float *bias,
        int64_t bm, int brows, float *out, int64_t om, int m0, int mr) {
    if (mr == MR)
        row_block(q, qm, kp, N, D, alpha, bias, bm, brows, out, om, m0, MR);
    else
        row_block(q, qm, kp, N, D, alpha, bias, bm, brows, out, om, m0, mr);
}

/* Every entry's keys packed (pack_keys) into one 64-byte aligned buffer of B · *per elements
 * (the caller frees it), or NULL when it cannot be allocated. */
static uint16_t *pack_all(const uint16_t *k, int64_t kb, int64_t kn, int B, int N, int D, int num_threads,
                          int64_t *per) {
    *per = (int64_t)((N + 15) / 16) * 16 * D;
    uint16_t *packed = NULL;
    if (posix_memalign((void **)&packed, 64, (size_t)(B * *per) * sizeof(uint16_t))) return NULL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int b = 0; b < B; b++) pack_keys(k + b * kb, kn, N, D, packed + b * *per);
    return packed;
}

/* Sizes both entry points refuse (-1) or accept. */
static inline int sizes_ok(int B, int M, int N, int D, const float *bias, int bdiv, int brows) {
    return !(D % 2 || D > MAX_D || B < 0 || M < 0 || N < 0 || (bias && (bdiv < 1 || brows < 1)));
}
#endif

#ifdef HAVE_SCORES
/* Row r of a block's scores (N keys at s) -> bfloat16 probabilities softmax(s) at p, and its
 * log-sum-exp into *lse when lse is not NULL. As torch's float32 softmax: m = max, e = exp(s - m)
 * (paged_decode.c's expv: 1-2 float32 ulp; -inf scores give exactly 0), l = Σe, p = e · (1 / l),
 * then rounded to nearest even bfloat16 (VCVTNEPS2BF16, as torch's cast). A row with every score
 * -inf gets zeros and lse -inf. */
static void softmax_row(float *s, int N, uint16_t *p, float *lse) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx = ninf;
    for (int n0 = 0; n0 < N; n0 += 16) {
        const __mmask16 keep = tail_mask(N - n0);
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(ninf, keep, s + n0));
    }
    const float m = _mm512_reduce_max_ps(mx);
    if (m == -INFINITY) {
        for (int n = 0; n < N; n++) p[n] = 0;
        if (lse) *lse = -INFINITY;
        return;
    }
    __m512 sum = _mm512_setzero_ps();
    for (int n0 = 0; n0 < N; n0 += 16) {
        const __mmask16 keep = tail_mask(N - n0);
        const __m512 x = _mm512_mask_loadu_ps(ninf, keep, s + n0);
        const __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(live, (__m512)expv((vf)_mm512_sub_ps(x, _mm512_set1_ps(m))));
        _mm512_mask_storeu_ps(s + n0, keep, e);
        sum = _mm512_add_ps(sum, e);
    }
    const float l = _mm512_reduce_add_ps(sum), inv = 1.0f / l;
    for (int n0 = 0; n0 < N; n0 += 16) {
        const __mmask16 keep = tail_mask(N - n0);
        const __m512 e = _mm512_maskz_loadu_ps(keep, s + n0);
        _mm256_mask_storeu_epi16(p + n0, keep, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(e, _mm512_set1_ps(inv))));
    }
    if (lse) *lse = m + logf(l);
}
#endif

/* P = softmax(alpha · Q Kᵀ + bias) as bfloat16 [B, M, N] (keys contiguous; strides pb, pm), the
 * scores never written to memory: each task scores MR rows into a per-thread float32 scratch and
 * normalizes them there (softmax_row). Arguments as llmd_bf16_scores; lse NULL or float32 [B, M]
 * (batch stride lb, rows contiguous): each row's log-sum-exp. Returns as llmd_bf16_scores. */
int llmd_bf16_attn_probs(const uint16_t *q, int64_t qb, int64_t qm, const uint16_t *k, int64_t kb, int64_t kn,
                         const float *bias, int64_t bb, int64_t bm, int bdiv, int brows, uint16_t *probs,
                         int64_t pb, int64_t pm, float *lse, int64_t lb, int B, int M, int N, int D, float alpha,
                         int num_threads) {
#ifdef HAVE_SCORES
    if (!sizes_ok(B, M, N, D, bias, bdiv, brows)) return -1;
    if (B == 0 || M == 0 || N == 0) return 0;
    const int64_t spad = (int64_t)((N + 15) / 16) * 16;  /* scratch floats per row */
    int64_t per;
    uint16_t *packed = pack_all(k, kb, kn, B, N, D, num_threads, &per);
    if (!packed) return -2;
    const int blocks = (M + MR - 1) / MR;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *s = NULL;
        if (posix_memalign((void **)&s, 64, (size_t)(MR * spad) * sizeof(float))) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < B * blocks; task++) {
            if (!s) continue;
            const int b = task / blocks, m0 = (task % blocks) * MR, mr = M - m0 < MR ? M - m0 : MR;
            const float *bias_b = bias ? bias + (b / bdiv) * bb : NULL;
            rows_of_entry(q + b * qb + m0 * qm, qm, packed + b * per, N, D, alpha, bias_b, bm, brows, s, spad, m0, mr);
            for (int r = 0; r < mr; r++)
                softmax_row(s + r * spad, N, probs + b * pb + (m0 + r) * pm, lse ? lse + b * lb + m0 + r : NULL);
        }
        free(s);
    }
    free(packed);
    return failed ? -2 : 0;
#else
    (void)q; (void)qb; (void)qm; (void)k; (void)kb; (void)kn; (void)bias; (void)bb; (void)bm; (void)bdiv;
    (void)brows; (void)probs; (void)pb; (void)pm; (void)lse; (void)lb; (void)B; (void)M; (void)N; (void)D;
    (void)alpha; (void)num_threads;
    return -1;
#endif
}

/* 1 when this build has the kernel (AVX512-BF16 under -march=native), else 0. */
int llmd_bf16_scores_supported(void) {
#ifdef HAVE_SCORES
    return 1;
#else
    return 0;
#endif
}

/* S = alpha · Q Kᵀ (+ bias) for B batch entries. Q [B, M, D] and K [B, N, D] bfloat16 with
 * contiguous channels (strides in elements: qb, qm; kb, kn); bias NULL or float32 with contiguous
 * keys, row m of entry b read at bias + (b / bdiv) · bb + (m % brows) · bm (a mask shared by bdiv
 * consecutive entries and repeating every brows rows: the cpu backend's [N, 1, Q, L] mask over
 * kv_heads entries of group · Q rows each, without expanding it); out float32 [B, M, N] with
 * contiguous keys (ob, om). D even, <= 256. Returns 0; -1 for a size past the limits or no kernel
 * in this build; -2 when the packing buffer cannot be allocated. */
int llmd_bf16_scores(const uint16_t *q, int64_t qb, int64_t qm, const uint16_t *k, int64_t kb, int64_t kn,
                     const float *bias, int64_t bb, int64_t bm, int bdiv, int brows, float *out, int64_t ob, int64_t om,
                     int B, int M, int N, int D, float alpha, int num_threads) {
#ifdef HAVE_SCORES
    if (!sizes_ok(B, M, N, D, bias, bdiv, brows)) return -1;
    if (B == 0 || M == 0 || N == 0) return 0;
    int64_t per;
    uint16_t *packed = pack_all(k, kb, kn, B, N, D, num_threads, &per);
    if (!packed) return -2;
    const int blocks = (M + MR - 1) / MR;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int task = 0; task < B * blocks; task++) {
        const int b = task / blocks, m0 = (task % blocks) * MR, mr = M - m0 < MR ? M - m0 : MR;
        rows_of_entry(q + b * qb + m0 * qm, qm, packed + b * per, N, D, alpha, bias ? bias + (b / bdiv) * bb : NULL,
                      bm, brows, out + b * ob + m0 * om, om, m0, mr);
    }
    free(packed);
    return 0;
#else
    (void)q; (void)qb; (void)qm; (void)k; (void)kb; (void)kn; (void)bias; (void)bb; (void)bm; (void)bdiv;
    (void)brows; (void)out;
    (void)ob; (void)om; (void)B; (void)M; (void)N; (void)D; (void)alpha; (void)num_threads;
    return -1;
#endif
}
