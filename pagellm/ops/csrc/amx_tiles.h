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

/* This thread's tiles 0..7: rows[t] rows of colsb[t] bytes each (a tile of 0 bytes is unused). */
static inline void amx_configure_shapes(const uint8_t rows[8], const uint16_t colsb[8]) {
    AmxTileConfig config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = colsb[t];
        config.rows[t] = rows[t];
    }
    /* Not _tile_loadconfig: GCC 12's tells the compiler that LDTILECFG reads 8 bytes, so once this function is
     * inlined the stores of the shapes can be dropped as dead, and the CPU faults on the garbage it loads. */
    __asm__ volatile("ldtilecfg %0" : : "m"(config));
}

/* This thread's tiles 0..7: 16 rows each, colsb[t] bytes per row. */
static inline void amx_configure(const uint16_t colsb[8]) {
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_configure_shapes(rows, colsb);
}

/* Weight bytes of a group of column blocks (amx_column_groups): what stays in L2 beside a chunk of rows. */
#define AMX_GROUP_BYTES (512 * 1024)

/* Work items of the GEMMs on tiles (linear_bf16.c, w8a8.c) over a chunk of chunk_blocks blocks of 32 rows: each is
 * a block of rows times one of the groups of column blocks this returns the count of. Over more than one chunk
 * (`grouped`) a group holds the column blocks (block_bytes of weights each) that fit AMX_GROUP_BYTES, which then
 * stay in L2 across the chunk's blocks of rows; within one chunk each column block is its own group. Groups double
 * until each of `threads` has 4 items or more; the caller splits column blocks into them evenly (first of group g:
 * column_blocks * g / groups). */
static inline int64_t amx_column_groups(int64_t column_blocks, int64_t block_bytes, int64_t chunk_blocks, int grouped,
                                        int64_t threads) {
    const int64_t per_group = AMX_GROUP_BYTES / block_bytes > 1 ? AMX_GROUP_BYTES / block_bytes : 1;
    int64_t groups = grouped ? (column_blocks + per_group - 1) / per_group : column_blocks;
    while (groups < column_blocks && groups * chunk_blocks < 4 * threads) groups *= 2;
    return groups < column_blocks ? groups : column_blocks;
}

/* Tiles 0-3 cleared: the accumulators (a GEMM's [row half][column half] of a 32 x 32 block of sums, the decode
 * attention's four 16-float output tiles). */
static inline void amx_zero_block(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* Tiles 0-3 into `out`, [32][32] 4-byte sums (row stride 128 bytes); with one column half, tiles 0 and 2 only. */
static inline void amx_store_block(void *out, int halves) {
    char *o = (char *)out;
    _tile_stored(0, o, 128);
    _tile_stored(2, o + 16 * 128, 128);
    if (halves == 2) {
        _tile_stored(1, o + 64, 128);
        _tile_stored(3, o + 16 * 128 + 64, 128);
    }
}

#endif
