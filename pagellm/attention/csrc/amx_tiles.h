/* Intel AMX tiles for the kernels built with them (-mamx-tile and -mamx-bf16 / -mamx-int8, where the CPU has
 * them): Linux hands a process the tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM), and each
 * thread loads its own tile configuration before its first tile instruction. */
#ifndef PAGELLM_AMX_TILES_H
#define PAGELLM_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ARCH_REQ_XCOMP_PERM 0x1023
#define AMX_XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxTileConfig;

/* 1 where this process may use the tiles (asked once; the grant is process-wide, so a race only asks twice). */
static int amx_ready(void) {
    static int state; /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

/* This thread's tiles 0..7: 16 rows each, colsb[t] bytes per row. */
static inline void amx_configure(const uint16_t colsb[8]) {
    AmxTileConfig config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = colsb[t];
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

#endif
