/* The exported probes and on/off switches of paged_decode.c's vector paths, for cpu_native.py
 * (kernels/cpu_native_paths.py: amx_available, set_amx, dot_available, set_dot, set_avx2): the 8-lane
 * AVX2 loops (decode_avx2.h), the AVX512-BF16 dot products (bf16dp_decode.h) and the AMX tile scores
 * (amx_decode.h). Each returns 0 on builds without its path. Included once, by paged_decode.c, after
 * those three headers. */

/* Turn decode_avx2.h's loops off (0: decode_task's own) or back on (1) on 8-lane AVX2 builds, for
 * side-by-side measurements in one process; returns whether they are on afterwards (0 on other
 * builds). Call it between kernel calls, not during one. */
int llmd_paged_decode_set_avx2(int on) {
#if VL == 8 && defined(__AVX2__) && defined(__F16C__)
    __atomic_store_n(&avx2_tiles, on ? 1 : 0, __ATOMIC_RELAXED);
    return on ? 1 : 0;
#else
    (void)on;
    return 0;
#endif
}

/* 1 when llmd_paged_decode runs bfloat16 queries over bfloat16 caches (head_dim a multiple of 32)
 * through bf16dp_decode.h (built with AVX512-BF16, LLMD_BF16_DOT not 0; the tile path, where on,
 * goes first), else 0. */
int llmd_paged_decode_dot(void) {
#ifdef HAVE_BF16DP
    return dp_ready();
#else
    return 0;
#endif
}

/* Turn the bf16 dot-product path off (0) or back on (1, where built); returns
 * llmd_paged_decode_dot() after the change. Call it between kernel calls, not during one. */
int llmd_paged_decode_set_dot(int on) {
#ifdef HAVE_BF16DP
    dp_state = on ? 1 : 0;
    return dp_state;
#else
    (void)on;
    return 0;
#endif
}

/* 1 when llmd_paged_decode scores bfloat16 queries over bfloat16 caches on the tile unit
 * (amx_decode.h: built with AMX here, granted by the OS, LLMD_AMX_ATTENTION not 0), else 0. */
int llmd_paged_decode_amx(void) {
#ifdef HAVE_AMX
    return amx_ready();
#else
    return 0;
#endif
}

/* Turn the tile path off (0) or back on (1, where granted), for side-by-side measurements and
 * tests in one process; returns llmd_paged_decode_amx() after the change. Call it between
 * kernel calls, not during one. */
int llmd_paged_decode_set_amx(int on) {
#ifdef HAVE_AMX
    if (!on) {  /* one store: a reader never sees a state that would ask the OS again */
        amx_state = 0;
        return 0;
    }
    amx_state = -1;
    return amx_ready();
#else
    (void)on;
    return 0;
#endif
}
