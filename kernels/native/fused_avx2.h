/* fused_decode.c's products, quantization and SwiGLU for CPUs with AVX2, FMA and F16C but no AVX-512
 * (Zen 1-3, Intel client cores before AVX-512): the same weight layout (quant/native_packs.py: tiles
 * of 16 rows, 4-byte groups of codes), the same activation quantization and the same integer sums,
 * on 8-lane vectors. A tile's 16 rows are two 8-lane halves (rows 0-7 are the first 32 bytes of
 * each 64-byte group, rows 8-15 the next 32).
 *
 * AVX2 has no vpdpbusd: a 4-byte group's dot is vpmaddubsw (u8 x s8 pairs summed into int16) then
 * vpmaddwd by ones (int16 pairs into int32), as llama.cpp's ggml-cpu AVX2 dots (mul_sum_us8_pairs).
 * Q4: codes 0..15 times int8 activations |x| <= 127 give pair sums |.| <= 3,810, so a block's 8
 * pair sums (4 chunks x low/high nibbles) are added in int16 (<= 30,480 < 32,767) before the one
 * vpmaddwd. Q8 (int8 codes; the AVX-512 path adds 128 for vpdpbusd's unsigned operand): the codes'
 * |w| and sign(x, w) as operands (vpsignb), so the
 * pairs are |w x| <= 128 x 127 x 2 < 32,767 with no correction term; one vpmaddwd per 4-byte step.
 * Integer results equal the AVX-512 path's exactly; the float sums differ only by summation order.
 * Included by fused_decode.c (after paged_decode.c: vf, VL = 8, expv, hsum, hmax). */

static inline int32_t hsum_epi32(__m256i v) {
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1)));
}

/* four 8-lane int32 code vectors (32 consecutive codes) -> 32 int8 codes in order (saturating) */
static inline void store_codes(int8_t *dst, __m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);  /* per 128-bit lane */
    const __m256i v = _mm256_packs_epi16(ab, cd);
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* As the AVX-512 quantize(): per block of 32, int8 codes at scale absmax / 127, the block's float
 * sum and code sums, and with levels == 2 the residual's codes in steps of dx / 254. */
static void quantize(const float *x, int K, qvec *q, int levels) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < K / 32; b++) {
        __m256 v[4];
        __m256 mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
            sm = _mm256_add_ps(sm, v[i]);
        }
        const float amax = hmax((vf)mx);
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        q->dx[b] = d;
        q->sx[b] = hsum((vf)sm);
        const __m256 vid = _mm256_set1_ps(id);
        __m256i c[4];
        for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));  /* nearest even */
        store_codes(q->xq[0] + 32 * b, c[0], c[1], c[2], c[3]);
        q->sq[0][b] = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
        if (levels == 2) {  /* residual r = x - d q1, in codes of d / 254 */
            const __m256 vd = _mm256_set1_ps(d), vid2 = _mm256_set1_ps(id * RESIDUAL_STEPS);
            __m256i r[4];
            for (int i = 0; i < 4; i++)
                r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_fnmadd_ps(_mm256_cvtepi32_ps(c[i]), vd, v[i]), vid2));
            store_codes(q->xq[1] + 32 * b, r[0], r[1], r[2], r[3]);
            q->sq[1][b] = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3])));
        }
    }
}

/* One block's integer dots for the 16 rows of a tile: out[0] rows 0-7, out[1] rows 8-15; the same
 * values as the AVX-512 block_dot (sum (q - 8) xq for Q4, sum code xq for Q8). */
static inline void block_dot(const uint8_t *wb, const int8_t *xb, int32_t sq, const int q4, __m256i out[2]) {
    const int32_t *x4 = (const int32_t *)xb;
    const __m256i ones = _mm256_set1_epi16(1);
    if (q4) {  /* chunk c (64 bytes): low nibbles are step c, high nibbles step c + 4 */
        const __m256i low = _mm256_set1_epi8(0x0F);
        for (int h = 0; h < 2; h++) {
            __m256i s16 = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * c + 32 * h));
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(v, low), _mm256_set1_epi32(x4[c])));
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                                                 _mm256_set1_epi32(x4[c + 4])));
            }
            out[h] = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones), _mm256_set1_epi32(8 * sq));
        }
        return;
    }
    for (int h = 0; h < 2; h++) {  /* the stored int8 codes, signed */
        __m256i d = _mm256_setzero_si256();
        for (int s8 = 0; s8 < 8; s8++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + 64 * s8 + 32 * h));
            const __m256i xv = _mm256_set1_epi32(x4[s8]);
            d = _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)),
                                                      ones));
        }
        out[h] = d;
    }
}

/* out[16 t ..] (+)= W x for row tiles [t0, t1): as the AVX-512 matvec_impl, two halves per tile. */
static inline __attribute__((always_inline)) void matvec_impl(const llmd_mat *w, int64_t t0, int64_t t1,
                                                               const qvec *q, float *out, int accumulate, const int LV) {
    const int nb = (int)(w->cols / 32), q4 = w->kind == 0;
    const int64_t tile_bytes = (int64_t)nb * (q4 ? 256 : 512);
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *wt = w->codes + t * tile_bytes;
        const uint16_t *st = w->scales + t * nb * ROWS, *mt = q4 ? w->mins + t * nb * ROWS : 0;
        const int pf = PF_TILES > 0 && t + PF_TILES < t1;
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, acc2[2] = {acc[0], acc[0]};
        __m256 accm[2] = {acc[0], acc[0]};
        for (int b = 0; b < nb; b++) {
            const uint8_t *wb = wt + (int64_t)b * (q4 ? 256 : 512);
            if (pf)
                for (int l = 0; l < (q4 ? 256 : 512); l += 64) _mm_prefetch((const char *)wb + PF_TILES * tile_bytes + l, _MM_HINT_T0);
            __m256i d1[2], d2[2];
            block_dot(wb, q->xq[0] + 32 * b, q->sq[0][b], q4, d1);
            if (LV == 2) block_dot(wb, q->xq[1] + 32 * b, q->sq[1][b], q4, d2);
            const __m256 dx = _mm256_set1_ps(q->dx[b]);
            for (int h = 0; h < 2; h++) {
                const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + b * ROWS + 8 * h)));
                const __m256 sd = _mm256_mul_ps(sc, dx);
                acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1[h]), sd, acc[h]);
                if (LV == 2) acc2[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d2[h]), sd, acc2[h]);
                if (q4) {  /* centred codes: w = (q - 8) s + (min + 8 s) */
                    const __m256 z = _mm256_fmadd_ps(_mm256_set1_ps(8.0f), sc,
                                                     _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + b * ROWS + 8 * h))));
                    accm[h] = _mm256_fmadd_ps(z, _mm256_set1_ps(q->sx[b]), accm[h]);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256 sum = _mm256_add_ps(acc[h], accm[h]);
            if (LV == 2) sum = _mm256_fmadd_ps(acc2[h], _mm256_set1_ps(1.0f / RESIDUAL_STEPS), sum);
            float *o = out + t * ROWS + 8 * h;
            _mm256_storeu_ps(o, accumulate ? _mm256_add_ps(_mm256_loadu_ps(o), sum) : sum);
        }
    }
}

/* silu(g) * u, 8 lanes: g / (1 + exp(-g)) with exp of -|g| only (expv). */
static void swiglu(const float *gu, int I, float *act) {
    for (int i = 0; i < I; i += 8) {
        const __m256 g = _mm256_loadu_ps(gu + i), u = _mm256_loadu_ps(gu + I + i);
        const vf e = expv((vf)_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));  /* exp(-|g|) */
        const vf gv = (vf)g, pos = gv / (1.0f + e), neg = gv * e / (1.0f + e);
        const __m256 s = _mm256_blendv_ps((__m256)neg, (__m256)pos, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(s, u));
    }
}
