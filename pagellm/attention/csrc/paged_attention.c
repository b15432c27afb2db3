/* Decode attention straight from the paged KV cache: no gathered copy of the keys and values.
 *
 * The torch path gathers every sequence's blocks into a padded [seqs, kv_heads, max_len, head_dim]
 * tensor and then runs SDPA over it, so each decode step reads the cache, writes a copy as large,
 * reads it again, and pays for padding up to the longest context. Here each (sequence, kv head) pair
 * reads its keys and values once, through the block table, for all the query heads that share them.
 *
 * Layouts (all contiguous, float32):
 *   q, out        [num_seqs, num_heads, head_dim]
 *   k/v_cache     [num_blocks, num_kv_heads, block_size, head_dim]: one head of a block is contiguous
 *   block_tables  [num_seqs, table_stride] int64
 *   context_lens  [num_seqs] int64, each >= 1
 *
 * Built with OpenMP against the runtime torch already loaded (same soname), so the kernel shares
 * torch's thread pool and thread count instead of competing with it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Eight floats: GCC/Clang vector extensions, which become AVX2 with -march=native on x86 and pairs of
 * NEON registers on Arm, with no intrinsics to port. */
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

static inline f32x8 load8(const float *p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }
static inline f32x8 splat8(float x) { return (f32x8){x, x, x, x, x, x, x, x}; }
static inline float sum8(f32x8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* exp(x) for x <= 0 (scores minus their maximum), Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2,
 * a degree-6 polynomial for e^r, 2^n through the exponent bits. About 1 ulp, like libm's expf, at a
 * fraction of the cost of calling it per score. */
static inline f32x8 exp8_nonpositive(f32x8 x) {
    const i32x8 tiny = x < splat8(-87.0f); /* e^-87 is already below every sum it joins */
    x = (f32x8)(((i32x8)x & ~tiny) | ((i32x8)splat8(-87.0f) & tiny));
    const i32x8 n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i32x8); /* round(), x <= 0 */
    const f32x8 nf = __builtin_convertvector(n, f32x8);
    const f32x8 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f; /* ln2 split in two: exact n * hi */
    f32x8 p = splat8(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return p * (f32x8)((n + 127) << 23);
}

/* Four consecutive keys (`stride` floats apart) against one query: four independent FMA chains, so the adds do not
 * wait on each other's latency as one chain per dot product would. */
static inline void dot4(const float *restrict query, const float *restrict key, int64_t stride, int64_t head_dim,
                        float scale, float *restrict out) {
    f32x8 a0 = splat8(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < head_dim; d += 8) {
        const f32x8 qv = load8(query + d);
        a0 += qv * load8(key + d);
        a1 += qv * load8(key + stride + d);
        a2 += qv * load8(key + 2 * stride + d);
        a3 += qv * load8(key + 3 * stride + d);
    }
    out[0] = sum8(a0) * scale;
    out[1] = sum8(a1) * scale;
    out[2] = sum8(a2) * scale;
    out[3] = sum8(a3) * scale;
}

static inline float dot1(const float *restrict query, const float *restrict key, int64_t head_dim) {
    f32x8 acc = splat8(0.0f);
    for (int64_t d = 0; d < head_dim; d += 8) acc += load8(query + d) * load8(key + d);
    return sum8(acc);
}

/* out[0..64) = sum over keys t of weights[t] * value_t[0..64): eight accumulators that stay in registers
 * for the whole context (accumulating in memory made every key a store-to-load round trip). */
static void weighted_sum64(const float *restrict weights, const float *restrict v_cache,
                           const int64_t *restrict table, int64_t context_len, int64_t block_size,
                           int64_t block_stride, int64_t offset, int64_t token_stride, float *restrict out) {
    f32x8 a0 = splat8(0.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t start = 0; start < context_len; start += block_size) {
        const float *block = v_cache + table[start / block_size] * block_stride + offset;
        const int64_t count = context_len - start < block_size ? context_len - start : block_size;
        for (int64_t i = 0; i < count; ++i) {
            const float *value = block + i * token_stride;
            const f32x8 w = splat8(weights[start + i]);
            a0 += w * load8(value);
            a1 += w * load8(value + 8);
            a2 += w * load8(value + 16);
            a3 += w * load8(value + 24);
            a4 += w * load8(value + 32);
            a5 += w * load8(value + 40);
            a6 += w * load8(value + 48);
            a7 += w * load8(value + 56);
        }
    }
    store8(out, a0);
    store8(out + 8, a1);
    store8(out + 16, a2);
    store8(out + 24, a3);
    store8(out + 32, a4);
    store8(out + 40, a5);
    store8(out + 48, a6);
    store8(out + 56, a7);
}

/* Softmax of row[0..n) in place, max-subtracted like SDPA. */
static void softmax(float *restrict row, int64_t n) {
    float max = row[0];
    for (int64_t t = 1; t < n; ++t) max = row[t] > max ? row[t] : max;
    f32x8 totals = splat8(0.0f);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
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
    const float inverse = 1.0f / total;
    for (int64_t i = 0; i < n; ++i) row[i] *= inverse;
}

/* One (sequence, kv head): the `group` query heads that share it, head_dim a multiple of 8.
 * scores is [group][context_len]; out is [group][head_dim]. */
static void attend_one(const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
                       const int64_t *restrict table, int64_t context_len, int64_t kv_head, int64_t group,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                       float *restrict scores, float *restrict out) {
    const int64_t token_stride = head_dim;
    const int64_t block_stride = num_kv_heads * block_size * head_dim;
    const int64_t head_offset = kv_head * block_size * head_dim;
    for (int64_t start = 0; start < context_len; start += block_size) {
        const float *block = k_cache + table[start / block_size] * block_stride + head_offset;
        const int64_t count = context_len - start < block_size ? context_len - start : block_size;
        for (int64_t g = 0; g < group; ++g) {
            const float *query = q + g * head_dim;
            float *row = scores + g * context_len + start;
            int64_t i = 0;
            for (; i + 4 <= count; i += 4) dot4(query, block + i * token_stride, token_stride, head_dim, scale, row + i);
            for (; i < count; ++i) row[i] = dot1(query, block + i * token_stride, head_dim) * scale;
        }
    }
    for (int64_t g = 0; g < group; ++g) softmax(scores + g * context_len, context_len);
    if (head_dim % 64 == 0) {
        for (int64_t g = 0; g < group; ++g)
            for (int64_t d = 0; d < head_dim; d += 64)
                weighted_sum64(scores + g * context_len, v_cache, table, context_len, block_size, block_stride,
                               head_offset + d, token_stride, out + g * head_dim + d);
        return;
    }
    memset(out, 0, sizeof(float) * group * head_dim);
    for (int64_t start = 0; start < context_len; start += block_size) {
        const float *block = v_cache + table[start / block_size] * block_stride + head_offset;
        const int64_t count = context_len - start < block_size ? context_len - start : block_size;
        for (int64_t i = 0; i < count; ++i) {
            const float *value = block + i * token_stride;
            for (int64_t g = 0; g < group; ++g) {
                const f32x8 weight = splat8(scores[g * context_len + start + i]);
                float *acc = out + g * head_dim;
                for (int64_t d = 0; d < head_dim; d += 8) store8(acc + d, load8(acc + d) + weight * load8(value + d));
            }
        }
    }
}

/* Returns 1 if a thread could not allocate its score buffer, 2 if head_dim is not a multiple of 8. */
int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                               float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale) {
    if (head_dim % 8 != 0) return 2;
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
            const int64_t first_head = kv_head * group;
            attend_one(q + (seq * num_heads + first_head) * head_dim, k_cache, v_cache,
                       block_tables + seq * table_stride, context_lens[seq], kv_head, group, num_kv_heads,
                       head_dim, block_size, scale, scores, out + (seq * num_heads + first_head) * head_dim);
        }
        free(scores);
    }
    return failed;
}
