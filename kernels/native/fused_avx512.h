/* fused_decode.c's products, quantization and SwiGLU for CPUs with AVX512-VNNI, -BW and -VL: per block
 * of 32, int8 activation codes (and, with 2 levels, the codes of their rounding residual), each tile's 16
 * integer dots in one 16-lane vpdpbusd accumulator over the packed weights (quant/native_packs.py: tiles
 * of 16 rows, 4-byte groups of codes; Q4 centred codes, Q8 codes + 128 as the unsigned operand), the
 * float scales applied per block, and silu(g) * u on 16 lanes. fused_avx2.h is the same on 8-lane AVX2.
 * Included by fused_decode.c (after paged_decode.c: vf, expv; and its llmd_mat, qvec, ROWS,
 * RESIDUAL_STEPS, PF_TILES). */

static inline __m512i round_codes(__m512 v) { return _mm512_cvtps_epi32(v); }  /* to nearest even (MXCSR) */

static inline int32_t sum_codes(const int8_t *c) {
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c));
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16)));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(w, v));
}

/* x [K] float32 -> int8 codes per block of 32 with scale dx (absmax / 127), each block's float sum sx
 * and code sums, and with levels == 2 the codes of the rounding residual in steps of dx / 254 (the
 * product then sees x to ~1/64,000 of the block's absmax instead of ~1/254). */
static void quantize(const float *x, int K, qvec *q, int levels) {
    for (int b = 0; b < K / 32; b++) {
        const __m512 a = _mm512_loadu_ps(x + 32 * b), c = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        q->dx[b] = d;
        q->sx[b] = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
        const __m512 vid = _mm512_set1_ps(id);
        const __m512i ia = round_codes(_mm512_mul_ps(a, vid)), ic = round_codes(_mm512_mul_ps(c, vid));
        _mm_storeu_si128((__m128i *)(q->xq[0] + 32 * b), _mm512_cvtsepi32_epi8(ia));
        _mm_storeu_si128((__m128i *)(q->xq[0] + 32 * b + 16), _mm512_cvtsepi32_epi8(ic));
        q->sq[0][b] = sum_codes(q->xq[0] + 32 * b);
        if (levels == 2) {  /* residual r = x - d q1, in codes of d / 254 */
            const __m512 vd = _mm512_set1_ps(d), vid2 = _mm512_set1_ps(id * RESIDUAL_STEPS);
            const __m512 ra = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ia), vd, a);
            const __m512 rc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ic), vd, c);
            _mm_storeu_si128((__m128i *)(q->xq[1] + 32 * b), _mm512_cvtsepi32_epi8(round_codes(_mm512_mul_ps(ra, vid2))));
            _mm_storeu_si128((__m128i *)(q->xq[1] + 32 * b + 16),
                             _mm512_cvtsepi32_epi8(round_codes(_mm512_mul_ps(rc, vid2))));
            q->sq[1][b] = sum_codes(q->xq[1] + 32 * b);
        }
    }
}

/* One block's integer dot for the 16 rows of a tile, lane j = row j: sum over the block's 32 weights
 * of (weight code as the u8 operand) x (activation code), then minus off x the block's code sum, so
 * lane j = sum (q - 8) xq (Q4) or sum code xq (Q8, stored + 128). The activation's 4 codes of a step
 * are broadcast to every lane (vpdpbusd's 4-byte groups). Layouts: quant/native_packs.py. */
static inline __m512i block_dot(const uint8_t *wb, const int8_t *xb, int32_t sq, const int q4) {
    const int32_t *x4 = (const int32_t *)xb;
    __m512i d = _mm512_setzero_si512();
    if (q4) {  /* 4 chunks of 64 bytes: chunk c's low nibbles are step c, its high nibbles step c + 4 */
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(wb + 64 * c);
            d = _mm512_dpbusd_epi32(d, _mm512_and_si512(v, low), _mm512_set1_epi32(x4[c]));
            d = _mm512_dpbusd_epi32(d, _mm512_and_si512(_mm512_srli_epi16(v, 4), low), _mm512_set1_epi32(x4[c + 4]));
        }
        return _mm512_sub_epi32(d, _mm512_set1_epi32(8 * sq));
    }
    const __m512i flip = _mm512_set1_epi8((char)0x80);  /* 8 steps of 64 bytes, codes + 128 as u8 */
    for (int s8 = 0; s8 < 8; s8++)
        d = _mm512_dpbusd_epi32(d, _mm512_xor_si512(_mm512_loadu_si512(wb + 64 * s8), flip), _mm512_set1_epi32(x4[s8]));
    return _mm512_sub_epi32(d, _mm512_set1_epi32(128 * sq));
}

/* out[16 t ..] (+)= W x for row tiles [t0, t1), x as quantize() left it (LV levels). Per block: the
 * tile's 16 integer dots (block_dot), x its 16 scales and the block's dx; Q4 adds (min + 8 scale) x
 * the block's exact float sum. */
static inline __attribute__((always_inline)) void matvec_impl(const llmd_mat *w, int64_t t0, int64_t t1,
                                                               const qvec *q, float *out, int accumulate, const int LV) {
    const int nb = (int)(w->cols / 32), q4 = w->kind == 0;
    const int64_t tile_bytes = (int64_t)nb * (q4 ? 256 : 512);
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *wt = w->codes + t * tile_bytes;
        const uint16_t *st = w->scales + t * nb * ROWS, *mt = q4 ? w->mins + t * nb * ROWS : 0;
        const int pf = PF_TILES > 0 && t + PF_TILES < t1;  /* the tile PF_TILES ahead, block by block */
        __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *wb = wt + (int64_t)b * (q4 ? 256 : 512);
            if (pf)
                for (int l = 0; l < (q4 ? 256 : 512); l += 64) _mm_prefetch((const char *)wb + PF_TILES * tile_bytes + l, _MM_HINT_T0);
            const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + b * ROWS)));
            const __m512 sd = _mm512_mul_ps(sc, _mm512_set1_ps(q->dx[b]));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_dot(wb, q->xq[0] + 32 * b, q->sq[0][b], q4)), sd, acc);
            if (LV == 2)
                acc2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_dot(wb, q->xq[1] + 32 * b, q->sq[1][b], q4)), sd, acc2);
            if (q4) {  /* centred codes: w = (q - 8) s + (min + 8 s) */
                const __m512 z = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), sc,
                                                 _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mt + b * ROWS))));
                accm = _mm512_fmadd_ps(z, _mm512_set1_ps(q->sx[b]), accm);
            }
        }
        __m512 sum = _mm512_add_ps(acc, accm);
        if (LV == 2) sum = _mm512_fmadd_ps(acc2, _mm512_set1_ps(1.0f / RESIDUAL_STEPS), sum);
        float *o = out + t * ROWS;
        _mm512_storeu_ps(o, accumulate ? _mm512_add_ps(_mm512_loadu_ps(o), sum) : sum);
    }
}

/* silu(g) * u, 16 lanes: g / (1 + exp(-g)) with exp of -|g| only (expv takes x <= 0). */
static void swiglu(const float *gu, int I, float *act) {
    for (int i = 0; i < I; i += 16) {
        vf g, u;
        memcpy(&g, gu + i, 64);
        memcpy(&u, gu + I + i, 64);
        vf ng = (vf)_mm512_abs_ps((__m512)g);
        const vf e = expv((vf){0} - ng);  /* exp(-|g|) */
        const vf pos = g / (1.0f + e), neg = g * e / (1.0f + e);
        const __mmask16 m = _mm512_cmp_ps_mask((__m512)g, _mm512_setzero_ps(), _CMP_GE_OQ);
        const vf s = (vf)_mm512_mask_blend_ps(m, (__m512)neg, (__m512)pos);
        const vf r = s * u;
        memcpy(act + i, &r, 64);
    }
}
