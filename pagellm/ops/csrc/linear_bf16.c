/* bfloat16 linear layers on CPUs with avx512_bf16: y = x W^T (+ bias), float32 accumulation, y rounded once
 * to bfloat16 (to nearest even), the arithmetic of torch's and oneDNN's bfloat16 GEMM.
 *
 * Why not oneDNN: its kernels on a pre-packed weight reach ~600 GFLOP/s at 32 rows and ~700 at 64 over a model's
 * chain of layers on a 2-core AMD EPYC (avx512_bf16, no AMX), against ~1,100 at 2,048 rows, and decode steps run
 * at those small row counts. This kernel is one register tile: VDPBF16PS multiplies a pair of x's columns,
 * broadcast, by the same pair of 16 weight rows, so each weight vector loaded serves TILE_ROWS rows of x and each
 * broadcast serves TILE_PANELS x 16 outputs (`benchmarks/cpu_gemm.py` times it beside oneDNN).
 *
 * On CPUs with AMX (amx_bf16), calls of at least `amx_min_rows` rows run on the tile unit instead, on the same
 * packed weight: each (panel, pair) row of it is one row of an AMX B tile (16 pairs of 16 outputs), so 16 pairs
 * of a panel are one 1 KiB tile load. TDPBF16PS multiplies 16 rows x 32 inputs by 32 inputs x 16 outputs, with
 * float32 accumulation; the results are rounded once as above. Where the vector path's VDPBF16PS peaks near
 * 230 GFLOP/s on 2 cores, the tiles reach several times that from ~8 rows on (the threshold is measured, see
 * native.LinearBF16). Linux hands out the tile state only on request (arch_prctl), asked once per process.
 *
 * Layouts (all contiguous):
 *   x       [rows, in_features] bfloat16, in_features even
 *   packed  [out_features / 16][in_features / 2][16][2] bfloat16: panel p, column pair k holds
 *           W[16p + j][2k + i] at [p][k][j][i]; one 64-byte vector per (panel, pair); native.LinearBF16.pack makes it.
 *   bias    [out_features] bfloat16, or NULL
 *   y       [rows, out_features] bfloat16, out_features a multiple of 16; linear_bf16_strided writes rows
 *           y_stride elements apart (a slice of a wider output: gguf_kernels' dense tiles)
 */
#include "vec.h"

const int pagellm_linear_bf16_available =
#ifdef HAVE_BF16_DOT
    1;
#else
    0;
#endif

const int pagellm_linear_bf16_amx_available =
#ifdef HAVE_AMX_BF16
    1;
#else
    0;
#endif

#ifdef HAVE_BF16_DOT

#define TILE_ROWS 8
#define TILE_PANELS 3

/* The next column tile's weights, which each row tile asks for a share of (every `shares`-th column pair from
 * `share`) while it computes: the first row tile of a column tile would otherwise wait for its weights from
 * memory while the rest run from cache with memory idle. panel NULL: no next tile. */
typedef struct {
    const uint16_t *panel;
    int64_t share, shares;
} Ahead;

/* y[rows x panels*16] of one tile (its rows y_stride apart); `rows` and `panels` are constants in the full tiles
 * after inlining. */
static ALWAYS_INLINE void tile(const uint16_t *restrict x, int64_t in_features, const uint16_t *restrict panel,
                               const uint16_t *restrict bias, uint16_t *restrict y, int64_t y_stride,
                               const int rows, const int panels, const Ahead *ahead) {
    __m512 acc[TILE_ROWS][TILE_PANELS];
    for (int r = 0; r < rows; ++r)
        for (int p = 0; p < panels; ++p) acc[r][p] = _mm512_setzero_ps();
    const int64_t pairs = in_features / 2, panel_stride = pairs * 32;
    int64_t next_prefetch = ahead->share;
    for (int64_t k = 0; k < pairs; ++k) {
        if (k == next_prefetch && ahead->panel != NULL) {
            for (int p = 0; p < TILE_PANELS; ++p) __builtin_prefetch(ahead->panel + p * panel_stride + k * 32, 0, 3);
            next_prefetch += ahead->shares;
        }
        __m512bh w[TILE_PANELS];
        for (int p = 0; p < panels; ++p) w[p] = (__m512bh)_mm512_loadu_si512(panel + p * panel_stride + k * 32);
        for (int r = 0; r < rows; ++r) {
            uint32_t pair;
            memcpy(&pair, x + r * in_features + 2 * k, sizeof pair);
            const __m512bh broadcast = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int p = 0; p < panels; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], broadcast, w[p]);
        }
    }
    for (int p = 0; p < panels; ++p) {
        fvec b = splat(0.0f);
        if (bias != NULL) b = load_any(bias, p * 16, 1);
        for (int r = 0; r < rows; ++r) {
            const hvec out = to_bf16_bits((fvec)acc[r][p] + b);
            memcpy(y + r * y_stride + p * 16, &out, sizeof out);
        }
    }
}

/* Tiles with fewer rows or panels than the full one, each count a constant so that its tile specialises. */
static void edge_tile(const uint16_t *x, int64_t in_features, const uint16_t *panel, const uint16_t *bias,
                      uint16_t *y, int64_t y_stride, int rows, int panels, const Ahead *ahead) {
#define EDGE(R)                                                                                     \
    case R:                                                                                         \
        if (panels == 1) tile(x, in_features, panel, bias, y, y_stride, R, 1, ahead);              \
        else if (panels == 2) tile(x, in_features, panel, bias, y, y_stride, R, 2, ahead);         \
        else tile(x, in_features, panel, bias, y, y_stride, R, 3, ahead);                          \
        break;
    switch (rows) {
        EDGE(1) EDGE(2) EDGE(3) EDGE(4) EDGE(5) EDGE(6) EDGE(7) default : EDGE(8)
    }
#undef EDGE
}

#ifdef HAVE_AMX_BF16
#include <omp.h>
#include <stdlib.h>

#include "amx_tiles.h"

#define AMX_ROWS 32 /* two A tiles of 16 rows */
#define AMX_K 32    /* bfloat16 inputs per tile row (64 bytes) */
#define AMX_CHUNK_BLOCKS 8 /* 256 rows of x: 288 KiB at 576 inputs */

int linear_bf16_amx_ready(void) { return amx_ready(); }

/* A block's sums waiting to be rounded and stored into y, a few rows at a time. */
typedef struct {
    const float *c;
    const uint16_t *bias;
    uint16_t *y;
    int64_t y_stride, n_rows, next;
    int panels;
} Pending;

/* y rows [from, to) of a pending block = c + bias, rounded to bfloat16; a row's two panels are one 64-byte store
 * (VCVTNE2PS2BF16 rounds as VCVTNEPS2BF16 does), so each line of y is written whole at once. */
static inline void store_rows(const Pending *p, int64_t from, int64_t to) {
    fvec bias_0 = splat(0.0f), bias_1 = splat(0.0f);
    if (p->bias != NULL) {
        bias_0 = load_any(p->bias, 0, 1);
        if (p->panels == 2) bias_1 = load_any(p->bias, 16, 1);
    }
    for (int64_t r = from; r < to; ++r) {
        const float *c = p->c + r * 32;
        if (p->panels == 2) {
            const __m512bh both = _mm512_cvtne2ps_pbh((__m512)(vload(c + 16) + bias_1), (__m512)(vload(c) + bias_0));
            _mm512_storeu_si512(p->y + r * p->y_stride, (__m512i)both);
        } else {
            const hvec out = to_bf16_bits(vload(c) + bias_0);
            memcpy(p->y + r * p->y_stride, &out, sizeof out);
        }
    }
}

static inline void store_pending(Pending *p, int64_t rows) {
    const int64_t to = p->next + rows < p->n_rows ? p->next + rows : p->n_rows;
    store_rows(p, p->next, to);
    p->next = to;
}

/* c[32][32] float32 = 32 rows of x (row stride in_features) times one or two panels. Meanwhile the previous
 * block's rows go out to y a couple per step (pending; NULL: none): stored all at once after their block, 32 lines
 * of y at the row stride that miss the cache, they held up the next block's tiles (README, "On a CPU with AMX"). */
static ALWAYS_INLINE void amx_block(const uint16_t *x, int64_t in_features, const uint16_t *panel, int panels,
                                    float *c, Pending *pending) {
    const int64_t x_stride = in_features * 2, panel_stride = in_features / 2 * 32;
    const int64_t steps = in_features / AMX_K;
    const int64_t per_step = pending != NULL ? (pending->n_rows - pending->next + steps - 1) / steps : 0;
    amx_zero_block();
    for (int64_t k = 0; k < in_features; k += AMX_K) {
        _tile_loadd(4, x + k, x_stride);
        _tile_loadd(6, panel + k / 2 * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (panels == 2) {
            _tile_loadd(7, panel + panel_stride + k / 2 * 32, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        _tile_loadd(5, x + 16 * in_features + k, x_stride);
        _tile_dpbf16ps(2, 5, 6);
        if (panels == 2) _tile_dpbf16ps(3, 5, 7);
        if (pending != NULL) store_pending(pending, per_step);
    }
    if (pending != NULL) store_pending(pending, pending->n_rows);
    amx_store_block(c, panels);
}

/* in_features a multiple of AMX_K. The last, partial block of rows reads a zero-padded copy of them. */
static int linear_bf16_amx(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                           int64_t y_stride, int64_t rows, int64_t in_features, int64_t out_features) {
    const int64_t panels = out_features / 16, column_blocks = (panels + 1) / 2;
    const int64_t row_blocks = (rows + AMX_ROWS - 1) / AMX_ROWS, tail_rows = rows % AMX_ROWS;
    uint16_t *tail = NULL;
    if (tail_rows != 0) {
        tail = calloc((size_t)(AMX_ROWS * in_features), sizeof *tail);
        if (tail == NULL) return 3;
        memcpy(tail, x + (rows - tail_rows) * in_features, (size_t)(tail_rows * in_features) * sizeof *tail);
    }
    /* A work item is one block of 32 rows times a group of column blocks, within a chunk of rows (AMX_CHUNK_BLOCKS
     * blocks, which stay in L2): the group's panels stay in L2 across the chunk's blocks of rows, and the item
     * writes its rows of y in runs of the group's width rather than 64 bytes a row at the row stride (6 KiB apart
     * at 3,072 outputs). Groups only where the call has more than one chunk: a single chunk keeps one column block
     * per item, whose panels stay in L1 across its few blocks of rows (groups there measured 9-20% slower at
     * 64-256 rows over 30 layers streamed from memory, and 3-9% faster from 512 rows; README), and only there are
     * a block's rows of y stored during the next block's steps (`spread`; within one chunk an item is one block).
     * Groups shrink until every thread has several items, and differ in size by one block at most. */
    const int spread = row_blocks > AMX_CHUNK_BLOCKS;
#pragma omp parallel if (rows * out_features * in_features >= 65536)
    {
        /* Eight 16 x 64-byte tiles: 0-3 accumulate [row half][panel], 4-5 hold x's row halves, 6-7 two panels. */
        static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
        amx_configure(colsb);
        float c[2][AMX_ROWS * 32] __attribute__((aligned(64)));
        const int64_t threads = omp_get_num_threads();
        for (int64_t chunk = 0; chunk < row_blocks; chunk += AMX_CHUNK_BLOCKS) {
            const int64_t chunk_blocks = row_blocks - chunk < AMX_CHUNK_BLOCKS ? row_blocks - chunk : AMX_CHUNK_BLOCKS;
            const int64_t groups = amx_column_groups(column_blocks, in_features * 64, chunk_blocks, spread, threads);
#pragma omp for collapse(2) schedule(static)
            for (int64_t g = 0; g < groups; ++g) {
                for (int64_t t = 0; t < chunk_blocks; ++t) {
                    const int64_t row = (chunk + t) * AMX_ROWS;
                    const int64_t n_rows = rows - row < AMX_ROWS ? rows - row : AMX_ROWS;
                    const uint16_t *rows_x = n_rows < AMX_ROWS ? tail : x + row * in_features;
                    const int64_t first = column_blocks * g / groups, last = column_blocks * (g + 1) / groups;
                    Pending pending = {.c = NULL};
                    for (int64_t b = first; b < last; ++b) {
                        const int64_t first_panel = 2 * b;
                        const int n_panels = panels - first_panel < 2 ? 1 : 2;
                        float *sums = c[spread && (b & 1)];
                        const uint16_t *block_panels = packed + first_panel * (in_features / 2) * 32;
                        /* Two calls, so that the unspread one inlines with a literal NULL and no per-step check
                         * (one call with a runtime NULL: best GFLOP/s 1-9% lower at 64-256 rows in 7 of 8 runs). */
                        if (spread)
                            amx_block(rows_x, in_features, block_panels, n_panels, sums,
                                      pending.c != NULL ? &pending : NULL);
                        else
                            amx_block(rows_x, in_features, block_panels, n_panels, sums, NULL);
                        pending = (Pending){.c = sums, .bias = bias != NULL ? bias + first_panel * 16 : NULL,
                                            .y = y + row * y_stride + first_panel * 16, .y_stride = y_stride,
                                            .n_rows = n_rows, .next = 0, .panels = n_panels};
                        if (!spread) store_pending(&pending, n_rows);
                    }
                    if (pending.c != NULL) store_pending(&pending, pending.n_rows);
                }
            }
        }
        _tile_release();
    }
    free(tail);
    return 0;
}
#endif

/* Returns 2 if the shapes do not fit the layout, 3 if memory ran out. Calls of at least amx_min_rows rows take
 * the tile unit where the build has it, this process may use it (linear_bf16_amx_ready) and in_features is a
 * multiple of 32. A prefetch of the next column tile may reach past the last panel of the weight: prefetches
 * never fault. */
int linear_bf16_strided(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                        int64_t y_stride, int64_t rows, int64_t in_features, int64_t out_features,
                        int64_t amx_min_rows) {
    if (in_features % 2 != 0 || out_features % 16 != 0 || y_stride < out_features) return 2;
#ifdef HAVE_AMX_BF16
    if (rows >= amx_min_rows && in_features % AMX_K == 0 && linear_bf16_amx_ready())
        return linear_bf16_amx(x, packed, bias, y, y_stride, rows, in_features, out_features);
#else
    (void)amx_min_rows;
#endif
    const int64_t panels = out_features / 16, column_tiles = (panels + TILE_PANELS - 1) / TILE_PANELS;
    const int64_t row_tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    /* Column tiles outer: each thread streams its own share of the weights from memory once and reuses every
     * panel from L1/L2 for all row tiles; with few column tiles (a narrow layer at prefill sizes) the row
     * tiles are shared out too. */
#pragma omp parallel for collapse(2) schedule(static) if (rows * out_features * in_features >= 65536)
    for (int64_t c = 0; c < column_tiles; ++c) {
        for (int64_t t = 0; t < row_tiles; ++t) {
            const int64_t first_panel = c * TILE_PANELS, row = t * TILE_ROWS;
            const int64_t n_panels = panels - first_panel < TILE_PANELS ? panels - first_panel : TILE_PANELS;
            const int64_t n_rows = rows - row < TILE_ROWS ? rows - row : TILE_ROWS;
            const uint16_t *panel = packed + first_panel * (in_features / 2) * 32;
            const uint16_t *tile_bias = bias != NULL ? bias + first_panel * 16 : NULL;
            uint16_t *out = y + row * y_stride + first_panel * 16;
            const Ahead ahead = {
                .panel = c + 1 < column_tiles ? panel + TILE_PANELS * (in_features / 2) * 32 : NULL,
                .share = t,
                .shares = row_tiles,
            };
            if (n_rows == TILE_ROWS && n_panels == TILE_PANELS)
                tile(x + row * in_features, in_features, panel, tile_bias, out, y_stride, TILE_ROWS, TILE_PANELS,
                     &ahead);
            else
                edge_tile(x + row * in_features, in_features, panel, tile_bias, out, y_stride, (int)n_rows,
                          (int)n_panels, &ahead);
        }
    }
    return 0;
}

int linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int64_t rows,
                int64_t in_features, int64_t out_features, int64_t amx_min_rows) {
    return linear_bf16_strided(x, packed, bias, y, out_features, rows, in_features, out_features, amx_min_rows);
}

/* linear_bf16 behind decode_stack.c's product signature (gguf_matmul's): `type` carries the layer's amx_min_rows
 * (INT32_MAX: never), both activations are bfloat16, no bias. Returns 1 if memory ran out, 2 for shapes it does
 * not take, as gguf_matmul numbers them. */
int linear_bf16_stack_product(int type, const void *packed, const void *x, int x_bf16, int64_t rows,
                              int64_t in_features, int64_t out_features, void *y, int y_bf16) {
    if (!x_bf16 || !y_bf16) return 2;
    const int failed = linear_bf16(x, packed, NULL, y, rows, in_features, out_features, type);
    return failed == 3 ? 1 : failed;
}

#endif

#ifndef HAVE_AMX_BF16
int linear_bf16_amx_ready(void) { return 0; }
#endif
