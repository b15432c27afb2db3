/* Decode attention straight from the paged KV cache: no gathered copy of the keys and values.
 *
 * The torch path gathers every sequence's blocks into a padded [seqs, kv_heads, max_len, head_dim]
 * tensor and then runs SDPA over it, so each decode step reads the cache, writes a copy as large,
 * reads it again, and pays for padding up to the longest context. Here each (sequence, kv head) pair
 * reads its keys and values once, through the block table, for all the query heads that share them.
 *
 * Layouts (all contiguous, float32):
 *   q, out        [num_seqs, num_heads, head_dim]
 *   k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables  [num_seqs, table_stride] int64
 *   context_lens  [num_seqs] int64, each >= 1
 *
 * Built with OpenMP against the runtime torch already loaded (same soname), so the kernel shares
 * torch's thread pool and thread count instead of competing with it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

static void attend_one(const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
                       const int64_t *restrict table, int64_t context_len, int64_t kv_head, int64_t group,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                       float *restrict scores, float *restrict out) {
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t head_offset = kv_head * head_dim;
    /* Pass 1: scores of every key for each of the group's query heads (scores is [group][context_len]). */
    for (int64_t start = 0; start < context_len; start += block_size) {
        const float *block = k_cache + table[start / block_size] * block_size * token_stride + head_offset;
        const int64_t count = context_len - start < block_size ? context_len - start : block_size;
        for (int64_t i = 0; i < count; ++i) {
            const float *key = block + i * token_stride;
            for (int64_t g = 0; g < group; ++g)
                scores[g * context_len + start + i] = dot(q + g * head_dim, key, head_dim) * scale;
        }
    }
    /* Softmax in place, max-subtracted like SDPA. */
    for (int64_t g = 0; g < group; ++g) {
        float *row = scores + g * context_len;
        float max = row[0];
        for (int64_t t = 1; t < context_len; ++t) max = row[t] > max ? row[t] : max;
        float total = 0.0f;
        for (int64_t t = 0; t < context_len; ++t) {
            row[t] = expf(row[t] - max);
            total += row[t];
        }
        const float inverse = 1.0f / total;
        for (int64_t t = 0; t < context_len; ++t) row[t] *= inverse;
    }
    /* Pass 2: weighted sum of the values. */
    for (int64_t g = 0; g < group * head_dim; ++g) out[g] = 0.0f;
    for (int64_t start = 0; start < context_len; start += block_size) {
        const float *block = v_cache + table[start / block_size] * block_size * token_stride + head_offset;
        const int64_t count = context_len - start < block_size ? context_len - start : block_size;
        for (int64_t i = 0; i < count; ++i) {
            const float *value = block + i * token_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float weight = scores[g * context_len + start + i];
                float *acc = out + g * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) acc[d] += weight * value[d];
            }
        }
    }
}

int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                               float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale) {
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
