/* The elementwise work between a bfloat16 layer's matmuls, one pass each: RMSNorm, NEOX RoPE of
 * the Q and K heads, SwiGLU's silu(gate) * up, and the K/V store into a bfloat16 or int8 cache.
 *
 * Why: in torch each of these is a chain of small kernels over the step's rows (F.rms_norm on a
 * bfloat16 CPU tensor runs nine: to, pow, sum, div, add, rsqrt, mul, to, and the weight's mul;
 * RoPE four, SwiGLU two), each a full pass with its own conversions; measured on the 2-core CPU at
 * 512 rows of SmolLM2 they cost ~2 ms (norm), ~2.5 ms (RoPE) and ~1.2 ms (SwiGLU) per layer, about
 * what the layer's matmuls cost. Here each is one pass over its rows in float32 registers.
 *
 * Numerics: the same roundings as torch's bfloat16 ops, in the same order (a bfloat16 mul or add
 * is the float32 op of the widened values rounded once to nearest even):
 *   rms_norm: y = bf16(x · r), out = bf16(w · y), r = 1 / sqrt(Σx² / dim + eps) in float32
 *             (HF LlamaRMSNorm; only the order of Σx² differs from torch's reduction: r can move by
 *             a float32 ulp, after the rounding to bfloat16 ~1e-5 of the outputs move by one ulp);
 *   rope:     out = bf16(bf16(x · cos) + bf16(swap(x) · sin)), swap(x) = [x₂, x₁], sin's first half
 *             negated by the caller's table (models/layers.py apply_rope): bit for bit;
 *   silu_mul: out = bf16(bf16(g / (1 + exp(-g))) · u) with paged_decode.c's exp (1-2 float32 ulp;
 *             torch uses Sleef's 1-ulp expf): equal but where the float32 silu lies within those
 *             ulps of a bfloat16 rounding boundary; silu(g) for g < -87 is taken as 0 (it is below
 *             1e-36; torch gives 0 from g < -88.7 on).
 *   add_rms_norm: res = bf16(res + y), then rms_norm of it (torch's add, then the norm above);
 *   rope_store: rope of Q and K as above, K and V written to the cache's slots unchanged (bit for bit);
 *   store_int8: K and V quantized per (token, KV head) into an int8 cache as llmd.quant.kv's torch
 *             reference does it (scale = max(amax / 127, floor), x / scale divided, clamped,
 *             rounded half-even): the same codes and scales, bit for bit.
 * Tested against the torch forms in tests/kernels/test_cpu_glue.py.
 *
 * Threads: rows split statically over an OpenMP team (torch's, build.py) when there are enough of
 * them; small steps run on the calling thread.
 */
#include "paged_decode.c"

#include <omp.h>

#define PAR_MIN_ELEMS 32768  /* torch's grain size: fewer elements run on one thread */

static inline vf bf16v(const uint16_t *p) { return loadv(p, 0, KV_BF16, 0); }

/* VL float32 lanes -> VL bfloat16, round to nearest even (finite inputs). */
static inline void store_bf16v(uint16_t *dst, vf v) {
    vu u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16((__m512i)u));
#elif defined(__AVX2__)
    const __m256i w = (__m256i)u;
    const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
    _mm_storeu_si128((__m128i *)dst, _mm_packus_epi32(lo, hi));
#else
    for (int k = 0; k < VL; k++) dst[k] = (uint16_t)u[k];
#endif
}

static inline float rbf(float f) { return bf16_to_f32(f32_to_bf16(f)); }  /* round to bfloat16 and back */
static inline vf rbfv(vf v) {
    vu u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

static int team(int64_t elems, int nthreads) { return elems >= PAR_MIN_ELEMS && nthreads > 1 ? nthreads : 1; }

/* o[:dim] = w · rmsnorm(xr[:dim]) for one row. */
static inline void norm_row(const uint16_t *xr, const uint16_t *w, int dim, float eps, uint16_t *o) {
    const int vec = dim - dim % VL;
    /* x² is exact in float32 (bfloat16 x); summed in double (8 partial sums), so the float32 mean
     * below is the correctly rounded one but in ties of ~1e-9 relative */
    double acc[8] = {0};
    int i = 0;
    for (; i + 8 <= dim; i += 8)
        for (int j = 0; j < 8; j++) {
            const float v = bf16_to_f32(xr[i + j]);
            acc[j] += (double)(v * v);
        }
    for (; i < dim; i++) {
        const float v = bf16_to_f32(xr[i]);
        acc[0] += (double)(v * v);
    }
    const double ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    const float k = 1.0f / sqrtf((float)(ss / dim) + eps);
    for (int i = 0; i < vec; i += VL) store_bf16v(o + i, rbfv(bf16v(xr + i) * k) * bf16v(w + i));
    for (int i = vec; i < dim; i++) o[i] = f32_to_bf16(rbf(bf16_to_f32(xr[i]) * k) * bf16_to_f32(w[i]));
}

/* out[r, :] = w · rmsnorm(x[r, :]) for rows r < rows; x rows x_stride elements apart, out contiguous. */
void llmd_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t rows, int dim, float eps,
                        uint16_t *out, int nthreads) {
#pragma omp parallel for num_threads(team(rows * dim, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * x_stride, w, dim, eps, out + r * (int64_t)dim);
}

/* The residual add and the next RMSNorm in one pass (vLLM's fused_add_rms_norm): for rows r < rows,
 * res[r, :] = bf16(res[r, :] + y[r, :]) in place (torch's bfloat16 add: the float32 sum rounded
 * once), then out[r, :] = w · rmsnorm(res[r, :]) as llmd_rms_norm_bf16. y rows y_stride elements
 * apart; res and out contiguous [rows, dim]. */
void llmd_add_rms_norm_bf16(const uint16_t *y, int64_t y_stride, uint16_t *res, const uint16_t *w, int64_t rows,
                            int dim, float eps, uint16_t *out, int nthreads) {
    const int vec = dim - dim % VL;
#pragma omp parallel for num_threads(team(rows * dim, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *yr = y + r * y_stride;
        uint16_t *xr = res + r * (int64_t)dim;
        for (int i = 0; i < vec; i += VL) store_bf16v(xr + i, bf16v(xr + i) + bf16v(yr + i));
        for (int i = vec; i < dim; i++) xr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(yr[i]));
        norm_row(xr, w, dim, eps, out + r * (int64_t)dim);
    }
}

/* o[:D] = rope(a[:D]) with the position's cos / sin rows c, s (D even). */
static inline void rope_head(const uint16_t *a, const uint16_t *c, const uint16_t *s, int D, uint16_t *o) {
    const int h2 = D / 2, vec = h2 - h2 % VL;
    for (int i = 0; i < vec; i += VL) {
        const vf x1 = bf16v(a + i), x2 = bf16v(a + h2 + i);
        store_bf16v(o + i, rbfv(x1 * bf16v(c + i)) + rbfv(x2 * bf16v(s + i)));
        store_bf16v(o + h2 + i, rbfv(x2 * bf16v(c + h2 + i)) + rbfv(x1 * bf16v(s + h2 + i)));
    }
    for (int i = vec; i < h2; i++) {
        const float x1 = bf16_to_f32(a[i]), x2 = bf16_to_f32(a[h2 + i]);
        o[i] = f32_to_bf16(rbf(x1 * bf16_to_f32(c[i])) + rbf(x2 * bf16_to_f32(s[i])));
        o[h2 + i] = f32_to_bf16(rbf(x2 * bf16_to_f32(c[h2 + i])) + rbf(x1 * bf16_to_f32(s[h2 + i])));
    }
}

/* out[t, h, :] = rope(x[t, h, :]) for heads h < heads of rows t < rows; x rows x_stride elements
 * apart (heads contiguous, D each), cos / sin rows of D contiguous, c_stride / s_stride apart, out
 * [rows, heads, D] contiguous. */
void llmd_rope_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, int heads, int D, const uint16_t *cs,
                    int64_t c_stride, const uint16_t *sn, int64_t s_stride, uint16_t *out, int nthreads) {
#pragma omp parallel for num_threads(team(rows * heads * D, nthreads)) schedule(static)
    for (int64_t t = 0; t < rows; t++)
        for (int h = 0; h < heads; h++)
            rope_head(x + t * x_stride + (int64_t)h * D, cs + t * c_stride, sn + t * s_stride, D,
                      out + (t * heads + h) * (int64_t)D);
}

/* The attention's inputs from a fused QKV row in one pass: for rows t < rows of qkv (x_stride
 * elements apart: heads Q heads, then kv_heads K heads, then kv_heads V heads, D channels each),
 * q_out[t, h, :] = rope(Q head h) ([rows, heads, D] contiguous), and where slots[t] >= 0 the
 * token's K heads, rotated, and V heads, copied, are stored at that slot of a bfloat16 ``auto``
 * cache: the K plane's row kv[slots[t] · kv_heads · D ...], the V plane kv_plane elements further
 * (llmd.quant.kv's planes). The same bits as llmd_rope_bf16 + store_kv's index_copy_. */
void llmd_rope_store_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, int heads, int kv_heads, int D,
                          const uint16_t *cs, int64_t c_stride, const uint16_t *sn, int64_t s_stride,
                          uint16_t *q_out, uint16_t *kv, int64_t kv_plane, const int64_t *slots, int nthreads) {
    const int64_t row = (int64_t)kv_heads * D;
#pragma omp parallel for num_threads(team(rows * (heads + 2 * kv_heads) * D, nthreads)) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *a = x + t * x_stride, *c = cs + t * c_stride, *s = sn + t * s_stride;
        for (int h = 0; h < heads; h++) rope_head(a + (int64_t)h * D, c, s, D, q_out + (t * heads + h) * (int64_t)D);
        if (slots[t] < 0) continue;
        uint16_t *k = kv + slots[t] * row;
        for (int h = 0; h < kv_heads; h++) rope_head(a + (int64_t)(heads + h) * D, c, s, D, k + (int64_t)h * D);
        memcpy(k + kv_plane, a + (int64_t)(heads + kv_heads) * D, row * sizeof *k);
    }
}

/* One row of D bfloat16 values as int8 codes with one float32 scale (llmd.quant.kv's int8 format,
 * the torch reference's compute_scales + quantize): scale = max(amax |x| / 127, floor), codes =
 * round-half-even(clamp(x / scale, -127, 127)), each step in float32 as torch takes it (a true
 * division, not a multiply by the reciprocal). */
static inline void quant_row_int8(const uint16_t *x, int D, float floor, int8_t *codes, float *scale) {
    const int vec = D - D % VL;
    vf am = (vf){0};
    for (int i = 0; i < vec; i += VL) {
        const vf v = bf16v(x + i);
        am = vmax(am, vmax(v, (vf){0} - v));
    }
    float amax = vec ? hmax(am) : 0.0f;
    for (int i = vec; i < D; i++) amax = fmaxf(amax, fabsf(bf16_to_f32(x[i])));
    float s = amax / 127.0f;
    if (s < floor) s = floor;
    const vf vs = splat(s), lo = splat(-127.0f), magic = splat(12582912.0f);  /* 1.5 * 2^23 */
    for (int i = 0; i < vec; i += VL) {
        vf y = bf16v(x + i) / vs;                          /* a true division per lane, as torch's */
        y = vmax(lo, (vf){0} - vmax((vf){0} - y, lo));     /* clamp: min(y, 127) via -max(-y, -127), then >= -127 */
        y = (y + magic) - magic;                           /* to nearest, ties to even (|y| <= 127 < 2^22) */
        const vi c = to_int(y);
        for (int j = 0; j < VL; j++) codes[i + j] = (int8_t)c[j];
    }
    for (int i = vec; i < D; i++) {
        const float y = fminf(fmaxf(bf16_to_f32(x[i]) / s, -127.0f), 127.0f);
        codes[i] = (int8_t)nearbyintf(y);  /* the default rounding mode: to nearest, ties to even */
    }
    *scale = s;
}

/* The K/V store into an int8 cache: rows t < rows of k and v ([kv_heads, D] bfloat16 each, heads
 * contiguous, rows k_stride / v_stride elements apart; K already rotated, by RoPE and any
 * --kv-rotation) quantized per (token, KV head) (quant_row_int8) into the K / V code planes
 * (kv_plane bytes apart) at slot slots[t] (skipped when negative) and their scales into the
 * scale planes ([slots, kv_heads] float32 each, scale_plane elements apart). The same bits as
 * the torch reference's store_kv into an int8 cache with dynamic scales, none grouped. */
void llmd_store_int8(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride, int64_t rows,
                     int kv_heads, int D, int8_t *kv, int64_t kv_plane, float *scales, int64_t scale_plane,
                     const int64_t *slots, float floor, int nthreads) {
    const int64_t row = (int64_t)kv_heads * D;
#pragma omp parallel for num_threads(team(rows * 2 * row, nthreads)) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        if (slots[t] < 0) continue;
        int8_t *c = kv + slots[t] * row;
        float *s = scales + slots[t] * kv_heads;
        for (int h = 0; h < kv_heads; h++) {
            quant_row_int8(k + t * k_stride + (int64_t)h * D, D, floor, c + (int64_t)h * D, s + h);
            quant_row_int8(v + t * v_stride + (int64_t)h * D, D, floor, c + kv_plane + (int64_t)h * D, s + scale_plane + h);
        }
    }
}

static inline float silu1(float g) {  /* g / (1 + exp(-g)), through exp(-|g|) as below */
    if (g < -87.0f) return g * 0.0f;
    const float e = expf(-fabsf(g));
    return g >= 0.0f ? g / (1.0f + e) : g * e / (1.0f + e);
}

/* silu(x) = x / (1 + exp(-x)) per lane, through exp(-|x|) (no overflow): x / (1 + e) for x >= 0,
 * x e / (1 + e) below; 0 for x < -87, where exp(-|x|) is clamped (silu is x · exp(x) < 1e-36). */
static inline vf siluv(vf x) {
    const vf ax = vmax(x, (vf){0} - x);
    const vf e = expv((vf){0} - ax); /* exp(-|x|) in (0, 1] */
    const vf xe = x * e;
    vi ge = (vi)(x >= 0.0f); /* lanes of all ones where x >= 0 */
    vi pi, ni;
    memcpy(&pi, &x, sizeof pi);
    memcpy(&ni, &xe, sizeof ni);
    ni &= (vi)(x >= -87.0f);
    vi si = (pi & ge) | (ni & ~ge);
    vf num;
    memcpy(&num, &si, sizeof num);
    return num / (1.0f + e);
}

/* out[r, :] = silu(gu[r, :I]) · gu[r, I:2I]; gu rows stride elements apart, out [rows, I] contiguous. */
void llmd_silu_mul_bf16(const uint16_t *gu, int64_t stride, int64_t rows, int I, uint16_t *out, int nthreads) {
    const int vec = I - I % VL;
#pragma omp parallel for num_threads(team(rows * I, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * stride, *u = g + I;
        uint16_t *o = out + r * (int64_t)I;
        for (int i = 0; i < vec; i += VL) store_bf16v(o + i, rbfv(siluv(bf16v(g + i))) * bf16v(u + i));
        for (int i = vec; i < I; i++) o[i] = f32_to_bf16(rbf(silu1(bf16_to_f32(g[i]))) * bf16_to_f32(u[i]));
    }
}

#include "layer_glue_f32.h"  /* the same passes for float32 models */
