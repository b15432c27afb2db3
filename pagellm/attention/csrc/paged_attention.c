/* Decode attention straight from the paged KV cache: no gathered copy of the keys and values.
 *
 * The torch path gathers every sequence's blocks into a padded [seqs, kv_heads, max_len, head_dim]
 * tensor and then runs SDPA over it, so each decode step reads the cache, writes a copy as large,
 * reads it again, and pays for padding up to the longest context. Here each (sequence, kv head) pair
 * reads its keys and values once, through the block table, for all the query heads that share them.
 *
 * Layouts (all contiguous):
 *   q, out        [num_seqs, num_heads, head_dim] float32
 *   k/v_cache     [num_blocks, num_kv_heads, block_size, head_dim]: one head of a block is contiguous;
 *                 float32, or bfloat16 (widened to float32 as it is loaded; all arithmetic is float32)
 *   block_tables  [num_seqs, table_stride] int64
 *   context_lens  [num_seqs] int64, each >= 1
 *   sliding_window  0, or W > 0: only keys at positions >= context_len - W are read; table entries wholly
 *                 before them may be holes (blocks given back to the pool) and are never dereferenced
 *
 * Built with OpenMP against the runtime torch already loaded (same soname), so the kernel shares
 * torch's thread pool and thread count instead of competing with it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"


/* Query heads that share a kv head are handled up to this many at a time, so that each key and value is
 * read once for all of them while their accumulators still fit in registers. */
#define MAX_HEADS_PER_PASS 4

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* Each block of one head is its own run of memory (4 KB at block_size 16, head_dim 64), often a page of
 * its own, and hardware prefetchers stop at page boundaries: ask for the next block while this one is used. */
static ALWAYS_INLINE void prefetch_run(const void *run, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)run + i, 0, 3);
}

/* Eight cache elements from `index` on, as float32. `bf16` is a constant after inlining: a bfloat16 is
 * the top half of a float32, so widening is a shift. */
static ALWAYS_INLINE f32x8 load_kv(const void *cache, int64_t index, const int bf16) {
    if (!bf16) return load8((const float *)cache + index);
    u16x8 raw;
    memcpy(&raw, (const uint16_t *)cache + index, sizeof raw);
    return (f32x8)(__builtin_convertvector(raw, i32x8) << 16);
}

static ALWAYS_INLINE const void *element(const void *cache, int64_t index, const int bf16) {
    return bf16 ? (const void *)((const uint16_t *)cache + index) : (const void *)((const float *)cache + index);
}

/* scores[h * context_len + i] = scale * q_h . key_i for the `count` keys of one block, starting at element
 * `keys` of the cache; `heads` is a constant after inlining, so the per-head loops unroll and the
 * accumulators stay in registers. */
static ALWAYS_INLINE void block_scores(const float *restrict q, const void *restrict k_cache, int64_t keys,
                                       int64_t count, int64_t head_dim, const int heads, const int bf16, float scale,
                                       float *restrict scores, int64_t context_len) {
    for (int64_t i = 0; i < count; ++i) {
        const int64_t key = keys + i * head_dim;
        f32x8 acc[MAX_HEADS_PER_PASS];
        for (int h = 0; h < heads; ++h) acc[h] = splat8(0.0f);
        for (int64_t d = 0; d < head_dim; d += 8) {
            const f32x8 k = load_kv(k_cache, key + d, bf16);
            for (int h = 0; h < heads; ++h) acc[h] += load8(q + h * head_dim + d) * k;
        }
        for (int h = 0; h < heads; ++h) scores[h * context_len + i] = sum8(acc[h]) * scale;
    }
}

/* Softmax numerators of row[0..n) in place (e^(x - max), max-subtracted like SDPA); returns 1 / their sum,
 * which the value pass applies once per output instead of once per score. */
static float softmax_numerators(float *restrict row, int64_t n) {
    f32x8 maxes = splat8(row[0]);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const f32x8 v = load8(row + t);
        const i32x8 greater = v > maxes;
        maxes = (f32x8)(((i32x8)v & greater) | ((i32x8)maxes & ~greater));
    }
    float max = maxes[0];
    for (int i = 1; i < 8; ++i) max = maxes[i] > max ? maxes[i] : max;
    for (; t < n; ++t) max = row[t] > max ? row[t] : max;
    f32x8 totals = splat8(0.0f);
    for (t = 0; t + 8 <= n; t += 8) {
        const f32x8 e = exp8_nonpositive(load8(row + t) - max);
        store8(row + t, e);
        totals += e;
    }
    float total = sum8(totals);
    if (t < n) {
        float tail[8];
        for (int i = 0; i < 8; ++i) tail[i] = t + i < n ? row[t + i] - max : -INFINITY;
        const f32x8 e = exp8_nonpositive(load8(tail));
        for (int i = 0; t + i < n; ++i) {
            row[t + i] = e[i];
            total += e[i];
        }
    }
    return 1.0f / total;
}

/* Floats of every head's output accumulated per pass over the values: 4 vectors x up to 4 heads fill the
 * registers, and two passes cover a 64-float head, each streaming half of every value row. */
#define PIECE_VECTORS 4
#define PIECE_FLOATS (8 * PIECE_VECTORS)

/* out[h][offset .. offset + PIECE_FLOATS) = inverse[h] * sum over keys t of weights[h][t] * value_t[same range]:
 * one piece of every head at a time, so each value line is read once for all heads. */
static ALWAYS_INLINE void piece_weighted_sum(const float *restrict weights, int64_t first_key, int64_t context_len,
                                             const void *restrict v_cache, const int64_t *restrict table,
                                             int64_t block_size, int64_t block_stride, int64_t head_offset,
                                             int64_t head_dim, int64_t offset, const int heads, const int bf16,
                                             const float *restrict inverse, float *restrict out) {
    f32x8 acc[MAX_HEADS_PER_PASS][PIECE_VECTORS];
    for (int h = 0; h < heads; ++h)
        for (int c = 0; c < PIECE_VECTORS; ++c) acc[h][c] = splat8(0.0f);
    for (int64_t start = first_key; start < context_len; start = (start / block_size + 1) * block_size) {
        const int64_t skip = start % block_size, next = start - skip + block_size;
        const int64_t block = table[start / block_size] * block_stride + head_offset + skip * head_dim + offset;
        const int64_t count = (context_len < next ? context_len : next) - start;
        if (offset == 0 && next < context_len)
            prefetch_run(element(v_cache, table[start / block_size + 1] * block_stride + head_offset, bf16),
                         block_size * head_dim * (bf16 ? 2 : 4));
        for (int64_t i = 0; i < count; ++i) {
            const int64_t value = block + i * head_dim;
            f32x8 v[PIECE_VECTORS];
            for (int c = 0; c < PIECE_VECTORS; ++c) v[c] = load_kv(v_cache, value + 8 * c, bf16);
            for (int h = 0; h < heads; ++h) {
                const f32x8 w = splat8(weights[h * context_len + start + i]);
                for (int c = 0; c < PIECE_VECTORS; ++c) acc[h][c] += w * v[c];
            }
        }
    }
    for (int h = 0; h < heads; ++h)
        for (int c = 0; c < PIECE_VECTORS; ++c) store8(out + h * head_dim + offset + 8 * c, acc[h][c] * inverse[h]);
}

/* Attention of `heads` (<= MAX_HEADS_PER_PASS) query heads over one kv head's keys first_key..context_len-1.
 * q and out are [heads][head_dim]; scores is [heads][context_len] (entries before first_key unused). */
static ALWAYS_INLINE void attend_heads(const float *restrict q, const void *restrict k_cache,
                                       const void *restrict v_cache, const int64_t *restrict table,
                                       int64_t first_key, int64_t context_len, int64_t block_size, int64_t block_stride,
                                       int64_t head_offset, int64_t head_dim, const int heads, const int bf16,
                                       float scale, float *restrict scores, float *restrict out) {
    for (int64_t start = first_key; start < context_len; start = (start / block_size + 1) * block_size) {
        const int64_t skip = start % block_size, next = start - skip + block_size;
        const int64_t keys = table[start / block_size] * block_stride + head_offset + skip * head_dim;
        const int64_t count = (context_len < next ? context_len : next) - start;
        if (next < context_len)
            prefetch_run(element(k_cache, table[start / block_size + 1] * block_stride + head_offset, bf16),
                         block_size * head_dim * (bf16 ? 2 : 4));
        block_scores(q, k_cache, keys, count, head_dim, heads, bf16, scale, scores + start, context_len);
    }
    float inverse[MAX_HEADS_PER_PASS];
    for (int h = 0; h < heads; ++h)
        inverse[h] = softmax_numerators(scores + h * context_len + first_key, context_len - first_key);
    for (int64_t offset = 0; offset < head_dim; offset += PIECE_FLOATS)
        piece_weighted_sum(scores, first_key, context_len, v_cache, table, block_size, block_stride, head_offset,
                           head_dim, offset, heads, bf16, inverse, out);
}

/* One (sequence, kv head): the `group` query heads that share it, head_dim a multiple of PIECE_FLOATS.
 * scores is [group][context_len]; out is [group][head_dim]. */
static void attend_one(const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
                       const int64_t *restrict table, int64_t first_key, int64_t context_len, int64_t kv_head,
                       int64_t group,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int bf16, float scale,
                       float *restrict scores, float *restrict out) {
    const int64_t block_stride = num_kv_heads * block_size * head_dim;
    const int64_t head_offset = kv_head * block_size * head_dim;
    for (int64_t first = 0; first < group; first += MAX_HEADS_PER_PASS) {
        const int64_t heads = group - first < MAX_HEADS_PER_PASS ? group - first : MAX_HEADS_PER_PASS;
        const float *hq = q + first * head_dim;
        float *hs = scores + first * context_len, *ho = out + first * head_dim;
        /* Constant head counts and cache types per call, so attend_heads specialises for each. */
#define ATTEND(HEADS, BF16)                                                                                  \
    attend_heads(hq, k_cache, v_cache, table, first_key, context_len, block_size, block_stride, head_offset, head_dim, \
                 HEADS, BF16, scale, hs, ho)
        switch (heads * 2 + (bf16 != 0)) {
        case 2: ATTEND(1, 0); break;
        case 3: ATTEND(1, 1); break;
        case 4: ATTEND(2, 0); break;
        case 5: ATTEND(2, 1); break;
        case 6: ATTEND(3, 0); break;
        case 7: ATTEND(3, 1); break;
        case 8: ATTEND(4, 0); break;
        default: ATTEND(4, 1); break;
        }
#undef ATTEND
    }
}

/* Returns 1 if a thread could not allocate its score buffer, 2 if head_dim is not a multiple of PIECE_FLOATS. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_is_bf16,
                           const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                           float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, int64_t sliding_window) {
    if (head_dim % PIECE_FLOATS != 0) return 2;
    const int64_t group = num_heads / num_kv_heads;
    int64_t max_context = 0;
    for (int64_t s = 0; s < num_seqs; ++s) max_context = context_lens[s] > max_context ? context_lens[s] : max_context;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * group * (max_context > 0 ? max_context : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* Longest sequences vary most in cost: dynamic scheduling keeps both threads busy. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * num_kv_heads; ++item) {
            if (scores == NULL) continue;
            const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
            const int64_t first_head = kv_head * group, context_len = context_lens[seq];
            const int64_t first_key =
                sliding_window > 0 && context_len > sliding_window ? context_len - sliding_window : 0;
            attend_one(q + (seq * num_heads + first_head) * head_dim, k_cache, v_cache,
                       block_tables + seq * table_stride, first_key, context_len, kv_head, group, num_kv_heads,
                       head_dim, block_size, kv_is_bf16, scale, scores,
                       out + (seq * num_heads + first_head) * head_dim);
        }
        free(scores);
    }
    return failed;
}
