/* What the libraries whose products run linear_bf16 on weights they dequantize per call (wna16.c, w8a8.c's fp8,
 * gguf_quant.c) share, for the decode stack's products and the layers' own: the type of linear_bf16_strided,
 * which they call through a pointer (it lives in the native library; the Python side passes its address), the
 * calling thread's buffer for one tile of a dequantized weight, and the loop over the tiles. */
#ifndef PAGELLM_BF16_TILES_H
#define PAGELLM_BF16_TILES_H

#include <stdint.h>
#include <stdlib.h>

/* csrc/linear_bf16.c's linear_bf16_strided. */
typedef int (*LinearBF16Strided)(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                                 int64_t y_stride, int64_t rows, int64_t in_features, int64_t out_features,
                                 int64_t amx_min_rows);

/* At least `elements` bfloat16 words, the calling thread's own, kept between calls (a decode step makes ~100):
 * NULL if memory ran out. (w8a8.c also rotates a row of activations in it: never while a tile product runs.) */
static inline uint16_t *thread_tile(size_t elements) {
    static __thread uint16_t *tile = NULL;
    static __thread size_t capacity = 0;
    if (elements > capacity) {
        uint16_t *grown = realloc(tile, elements * sizeof *tile);
        if (grown == NULL) return NULL;
        tile = grown;
        capacity = elements;
    }
    return tile;
}

/* Where a decode-stack layer's bfloat16 rows go to linear_bf16 on its weight dequantized per call: from
 * `min_rows` rows, `columns` columns (a multiple of 16) at a time (linear NULL: never). */
typedef struct {
    LinearBF16Strided linear;
    int64_t min_rows, columns, amx_min_rows;
} BF16Tiles;

/* Whether a stack product sends these rows to the tiles. */
static inline int bf16_tiles_take(const BF16Tiles *tiles, int x_bf16, int64_t rows) {
    return x_bf16 && tiles->linear != NULL && rows >= tiles->min_rows;
}

/* Columns [first, first + n) of `weight` (K inputs) into `tile` in linear_bf16's packed layout: 0, or nonzero. */
typedef int (*DequantizeColumns)(const void *weight, int64_t K, int64_t N, int64_t first, int64_t n, uint16_t *tile);

/* y [rows, N] bfloat16 (rows y_stride apart) = x [rows, K] bfloat16 (contiguous) @ W^T on linear_bf16, the
 * weight dequantized tiles.columns columns at a time into the calling thread's buffer: each tile's dequantization
 * and product run their own parallel regions. Returns 1 if memory ran out, 2 for a refusal (0 rows: nothing). */
static inline int bf16_tiles_product(const BF16Tiles *tiles, const void *weight, DequantizeColumns dequantize,
                                     const uint16_t *x, int64_t rows, int64_t K, int64_t N, uint16_t *y,
                                     int64_t y_stride) {
    if (rows < 0 || K <= 0 || N <= 0 || y_stride < N || tiles->linear == NULL || tiles->columns <= 0 ||
        tiles->columns % 16 != 0)
        return 2;
    if (rows == 0) return 0;
    const int64_t columns = tiles->columns < N ? tiles->columns : N;
    uint16_t *tile = thread_tile((size_t)(columns * K));
    if (tile == NULL) return 1;
    for (int64_t first = 0; first < N; first += columns) {
        const int64_t n = N - first < columns ? N - first : columns;
        if (dequantize(weight, K, N, first, n, tile)) return 2;
        const int status = tiles->linear(x, tile, NULL, y + first, y_stride, rows, K, n, tiles->amx_min_rows);
        if (status) return status == 3 ? 1 : 2;
    }
    return 0;
}

#endif
