/* What both AMX kernels (amx_decode.h's scores, amx_linear.c's products) need from the tile unit:
 * the LDTILECFG operand's layout (Intel SDM, "LDTILECFG": palette 1, then per tile its bytes per
 * row and its rows) and the process's grant of the tile state, which Linux gives only on request
 * (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); kernel docs x86/xstate.rst). Included
 * only where -march=native enables AMX-TILE. */
#ifndef LLMD_AMX_TILES_H
#define LLMD_AMX_TILES_H

#include <stdint.h>
#include <unistd.h>
#include <sys/syscall.h>

struct amx_tilecfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

/* 1 when the kernel grants this process the tile state, else 0. The grant is process-wide: ask
 * from the calling thread before any OpenMP region, and keep the answer. */
static inline int amx_request_tiles(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

#endif
