/* Each row's `count` largest logits, in the order a stable descending sort of the whole row gives them (by value,
 * then the lower token id first): the candidates of the sampler's top-k and top-p filters and its most likely
 * tokens for log-probabilities (pagellm/sample/sampler.py), which torch.topk found at several nanoseconds a logit.
 *
 * One vectorised pass takes the maximum of each block of `block` logits. The count-th largest of those maxima, T,
 * is at most the row's count-th largest logit (the `count` blocks whose maxima reach T hold `count` logits of at
 * least T), so every logit of the result is >= T: only the blocks whose maximum reaches T are scanned, what they
 * hold >= T is collected in token order, and a stable radix sort on the values' order-preserving bits ranks it.
 * Where fewer than `count` blocks hold a logit above -inf (constrained rows, or rows too short for `count`
 * blocks), T is -inf: every logit above it is collected, and the -inf ones follow by token id. A row holding a
 * NaN is refused (nonzero return; the caller then ranks with torch, which puts NaN above every number).
 */
#include "vec.h"

#include <math.h>
#include <stdlib.h>

#define LARGEST_MAX_BLOCK 64
/* Blocks are halved (down to one vector) until the row has this many per asked-for logit: fewer logits >= T
 * to collect, for a longer list of maxima to select in. */
#define LARGEST_BLOCKS_PER_COUNT 2

/* Unsigned integers in the order of the floats they come from (for every float but NaN), -0 and +0 one value as
 * they are to a sort. */
static ALWAYS_INLINE uint32_t order_bits(float x) {
    if (x == 0.0f) x = 0.0f;
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

/* Each block's maximum into `maxima`; returns whether the row holds a NaN. */
static int block_maxima(const float *row, int64_t vocab, int64_t block, float *maxima) {
    ivec nan = (ivec){0};
    const int64_t full = vocab / block;
    for (int64_t b = 0; b < full; ++b) {
        const float *x = row + b * block;
        fvec m = vload(x);
        nan |= m != m;
        for (int64_t i = VEC; i < block; i += VEC) {
            const fvec v = vload(x + i);
            nan |= v != v;
            m = vselect(v > m, v, m);
        }
        float best = m[0];
        for (int lane = 1; lane < VEC; ++lane) best = m[lane] > best ? m[lane] : best;
        maxima[b] = best;
    }
    int any_nan = 0;
    for (int lane = 0; lane < VEC; ++lane) any_nan |= nan[lane] != 0;
    if (full * block < vocab) {
        float best = -INFINITY;
        for (int64_t i = full * block; i < vocab; ++i) {
            any_nan |= row[i] != row[i];
            best = row[i] > best ? row[i] : best;
        }
        maxima[full] = best;
    }
    return any_nan;
}

/* The k-th largest (k from 1) of values[0:n], reordering them (Hoare's selection; no NaN among them). */
static float kth_largest(float *values, int64_t n, int64_t k) {
    int64_t low = 0, high = n - 1, target = k - 1;
    while (low < high) {
        const float a = values[low], b = values[low + (high - low) / 2], c = values[high];
        const float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t i = low, j = high;
        while (i <= j) {
            while (values[i] > pivot) ++i;
            while (values[j] < pivot) --j;
            if (i <= j) {
                const float swap = values[i];
                values[i++] = values[j];
                values[j--] = swap;
            }
        }
        if (target <= j) high = j;
        else if (target >= i) low = i;
        else return values[target];
    }
    return values[target];
}

/* Stable LSD radix sort of (keys, ids) by keys, ascending, a byte at a time; bytes every key shares are skipped.
 * The result is in keys/ids or in the spare arrays: returns which (0 or 1). */
static int radix_sort(uint32_t *keys, int32_t *ids, uint32_t *spare_keys, int32_t *spare_ids, int64_t n) {
    int64_t counts[4][256] = {{0}};
    for (int64_t i = 0; i < n; ++i)
        for (int byte = 0; byte < 4; ++byte) ++counts[byte][(keys[i] >> (8 * byte)) & 0xff];
    uint32_t *from_keys = keys, *to_keys = spare_keys;
    int32_t *from_ids = ids, *to_ids = spare_ids;
    int swapped = 0;
    for (int byte = 0; byte < 4; ++byte) {
        int64_t offsets[256], total = 0;
        int shared = 0;
        for (int digit = 0; digit < 256; ++digit) {
            shared |= counts[byte][digit] == n;
            offsets[digit] = total;
            total += counts[byte][digit];
        }
        if (shared) continue;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t at = offsets[(from_keys[i] >> (8 * byte)) & 0xff]++;
            to_keys[at] = from_keys[i];
            to_ids[at] = from_ids[i];
        }
        uint32_t *keys_swap = from_keys;
        from_keys = to_keys;
        to_keys = keys_swap;
        int32_t *ids_swap = from_ids;
        from_ids = to_ids;
        to_ids = ids_swap;
        swapped ^= 1;
    }
    return swapped;
}

static int largest_row(const float *row, int64_t vocab, int64_t count, int64_t block, int64_t *ids_out,
                       float *values_out) {
    const int64_t blocks = (vocab + block - 1) / block;
    float *maxima = malloc(2 * blocks * sizeof(float));
    if (maxima == NULL) return 3;
    float *selecting = maxima + blocks;
    if (block_maxima(row, vocab, block, maxima)) {
        free(maxima);
        return 1;
    }
    /* -inf where fewer blocks than `count` hold a logit above -inf: then every such logit belongs to the result,
     * and the -inf ones after them by token id. */
    float threshold = -INFINITY;
    if (blocks >= count) {
        memcpy(selecting, maxima, blocks * sizeof(float));
        threshold = kth_largest(selecting, blocks, count);
    }
    const int everything_above_minus_inf = threshold == -INFINITY;
    int64_t reaching = 0;
    for (int64_t b = 0; b < blocks; ++b)
        reaching += everything_above_minus_inf ? maxima[b] > -INFINITY : maxima[b] >= threshold;
    const int64_t room = reaching * block;
    /* Keys and ids, then the radix sort's spare copies of both (one element at least: malloc(0) may give NULL). */
    uint32_t *keys = malloc(2 * (room + 1) * (sizeof(uint32_t) + sizeof(int32_t)));
    if (keys == NULL) {
        free(maxima);
        return 3;
    }
    int32_t *ids = (int32_t *)(keys + room + 1);
    uint32_t *spare_keys = (uint32_t *)(ids + room + 1);
    int32_t *spare_ids = (int32_t *)(spare_keys + room + 1);
    int64_t n = 0;
    for (int64_t b = 0; b < blocks; ++b) {
        if (everything_above_minus_inf ? !(maxima[b] > -INFINITY) : maxima[b] < threshold) continue;
        const int64_t end = b * block + block < vocab ? b * block + block : vocab;
        for (int64_t i = b * block; i < end; ++i) {
            if (everything_above_minus_inf ? row[i] > -INFINITY : row[i] >= threshold) {
                keys[n] = ~order_bits(row[i]); /* ascending keys: descending values */
                ids[n++] = (int32_t)i;
            }
        }
    }
    const int in_spare = radix_sort(keys, ids, spare_keys, spare_ids, n);
    const int32_t *sorted_ids = in_spare ? spare_ids : ids;
    int64_t filled = 0;
    for (; filled < count && filled < n; ++filled) {
        ids_out[filled] = sorted_ids[filled];
        values_out[filled] = row[sorted_ids[filled]];
    }
    for (int64_t i = 0; filled < count && i < vocab; ++i) {
        if (row[i] == -INFINITY) {
            ids_out[filled] = i;
            values_out[filled++] = row[i];
        }
    }
    free(keys);
    free(maxima);
    return 0;
}

/* logits [rows, vocab] float32, contiguous; ids [rows, count] int64 and values [rows, count] float32 receive each
 * row's `count` largest. Returns 0, or the first refusing row's reason (1 NaN, 3 out of memory, 4 count out of
 * range), the outputs then unspecified. */
int64_t largest_per_row(const float *logits, int64_t rows, int64_t vocab, int64_t count, int64_t *ids,
                        float *values) {
    if (count < 1 || count > vocab || vocab > INT32_MAX) return 4;
    int64_t block = LARGEST_MAX_BLOCK;
    while (block > VEC && vocab / block < LARGEST_BLOCKS_PER_COUNT * count) block /= 2;
    int64_t refused = 0;
#pragma omp parallel for if (rows > 1) reduction(max : refused)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t reason = largest_row(logits + r * vocab, vocab, count, block, ids + r * count,
                                           values + r * count);
        refused = reason > refused ? reason : refused;
    }
    return refused;
}
