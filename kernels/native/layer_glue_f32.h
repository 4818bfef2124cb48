/* The float32 layer glue: layer_glue.c's passes for a float32 model (RMSNorm alone or after the
 * residual add, NEOX RoPE of Q and K with the K/V store into a float32 or float16 cache, SwiGLU's
 * silu(gate) * up), one pass each over the step's rows. Included by layer_glue.c (one library).
 *
 * Why: on a CPU without native bfloat16 (AVX2-only, e.g. AMD Zen 3) `--dtype auto` runs SmolLM2 in
 * float32 with fp16 weight packs, and there the torch ops between the matmuls (F.rms_norm's nine
 * kernels, RoPE's four, the K/V store's index_copy_ and cast, SwiGLU's two) took ~17 ms of a
 * ~100 ms batch-32 decode step (torch profiler, 2026-12-06): 300 small kernels per step.
 *
 * Numerics, each against the torch op in float32 (tests/kernels/test_cpu_glue_f32.py):
 *   rms_norm: out = w · (x · r), r = 1 / sqrt(Σx² / dim + eps) with Σx² summed in double (torch
 *             sums in float32 in its own order: r can differ by a float32 ulp, the outputs by ~1 ulp);
 *   add_rms_norm: res = res + y (one float32 add, as torch's), then rms_norm of it;
 *   rope_store: out = x · cos + swap(x) · sin, two products and a sum each rounded (no FMA
 *             contraction: this part is built with fp-contract off), bit for bit as
 *             models/layers.py apply_rope; K and V stored unchanged into a float32 cache, or
 *             rounded to nearest even into a float16 one (torch's .to(torch.float16)): bit for bit;
 *   silu_mul: out = (g / (1 + exp(-g))) · u with decode_vec.h's exp (1-2 float32 ulp; torch's
 *             Sleef expf is within 1): within a few float32 ulps of torch's silu(g) * u.
 */
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline vf f32v(const float *p) {
    vf r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline void st_f32v(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* o[:dim] = w · (x · r) for one float32 row (see the file comment). */
static inline void norm_row_f32(const float *xr, const float *w, int dim, float eps, float *o) {
    double acc[8] = {0};
    int i = 0;
    for (; i + 8 <= dim; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += (double)xr[i + j] * xr[i + j];
    for (; i < dim; i++) acc[0] += (double)xr[i] * xr[i];
    const double ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    const float k = 1.0f / sqrtf((float)(ss / dim) + eps);
    const int vec = dim - dim % VL;
    for (i = 0; i < vec; i += VL) {
        st_f32v(o + i, (f32v(xr + i) * k) * f32v(w + i));  /* two rounded products (no add to contract) */
    }
    for (; i < dim; i++) o[i] = (xr[i] * k) * w[i];
}

/* out[r, :] = rmsnorm(x[r, :]) for rows r < rows; x rows x_stride elements apart, out contiguous. */
void llmd_rms_norm_f32(const float *x, int64_t x_stride, const float *w, int64_t rows, int dim, float eps, float *out,
                       int nthreads) {
#pragma omp parallel for num_threads(team(rows * dim, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row_f32(x + r * x_stride, w, dim, eps, out + r * (int64_t)dim);
}

/* res[r, :] += y[r, :] in place, then out[r, :] = rmsnorm(res[r, :]) (vLLM's fused_add_rms_norm);
 * y rows y_stride elements apart, res and out contiguous [rows, dim]. */
void llmd_add_rms_norm_f32(const float *y, int64_t y_stride, float *res, const float *w, int64_t rows, int dim,
                           float eps, float *out, int nthreads) {
#pragma omp parallel for num_threads(team(rows * dim, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = res + r * (int64_t)dim;
        const float *yr = y + r * y_stride;
        for (int i = 0; i < dim; i++) xr[i] += yr[i];
        norm_row_f32(xr, w, dim, eps, out + r * (int64_t)dim);
    }
}

/* n float32 values as float16, round to nearest even (torch's .to(torch.float16)). */
static inline void store_f16(const float *src, int n, uint16_t *dst) {
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) {
        const _Float16 h = (_Float16)src[i];
        memcpy(dst + i, &h, 2);
    }
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
/* o[:D] = rope(a[:D]) with the position's cos / sin rows c, s (D even), float32. */
static void rope_head_f32(const float *a, const float *c, const float *s, int D, float *o) {
    const int h2 = D / 2;
    for (int i = 0; i < h2; i++) {
        const float x1 = a[i], x2 = a[h2 + i];
        o[i] = x1 * c[i] + x2 * s[i];
        o[h2 + i] = x2 * c[h2 + i] + x1 * s[h2 + i];
    }
}
#pragma GCC pop_options

/* The attention's inputs from a fused float32 QKV row in one pass (llmd_rope_store_bf16's
 * float32 twin): q_out[t, h, :] = rope(Q head h) ([rows, heads, D] contiguous); where slots[t] >= 0
 * the rotated K heads and the V heads go to that slot of the cache's K and V planes (kv_plane
 * elements apart), as float32 (kv_f16 = 0) or rounded to float16 (kv_f16 = 1). */
void llmd_rope_store_f32(const float *x, int64_t x_stride, int64_t rows, int heads, int kv_heads, int D,
                         const float *cs, int64_t c_stride, const float *sn, int64_t s_stride, float *q_out, void *kv,
                         int64_t kv_plane, const int64_t *slots, int kv_f16, int nthreads) {
    const int64_t row = (int64_t)kv_heads * D;
#pragma omp parallel for num_threads(team(rows * (heads + 2 * kv_heads) * D, nthreads)) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *a = x + t * x_stride, *c = cs + t * c_stride, *s = sn + t * s_stride;
        for (int h = 0; h < heads; h++) rope_head_f32(a + (int64_t)h * D, c, s, D, q_out + (t * heads + h) * (int64_t)D);
        if (slots[t] < 0) continue;
        const float *v = a + (int64_t)(heads + kv_heads) * D;
        if (kv_f16) {
            float k[MAX_TASK_HEADS * MAX_HEAD_DIM];
            const int per = MAX_TASK_HEADS * MAX_HEAD_DIM / D;  /* K heads per pass through k */
            uint16_t *dst = (uint16_t *)kv + slots[t] * row;
            for (int h0 = 0; h0 < kv_heads; h0 += per) {
                const int n = kv_heads - h0 < per ? kv_heads - h0 : per;
                for (int h = 0; h < n; h++) rope_head_f32(a + (int64_t)(heads + h0 + h) * D, c, s, D, k + h * D);
                store_f16(k, n * D, dst + (int64_t)h0 * D);
            }
            store_f16(v, (int)row, dst + kv_plane);
        } else {
            float *dst = (float *)kv + slots[t] * row;
            for (int h = 0; h < kv_heads; h++) rope_head_f32(a + (int64_t)(heads + h) * D, c, s, D, dst + (int64_t)h * D);
            memcpy(dst + kv_plane, v, row * sizeof *dst);
        }
    }
}

/* out[r, :] = silu(gu[r, :I]) · gu[r, I:2I], float32; gu rows stride elements apart, out [rows, I]
 * contiguous. */
void llmd_silu_mul_f32(const float *gu, int64_t stride, int64_t rows, int I, float *out, int nthreads) {
    const int vec = I - I % VL;
#pragma omp parallel for num_threads(team(rows * I, nthreads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * stride, *u = g + I;
        float *o = out + r * (int64_t)I;
        for (int i = 0; i < vec; i += VL) st_f32v(o + i, siluv(f32v(g + i)) * f32v(u + i));
        for (int i = vec; i < I; i++) o[i] = silu1(g[i]) * u[i];
    }
}
