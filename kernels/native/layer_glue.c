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
 *             1e-36; torch gives 0 from g < -88.7 on). bf16(silu(g)) is looked up: a table of the
             65536 bfloat16 g filled by that vector code as the library loads (layer_glue_vec.h);
 *   add_rms_norm: res = bf16(res + y), then rms_norm of it (torch's add, then the norm above);
 *   rope_store: rope of Q and K as above, K and V written to the cache's slots unchanged (bit for bit);
 *   store_int8: K and V quantized per (token, KV head) into an int8 cache as llmd.quant.kv's torch
 *             reference does it (scale = max(amax / 127, floor), x / scale divided, clamped,
 *             rounded half-even): the same codes and scales, bit for bit.
 * Tested against the torch forms in tests/kernels/test_cpu_glue.py.
 *
 * Threads: rows split statically over an OpenMP team (torch's, build.py) when there are enough of
 * them (team_rows: a thread per row and per 2048 elements at most; the float32 passes and
 * store_int8 from 32768 elements on); small steps run on the calling thread.
 *
 * Speed (2026-12-07, 2-core AMD EPYC Zen 4 with AVX512-BF16, shared; SmolLM2-135M: hidden 576,
 * intermediate 1536, 9 + 3 + 3 heads of 64). The kernel alone on one thread (thread CPU time, µs
 * at 1 / 8 / 32 / 64 rows, before -> now): rms_norm 0.56 / 2.35 / 8.4 / 16.4 -> 0.50 / 1.74 / 5.9
 * / 12.9; add_rms_norm 0.63 / 2.93 / 10.6 / 21.0 -> 0.56 / 2.30 / 8.1 / 16.0; silu_mul 1.31 / 8.4
 * / 32.3 / 64.3 -> 0.81 / 4.4 / 16.5 / 32.6; rope_store 0.52 / 2.05 / 7.0 / 13.7 -> 0.49 / 1.69 /
 * 5.6 / 10.9. From: Σx² in one double vector of the 8 partial sums (gcc had split them into xmm
 * pairs), SiLU looked up (computed: an exp and a division per lane; a 16-lane gather took 1.5x the
 * scalar lookups), the stores rounded by vcvtne(2)ps2bf16, cos / sin widened once per row. Per
 * ctypes call with torch's 2 threads (~2 µs of it the call): rms_norm 2.1 / 3.9 / 9.9 / 10.3 ->
 * 2.0 / 2.9 / 5.1 / 7.8, add_rms_norm 2.2 / 4.6 / 12.2 / 12.6 -> 2.2 / 3.3 / 6.3 / 10.1, silu_mul
 * 2.6 / 9.6 / 18.0 / 34.2 -> 2.1 / 4.0 / 10.0 / 18.0, rope_store 3.3 / 4.7 / 9.8 / 10.1 -> 3.2 /
 * 4.1 / 6.1 / 8.8; part of it team_rows (two threads from 4096 elements, was 32768: after a
 * torch matmul, two threads at 8-16 rows took 0.7-0.8x the one-thread call, add_rms_norm 1.0x; at
 * 2 rows 1.0-1.2x). The decode step (glue_forward, 512 cached tokens, the two libraries
 * alternated in one process, 30 rounds): batch 8 22.4 -> 21.8 ms (0.98x per round), batch 32
 * 48.0 -> 47.1 ms (0.986x); batch 1 and 64 within noise (1.005x, 0.998x).
 */
#include "paged_decode.c"

#include <omp.h>

#define PAR_MIN_ELEMS 32768  /* torch's grain size: fewer elements run on one thread (float32 passes, store_int8) */
#define PAR_GRAIN 2048       /* the bfloat16 norm / RoPE / SwiGLU passes: elements per thread at least */

#include "layer_glue_vec.h"  /* bfloat16 loads, rounding and stores; Σx²; SiLU, its lookup table */

static int team(int64_t elems, int nthreads) { return elems >= PAR_MIN_ELEMS && nthreads > 1 ? nthreads : 1; }

/* The team of a bfloat16 pass over rows: at most one thread per row and per PAR_GRAIN elements
 * (~0.7 µs of work on Zen 4, about what waking torch's spinning threads costs; see the top). */
static int team_rows(int64_t elems, int64_t rows, int nthreads) {
    int64_t n = elems / PAR_GRAIN;
    n = n < rows ? n : rows;
    return n < nthreads ? (n > 1 ? (int)n : 1) : nthreads;
}

/* o[:dim] = w · rmsnorm(xr[:dim]) for one row. */
static inline void norm_row(const uint16_t *xr, const uint16_t *w, int dim, float eps, uint16_t *o) {
    const int vec = dim - dim % VL;
    const float k = 1.0f / sqrtf((float)(sumsq(xr, dim) / dim) + eps);
    int i = 0;
    for (; i + 2 * VL <= vec; i += 2 * VL)
        store2_bf16v(o + i, rbfv(bf16v(xr + i) * k) * bf16v(w + i), rbfv(bf16v(xr + i + VL) * k) * bf16v(w + i + VL));
    for (; i < vec; i += VL) store1_bf16v(o + i, rbfv(bf16v(xr + i) * k) * bf16v(w + i));
    for (; i < dim; i++) o[i] = f32_to_bf16(rbf(bf16_to_f32(xr[i]) * k) * bf16_to_f32(w[i]));
}

/* out[r, :] = w · rmsnorm(x[r, :]) for rows r < rows; x rows x_stride elements apart, out contiguous. */
void llmd_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t rows, int dim, float eps,
                        uint16_t *out, int nthreads) {
#pragma omp parallel for num_threads(team_rows(rows * dim, rows, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * x_stride, w, dim, eps, out + r * (int64_t)dim);
}

/* The residual add and the next RMSNorm in one pass (vLLM's fused_add_rms_norm): for rows r < rows,
 * res[r, :] = bf16(res[r, :] + y[r, :]) in place (torch's bfloat16 add: the float32 sum rounded
 * once), then out[r, :] = w · rmsnorm(res[r, :]) as llmd_rms_norm_bf16. y rows y_stride elements
 * apart; res and out contiguous [rows, dim]. */
void llmd_add_rms_norm_bf16(const uint16_t *y, int64_t y_stride, uint16_t *res, const uint16_t *w, int64_t rows,
                            int dim, float eps, uint16_t *out, int nthreads) {
    const int vec = dim - dim % VL;
#pragma omp parallel for num_threads(team_rows(rows * dim, rows, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *yr = y + r * y_stride;
        uint16_t *xr = res + r * (int64_t)dim;
        for (int i = 0; i < vec; i += VL) store_bf16v(xr + i, bf16v(xr + i) + bf16v(yr + i));
        for (int i = vec; i < dim; i++) xr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(yr[i]));
        norm_row(xr, w, dim, eps, out + r * (int64_t)dim);
    }
}

/* o[:D] = rope(a[:D]) with the position's cos / sin rows c, s, widened to float32 (D even). */
static inline void rope_head(const uint16_t *a, const float *c, const float *s, int D, uint16_t *o) {
    const int h2 = D / 2, vec = h2 - h2 % VL;
    for (int i = 0; i < vec; i += VL) {
        vf c1, c2, s1, s2;
        memcpy(&c1, c + i, sizeof c1);
        memcpy(&c2, c + h2 + i, sizeof c2);
        memcpy(&s1, s + i, sizeof s1);
        memcpy(&s2, s + h2 + i, sizeof s2);
        const vf x1 = bf16v(a + i), x2 = bf16v(a + h2 + i);
        store1_bf16v(o + i, rbfv(x1 * c1) + rbfv(x2 * s1));
        store1_bf16v(o + h2 + i, rbfv(x2 * c2) + rbfv(x1 * s2));
    }
    for (int i = vec; i < h2; i++) {
        const float x1 = bf16_to_f32(a[i]), x2 = bf16_to_f32(a[h2 + i]);
        o[i] = f32_to_bf16(rbf(x1 * c[i]) + rbf(x2 * s[i]));
        o[h2 + i] = f32_to_bf16(rbf(x2 * c[h2 + i]) + rbf(x1 * s[h2 + i]));
    }
}

/* The position's cos / sin rows as float32 (rope_head reads them once per head). */
static inline void widen2(const uint16_t *c, const uint16_t *s, int D, float *cf, float *sf) {
    for (int i = 0; i < D; i++) {
        cf[i] = bf16_to_f32(c[i]);
        sf[i] = bf16_to_f32(s[i]);
    }
}

/* out[t, h, :] = rope(x[t, h, :]) for heads h < heads of rows t < rows; x rows x_stride elements
 * apart (heads contiguous, D each), cos / sin rows of D contiguous, c_stride / s_stride apart, out
 * [rows, heads, D] contiguous. */
void llmd_rope_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, int heads, int D, const uint16_t *cs,
                    int64_t c_stride, const uint16_t *sn, int64_t s_stride, uint16_t *out, int nthreads) {
#pragma omp parallel for num_threads(team_rows(rows * heads * D, rows, nthreads)) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        float c[D], s[D];
        widen2(cs + t * c_stride, sn + t * s_stride, D, c, s);
        for (int h = 0; h < heads; h++)
            rope_head(x + t * x_stride + (int64_t)h * D, c, s, D, out + (t * heads + h) * (int64_t)D);
    }
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
#pragma omp parallel for num_threads(team_rows(rows * (heads + 2 * kv_heads) * D, rows, nthreads)) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *a = x + t * x_stride;
        float c[D], s[D];
        widen2(cs + t * c_stride, sn + t * s_stride, D, c, s);
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

/* out[r, :] = silu(gu[r, :I]) · gu[r, I:2I]; gu rows stride elements apart, out [rows, I] contiguous. */
void llmd_silu_mul_bf16(const uint16_t *gu, int64_t stride, int64_t rows, int I, uint16_t *out, int nthreads) {
    const int vec = I - I % VL;
#pragma omp parallel for num_threads(team_rows(rows * I, rows, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * stride, *u = g + I;
        uint16_t *o = out + r * (int64_t)I;
        int i = 0;
        for (; i + 2 * VL <= vec; i += 2 * VL)
            store2_bf16v(o + i, silu_tabv(g + i) * bf16v(u + i), silu_tabv(g + i + VL) * bf16v(u + i + VL));
        for (; i < vec; i += VL) store1_bf16v(o + i, silu_tabv(g + i) * bf16v(u + i));
        for (; i < I; i++) o[i] = f32_to_bf16(rbf(silu1(bf16_to_f32(g[i]))) * bf16_to_f32(u[i]));
    }
}

#include "layer_glue_f32.h"  /* the same passes for float32 models */
