/* Decode attention straight from the paged KV cache: no gathered copy of the keys and values.
 *
 * The torch path gathers every sequence's blocks into a padded [seqs, kv_heads, max_len, head_dim]
 * tensor and then runs SDPA over it, so each decode step reads the cache, writes a copy as large,
 * reads it again, and pays for padding up to the longest context. Here each (sequence, kv head) pair
 * reads its keys and values once, through the block table, for all the query heads that share them.
 *
 * Layouts (all contiguous):
 *   q, out        [num_seqs, num_heads, head_dim] float32, or bfloat16 (q widened on entry, out rounded to
 *                 nearest even once on store, as SDPA in bfloat16 does; all arithmetic is float32)
 *   k/v_cache     [num_blocks, num_kv_heads, block_size, head_dim]: one head of a block is contiguous;
 *                 float32, or bfloat16 (widened to float32 as it is loaded); or, in a quantized format, runs
 *                 of [block_size][head_dim] one-byte codes and block_size scales (kv_format.h), the codes
 *                 widened in registers, each key's scale folded into its score and each value's into its
 *                 softmax weight
 *   block_tables  [num_seqs, table_stride] int64
 *   context_lens  [num_seqs] int64, each >= 1
 *   sliding_window  0 for full attention; else a sequence of context_len L attends only the keys at
 *                 positions >= L - sliding_window, and block-table entries wholly before them are never read
 *                 (they may be freed holes)
 *   sinks         NULL, or [num_heads] float32: head h's softmax denominator also holds e^sinks[h] (gpt-oss's
 *                 attention sinks, which carry no value)
 *
 * Built with OpenMP against the runtime torch already loaded (same soname), so the kernel shares
 * torch's thread pool and thread count instead of competing with it.
 */
#include <stdlib.h>

#include "kv_format.h"


/* Query heads that share a kv head are handled up to this many at a time, so that each key and value is
 * read once for all of them while their accumulators still fit in registers. */
#define MAX_HEADS_PER_PASS 4

/* Each block of one head is its own run of memory (4 KB at block_size 16, head_dim 64 in float32), often a
 * page of its own, and hardware prefetchers stop at page boundaries: ask for blocks before they are used. */
static ALWAYS_INLINE void prefetch_run(const void *run, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)run + i, 0, 3);
}

static ALWAYS_INLINE const void *element(const void *cache, int64_t index, const int format) {
    return (const char *)cache + index * kv_element_bytes(format);
}

/* The keys a sequence attends, [first, context_len), walked block by block: `run` keys of the block holding
 * position `position`, starting at cache element `start` (its first key's first element). A (block, head) run
 * is run_elements long (its scales after its codes when quantized). */
typedef struct {
    const int64_t *table;
    int64_t first, context_len, block_size, block_stride, head_offset, head_dim, run_elements;
} KeyRange;

static ALWAYS_INLINE int64_t run_start(const KeyRange *keys, int64_t position) {
    return keys->table[position / keys->block_size] * keys->block_stride + keys->head_offset +
           (position % keys->block_size) * keys->head_dim;
}

/* Where the scale of the key at `position` is (quantized formats): after its run's codes. */
static ALWAYS_INLINE const void *scale_of(const KeyRange *keys, const void *cache, int64_t position) {
    return (const char *)cache + keys->table[position / keys->block_size] * keys->block_stride + keys->head_offset +
           keys->block_size * keys->head_dim + (position % keys->block_size) * KV_SCALE_BYTES;
}

/* Bytes to prefetch for `length` keys from `position`: their rows, and for a quantized run the rest of it,
 * where their scales are. */
static ALWAYS_INLINE int64_t rows_bytes(const KeyRange *keys, int64_t position, int64_t length, const int format) {
    if (!kv_quantized(format)) return length * keys->head_dim * kv_element_bytes(format);
    return keys->run_elements - (position % keys->block_size) * keys->head_dim;
}

static ALWAYS_INLINE int64_t run_length(const KeyRange *keys, int64_t position) {
    const int64_t to_block_end = keys->block_size - position % keys->block_size;
    return keys->context_len - position < to_block_end ? keys->context_len - position : to_block_end;
}

/* Prefetch the block `ahead` blocks after the one holding `position`, if the range reaches into it. */
static ALWAYS_INLINE void prefetch_block_ahead(const KeyRange *keys, const void *cache, int64_t position,
                                               int64_t ahead, const int format) {
    const int64_t target = (position / keys->block_size + ahead) * keys->block_size;
    if (target < keys->context_len)
        prefetch_run(element(cache, run_start(keys, target), format), keys->run_elements * kv_element_bytes(format));
}

/* Decode attention is bound by DRAM reads of blocks scattered over the pool, and one block ahead leaves too
 * few reads in flight to use the bandwidth: the key pass asks for the key block two ahead and for the value
 * block of the keys it is scoring, so that the value pass finds its blocks in L2 (`benchmarks/cpu_kernels.py
 * --layers 30` times the kernel over caches as large as a model's). */
#define KEY_PREFETCH_AHEAD 2

/* Runs of memory to bring into cache while one run of keys is scored: asked for a share at a time between
 * the heads' score passes, not all at once before them, because a burst of prefetches fills the core's miss
 * buffers and stalls it, so the loads that follow wait instead of computing while the reads are in flight. */
typedef struct {
    const char *runs[2];
    int64_t bytes[2];
} Prefetches;

static ALWAYS_INLINE void prefetch_share(const Prefetches *prefetches, int64_t share, int64_t lines_per_share) {
    for (int r = 0; r < 2; ++r) {
        if (prefetches->runs[r] == NULL) continue;
        const int64_t lines = (prefetches->bytes[r] + 63) / 64, end = (share + 1) * lines_per_share;
        for (int64_t line = share * lines_per_share; line < end && line < lines; ++line)
            __builtin_prefetch(prefetches->runs[r] + 64 * line, 0, 3);
    }
}

/* The lines per share that spread the longer of the two runs over `shares` (one division per run, where one
 * per share cost as much as the arithmetic between them on CPUs with a slow divider). */
static ALWAYS_INLINE int64_t lines_per_share(const Prefetches *prefetches, int64_t shares) {
    const int64_t bytes = prefetches->bytes[0] > prefetches->bytes[1] ? prefetches->bytes[0] : prefetches->bytes[1];
    return ((bytes + 63) / 64 + shares - 1) / shares;
}

/* scale * q . key for VEC keys, key i at element keys[i] of the cache, as one vector (lane i for key i): each
 * key's products are summed in its own accumulator and the VEC horizontal sums are done together (vsums),
 * where one sum per key and head took a third of the kernel's instructions. q16, where not NULL, is q in
 * bfloat16 (then the cache is bfloat16 too): with avx512_bf16, one VDPBF16PS multiplies 32 pairs and adds
 * them in float32, where widening the keys and multiplying in float32 takes five instructions per 16.
 * `scale` is per key (lane): the softmax scale, times the key's own scale in a quantized cache. */
static ALWAYS_INLINE fvec key_scores(const float *restrict q, const uint16_t *restrict q16,
                                     const void *restrict k_cache, const int64_t *keys, int64_t head_dim,
                                     const int format, fvec scale) {
    fvec acc[VEC];
    for (int i = 0; i < VEC; ++i) acc[i] = splat(0.0f);
#ifdef HAVE_BF16_DOT
    if (format == KV_BF16 && q16 != NULL) {
        for (int64_t d = 0; d < head_dim; d += 2 * VEC)
            for (int i = 0; i < VEC; ++i)
                acc[i] = dot_bf16_pairs(acc[i], q16 + d, (const uint16_t *)k_cache + keys[i] + d);
    } else
#endif
    {
        for (int64_t d = 0; d < head_dim; d += VEC) {
            const fvec qd = vload(q + d);
            for (int i = 0; i < VEC; ++i) acc[i] += qd * load_kv(k_cache, keys[i] + d, format);
        }
    }
    return vsums(acc) * scale;
}

/* scores[h * stride + i] = scale * q_h . key_i for the `count` keys of one run, starting at element `start`
 * of the cache (their scales at `scales` when quantized), VEC keys at a time; a last group of fewer repeats its
 * last key in the unused lanes, which are not stored. */
static ALWAYS_INLINE void run_scores(const float *restrict q, const uint16_t *restrict q16,
                                     const void *restrict k_cache, int64_t start, const void *scales, int64_t count,
                                     int64_t head_dim, const int heads, const int format, float scale,
                                     float *restrict scores, int64_t stride, const Prefetches *prefetches) {
    const int64_t per_share = lines_per_share(prefetches, (count + VEC - 1) / VEC * heads);
    for (int64_t first = 0; first < count; first += VEC) {
        const int64_t n = count - first < VEC ? count - first : VEC;
        int64_t keys[VEC];
        fvec scale_per_key = splat(scale);
        for (int i = 0; i < VEC; ++i) {
            keys[i] = start + (first + (i < n ? i : n - 1)) * head_dim;
            if (kv_quantized(format)) scale_per_key[i] = scale * kv_row_scale(scales, first + (i < n ? i : n - 1), format);
        }
        for (int h = 0; h < heads; ++h) {
            prefetch_share(prefetches, first / VEC * heads + h, per_share);
            const fvec s = key_scores(q + h * head_dim, q16 != NULL ? q16 + h * head_dim : NULL, k_cache, keys,
                                      head_dim, format, scale_per_key);
            if (n == VEC) vstore(scores + h * stride + first, s);
            else memcpy(scores + h * stride + first, &s, sizeof(float) * n);
        }
    }
}

/* Softmax numerators of row[0..n) in place (e^(x - max), max-subtracted like SDPA); returns 1 / their sum,
 * which the value pass applies once per output instead of once per score. With `sink` (not NULL), the maximum
 * and the sum take in that logit too. */
static float softmax_numerators(float *restrict row, int64_t n, const float *sink) {
    fvec maxes = splat(row[0]);
    int64_t t = 0;
    for (; t + VEC <= n; t += VEC) {
        const fvec v = vload(row + t);
        maxes = vselect(v > maxes, v, maxes);
    }
    float max = maxes[0];
    for (int i = 1; i < VEC; ++i) max = maxes[i] > max ? maxes[i] : max;
    for (; t < n; ++t) max = row[t] > max ? row[t] : max;
    if (sink != NULL && *sink > max) max = *sink;
    fvec totals = splat(0.0f);
    for (t = 0; t + VEC <= n; t += VEC) {
        const fvec e = exp_nonpositive(vload(row + t) - max);
        vstore(row + t, e);
        totals += e;
    }
    float total = vsum(totals);
    if (t < n) {
        float tail[VEC];
        for (int i = 0; i < VEC; ++i) tail[i] = t + i < n ? row[t + i] - max : -INFINITY;
        const fvec e = exp_nonpositive(vload(tail));
        for (int i = 0; t + i < n; ++i) {
            row[t + i] = e[i];
            total += e[i];
        }
    }
    if (sink != NULL) total += expf(*sink - max);
    return 1.0f / total;
}

/* The keys of the (sequence, kv head) this thread takes next, which it asks for while it sums the current
 * one's values: the key pass streams keys and values in from DRAM, and the value pass, whose values are then in
 * L2, would otherwise leave DRAM idle. NULL cache: no next item, or not in this pass. */
typedef struct {
    KeyRange keys;
    const void *k_cache;
} Upcoming;

/* Block `block` (counted from the first attended) of the upcoming item's keys, as a run to prefetch. */
static ALWAYS_INLINE Prefetches upcoming_key_block(const Upcoming *upcoming, int64_t block, const int format) {
    Prefetches run = {.runs = {NULL, NULL}, .bytes = {0, 0}};
    if (upcoming == NULL || upcoming->k_cache == NULL) return run;
    const KeyRange *keys = &upcoming->keys;
    int64_t position = (keys->first / keys->block_size + block) * keys->block_size;
    position = position > keys->first ? position : keys->first;
    if (position >= keys->context_len) return run;
    run.runs[0] = (const char *)element(upcoming->k_cache, run_start(keys, position), format);
    run.bytes[0] = rows_bytes(keys, position, run_length(keys, position), format);
    return run;
}

/* Floats of every head's output accumulated per pass over the values: up to 4 heads x 4 vectors of
 * accumulators fill the registers (16 of AVX2's 16 ymm; 16 of AVX-512's 32 zmm, leaving room for the value
 * vectors), so a 64-float head takes one pass with AVX-512 and two with AVX2, each streaming its part of every
 * value row. head_dim must be a multiple of PIECE_FLOATS; WIDE_PIECE_FLOATS is used while enough is left
 * (measured on a 2-core AMD EPYC, avx512f avx512_bf16, at 48 x 512 keys in bf16: 1.21 ms in one 64-float
 * pass, 1.33-1.39 in two). */
#define PIECE_FLOATS 32
#define WIDE_PIECE_FLOATS (VEC == 16 ? 64 : PIECE_FLOATS)
#define MAX_PIECE_VECTORS (WIDE_PIECE_FLOATS / VEC)

/* out[h][offset .. offset + vectors * VEC) = inverse[h] * sum over keys t of weights[h][t] * value_t[same
 * range]: one piece of every head at a time, so each value line is read once for all heads. */
static ALWAYS_INLINE void piece_weighted_sum(const float *restrict weights, const KeyRange *keys,
                                             const void *restrict v_cache, int64_t offset, const int vectors,
                                             const int heads, const int format, const float *restrict inverse,
                                             float *restrict out, const Upcoming *upcoming) {
    const int64_t count = keys->context_len - keys->first, head_dim = keys->head_dim;
    int64_t block = 0;
    fvec acc[MAX_HEADS_PER_PASS][MAX_PIECE_VECTORS];
    for (int h = 0; h < heads; ++h)
        for (int c = 0; c < vectors; ++c) acc[h][c] = splat(0.0f);
    for (int64_t position = keys->first; position < keys->context_len;) {
        const int64_t start = run_start(keys, position) + offset, length = run_length(keys, position);
        if (offset == 0) prefetch_block_ahead(keys, v_cache, position, 1, format);
        const Prefetches next_keys = upcoming_key_block(upcoming, block++, format);
        const int64_t per_share = lines_per_share(&next_keys, length);
        const float *w = weights + (position - keys->first);
        const void *scales = kv_quantized(format) ? scale_of(keys, v_cache, position) : NULL;
        for (int64_t i = 0; i < length; ++i) {
            prefetch_share(&next_keys, i, per_share);
            const int64_t value = start + i * head_dim;
            /* A quantized value row's scale multiplies its softmax weight: one product per row and head. */
            const float value_scale = kv_quantized(format) ? kv_row_scale(scales, i, format) : 1.0f;
            fvec v[MAX_PIECE_VECTORS];
            for (int c = 0; c < vectors; ++c) v[c] = load_kv(v_cache, value + VEC * c, format);
            for (int h = 0; h < heads; ++h) {
                const fvec weight = splat(w[h * count + i] * value_scale);
                for (int c = 0; c < vectors; ++c) acc[h][c] += weight * v[c];
            }
        }
        position += length;
    }
    for (int h = 0; h < heads; ++h)
        for (int c = 0; c < vectors; ++c) vstore(out + h * head_dim + offset + VEC * c, acc[h][c] * inverse[h]);
}

/* Attention of `heads` (<= MAX_HEADS_PER_PASS) query heads over one kv head's keys in `keys`.
 * q and out are [heads][head_dim] float32; scores is [heads][keys attended]; sinks NULL or [heads]. */
static ALWAYS_INLINE void attend_heads(const float *restrict q, const uint16_t *restrict q16,
                                       const void *restrict k_cache,
                                       const void *restrict v_cache, const KeyRange *keys, const int heads,
                                       const int format, float scale, float *restrict scores, float *restrict out,
                                       const Upcoming *upcoming, const float *sinks) {
    const int64_t count = keys->context_len - keys->first;
    for (int64_t ahead = 1; ahead < KEY_PREFETCH_AHEAD; ++ahead)
        prefetch_block_ahead(keys, k_cache, keys->first, ahead, format);
    for (int64_t position = keys->first; position < keys->context_len;) {
        const int64_t length = run_length(keys, position);
        const int64_t ahead = (position / keys->block_size + KEY_PREFETCH_AHEAD) * keys->block_size;
        const Prefetches prefetches = {
            .runs = {ahead < keys->context_len ? (const char *)element(k_cache, run_start(keys, ahead), format)
                                               : NULL,
                     (const char *)element(v_cache, run_start(keys, position), format)},
            .bytes = {keys->run_elements * kv_element_bytes(format), rows_bytes(keys, position, length, format)},
        };
        const void *scales = kv_quantized(format) ? scale_of(keys, k_cache, position) : NULL;
        run_scores(q, q16, k_cache, run_start(keys, position), scales, length, keys->head_dim, heads, format, scale,
                   scores + (position - keys->first), count, &prefetches);
        position += length;
    }
    float inverse[MAX_HEADS_PER_PASS];
    for (int h = 0; h < heads; ++h)
        inverse[h] = softmax_numerators(scores + h * count, count, sinks != NULL ? sinks + h : NULL);
    for (int64_t offset = 0; offset < keys->head_dim;) {
        const int wide = keys->head_dim - offset >= WIDE_PIECE_FLOATS;
        const Upcoming *next = offset == 0 ? upcoming : NULL;  /* the next item's keys are asked for once */
        if (wide)
            piece_weighted_sum(scores, keys, v_cache, offset, WIDE_PIECE_FLOATS / VEC, heads, format, inverse, out,
                               next);
        else
            piece_weighted_sum(scores, keys, v_cache, offset, PIECE_FLOATS / VEC, heads, format, inverse, out, next);
        offset += wide ? WIDE_PIECE_FLOATS : PIECE_FLOATS;
    }
}

/* One (sequence, kv head): the `group` query heads that share it, head_dim a multiple of PIECE_FLOATS.
 * q and out are [group][head_dim] float32; scores is [group][keys attended]; sinks NULL or [group]. */
static void attend_one(const float *restrict q, const uint16_t *restrict q16, const void *restrict k_cache,
                       const void *restrict v_cache, const KeyRange *keys, int64_t group, int format, float scale,
                       float *restrict scores, float *restrict out, const Upcoming *upcoming, const float *sinks) {
    const int64_t count = keys->context_len - keys->first;
    for (int64_t first = 0; first < group; first += MAX_HEADS_PER_PASS) {
        const int64_t heads = group - first < MAX_HEADS_PER_PASS ? group - first : MAX_HEADS_PER_PASS;
        const float *hq = q + first * keys->head_dim;
        const uint16_t *hq16 = q16 != NULL ? q16 + first * keys->head_dim : NULL;
        float *hs = scores + first * count, *ho = out + first * keys->head_dim;
        /* Constant head counts and cache types per call, so attend_heads specialises for each. */
        const Upcoming *next = first + MAX_HEADS_PER_PASS >= group ? upcoming : NULL;
        const float *hsinks = sinks != NULL ? sinks + first : NULL;
#define ATTEND(HEADS, FORMAT) \
    attend_heads(hq, hq16, k_cache, v_cache, keys, HEADS, FORMAT, scale, hs, ho, next, hsinks)
#define ATTEND_HEADS(FORMAT)                                                                                     \
    switch (heads) {                                                                                             \
    case 1: ATTEND(1, FORMAT); break;                                                                            \
    case 2: ATTEND(2, FORMAT); break;                                                                            \
    case 3: ATTEND(3, FORMAT); break;                                                                            \
    default: ATTEND(4, FORMAT); break;                                                                           \
    }
        switch (format) {
        case KV_F32: ATTEND_HEADS(KV_F32); break;
        case KV_BF16: ATTEND_HEADS(KV_BF16); break;
        case KV_E4M3: ATTEND_HEADS(KV_E4M3); break;
        case KV_E5M2: ATTEND_HEADS(KV_E5M2); break;
        default: ATTEND_HEADS(KV_INT8); break;
        }
#undef ATTEND_HEADS
#undef ATTEND
    }
}

#ifdef HAVE_AMX_BF16
#include "../../ops/csrc/amx_tiles.h"

/* ---- bfloat16 queries over a bfloat16 cache on AMX tiles ----
 *
 * On a core whose vector unit retires one 16-float multiply-add per cycle, the loops above spend tens of cycles
 * per key for a few heads, longer than memory takes to deliver the key (README, "On a CPU with AMX"). The tiles
 * take the same products in bulk:
 *   scores: C[16 keys][16 heads] += K[16 keys][32 d] . Q[32 d][16 heads], the keys' tile read straight from
 *           the cache (a block's 16 rows of one head are 16 rows of head_dim bfloat16, one after the other) and
 *           the queries in the B tile's pair layout, zero columns for absent heads;
 *   values: O[heads][16 d] += P[heads][32 keys] . V[32 keys][16 d], the softmax numerators rounded to bfloat16
 *           (as SDPA's bfloat16 kernel rounds them) and the values moved into pair layout on the way: rows 2r and
 *           2r+1 interleaved by VPUNPCKL/HWD, whose lanes order the output columns as `unpermute` undoes.
 * Needs block_size a multiple of 16 (a tile's keys lie in one block) and head_dim a multiple of 32. */
#define AMX_KEYS 16         /* keys per score tile */
#define AMX_VALUE_KEYS 32   /* keys per value product (16 pairs) */
#define AMX_HEADS 16        /* query heads per pass: the score tile's columns */
#define AMX_OUT_FLOATS 64   /* output floats per pass over the values: four 16-float tiles */
#define AMX_MAX_ITEM_ROWS (16 * AMX_HEADS)  /* query heads of one item at most (its softmax inverses) */

typedef struct {
    float *scores;          /* [rows][stride]: scores, then softmax numerators */
    uint16_t *weights;      /* [rows][stride]: the numerators in bfloat16, zero outside the keys attended */
    uint16_t *q_pairs;      /* [kv heads][head_dim / 32][16 pairs][AMX_HEADS][2]: the B tiles of the queries */
    uint16_t *value_pairs;  /* [4][16 pairs][16 d][2]: the B tiles of 32 values */
    float *tile_out;        /* [4][16][16]: stored C tiles */
    float *out;             /* [out rows][head_dim]: the item's outputs */
    int64_t stride;         /* keys per row of scores and weights, a multiple of AMX_VALUE_KEYS */
} AmxScratch;

/* Keys per row of the scores of items attending up to max_keys keys: the first tile starts at the 16-aligned
 * position before the first key (up to 15 more keys), and the value products take whole 32-key steps. */
static int64_t amx_stride(int64_t max_keys) {
    return (max_keys + AMX_KEYS - 1 + AMX_VALUE_KEYS - 1) / AMX_VALUE_KEYS * AMX_VALUE_KEYS;
}

/* Scratch for items of up to `kv_heads` kv heads of `heads` query heads each, attending up to max_keys keys, and
 * writing `out_rows` rows of output. */
static int amx_scratch_alloc(AmxScratch *scratch, int64_t max_keys, int64_t head_dim, int64_t kv_heads,
                             int64_t heads, int64_t out_rows) {
    const int64_t stride = amx_stride(max_keys);
    const size_t rows = (size_t)(kv_heads * heads), q_halves = (size_t)(kv_heads * head_dim / 32 * 512);
    const size_t floats = rows * stride + 4 * 256 + (size_t)(out_rows * head_dim);
    const size_t halves = rows * stride + q_halves + 4 * 512;
    char *memory = aligned_alloc(64, (sizeof(float) * floats + sizeof(uint16_t) * halves + 63) / 64 * 64);
    if (memory == NULL) return 1;
    scratch->tile_out = (float *)memory;
    scratch->scores = scratch->tile_out + 4 * 256;
    scratch->out = scratch->scores + rows * stride;
    scratch->value_pairs = (uint16_t *)(scratch->out + out_rows * head_dim);
    scratch->q_pairs = scratch->value_pairs + 4 * 512;
    scratch->weights = scratch->q_pairs + q_halves;
    scratch->stride = stride;
    return 0;
}

static void amx_configure_scores(void) {
    const uint8_t rows[8] = {16, 16, 16};
    const uint16_t colsb[8] = {64, 64, 64};
    amx_configure_shapes(rows, colsb);
}

/* Tiles 0-3: output columns; 4: the weights; 5: values. */
static void amx_configure_values(int heads) {
    const uint8_t rows[8] = {heads, heads, heads, heads, heads, 16};
    const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64};
    amx_configure_shapes(rows, colsb);
}

/* q's `heads` rows (bfloat16) in the B tiles' layout: pair r of tile k, column h = q[h][32k + 2r .. + 1]. */
static void pair_queries(const uint16_t *q16, int heads, int64_t head_dim, uint16_t *restrict q_pairs) {
    memset(q_pairs, 0, sizeof(uint16_t) * head_dim / 32 * 512);
    for (int h = 0; h < heads; ++h)
        for (int64_t d = 0; d < head_dim; d += 2) {
            uint16_t *pair = q_pairs + d / 32 * 512 + (d % 32) / 2 * 32 + 2 * h;
            pair[0] = q16[h * head_dim + d];
            pair[1] = q16[h * head_dim + d + 1];
        }
}

/* An item's keys and values: `kv_heads` kv heads from the one `keys` names, whose runs follow each other in every
 * block (a whole sequence, when it takes all its kv heads, reads each block's keys as one run of memory). */
typedef struct {
    KeyRange keys;
    int kv_heads;
} AmxItem;

/* The runs of the item's kv heads in the block `ahead` blocks after the one holding `position`, if the item
 * reaches into it: one span of memory. */
static ALWAYS_INLINE void prefetch_item_block(const AmxItem *item, const uint16_t *cache, int64_t position,
                                              int64_t ahead) {
    const KeyRange *keys = &item->keys;
    const int64_t target = (position / keys->block_size + ahead) * keys->block_size;
    if (target < keys->context_len)
        prefetch_run(cache + keys->table[target / keys->block_size] * keys->block_stride + keys->head_offset,
                     item->kv_heads * keys->run_elements * 2);
}

/* scores[j * heads + h][i] = scale * q_jh . key_j(base + i) for the keys attended, kv head j of the item; the
 * 16-key chunks from `base`, each chunk's kv heads one after the other. */
static void amx_scores(const uint16_t *k_cache, const AmxItem *item, int64_t base, int heads, float scale,
                       const AmxScratch *scratch) {
    const KeyRange *keys = &item->keys;
    const int64_t head_dim = keys->head_dim, q_tiles = head_dim / 32 * 512;
    const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224,
                                           240);
    for (int64_t ahead = 1; ahead < KEY_PREFETCH_AHEAD; ++ahead) prefetch_item_block(item, k_cache, base, ahead);
    for (int64_t position = base; position < keys->context_len; position += AMX_KEYS) {
        /* Keys a block or two ahead; not the values, which the value pass's loads stream in as fast (prefetching
         * them here measured slower over scattered blocks and no faster over blocks in order: README). */
        if (position % keys->block_size == 0) prefetch_item_block(item, k_cache, position, KEY_PREFETCH_AHEAD);
        for (int j = 0; j < item->kv_heads; ++j) {
            const uint16_t *chunk = k_cache + run_start(keys, position) + j * keys->run_elements;
            _tile_zero(0);
            for (int64_t d = 0; d < head_dim; d += 32) {
                _tile_loadd(1, chunk + d, head_dim * 2);
                _tile_loadd(2, scratch->q_pairs + j * q_tiles + d / 32 * 512, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, scratch->tile_out, 64);
            for (int h = 0; h < heads; ++h) {
                const __m512 column = _mm512_i32gather_ps(_mm512_add_epi32(rows, _mm512_set1_epi32(h)),
                                                          scratch->tile_out, 4);
                _mm512_storeu_ps(scratch->scores + (j * heads + h) * scratch->stride + (position - base),
                                 _mm512_mul_ps(column, _mm512_set1_ps(scale)));
            }
        }
    }
}

/* Rows a, b (32 bfloat16 each, or zeros where NULL) into row `pair` of the value tiles `tile` and `tile` + 1. */
static ALWAYS_INLINE void pair_values(const uint16_t *a, const uint16_t *b, uint16_t *value_pairs, int tile,
                                      int pair) {
    const __m512i x = a != NULL ? _mm512_loadu_si512(a) : _mm512_setzero_si512();
    const __m512i y = b != NULL ? _mm512_loadu_si512(b) : _mm512_setzero_si512();
    _mm512_store_si512(value_pairs + tile * 512 + pair * 32, _mm512_unpacklo_epi16(x, y));
    _mm512_store_si512(value_pairs + (tile + 1) * 512 + pair * 32, _mm512_unpackhi_epi16(x, y));
}

/* The value tiles of keys [position, position + 32) and output floats [offset, offset + width): a key outside
 * [first, context_len) is a zero row (its cache slot may hold anything, NaN included, and 0 * NaN is NaN). */
static void pack_values(const uint16_t *v_cache, const KeyRange *keys, int64_t position, int64_t offset,
                        int width, uint16_t *value_pairs) {
    for (int half = 0; half < 2; ++half) {
        const int64_t run = position + half * AMX_KEYS;
        const uint16_t *rows = run < keys->context_len ? v_cache + run_start(keys, run) + offset : NULL;
        for (int r = 0; r < AMX_KEYS / 2; ++r) {
            const int64_t a = run + 2 * r, b = a + 1;
            const uint16_t *row_a = rows != NULL && a >= keys->first && a < keys->context_len ? rows + 2 * r * keys->head_dim : NULL;
            const uint16_t *row_b = rows != NULL && b >= keys->first && b < keys->context_len ? rows + (2 * r + 1) * keys->head_dim : NULL;
            for (int s = 0; s < width / 32; ++s)
                pair_values(row_a != NULL ? row_a + 32 * s : NULL, row_b != NULL ? row_b + 32 * s : NULL,
                            value_pairs, 2 * s, half * (AMX_KEYS / 2) + r);
        }
    }
}

/* Output tiles 2s (unpacklo) and 2s + 1 (unpackhi), row h, back in d order: 128-bit lane L of an unpack holds
 * d 8L .. 8L + 3 (lo) or 8L + 4 .. 8L + 7 (hi) of its 32. */
static ALWAYS_INLINE void unpermute(const float *lo, const float *hi, float inverse, float *out) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 a = _mm512_loadu_ps(lo), b = _mm512_loadu_ps(hi), scale = _mm512_set1_ps(inverse);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_permutex2var_ps(a, first, b), scale));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_permutex2var_ps(a, second, b), scale));
}

/* out[h][offset .. + width) = inverse[h] * sum over keys of weight . value, width 32 or 64, for one kv head's
 * `keys` and its heads' rows of `weights`. While it sums, it asks for the `upcoming` item's key blocks, one per 32
 * keys, so that the next score pass does not start on keys still in memory. */
static void amx_values(const uint16_t *v_cache, const KeyRange *keys, int64_t base, int heads, int64_t offset,
                       int width, const float *inverse, const uint16_t *weights, const AmxScratch *scratch,
                       float *out, const AmxItem *upcoming, const uint16_t *k_cache) {
    amx_zero_block();
    int64_t block = 0;
    for (int64_t position = base; position < keys->context_len; position += AMX_VALUE_KEYS) {
        if (upcoming != NULL) {
            const int64_t first = upcoming->keys.first - upcoming->keys.first % upcoming->keys.block_size;
            prefetch_item_block(upcoming, k_cache, first, block++);
        }
        pack_values(v_cache, keys, position, offset, width, scratch->value_pairs);
        _tile_loadd(4, weights + (position - base), scratch->stride * 2);
        _tile_loadd(5, scratch->value_pairs, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, scratch->value_pairs + 512, 64);
        _tile_dpbf16ps(1, 4, 5);
        if (width == 64) {
            _tile_loadd(5, scratch->value_pairs + 2 * 512, 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(5, scratch->value_pairs + 3 * 512, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    float *tiles = scratch->tile_out;
    _tile_stored(0, tiles, 64);
    _tile_stored(1, tiles + 256, 64);
    if (width == 64) {
        _tile_stored(2, tiles + 512, 64);
        _tile_stored(3, tiles + 768, 64);
    }
    for (int h = 0; h < heads; ++h)
        for (int s = 0; s < width / 32; ++s)
            unpermute(tiles + 2 * s * 256 + 16 * h, tiles + (2 * s + 1) * 256 + 16 * h, inverse[h],
                      out + h * keys->head_dim + offset + 32 * s);
}

/* Attention of the item's kv heads, `heads` (<= AMX_HEADS) bfloat16 query heads each, over their bfloat16 keys.
 * q16 [kv heads][q_stride] bfloat16, kv head j's heads at q16 + j * q_stride; out likewise, float32; sinks NULL
 * or laid out as q's rows. */
static void amx_attend(const uint16_t *q16, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                       const AmxItem *item, int heads, float scale, const AmxScratch *scratch, float *out,
                       const AmxItem *upcoming, const float *sinks) {
    const KeyRange *keys = &item->keys;
    const int64_t head_dim = keys->head_dim, stride = scratch->stride;
    const int64_t base = keys->first - keys->first % AMX_KEYS;
    const int64_t skipped = keys->first - base, count = keys->context_len - keys->first;
    const int64_t padded = (keys->context_len - base + AMX_VALUE_KEYS - 1) / AMX_VALUE_KEYS * AMX_VALUE_KEYS;
    for (int j = 0; j < item->kv_heads; ++j)
        pair_queries(q16 + j * q_stride, heads, head_dim, scratch->q_pairs + j * (head_dim / 32 * 512));
    amx_configure_scores();
    amx_scores(k_cache, item, base, heads, scale, scratch);
    float inverse[AMX_MAX_ITEM_ROWS];
    for (int j = 0; j < item->kv_heads; ++j)
        for (int h = 0; h < heads; ++h) {
            const int64_t r = j * heads + h;
            float *row = scratch->scores + r * stride;
            const float *sink = sinks != NULL ? sinks + j * q_stride / head_dim + h : NULL;
            inverse[r] = softmax_numerators(row + skipped, count, sink);
            for (int64_t i = 0; i < skipped; ++i) row[i] = 0.0f;
            for (int64_t i = skipped + count; i < padded; ++i) row[i] = 0.0f;
            uint16_t *weights = scratch->weights + r * stride;
            for (int64_t i = 0; i < padded; i += VEC) {
                const hvec bits = to_bf16_bits(vload(row + i));
                memcpy(weights + i, &bits, sizeof bits);
            }
        }
    amx_configure_values(heads);
    for (int j = 0; j < item->kv_heads; ++j) {
        KeyRange head_keys = *keys;
        head_keys.head_offset += j * keys->run_elements;
        for (int64_t offset = 0; offset < head_dim; offset += AMX_OUT_FLOATS) {
            const int width = head_dim - offset >= AMX_OUT_FLOATS ? AMX_OUT_FLOATS : 32;
            const int last = j == item->kv_heads - 1 && offset == 0;
            amx_values(v_cache, &head_keys, base, heads, offset, width, inverse + j * heads,
                       scratch->weights + j * heads * stride, scratch, out + j * q_stride, last ? upcoming : NULL,
                       k_cache);
        }
    }
}
#endif

/* n floats from a float32 or bfloat16 array (n a multiple of VEC), and back. */
static void widen(const void *from, float *to, int64_t n, int bf16) {
    for (int64_t i = 0; i < n; i += VEC) vstore(to + i, bf16 ? load_any(from, i, 1) : load_any(from, i, 0));
}

static void narrow(const float *from, void *to, int64_t n, int bf16) {
    for (int64_t i = 0; i < n; i += VEC) {
        if (bf16) store_any(to, i, vload(from + i), 1);
        else store_any(to, i, vload(from + i), 0);
    }
}

/* The first key position a sequence of context_len attends. */
static int64_t first_key(int64_t context_len, int64_t sliding_window) {
    return sliding_window > 0 && context_len > sliding_window ? context_len - sliding_window : 0;
}

/* The keys of work item `item`: (sequence item / num_kv_heads, kv head item % num_kv_heads). */
static KeyRange key_range(int64_t item, const int64_t *block_tables, int64_t table_stride,
                          const int64_t *context_lens, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                          int64_t sliding_window, int format) {
    const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
    const int64_t run = kv_run_elements(block_size, head_dim, format);
    const KeyRange keys = {
        .table = block_tables + seq * table_stride,
        .first = first_key(context_lens[seq], sliding_window),
        .context_len = context_lens[seq],
        .block_size = block_size,
        .block_stride = num_kv_heads * run,
        .head_offset = kv_head * run,
        .head_dim = head_dim,
        .run_elements = run,
    };
    return keys;
}

#ifdef HAVE_AMX_BF16
/* A whole sequence is one item on the tiles (all its kv heads, each block's keys read as one run) where its
 * scores fit this many bytes per thread; else an item is one kv head, its query heads AMX_HEADS at a time. */
#define AMX_SEQUENCE_SCRATCH_BYTES (64 << 20)

static int amx_items_are_sequences(int64_t group, int64_t num_heads, int64_t max_keys) {
    return group <= AMX_HEADS && num_heads <= AMX_MAX_ITEM_ROWS &&
           num_heads * amx_stride(max_keys) * (int64_t)(sizeof(float) + sizeof(uint16_t)) <=
               AMX_SEQUENCE_SCRATCH_BYTES;
}

/* The keys of item `item` on the tiles: sequence `item` (all kv heads), or (sequence, kv head) = (item / kv heads,
 * item % kv heads). */
static AmxItem amx_item(int64_t item, int sequences, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *context_lens, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                        int64_t sliding_window) {
    const AmxItem result = {
        .keys = key_range(sequences ? item * num_kv_heads : item, block_tables, table_stride, context_lens,
                          num_kv_heads, block_size, head_dim, sliding_window, KV_BF16),
        .kv_heads = sequences ? (int)num_kv_heads : 1,
    };
    return result;
}

/* Item `item` of paged_decode_attention's arguments on the tiles; `next` (if < num_items) is the item this thread
 * takes after it, whose first blocks it asks for. */
static void amx_run_item(int64_t item, int64_t next, int64_t num_items, int sequences, const uint16_t *q,
                         const void *k_cache, const void *v_cache, const int64_t *block_tables, int64_t table_stride,
                         const int64_t *context_lens, uint16_t *out, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, int64_t sliding_window,
                         const float *sinks, const AmxScratch *scratch) {
    const int64_t group = num_heads / num_kv_heads;
    const AmxItem current = amx_item(item, sequences, block_tables, table_stride, context_lens, num_kv_heads,
                                     block_size, head_dim, sliding_window);
    AmxItem upcoming;
    if (next < num_items)
        upcoming = amx_item(next, sequences, block_tables, table_stride, context_lens, num_kv_heads, block_size,
                            head_dim, sliding_window);
    const AmxItem *ahead = next < num_items ? &upcoming : NULL;
    /* Its first query row: every head of a sequence, or the group of one kv head (items are seq * kv heads + j). */
    const int64_t first_row = sequences ? item * num_heads : item * group, rows = sequences ? num_heads : group;
    const float *item_sinks = sinks != NULL ? sinks + first_row % num_heads : NULL;
    if (sequences) {  /* group <= AMX_HEADS */
        amx_attend(q + first_row * head_dim, group * head_dim, k_cache, v_cache, &current, (int)group, scale, scratch,
                   scratch->out, ahead, item_sinks);
    } else {
        for (int64_t first = 0; first < group; first += AMX_HEADS) {
            const int heads = group - first < AMX_HEADS ? (int)(group - first) : AMX_HEADS;
            amx_attend(q + (first_row + first) * head_dim, 0, k_cache, v_cache, &current, heads, scale, scratch,
                       scratch->out + first * head_dim, first + AMX_HEADS >= group ? ahead : NULL,
                       item_sinks != NULL ? item_sinks + first : NULL);
        }
    }
    narrow(scratch->out, out + first_row * head_dim, rows * head_dim, 1);
}
#endif

/* kv_format: kv_format.h's KV_* (not KV_F16); sinks NULL or [num_heads]. use_amx: take the tiles where this build
 * has them, the process may use them (linear_bf16_amx_ready), q and the cache are bfloat16 and block_size is a
 * multiple of 16. Returns 1 if a thread could not allocate its buffers, 2 if head_dim is not a multiple of
 * PIECE_FLOATS. */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, int kv_format, int q_is_bf16,
                           const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                           void *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, int64_t sliding_window,
                           const float *sinks, int use_amx) {
    if (head_dim % PIECE_FLOATS != 0) return 2;
#ifdef HAVE_AMX_BF16
    use_amx = use_amx && q_is_bf16 && kv_format == KV_BF16 && block_size % AMX_KEYS == 0 && amx_ready();
#else
    use_amx = 0;
#endif
    const int64_t group = num_heads / num_kv_heads;
    int64_t max_keys = 1;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t keys = context_lens[s] - first_key(context_lens[s], sliding_window);
        max_keys = keys > max_keys ? keys : max_keys;
    }
    int failed = 0;
#ifdef HAVE_AMX_BF16
    const int amx_sequences = use_amx && amx_items_are_sequences(group, num_heads, max_keys);
#else
    const int amx_sequences = 0;
#endif
    const int64_t num_items = amx_sequences ? num_seqs : num_seqs * num_kv_heads;
    int64_t taken = 0;
#pragma omp parallel
    {
        /* Per thread: the scores of one group of heads, and its queries and outputs in float32 (on the tiles, their
         * own scratch instead). */
        float *scores = use_amx ? NULL : malloc(sizeof(float) * group * (max_keys + 2 * head_dim));
#ifdef HAVE_AMX_BF16
        AmxScratch amx_scratch = {0};
        const int no_scratch = use_amx ? amx_scratch_alloc(&amx_scratch, max_keys, head_dim,
                                                           amx_sequences ? num_kv_heads : 1,
                                                           amx_sequences || group < AMX_HEADS ? group : AMX_HEADS,
                                                           amx_sequences ? num_heads : group)
                                       : scores == NULL;
#else
        const int no_scratch = scores == NULL;
#endif
        if (no_scratch) {
#pragma omp atomic write
            failed = 1;
        }
        /* Items are taken one at a time (the longest sequences vary most in cost), and each thread takes its
         * next item when it starts the current one, so that it can ask for the next one's keys meanwhile. */
        int64_t next;
#pragma omp atomic capture
        next = taken++;
        while (next < num_items) {
            const int64_t item = next;
#pragma omp atomic capture
            next = taken++;
            if (no_scratch) continue;
#ifdef HAVE_AMX_BF16
            if (use_amx) {
                amx_run_item(item, next, num_items, amx_sequences, q, k_cache, v_cache, block_tables, table_stride,
                             context_lens, out, num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window,
                             sinks, &amx_scratch);
                continue;
            }
#endif
            float *q32 = scores + group * max_keys, *out32 = q32 + group * head_dim;
            const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
            const KeyRange keys = key_range(item, block_tables, table_stride, context_lens, num_kv_heads, block_size,
                                            head_dim, sliding_window, kv_format);
            const Upcoming upcoming = {
                .keys = next < num_items ? key_range(next, block_tables, table_stride, context_lens, num_kv_heads,
                                                     block_size, head_dim, sliding_window, kv_format) : keys,
                .k_cache = next < num_items ? k_cache : NULL,
            };
            const int64_t first_element = (seq * num_heads + kv_head * group) * head_dim;
            const int q_format = q_is_bf16 ? KV_BF16 : KV_F32;
            widen(element(q, first_element, q_format), q32, group * head_dim, q_is_bf16);
            const uint16_t *q16 = q_is_bf16 && kv_format == KV_BF16 ? (const uint16_t *)q + first_element : NULL;
            attend_one(q32, q16, k_cache, v_cache, &keys, group, kv_format, scale, scores, out32, &upcoming,
                       sinks != NULL ? sinks + kv_head * group : NULL);
            narrow(out32, (void *)element(out, first_element, q_format), group * head_dim, q_is_bf16);
        }
        free(scores);
#ifdef HAVE_AMX_BF16
        free(amx_scratch.tile_out);
        if (use_amx) _tile_release();
#endif
    }
    return failed;
}
