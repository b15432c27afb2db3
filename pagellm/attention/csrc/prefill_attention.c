/* Causal prefill attention straight from the paged KV cache, every prefill chunk of a step in one call.
 *
 * The torch path attends each chunk with SDPA, after gathering the chunk's cached context into a contiguous
 * copy when it has one (chunked prefill, prefix-cache hits). Here the step's keys and values are read where
 * write_kv put them, through each chunk's block table, and the chunk is attended flash-style: tiles of
 * KEY_TILE keys stream past a tile of query rows, with an online softmax (running maximum and sum per row)
 * so no [queries, keys] matrix is ever stored.
 *
 * Layouts (all contiguous unless said):
 *   q             [tokens, num_heads, head_dim], token t at q + t * q_token_stride (a view of the fused QKV
 *                 projection); float32 or bfloat16, the cache's dtype unless the cache is quantized
 *   out           [tokens, num_heads, head_dim], q's dtype (bfloat16 rounded to nearest even once, on store)
 *   k/v_cache     [num_blocks, num_kv_heads, block_size, head_dim], or runs of codes and scales in a quantized
 *                 format (kv_format.h), dequantized as the tiles are packed
 *   block_tables  [num_chunks, table_stride] int64
 *   query_starts, query_lens, seq_lens  [num_chunks] int64: chunk c's queries are tokens query_starts[c] ..
 *                 + query_lens[c] of q, and its sequence holds seq_lens[c] keys once this step's are written;
 *                 query i of the chunk sits at position seq_lens[c] - query_lens[c] + i and sees keys up to it
 *   sliding_window  0 for full attention; else the query at position p sees keys in (p - window, p] only,
 *                 and block-table entries wholly before the first key any query of the chunk sees are never
 *                 read (they may be freed holes)
 *   sinks         NULL, or [num_heads] float32: head h's softmax denominator also holds e^sinks[h] (gpt-oss's
 *                 attention sinks, which carry no value), added once per row after the last tile
 *
 * Numerics: float32 arithmetic throughout. In bfloat16, the softmax weights are rounded to bfloat16 before
 * they multiply the values, as torch's flash attention for bfloat16 does (its P.V product is a bfloat16
 * GEMM); with avx512_bf16 both products run on VDPBF16PS (exact bfloat16 products, float32 sums). Over a
 * quantized cache the keys and values are code * scale, exact in float32 but not in bfloat16, so the products
 * and weights stay float32 whatever q's dtype (the torch reference attends the dequantized cache in float32).
 *
 * Work: the query rows of one work item are a run of a chunk's queries times the GQA group's heads (adjacent
 * in q), so each key tile is used by every head that shares it. Key tiles are first packed once per call into
 * the layout the products stream (transposed keys; for VDPBF16PS, pairs interleaved), then the work items
 * (chunk, kv head, query tile) run longest first on torch's OpenMP pool.
 */
#include <stdlib.h>

#include "kv_format.h"

/* Keys per tile: two vectors of scores per query row. */
#define KEY_TILE (2 * VEC)
/* Query rows (queries x heads of the group) per work item, at most: the item's queries, scores, weights and
 * output accumulators stay in the first-level cache while the key tiles stream past. */
#define ROWS_PER_ITEM 96
/* Register blocking: rows per pass of the score product (x KEY_TILE keys) and of the value product
 * (x PV_VECTORS vectors of head_dim), so accumulators, the loaded operands and one broadcast fit in the
 * register file (32 zmm with AVX-512, 16 ymm/xmm otherwise). Row counts are padded to ROW_MULTIPLE. */
#if VEC == 16
#define QK_ROWS 8
#define PV_ROWS 6
#define ROW_MULTIPLE 24
#else
#define QK_ROWS 6
#define PV_ROWS 2
#define ROW_MULTIPLE 6
#endif
#define PV_VECTORS 4
/* Calls with fewer multiply-adds (query heads x keys x head_dim, both products) run on the calling thread:
 * a parallel region costs microseconds on a quiet machine, and far more when another process holds a core
 * (every region then waits for the descheduled thread), which a short chunk's attention does not repay. */
#define PARALLEL_MIN_MACS (1 << 21)
/* head_dim is summed in pieces of PV_VECTORS vectors, or of 32 floats where less is left. */
#define NARROW_VECTORS (32 / VEC < PV_VECTORS ? 32 / VEC : PV_VECTORS)

#ifdef HAVE_BF16_DOT
/* acc[i] += a[2i] * pair.lo + a[2i + 1] * pair.hi: `pair` holds two bfloat16 values, the same in every lane. */
static ALWAYS_INLINE fvec dot_pairs_broadcast(fvec acc, const uint16_t *a, const uint32_t *pair) {
    __m512bh lanes;
    memcpy(&lanes, a, sizeof lanes);
    return (fvec)_mm512_dpbf16_ps((__m512)acc, lanes, (__m512bh)_mm512_set1_epi32((int)*pair));
}
#endif

/* 2^x for x <= 0, or -inf: the bfloat16 softmax's exponential, on scores kept in base 2 (their scale carries
 * log2(e)).
 * With AVX-512, x = n + f with |f| <= 1/2, Cephes' exp2f polynomial for 2^f and VSCALEFPS for the 2^n: half
 * the instructions of exp_nonpositive's natural-base reduction, within a couple of ulp all the same;
 * elsewhere that function. NaN where x is -inf (callers mask those lanes). */
static ALWAYS_INLINE fvec exp2_nonpositive(fvec x) {
#if VEC == 16
    const __m512 n = _mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const fvec f = x - (fvec)n;
    fvec p = splat(1.535336188319500e-4f);
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    return (fvec)_mm512_scalef_ps((__m512)p, n);
#else
    return exp_nonpositive(x * 0.693147180559945309f);
#endif
}

/* The softmax's exponential of x <= 0 (or -inf): base 2 in bfloat16, base e in float32 (see score_scale). */
static ALWAYS_INLINE fvec softmax_exp(fvec x, const int bf16) {
    return bf16 ? exp2_nonpositive(x) : exp_nonpositive(x);
}

static ALWAYS_INLINE float vmax_lanes(fvec v) {
#if VEC == 16
    return _mm512_reduce_max_ps((__m512)v);
#else
    float max = v[0];
    for (int i = 1; i < VEC; ++i) max = v[i] > max ? v[i] : max;
    return max;
#endif
}

typedef struct {
    const void *q;
    int64_t q_token_stride;
    const void *k_cache, *v_cache;
    const int64_t *block_tables, *query_starts, *query_lens, *seq_lens;
    int64_t table_stride, num_heads, num_kv_heads, head_dim, block_size, sliding_window;
    int64_t run_elements;  /* of one (block, kv head) run of the cache */
    /* Scores' scale: in bfloat16 the softmax scale times log2(e), so the softmax runs in base 2 (the cheaper
     * exponential; its results are rounded to bfloat16 anyway); in float32 the scale itself, which is exact
     * for the usual power-of-two scales, so scores are rounded as SDPA rounds them. */
    float score_scale;
    void *out;
    const float *sinks;  /* NULL: no sinks */
    /* Per chunk: the first key position any query sees, the packed tiles from it and where they start. */
    int64_t *key_base, *num_tiles, *tile_offset;
    void *packed;
} Prefill;

/* The first key a query at `position` sees. */
static ALWAYS_INLINE int64_t first_visible(int64_t position, int64_t window) {
    return window > 0 && position >= window ? position - window + 1 : 0;
}

/* Elements of one packed tile: KEY_TILE keys and KEY_TILE values of head_dim. */
static ALWAYS_INLINE int64_t tile_elements(const Prefill *p) { return 2 * KEY_TILE * p->head_dim; }

/* Packs tile `tile` of (chunk, kv_head): keys from key_base + tile * KEY_TILE, zeros past the sequence.
 * dot: keys as [head_dim / 2][KEY_TILE] bfloat16 pairs (one vector: 2 dims of VEC keys), values as
 * [KEY_TILE / 2][head_dim] pairs of adjacent keys; else keys transposed to [head_dim][KEY_TILE] float32 and
 * values as [KEY_TILE][head_dim] float32, a quantized cache's codes times their row's scale. */
static ALWAYS_INLINE void pack_tile(const Prefill *p, int64_t chunk, int64_t kv_head, int64_t tile, const int format,
                                    const int dot) {
    const int64_t dim = p->head_dim, bs = p->block_size;
    const int64_t *table = p->block_tables + chunk * p->table_stride;
    const int64_t first = p->key_base[chunk] + tile * KEY_TILE, end = p->seq_lens[chunk];
    const int64_t index = (p->tile_offset[chunk] + kv_head * p->num_tiles[chunk] + tile) * tile_elements(p);
    if (dot) {
        uint32_t *keys = (uint32_t *)((uint16_t *)p->packed + index);
        uint16_t *values = (uint16_t *)p->packed + index + KEY_TILE * dim;
        for (int64_t n = 0; n < KEY_TILE; ++n) {
            const int64_t position = first + n;
            if (position >= end) {
                for (int64_t i = 0; i < dim / 2; ++i) keys[i * KEY_TILE + n] = 0;
                for (int64_t d = 0; d < dim; ++d) values[((n / 2) * dim + d) * 2 + (n & 1)] = 0;
                continue;
            }
            const int64_t row = (table[position / bs] * p->num_kv_heads + kv_head) * p->run_elements +
                                (position % bs) * dim;
            const uint32_t *key = (const uint32_t *)((const uint16_t *)p->k_cache + row);
            const uint16_t *value = (const uint16_t *)p->v_cache + row;
            for (int64_t i = 0; i < dim / 2; ++i) keys[i * KEY_TILE + n] = key[i];
            for (int64_t d = 0; d < dim; ++d) values[((n / 2) * dim + d) * 2 + (n & 1)] = value[d];
        }
        return;
    }
    float *keys = (float *)p->packed + index, *values = keys + KEY_TILE * dim;
    for (int64_t n = 0; n < KEY_TILE; ++n) {
        const int64_t position = first + n;
        if (position >= end) {
            for (int64_t d = 0; d < dim; ++d) keys[d * KEY_TILE + n] = values[n * dim + d] = 0.0f;
            continue;
        }
        const int64_t run = (table[position / bs] * p->num_kv_heads + kv_head) * p->run_elements;
        const int64_t row = run + (position % bs) * dim;
        float key_scale = 1.0f, value_scale = 1.0f;  /* folded away when unquantized */
        if (kv_quantized(format)) {
            const int64_t scale = run + bs * dim + (position % bs) * KV_SCALE_BYTES;
            key_scale = kv_row_scale((const char *)p->k_cache + scale, 0, format);
            value_scale = kv_row_scale((const char *)p->v_cache + scale, 0, format);
        }
        for (int64_t d = 0; d < dim; d += VEC) {
            const fvec key = load_kv(p->k_cache, row + d, format) * key_scale;
            for (int i = 0; i < VEC; ++i) keys[(d + i) * KEY_TILE + n] = key[i];
            vstore(values + n * dim + d, load_kv(p->v_cache, row + d, format) * value_scale);
        }
    }
}

/* Per-thread buffers of one work item, rows padded to ROW_MULTIPLE. */
typedef struct {
    /* [rows / QK_ROWS][head_dim / 2][QK_ROWS] bfloat16 pairs for dot, else [rows / QK_ROWS][head_dim][QK_ROWS]
     * float32: the QK_ROWS values one step of the score product broadcasts are adjacent, at fixed offsets. */
    void *queries;
    float *scores;   /* [rows][KEY_TILE] */
    void *weights;   /* [rows][KEY_TILE]: bfloat16 for dot, else float32 */
    float *acc;      /* [rows][head_dim] output accumulators */
    float *row_sum;  /* [rows][VEC]: per-lane partial sums, added up once at the end */
    float *row_max, *rescale;
    int64_t *position;
    float *product;  /* [4][16][16]: stored C tiles of the AMX path */
} Scratch;

/* Query rows per AMX tile (the tile path pads an item's rows to a multiple of it). */
#define AMX_ROW_BLOCK 16

#ifdef HAVE_AMX_BF16
#include "../../ops/csrc/amx_tiles.h"

/* ---- bfloat16 on AMX tiles ----
 * The packed tiles are already in the tiles' B layout: a key tile's rows are pairs of dims, 32 keys of 4 bytes
 * each (two 16-key B tiles side by side), a value tile's rows pairs of adjacent keys over head_dim. The queries
 * are copied row-major (A tiles of 16 rows), and the weights' [rows][KEY_TILE] bfloat16 rows are A tiles as
 * they are. Per 16 rows: scores C[16][32 keys] in tiles 0-1 (two row blocks at a time, the second in 6-7); per
 * 64 dims of the output, C[16][16] in tiles 0, 1, 6 and 7, then added into the float32 accumulators after their
 * rescale. */

static void amx_configure_prefill(void) {
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure(colsb);
}

/* The stored scores of 16 rows times score_scale. */
static ALWAYS_INLINE void amx_scale_scores(const Prefill *p, float *scores) {
    const fvec scale = splat(p->score_scale);
    for (int64_t i = 0; i < AMX_ROW_BLOCK * KEY_TILE; i += VEC) vstore(scores + i, vload(scores + i) * scale);
}

/* scores[row .. row + 16 * blocks)[0..KEY_TILE) = score_scale * q . key for one or two blocks of 16 rows, q from
 * the row-major copy: two blocks' four products per 32 dims (tiles 0-1 and 6-7) overlap. */
static ALWAYS_INLINE void amx_score_blocks(const Prefill *p, const Scratch *s, const uint16_t *q_rows,
                                           const uint16_t *keys, int64_t row, const int blocks) {
    const int64_t dim = p->head_dim;
    _tile_zero(0);
    _tile_zero(1);
    if (blocks == 2) {
        _tile_zero(6);
        _tile_zero(7);
    }
    for (int64_t d = 0; d < dim; d += 32) {
        _tile_loadd(3, keys + d * KEY_TILE, KEY_TILE * 4);
        _tile_loadd(4, keys + d * KEY_TILE + 2 * AMX_ROW_BLOCK, KEY_TILE * 4);
        _tile_loadd(2, q_rows + row * dim + d, dim * 2);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
        if (blocks == 2) {
            _tile_loadd(5, q_rows + (row + AMX_ROW_BLOCK) * dim + d, dim * 2);
            _tile_dpbf16ps(6, 5, 3);
            _tile_dpbf16ps(7, 5, 4);
        }
    }
    float *scores = s->scores + row * KEY_TILE;
    _tile_stored(0, scores, KEY_TILE * 4);
    _tile_stored(1, scores + AMX_ROW_BLOCK, KEY_TILE * 4);
    amx_scale_scores(p, scores);
    if (blocks == 2) {
        scores += AMX_ROW_BLOCK * KEY_TILE;
        _tile_stored(6, scores, KEY_TILE * 4);
        _tile_stored(7, scores + AMX_ROW_BLOCK, KEY_TILE * 4);
        amx_scale_scores(p, scores);
    }
}

/* acc[rows][d .. d + 16 * tiles) = acc * rescale + the products stored in `product` ([tiles][16][16]). */
static ALWAYS_INLINE void amx_add_products(const Prefill *p, const Scratch *s, int64_t row, int64_t d, int tiles,
                                           const float *product) {
    for (int r = 0; r < AMX_ROW_BLOCK; ++r) {
        float *out = s->acc + (row + r) * p->head_dim + d;
        const fvec rescale = splat(s->rescale[row + r]);
        for (int t = 0; t < tiles; ++t)
            vstore(out + 16 * t, vload(out + 16 * t) * rescale + vload(product + t * 256 + r * 16));
    }
}

/* acc[row .. row + 16) = acc * rescale + weights . values: 64 dims at a time in four output tiles (0, 1, 6, 7),
 * whose products overlap, then 32 where less is left. */
static ALWAYS_INLINE void amx_accumulate_block(const Prefill *p, const Scratch *s, const uint16_t *values,
                                               int64_t row, float *product) {
    const int64_t dim = p->head_dim, stride = dim * 4;
    _tile_loadd(2, (const uint16_t *)s->weights + row * KEY_TILE, KEY_TILE * 2);
    int64_t d = 0;
    for (; d + 64 <= dim; d += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(6);
        _tile_zero(7);
        _tile_loadd(3, values + 2 * d, stride);
        _tile_loadd(4, values + 2 * (d + 16), stride);
        _tile_loadd(5, values + 2 * (d + 32), stride);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
        _tile_dpbf16ps(6, 2, 5);
        _tile_loadd(3, values + 2 * (d + 48), stride);
        _tile_dpbf16ps(7, 2, 3);
        _tile_stored(0, product, 64);
        _tile_stored(1, product + 256, 64);
        _tile_stored(6, product + 512, 64);
        _tile_stored(7, product + 768, 64);
        amx_add_products(p, s, row, d, 4, product);
    }
    if (d < dim) {  /* 32 dims */
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(3, values + 2 * d, stride);
        _tile_loadd(4, values + 2 * (d + 16), stride);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
        _tile_stored(0, product, 64);
        _tile_stored(1, product + 256, 64);
        amx_add_products(p, s, row, d, 2, product);
    }
}
#endif

/* scores[row + r][0..KEY_TILE) = scale * log2(e) * q_row . key for QK_ROWS rows against one packed key tile. */
static ALWAYS_INLINE void score_rows(const Prefill *p, const Scratch *s, const void *keys, int64_t row,
                                     const int dot) {
    const int64_t dim = p->head_dim;
    fvec acc[QK_ROWS][2];
    (void)dot;
    for (int r = 0; r < QK_ROWS; ++r) acc[r][0] = acc[r][1] = splat(0.0f);
#ifdef HAVE_BF16_DOT
    if (dot) {
        const uint32_t *q = (const uint32_t *)s->queries + row * dim / 2;  /* row: a multiple of QK_ROWS */
        for (int64_t i = 0; i < dim / 2; ++i) {
            const uint16_t *k = (const uint16_t *)keys + i * KEY_TILE * 2;
            for (int r = 0; r < QK_ROWS; ++r) {
                acc[r][0] = dot_pairs_broadcast(acc[r][0], k, q + i * QK_ROWS + r);
                acc[r][1] = dot_pairs_broadcast(acc[r][1], k + 2 * VEC, q + i * QK_ROWS + r);
            }
        }
    } else
#endif
    {
        const float *q = (const float *)s->queries + row * dim;
        for (int64_t d = 0; d < dim; ++d) {
            const float *k = (const float *)keys + d * KEY_TILE;
            const fvec k0 = vload(k), k1 = vload(k + VEC);
            for (int r = 0; r < QK_ROWS; ++r) {
                const fvec x = splat(q[d * QK_ROWS + r]);
                acc[r][0] += x * k0;
                acc[r][1] += x * k1;
            }
        }
    }
    for (int r = 0; r < QK_ROWS; ++r) {
        vstore(s->scores + (row + r) * KEY_TILE, acc[r][0] * p->score_scale);
        vstore(s->scores + (row + r) * KEY_TILE + VEC, acc[r][1] * p->score_scale);
    }
}

/* acc[row + r][offset ..] = acc * rescale[row + r] + weights . values over one packed value tile, for
 * PV_ROWS rows and `vectors` vectors of head_dim from `offset`. */
static ALWAYS_INLINE void accumulate_rows(const Prefill *p, const Scratch *s, const void *values, int64_t row,
                                          int64_t offset, const int vectors, const int dot) {
    const int64_t dim = p->head_dim;
    fvec acc[PV_ROWS][PV_VECTORS];
    (void)dot;
    for (int r = 0; r < PV_ROWS; ++r)
        for (int c = 0; c < vectors; ++c) acc[r][c] = splat(0.0f);
#ifdef HAVE_BF16_DOT
    if (dot) {
        const uint32_t *w = (const uint32_t *)s->weights + row * KEY_TILE / 2;
        for (int64_t j = 0; j < KEY_TILE / 2; ++j) {
            const uint16_t *v = (const uint16_t *)values + (j * dim + offset) * 2;
            for (int r = 0; r < PV_ROWS; ++r)
                for (int c = 0; c < vectors; ++c)
                    acc[r][c] = dot_pairs_broadcast(acc[r][c], v + c * 2 * VEC, w + r * KEY_TILE / 2 + j);
        }
    } else
#endif
    {
        const float *w = (const float *)s->weights + row * KEY_TILE;
        for (int64_t j = 0; j < KEY_TILE; ++j) {
            fvec v[PV_VECTORS];
            for (int c = 0; c < vectors; ++c) v[c] = vload((const float *)values + j * dim + offset + c * VEC);
            for (int r = 0; r < PV_ROWS; ++r) {
                const fvec x = splat(w[r * KEY_TILE + j]);
                for (int c = 0; c < vectors; ++c) acc[r][c] += x * v[c];
            }
        }
    }
    for (int r = 0; r < PV_ROWS; ++r) {
        float *out = s->acc + (row + r) * dim + offset;
        const fvec rescale = splat(s->rescale[row + r]);
        for (int c = 0; c < vectors; ++c) vstore(out + c * VEC, vload(out + c * VEC) * rescale + acc[r][c]);
    }
}

/* The online softmax over one tile's scores of `rows` rows, keys from `first_key`: updates each row's
 * maximum and sum, sets the factor its accumulators are rescaled by and writes its weights. `masked`: some
 * key of the tile is outside some row's (window, causal) range. */
static ALWAYS_INLINE void softmax_tile(const Prefill *p, const Scratch *s, int64_t rows, int64_t first_key,
                                       const int masked, const int bf16, const int dot) {
    ivec lane;
    for (int i = 0; i < VEC; ++i) lane[i] = i;
    for (int64_t m = 0; m < rows; ++m) {
        fvec s0 = vload(s->scores + m * KEY_TILE), s1 = vload(s->scores + m * KEY_TILE + VEC);
        ivec visible0 = lane < VEC, visible1 = visible0;  /* all true */
        if (masked) {
            const int64_t last = s->position[m], first = first_visible(last, p->sliding_window);
            const ivec keys0 = lane + (int32_t)(first_key - first), keys1 = keys0 + VEC;
            const int32_t span = (int32_t)(last - first);
            /* first <= key <= last, as 0 <= key - first <= span */
            visible0 = (keys0 >= 0) & (keys0 <= span);
            visible1 = (keys1 >= 0) & (keys1 <= span);
            s0 = vselect(visible0, s0, splat(-INFINITY));
            s1 = vselect(visible1, s1, splat(-INFINITY));
        }
        const float tile_max = vmax_lanes(vselect(s0 > s1, s0, s1));
        const float old_max = s->row_max[m];
        float rescale = 1.0f, new_max = old_max;
        if (tile_max > old_max) {  /* a new maximum: what was summed so far shrinks by e^(old - new) */
            new_max = tile_max;
            rescale = old_max == -INFINITY ? 0.0f : softmax_exp(splat(old_max - new_max), bf16)[0];
            s->row_max[m] = new_max;
        }
        fvec e0 = splat(0.0f), e1 = splat(0.0f);
        if (new_max != -INFINITY) {  /* else no key seen yet: nothing to add */
            e0 = softmax_exp(s0 - new_max, bf16);
            e1 = softmax_exp(s1 - new_max, bf16);
            if (masked) {
                e0 = vselect(visible0, e0, splat(0.0f));
                e1 = vselect(visible1, e1, splat(0.0f));
            }
        }
        vstore(s->row_sum + m * VEC, vload(s->row_sum + m * VEC) * rescale + (e0 + e1));
        s->rescale[m] = rescale;
        if (dot) {
            store_any(s->weights, m * KEY_TILE, e0, 1);
            store_any(s->weights, m * KEY_TILE + VEC, e1, 1);
        } else {
            float *w = (float *)s->weights + m * KEY_TILE;
            vstore(w, bf16 ? round_bf16(e0) : e0);
            vstore(w + VEC, bf16 ? round_bf16(e1) : e1);
        }
    }
}

/* 1 / the softmax denominator of a row whose numerators sum to `total` relative to its maximum `row_max`, once
 * e^sink joins it (base 2 in bfloat16, where scores and row_max carry log2(e)). A sink above the maximum shrinks
 * the numerators by e^(row_max - sink), which the inverse then carries. */
static float sink_inverse(float total, float row_max, float sink, const int bf16) {
    if (bf16) sink *= 1.44269504088896341f;
    if (sink > row_max) {
        const float shrink = bf16 ? exp2f(row_max - sink) : expf(row_max - sink);
        return shrink / (total * shrink + 1.0f);
    }
    return 1.0f / (total + (bf16 ? exp2f(sink - row_max) : expf(sink - row_max)));
}

/* One work item: queries [q_first, q_first + q_count) of `chunk` with the heads sharing `kv_head`. q_bf16: q and
 * out are bfloat16; bf16: bfloat16 numerics (a bfloat16 cache). */
static ALWAYS_INLINE void attend_item(const Prefill *p, const Scratch *s, int64_t chunk, int64_t kv_head,
                                      int64_t q_first, int64_t q_count, const int q_bf16, const int bf16,
                                      const int dot, const int amx) {
    const int64_t dim = p->head_dim, group = p->num_heads / p->num_kv_heads;
    const int64_t num_computed = p->seq_lens[chunk] - p->query_lens[chunk];
    const int64_t multiple = amx ? AMX_ROW_BLOCK : ROW_MULTIPLE, rows = q_count * group;
    const int64_t padded = (rows + multiple - 1) / multiple * multiple;
    for (int64_t m = 0; m < padded; ++m) {
        /* Padding rows copy the last real row's position (they see its keys) and attend zeros. */
        const int64_t r = m < rows ? m / group : q_count - 1;
        s->position[m] = num_computed + q_first + r;
        s->row_max[m] = -INFINITY;
        vstore(s->row_sum + m * VEC, splat(0.0f));
        for (int64_t d = 0; d < dim; d += VEC) vstore(s->acc + m * dim + d, splat(0.0f));
        const int64_t element = (p->query_starts[chunk] + q_first + r) * p->q_token_stride +
                                (kv_head * group + m % group) * dim;
        const int64_t block = m / QK_ROWS * dim * QK_ROWS, lane = m % QK_ROWS;
        if (amx) {
            uint16_t *q_row = (uint16_t *)s->queries + m * dim;
            if (m < rows) memcpy(q_row, (const uint16_t *)p->q + element, sizeof(uint16_t) * dim);
            else memset(q_row, 0, sizeof(uint16_t) * dim);
        } else if (dot) {
            const uint32_t *pairs = (const uint32_t *)((const uint16_t *)p->q + element);
            for (int64_t i = 0; i < dim / 2; ++i)
                ((uint32_t *)s->queries)[block / 2 + i * QK_ROWS + lane] = m < rows ? pairs[i] : 0;
        } else {
            for (int64_t d = 0; d < dim; d += VEC) {
                const fvec x = m < rows ? load_any(p->q, element + d, q_bf16) : splat(0.0f);
                for (int i = 0; i < VEC; ++i) ((float *)s->queries)[block + (d + i) * QK_ROWS + lane] = x[i];
            }
        }
    }
    const int64_t low = num_computed + q_first, high = low + q_count - 1;  /* positions of the first, last query */
    const int64_t base = p->key_base[chunk], window = p->sliding_window;
    const int64_t first_tile = (first_visible(low, window) - base) / KEY_TILE, last_tile = (high - base) / KEY_TILE;
    const int64_t element_size = dot ? 2 : 4;
    for (int64_t tile = first_tile; tile <= last_tile; ++tile) {
        const int64_t first_key = base + tile * KEY_TILE, last_key = first_key + KEY_TILE - 1;
        const int64_t packed_tile = p->tile_offset[chunk] + kv_head * p->num_tiles[chunk] + tile;
        const char *keys = (const char *)p->packed + packed_tile * tile_elements(p) * element_size;
        const char *values = keys + KEY_TILE * dim * element_size;
#ifdef HAVE_AMX_BF16
        if (amx) {
            int64_t row = 0;
            for (; row + 2 * AMX_ROW_BLOCK <= padded; row += 2 * AMX_ROW_BLOCK)
                amx_score_blocks(p, s, (const uint16_t *)s->queries, (const uint16_t *)keys, row, 2);
            if (row < padded) amx_score_blocks(p, s, (const uint16_t *)s->queries, (const uint16_t *)keys, row, 1);
        } else
#endif
            for (int64_t row = 0; row < padded; row += QK_ROWS) score_rows(p, s, keys, row, dot);
        /* Every row sees the whole tile when its last key is at or before the first query and its first key
         * is inside the last query's window. */
        const int masked = last_key > low || first_key < first_visible(high, window);
        if (masked) softmax_tile(p, s, padded, first_key, 1, bf16, dot);  /* constant: no selects when unmasked */
        else softmax_tile(p, s, padded, first_key, 0, bf16, dot);
#ifdef HAVE_AMX_BF16
        if (amx) {
            for (int64_t row = 0; row < padded; row += AMX_ROW_BLOCK)
                amx_accumulate_block(p, s, (const uint16_t *)values, row, s->product);
            continue;
        }
#endif
        for (int64_t offset = 0; offset < dim;) {
            const int wide = dim - offset >= PV_VECTORS * VEC;
            for (int64_t row = 0; row < padded; row += PV_ROWS) {
                if (wide) accumulate_rows(p, s, values, row, offset, PV_VECTORS, dot);
                else accumulate_rows(p, s, values, row, offset, NARROW_VECTORS, dot);
            }
            offset += (wide ? PV_VECTORS : NARROW_VECTORS) * VEC;
        }
    }
    for (int64_t m = 0; m < rows; ++m) {
        const int64_t element = (p->query_starts[chunk] + q_first + m / group) * p->num_heads * dim +
                                (kv_head * group + m % group) * dim;
        const float total = vsum(vload(s->row_sum + m * VEC));
        const fvec inverse = splat(p->sinks == NULL ? 1.0f / total
                                                    : sink_inverse(total, s->row_max[m],
                                                                   p->sinks[kv_head * group + m % group], bf16));
        for (int64_t d = 0; d < dim; d += VEC)
            store_any(p->out, element + d, vload(s->acc + m * dim + d) * inverse, q_bf16);
    }
}

typedef struct {
    int64_t chunk, kv_head, q_first, q_count, cost;
} Item;

static int by_cost_descending(const void *a, const void *b) {
    const int64_t x = ((const Item *)a)->cost, y = ((const Item *)b)->cost;
    return (x < y) - (x > y);
}

/* Every tile of every (chunk, kv head), split among the threads of the enclosing parallel region. */
static void pack_all(const Prefill *p, int64_t total_tiles, int format, int dot) {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < total_tiles; ++g) {
        int64_t chunk = 0;
        while (g >= p->tile_offset[chunk + 1]) ++chunk;  /* tile_offset has num_chunks + 1 entries */
        const int64_t local = g - p->tile_offset[chunk], kv_head = local / p->num_tiles[chunk];
        const int64_t tile = local % p->num_tiles[chunk];
        if (dot) pack_tile(p, chunk, kv_head, tile, KV_BF16, 1);
        else if (format == KV_BF16) pack_tile(p, chunk, kv_head, tile, KV_BF16, 0);
        else if (format == KV_E4M3) pack_tile(p, chunk, kv_head, tile, KV_E4M3, 0);
        else if (format == KV_E5M2) pack_tile(p, chunk, kv_head, tile, KV_E5M2, 0);
        else if (format == KV_INT8) pack_tile(p, chunk, kv_head, tile, KV_INT8, 0);
        else pack_tile(p, chunk, kv_head, tile, KV_F32, 0);
    }
}

/* kv_format: kv_format.h's KV_* (not KV_F16); an unquantized cache has q's dtype, or is bfloat16 under float32
 * queries; sinks NULL or [num_heads].
 * use_amx: a bfloat16 cache takes the tiles where the build has them and the process may use them
 * (linear_bf16_amx_ready). Returns 1 if a buffer could not be allocated, 2 if head_dim is not a multiple of 32. */
int paged_prefill_attention(const void *q, int64_t q_token_stride, const void *k_cache, const void *v_cache,
                            int q_is_bf16, int kv_format, const int64_t *block_tables, int64_t table_stride,
                            const int64_t *query_starts, const int64_t *query_lens, const int64_t *seq_lens,
                            int64_t num_chunks, void *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, int64_t sliding_window, const float *sinks,
                            int use_amx) {
    if (head_dim % 32 != 0) return 2;
    /* bf16: the bfloat16 model's arithmetic, for bfloat16 queries on a bfloat16 cache. float32 queries on a
     * bfloat16 cache (kv_cache_dtype="bfloat16" under a float32 model) take the float32 path on float32 tiles
     * widened from the cache, as a quantized cache's are. */
    const int q_bf16 = q_is_bf16 != 0, bf16 = kv_format == KV_BF16 && q_bf16;
#ifdef HAVE_BF16_DOT
    const int dot = bf16;
#else
    const int dot = 0;
#endif
#ifdef HAVE_AMX_BF16
    const int amx = use_amx && dot && amx_ready();
#else
    const int amx = 0;
    (void)use_amx;
#endif
    const int64_t group = num_heads / num_kv_heads;
    const int64_t tile_queries = ROWS_PER_ITEM / group > 0 ? ROWS_PER_ITEM / group : 1;
    int64_t *per_chunk = malloc(sizeof(int64_t) * (3 * num_chunks + 1));
    int64_t num_items = 0;
    for (int64_t c = 0; c < num_chunks; ++c)
        num_items += (query_lens[c] + tile_queries - 1) / tile_queries * num_kv_heads;
    Item *items = malloc(sizeof(Item) * (num_items > 0 ? num_items : 1));
    if (per_chunk == NULL || items == NULL) {
        free(per_chunk);
        free(items);
        return 1;
    }
    Prefill p = {
        .q = q, .q_token_stride = q_token_stride, .k_cache = k_cache, .v_cache = v_cache,
        .block_tables = block_tables, .query_starts = query_starts, .query_lens = query_lens, .seq_lens = seq_lens,
        .table_stride = table_stride, .num_heads = num_heads, .num_kv_heads = num_kv_heads, .head_dim = head_dim,
        .block_size = block_size, .sliding_window = sliding_window, .out = out, .sinks = sinks,
        .run_elements = kv_run_elements(block_size, head_dim, kv_format),
        .score_scale = bf16 ? scale * 1.44269504088896341f : scale,
        .key_base = per_chunk, .num_tiles = per_chunk + num_chunks, .tile_offset = per_chunk + 2 * num_chunks,
    };
    /* tile_offset counts tiles of every kv head: chunk c's tiles are [tile_offset[c], tile_offset[c + 1]). */
    int64_t total_tiles = 0, n = 0, macs = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t num_computed = seq_lens[c] - query_lens[c];
        p.key_base[c] = first_visible(num_computed, sliding_window);
        p.num_tiles[c] = (seq_lens[c] - p.key_base[c] + KEY_TILE - 1) / KEY_TILE;
        p.tile_offset[c] = total_tiles;
        total_tiles += p.num_tiles[c] * num_kv_heads;
        for (int64_t first = 0; first < query_lens[c]; first += tile_queries) {
            const int64_t count = query_lens[c] - first < tile_queries ? query_lens[c] - first : tile_queries;
            const int64_t high = num_computed + first + count - 1;
            const int64_t keys = high + 1 - first_visible(num_computed + first, sliding_window);
            for (int64_t h = 0; h < num_kv_heads; ++h) items[n++] = (Item){c, h, first, count, count * keys};
            macs += count * keys * num_heads * head_dim * 2;
        }
    }
    p.tile_offset[num_chunks] = total_tiles;
    /* The costliest items first: with dynamic scheduling, the short ones fill in at the end. */
    qsort(items, num_items, sizeof(Item), by_cost_descending);
    p.packed = malloc((size_t)(total_tiles > 0 ? total_tiles : 1) * tile_elements(&p) * (dot ? 2 : 4));
    if (p.packed == NULL) {
        free(per_chunk);
        free(items);
        return 1;
    }
    /* Rows padded for either path: to ROW_MULTIPLE for the vector products, to AMX_ROW_BLOCK for the tiles. */
    const int64_t item_rows = tile_queries * group;
    const int64_t vector_rows = (item_rows + ROW_MULTIPLE - 1) / ROW_MULTIPLE * ROW_MULTIPLE;
    const int64_t tile_rows = (item_rows + AMX_ROW_BLOCK - 1) / AMX_ROW_BLOCK * AMX_ROW_BLOCK;
    const int64_t rows = vector_rows > tile_rows ? vector_rows : tile_rows;
    int failed = 0;
#pragma omp parallel if (macs >= PARALLEL_MIN_MACS)
    {
        pack_all(&p, total_tiles, kv_format, dot);  /* ends in the omp for's barrier */
        char *buffer = malloc(rows * (head_dim * 4 + KEY_TILE * 4 * 2 + head_dim * 4 + VEC * 4 + 2 * 4 + 8) +
                              4 * 256 * 4);
        if (buffer == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        Scratch s = {0};
        if (buffer != NULL) {
            s.queries = buffer;
            s.scores = (float *)(buffer + rows * head_dim * 4);
            s.weights = s.scores + rows * KEY_TILE;
            s.acc = (float *)s.weights + rows * KEY_TILE;
            s.row_sum = s.acc + rows * head_dim;
            s.row_max = s.row_sum + rows * VEC;
            s.rescale = s.row_max + rows;
            s.position = (int64_t *)(s.rescale + rows + (rows & 1));
            s.product = (float *)(s.position + rows);
        }
#ifdef HAVE_AMX_BF16
        if (amx) amx_configure_prefill();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; ++i) {
            if (buffer == NULL) continue;
            const Item it = items[i];
            if (amx) attend_item(&p, &s, it.chunk, it.kv_head, it.q_first, it.q_count, 1, 1, 1, 1);
            else if (dot) attend_item(&p, &s, it.chunk, it.kv_head, it.q_first, it.q_count, 1, 1, 1, 0);
            else if (bf16) attend_item(&p, &s, it.chunk, it.kv_head, it.q_first, it.q_count, 1, 1, 0, 0);
            else if (q_bf16) attend_item(&p, &s, it.chunk, it.kv_head, it.q_first, it.q_count, 1, 0, 0, 0);
            else attend_item(&p, &s, it.chunk, it.kv_head, it.q_first, it.q_count, 0, 0, 0, 0);
        }
#ifdef HAVE_AMX_BF16
        if (amx) _tile_release();
#endif
        free(buffer);
    }
    free(p.packed);
    free(per_chunk);
    free(items);
    return failed;
}
