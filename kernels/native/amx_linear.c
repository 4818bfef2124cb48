/* Dense bfloat16 linears on Intel AMX tiles (Sapphire Rapids and later): y = x · Wᵀ for the cpu
 * backend's layer weights (kernels/amx_linear.py), every row count from a decode step's few rows to
 * a 512-token prefill chunk.
 *
 * Weights are packed once (quant/prepacked.py, amx_pack) as 1 KiB tiles in the order this kernel
 * streams them: W [N, K] → [N/32][K/32][2][16][16][2], i.e. per 32 output columns and 32 input
 * columns two B tiles of 16 rows (input-column pairs) × 16 columns × 2 (the pair), the layout
 * TDPBF16PS takes for its second operand (Intel's "Architecture Instruction Set Extensions
 * Programming Reference", ch. 3: B is K/2 rows of N dword pairs). x stays as it is: its 16-row × 32-
 * column A tiles load straight from the rows (stride = the row's bytes).
 *
 * Work: each thread takes a contiguous range of 32-column panels (OpenMP, static), so it streams
 * its part of the weights front to back once (a panel's K/32 tile pairs stay in L1/L2 while every
 * 32-row block of x runs over them); per panel and row block, four accumulators (2 row tiles × 2
 * column tiles) over K/32 steps of two A loads, two B loads and four TDPBF16PS. Products of
 * bfloat16 values are exact in float32 and summed in float32 in the tile unit's order (bfloat16
 * subnormal inputs flushed to zero); the sums are rounded to bfloat16 (round to nearest even,
 * VCVTNE2PS2BF16). Each row's output depends on that row and the weights only, never on how many
 * rows the call has (a sequence's logits do not change with its batch).
 *
 * The process must hold the tile state (Linux arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
 * the kernel's Documentation/arch/x86/xstate.rst): llmd_amx_linear_ready() asks once.
 * Built everywhere (-march=native); without AMX-TILE/AMX-BF16/AVX512-BF16 both functions report
 * "unavailable" and nothing else is compiled.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#include "amx_tiles.h"

static int ready = -1;  /* -1: not asked yet; 0: refused; 1: granted */

int llmd_amx_linear_ready(void) {
    if (ready < 0) ready = amx_request_tiles();
    return ready;
}

/* tiles 0-3: C (rows m0 for 0-1, m1 for 2-3), 4-5: A (m0, m1 rows), 6-7: B (16 rows); 64 bytes a row */
static void configure(int m0, int m1) {
    struct amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int rows[8] = {m0, m0, m1, m1, m0, m1, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

/* y [M, N] bfloat16 (rows of N) = x [M, K] bfloat16 (row stride ldx elements) · Wᵀ, W packed as
 * above; K and N multiples of 32. Returns 0, or -1 when the shape is not served or the tile state
 * is not granted (nothing written). */
int llmd_amx_linear(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int M, int K, int N,
                    int num_threads) {
    if (M < 1 || K % 32 || N % 32 || K < 32 || N < 32 || llmd_amx_linear_ready() != 1) return -1;
    const int panels = N / 32, kc = K / 32;
#pragma omp parallel num_threads(num_threads)
    {
        float c[4][16][16] __attribute__((aligned(64)));
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int lo = (int)((int64_t)panels * me / nt), hi = (int)((int64_t)panels * (me + 1) / nt);
        int configured = -1;  /* the row count of the block the tiles are configured for */
        for (int p = lo; p < hi; p++) {
            const uint16_t *wp = w + (int64_t)p * kc * 1024;
            for (int mb = 0; mb < M; mb += 32) {
                const int rows = M - mb < 32 ? M - mb : 32, m0 = rows > 16 ? 16 : rows, m1 = rows - m0;
                if (rows != configured) {
                    configure(m0, m1);
                    configured = rows;
                }
                const uint16_t *xa = x + (int64_t)mb * ldx;
                _tile_zero(0);
                _tile_zero(1);
                if (m1) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
                for (int k = 0; k < kc; k++) {
                    const uint16_t *b = wp + (int64_t)k * 1024;
                    if (mb == 0) {  /* the panel's first pass streams it from memory: 4 KiB ahead */
                        __builtin_prefetch((const char *)b + 4096, 0, 3);
                        __builtin_prefetch((const char *)b + 4096 + 256, 0, 3);
                    }
                    _tile_loadd(4, xa + 32 * k, ldx * 2);
                    _tile_loadd(6, b, 64);
                    _tile_loadd(7, b + 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (m1) {
                        _tile_loadd(5, xa + 16 * ldx + 32 * k, ldx * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                if (m1) {
                    _tile_stored(2, c[2], 64);
                    _tile_stored(3, c[3], 64);
                }
                for (int m = 0; m < rows; m++) {
                    const int t = m < 16 ? 0 : 2, r = m & 15;
                    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(c[t + 1][r]), _mm512_load_ps(c[t][r]));
                    _mm512_storeu_si512(y + (int64_t)(mb + m) * N + 32 * p, (__m512i)v);
                }
            }
        }
        _tile_release();
    }
    return 0;
}
#else
int llmd_amx_linear_ready(void) { return 0; }

int llmd_amx_linear(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int M, int K, int N,
                    int num_threads) {
    (void)x, (void)ldx, (void)w, (void)y, (void)M, (void)K, (void)N, (void)num_threads;
    return -1;
}
#endif
