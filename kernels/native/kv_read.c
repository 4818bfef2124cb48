/* The KV-gather read: every K and V byte a step's decodes attend to, read through their block
 * tables in the decode kernel's order and summed, and nothing else (no scores, no softmax, no
 * output). llmd bench step times it beside the attention (daemon/bench/step.py): the read
 * bandwidth this machine gives for the paged layout (random blocks of block_size slots, each
 * plane's rows of a block contiguous) rather than for one long stream (x.sum()).
 *
 * Per decode i (one OpenMP task, dynamic schedule, as llmd_paged_decode with all KV heads per
 * task): for positions [first[i], seq_len[i]) block by block, the K rows of the run of slots in
 * that block (row_bytes each, contiguous), then the V rows kv_plane bytes further, then, if
 * scale_bytes > 0, the K and V scale rows (scale_bytes each, scale_plane bytes apart) at
 * `scales`; the next block's K and V rows are prefetched into L2 first (prefetcht1, as the decode
 * kernel does one block ahead). Every 64-byte line is loaded whole (its eight 8-byte words
 * added), so the sum cannot be computed without reading it. Returns the wrapped 64-bit sum (to
 * keep the loads live).
 */
#include <stdint.h>
#include <string.h>

/* One vector register of 64-bit lanes: a zmm with AVX-512, else a ymm (a 64-byte GCC vector on an
 * AVX2-only CPU goes through the stack: see paged_decode.c's VL). */
#if defined(__AVX512F__)
#define VW 64
#else
#define VW 32
#endif
typedef uint64_t vw __attribute__((vector_size(VW)));

static inline vw sum_bytes(const char *p, int64_t n, vw acc) {
    int64_t b = 0;
    for (; b + 64 <= n; b += 64)
        for (int h = 0; h < 64; h += VW) {
            vw x;
            memcpy(&x, p + b + h, VW);
            acc += x;
        }
    for (; b < n; b++) acc[0] += (unsigned char)p[b];
    return acc;
}

uint64_t llmd_kv_gather_read(const char *kv, int64_t kv_plane, int64_t row_bytes, const char *scales,
                             int64_t scale_plane, int64_t scale_bytes, int block_size, const int32_t *block_tables,
                             int64_t bt_stride, const int64_t *table_rows, const int64_t *first,
                             const int64_t *seq_lens, int num_decodes, int num_threads) {
    uint64_t total = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(+ : total)
    for (int i = 0; i < num_decodes; i++) {
        const int32_t *table = block_tables + table_rows[i] * bt_stride;
        vw acc = {0};
        for (int64_t pos = first[i]; pos < seq_lens[i];) {
            const int64_t off = pos % block_size;
            const int64_t n = block_size - off < seq_lens[i] - pos ? block_size - off : seq_lens[i] - pos;
            const int64_t slot = (int64_t)table[pos / block_size] * block_size + off;
            const int64_t next = (pos / block_size + 1) * block_size;  /* the next block: prefetched into L2 */
            if (next < seq_lens[i]) {
                const int64_t nn = block_size < seq_lens[i] - next ? block_size : seq_lens[i] - next;
                const char *k = kv + (int64_t)table[next / block_size] * block_size * row_bytes;
                for (int64_t b = 0; b < nn * row_bytes; b += 64) {
                    __builtin_prefetch(k + b, 0, 2);
                    __builtin_prefetch(k + kv_plane + b, 0, 2);
                }
            }
            acc = sum_bytes(kv + slot * row_bytes, n * row_bytes, acc);
            acc = sum_bytes(kv + kv_plane + slot * row_bytes, n * row_bytes, acc);
            if (scale_bytes > 0) {
                acc = sum_bytes(scales + slot * scale_bytes, n * scale_bytes, acc);
                acc = sum_bytes(scales + scale_plane + slot * scale_bytes, n * scale_bytes, acc);
            }
            pos += n;
        }
        for (int k = 0; k < VW / 8; k++) total += acc[k];
    }
    return total;
}
