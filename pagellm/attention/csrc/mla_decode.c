/* Multi-head latent attention decode straight from the paged latent cache (attention/mla.py).
 *
 * Each cached row is one token's [rank latent values | rope key], `width` = rank + rope values, in a cache
 * [num_blocks, 1, block_size, width] of float32 or bfloat16, or in a quantized format (kv_format.h: fp8 e4m3,
 * fp8 e5m2 or int8 codes, each block one run of [block_size][width] codes then block_size bfloat16 scales, one
 * per row). A decode's query per head is its absorbed query
 * [q_nope W_UK | q_pe] of `width` values; its output per head is the softmax-weighted sum of the rows' first
 * `rank` values (W_UV is applied afterwards, in torch):
 *
 *     s_j = scale * q . row_j          out = sum_j softmax(s)_j row_j[:rank]
 *
 * All heads read the same rows, so a task takes one sequence and a tile of heads and streams the sequence's
 * rows once per pass for the whole tile, ROWS rows at a time converted to float32 once: the scores pass (each
 * head's query loaded once per ROWS rows), then the weighted sum (each head's accumulator loaded and stored
 * once per ROWS rows). A quantized row's codes are widened in registers into that buffer (in kv_format.h's
 * widen_codes units) and its scale is folded into the row's score and its softmax weight, never into every
 * element. Arithmetic is float32; exp is libm's expf. Built once per instruction set from this one source
 * (vec.h picks the width). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kv_format.h"

#define HEAD_TILE 16

const char *pagellm_isa(void) { return ISA_NAME; }

/* Round to nearest even, as torch's float -> bfloat16 cast does; NaN stays a quiet NaN. */
static inline uint16_t bf16_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (x != x) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* q . row over `width` floats, four independent sums so the FMAs do not wait on each other. */
static inline float dot(const float *q, const float *row, int64_t width) {
    fvec acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0};
    int64_t i = 0;
    for (; i + 4 * VEC <= width; i += 4 * VEC) {
        acc0 += vload(q + i) * vload(row + i);
        acc1 += vload(q + i + VEC) * vload(row + i + VEC);
        acc2 += vload(q + i + 2 * VEC) * vload(row + i + 2 * VEC);
        acc3 += vload(q + i + 3 * VEC) * vload(row + i + 3 * VEC);
    }
    for (; i + VEC <= width; i += VEC) acc0 += vload(q + i) * vload(row + i);
    float sum = vsum((acc0 + acc1) + (acc2 + acc3));
    for (; i < width; ++i) sum += q[i] * row[i];
    return sum;
}

/* acc[:rank] += p * row[:rank] */
static inline void add_scaled(float *acc, float p, const float *row, int64_t rank) {
    const fvec weight = splat(p);
    int64_t i = 0;
    for (; i + VEC <= rank; i += VEC) vstore(acc + i, vload(acc + i) + weight * vload(row + i));
    for (; i < rank; ++i) acc[i] += p * row[i];
}

/* The first n values of one cached row as float32 in `dst` (a quantized row's codes in widen_codes' units),
 * converted once for all the tile's heads. `format` is a constant after inlining. */
static ALWAYS_INLINE void load_row(float *dst, const void *row, int64_t n, const int format) {
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) vstore(dst + i, load_kv(row, i, format));
    if (i == n) return;
    if (kv_quantized(format)) {
        uint8_t tail[VEC] = {0};  /* widen_codes reads VEC codes: the row's last ones, zero-padded */
        memcpy(tail, (const uint8_t *)row + i, (size_t)(n - i));
        const fvec widened = widen_codes(tail, format);
        for (int64_t k = 0; i + k < n; ++k) dst[i + k] = widened[k];
        return;
    }
    for (; i < n; ++i) dst[i] = scalar_any(row, i, format == KV_BF16);
}

/* q . rows[r] for ROWS consecutive buffered rows (row stride `width`): q is loaded once for all of them. */
#define ROWS 4
static inline void dot_rows(float *out, const float *q, const float *rows, int64_t width) {
    fvec acc[ROWS] = {{0}};
    int64_t i = 0;
    for (; i + VEC <= width; i += VEC) {
        const fvec qv = vload(q + i);
        for (int r = 0; r < ROWS; ++r) acc[r] += qv * vload(rows + r * width + i);
    }
    for (int r = 0; r < ROWS; ++r) {
        float sum = vsum(acc[r]);
        for (int64_t k = i; k < width; ++k) sum += q[k] * rows[r * width + k];
        out[r] = sum;
    }
}

/* acc[:rank] += sum_r p[r] * rows[r][:rank]: one load and store of acc for ROWS rows. */
static inline void add_scaled_rows(float *acc, const float *p, const float *rows, int64_t width, int64_t rank) {
    fvec weight[ROWS];
    for (int r = 0; r < ROWS; ++r) weight[r] = splat(p[r]);
    int64_t i = 0;
    for (; i + VEC <= rank; i += VEC) {
        fvec sum = vload(acc + i);
        for (int r = 0; r < ROWS; ++r) sum += weight[r] * vload(rows + r * width + i);
        vstore(acc + i, sum);
    }
    for (; i < rank; ++i)
        for (int r = 0; r < ROWS; ++r) acc[i] += p[r] * rows[r * width + i];
}

/* The cached row at `position` of a sequence, and its scale (1 in an unquantized cache): a block is one run of
 * block_size rows (then, quantized, their scales). */
static ALWAYS_INLINE const void *row_at(const void *cache, const int format, const int64_t *table,
                                        int64_t position, int64_t block_size, int64_t width, float *scale) {
    const int64_t block = table[position / block_size], offset = position % block_size;
    const char *run = (const char *)cache + block * kv_run_elements(block_size, width, format) *
                                                kv_element_bytes(format);
    *scale = kv_quantized(format) ? kv_row_scale(run + block_size * width, offset, format) : 1.0f;
    return run + offset * width * kv_element_bytes(format);
}

static ALWAYS_INLINE int attend_tile(const void *q, const int q_bf16, const void *cache, const int format,
                                     const int64_t *table, int64_t context_len, void *out, int64_t seq,
                                     int64_t first_head, int64_t heads, int64_t num_heads, int64_t width,
                                     int64_t rank, int64_t block_size, float scale) {
    float *queries = malloc(sizeof(float) * heads * width);
    float *scores = malloc(sizeof(float) * heads * (context_len > 0 ? context_len : 1));
    float *acc = calloc((size_t)(heads * rank), sizeof(float));
    float *row = malloc(sizeof(float) * width * ROWS);
    if (queries == NULL || scores == NULL || acc == NULL || row == NULL) {
        free(queries), free(scores), free(acc), free(row);
        return 1;
    }
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < width; ++i)
            queries[h * width + i] = scalar_any(q, (seq * num_heads + first_head + h) * width + i, q_bf16);
    /* Row r's scale times the softmax scale multiplies its dot products. */
    float row_scales[ROWS];
    int64_t j = 0;
    for (; j + ROWS <= context_len; j += ROWS) {
        for (int r = 0; r < ROWS; ++r) {
            const void *src = row_at(cache, format, table, j + r, block_size, width, &row_scales[r]);
            load_row(row + r * width, src, width, format);
            row_scales[r] *= scale;
        }
        for (int64_t h = 0; h < heads; ++h) {
            float dots[ROWS];
            dot_rows(dots, queries + h * width, row, width);
            for (int r = 0; r < ROWS; ++r) scores[h * context_len + j + r] = row_scales[r] * dots[r];
        }
    }
    for (; j < context_len; ++j) {
        load_row(row, row_at(cache, format, table, j, block_size, width, &row_scales[0]), width, format);
        const float row_scale = row_scales[0] * scale;
        for (int64_t h = 0; h < heads; ++h)
            scores[h * context_len + j] = row_scale * dot(queries + h * width, row, width);
    }
    float inverse_sums[HEAD_TILE];
    for (int64_t h = 0; h < heads; ++h) {
        float *s = scores + h * context_len;
        float max = -INFINITY;
        for (int64_t j = 0; j < context_len; ++j) max = s[j] > max ? s[j] : max;
        float sum = 0.0f;
        for (int64_t j = 0; j < context_len; ++j) {
            s[j] = expf(s[j] - max);
            sum += s[j];
        }
        inverse_sums[h] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }
    /* Row r's scale multiplies its softmax weight in the weighted sum. */
    for (j = 0; j + ROWS <= context_len; j += ROWS) {
        for (int r = 0; r < ROWS; ++r)
            load_row(row + r * width, row_at(cache, format, table, j + r, block_size, width, &row_scales[r]), rank,
                     format);
        for (int64_t h = 0; h < heads; ++h) {
            float weights[ROWS];
            for (int r = 0; r < ROWS; ++r) weights[r] = scores[h * context_len + j + r] * row_scales[r];
            add_scaled_rows(acc + h * rank, weights, row, width, rank);
        }
    }
    for (; j < context_len; ++j) {
        load_row(row, row_at(cache, format, table, j, block_size, width, &row_scales[0]), rank, format);
        for (int64_t h = 0; h < heads; ++h)
            add_scaled(acc + h * rank, scores[h * context_len + j] * row_scales[0], row, rank);
    }
    for (int64_t h = 0; h < heads; ++h) {
        const int64_t base = (seq * num_heads + first_head + h) * rank;
        for (int64_t i = 0; i < rank; ++i) {
            const float value = acc[h * rank + i] * inverse_sums[h];
            if (q_bf16)
                ((uint16_t *)out)[base + i] = bf16_bits(value);
            else
                ((float *)out)[base + i] = value;
        }
    }
    free(queries), free(scores), free(acc), free(row);
    return 0;
}

/* attend_tile specialised per cache format (a constant inside each copy). */
#define ATTEND_TILE_AS(name, format_code)                                                                        \
    static int name(const void *q, int q_bf16, const void *cache, const int64_t *table, int64_t context_len,      \
                    void *out, int64_t seq, int64_t first_head, int64_t heads, int64_t num_heads, int64_t width,   \
                    int64_t rank, int64_t block_size, float scale) {                                               \
        return attend_tile(q, q_bf16, cache, format_code, table, context_len, out, seq, first_head, heads,         \
                           num_heads, width, rank, block_size, scale);                                             \
    }
ATTEND_TILE_AS(attend_tile_f32, KV_F32)
ATTEND_TILE_AS(attend_tile_bf16, KV_BF16)
ATTEND_TILE_AS(attend_tile_e4m3, KV_E4M3)
ATTEND_TILE_AS(attend_tile_e5m2, KV_E5M2)
ATTEND_TILE_AS(attend_tile_int8, KV_INT8)

typedef int (*AttendTile)(const void *, int, const void *, const int64_t *, int64_t, void *, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, float);

static AttendTile attend_tile_for(const int format) {
    switch (format) {
        case KV_F32: return attend_tile_f32;
        case KV_BF16: return attend_tile_bf16;
        case KV_E4M3: return attend_tile_e4m3;
        case KV_E5M2: return attend_tile_e5m2;
        case KV_INT8: return attend_tile_int8;
        default: return NULL;
    }
}

/* q [num_seqs, num_heads, width] (float32 or bfloat16: q_bf16); cache [num_blocks, 1, block_size, width] of
 * cache_format (kv_format.h's KV_F32, KV_BF16, or a quantized format's runs); block_tables [num_seqs,
 * max_blocks]; context_lens [num_seqs]; out [num_seqs, num_heads, rank] in q's dtype. Returns 0, 1 where a
 * buffer could not be allocated, or 2 for a cache format the kernel does not read. */
int mla_decode_attention(const void *q, const void *cache, int q_bf16, int cache_format,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, void *out,
                         int64_t num_seqs, int64_t num_heads, int64_t width, int64_t rank, int64_t block_size,
                         float scale) {
    const AttendTile attend = attend_tile_for(cache_format);
    if (attend == NULL) return 2;
    /* Tiles of up to HEAD_TILE heads, smaller where there would be fewer tasks than threads (one long
     * sequence would otherwise run on one core). */
    const int64_t threads = omp_get_max_threads();
    int64_t tile = HEAD_TILE;
    while (tile > 1 && num_seqs * ((num_heads + tile - 1) / tile) < threads) tile /= 2;
    const int64_t tiles = (num_heads + tile - 1) / tile;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t task = 0; task < num_seqs * tiles; ++task) {
        const int64_t seq = task / tiles, first_head = task % tiles * tile;
        const int64_t heads = num_heads - first_head < tile ? num_heads - first_head : tile;
        failed |= attend(q, q_bf16, cache, block_tables + seq * max_blocks, context_lens[seq], out, seq, first_head,
                         heads, num_heads, width, rank, block_size, scale);
    }
    return failed;
}
