/* The K/V writers of the paged cache: the step's keys and values copied, or quantized (kv_format.h), into
 * their cache rows. Built into the same library as the attention kernels that read those rows.
 */
#include "kv_format.h"

/* Rows are split across threads from this many elements on, as in cpu_ops.c (torch's grain size). */
#define PARALLEL_MIN_ELEMENTS 32768

/* Copies each token's key and value heads into their cache rows: head h of token t goes to row
 * rows[t * num_kv_heads + h] of the caches viewed as [rows, head_dim] (pagellm/attention/paged.py,
 * kv_write_index). k and v are [tokens, num_kv_heads, head_dim] with contiguous heads and a row stride of
 * their own (they are views into the fused qkv projection's output); any element size. torch's index_copy_
 * on those views walks them element by element and cost more than the decode attention of small batches. */
void write_kv_rows(const void *k, const void *v, int64_t k_row_stride, int64_t v_row_stride, void *k_cache,
                   void *v_cache, const int64_t *rows, int64_t tokens, int64_t num_kv_heads, int64_t head_dim,
                   int64_t element_size) {
    const int64_t head_bytes = head_dim * element_size;
#pragma omp parallel for if (tokens * num_kv_heads * head_dim >= 8 * PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; ++t) {
        const char *k_row = (const char *)k + t * k_row_stride * element_size;
        const char *v_row = (const char *)v + t * v_row_stride * element_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t row = rows[t * num_kv_heads + h];
            memcpy((char *)k_cache + row * head_bytes, k_row + h * head_bytes, head_bytes);
            memcpy((char *)v_cache + row * head_bytes, v_row + h * head_bytes, head_bytes);
        }
    }
}

/* The quantized counterpart of write_kv_rows: each (token, head) row of k and v (float32, or bfloat16 if bf16)
 * becomes head_dim codes and a scale in its cache run (kv_format.h), row r of the cache being position
 * r % block_size of run r / block_size. */
void write_kv_rows_quantized(const void *k, const void *v, int64_t k_row_stride, int64_t v_row_stride, void *k_cache,
                             void *v_cache, const int64_t *rows, int64_t tokens, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, int bf16, int format) {
    const int64_t element_size = bf16 ? 2 : 4, run = kv_run_elements(block_size, head_dim, format);
#pragma omp parallel for if (tokens * num_kv_heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t row = rows[t * num_kv_heads + h], offset = row % block_size;
            const int64_t start = row / block_size * run;
            const char *sources[2] = {(const char *)k + (t * k_row_stride + h * head_dim) * element_size,
                                      (const char *)v + (t * v_row_stride + h * head_dim) * element_size};
            char *caches[2] = {(char *)k_cache + start, (char *)v_cache + start};
            for (int kv = 0; kv < 2; ++kv) {
                uint8_t *codes = (uint8_t *)caches[kv] + offset * head_dim;
                char *scale = caches[kv] + block_size * head_dim + offset * KV_SCALE_BYTES;
#define QUANTIZE(BF16, FORMAT) quantize_row(sources[kv], head_dim, BF16, codes, scale, FORMAT)
                switch (format * 2 + (bf16 != 0)) {
                case KV_E4M3 * 2: QUANTIZE(0, KV_E4M3); break;
                case KV_E4M3 * 2 + 1: QUANTIZE(1, KV_E4M3); break;
                case KV_E5M2 * 2: QUANTIZE(0, KV_E5M2); break;
                case KV_E5M2 * 2 + 1: QUANTIZE(1, KV_E5M2); break;
                case KV_INT8 * 2: QUANTIZE(0, KV_INT8); break;
                default: QUANTIZE(1, KV_INT8); break;
                }
#undef QUANTIZE
            }
        }
    }
}

/* write_kv_rows from float32 K/V into a bfloat16 cache (kv_cache_dtype="bfloat16" under a float32 model): each value
 * rounded to nearest even, as torch's .to(torch.bfloat16) rounds it. */
void write_kv_rows_to_bf16(const float *k, const float *v, int64_t k_row_stride, int64_t v_row_stride,
                           uint16_t *k_cache, uint16_t *v_cache, const int64_t *rows, int64_t tokens,
                           int64_t num_kv_heads, int64_t head_dim) {
#pragma omp parallel for if (tokens * num_kv_heads * head_dim >= 8 * PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t row = rows[t * num_kv_heads + h];
            const float *sources[2] = {k + t * k_row_stride + h * head_dim, v + t * v_row_stride + h * head_dim};
            uint16_t *caches[2] = {k_cache + row * head_dim, v_cache + row * head_dim};
            for (int kv = 0; kv < 2; ++kv)
                for (int64_t d = 0; d < head_dim; d += VEC) {
                    const int64_t n = piece(d, head_dim);
                    store_n(caches[kv], d, n, load_n(sources[kv], d, n, 0), 1);
                }
        }
    }
}
