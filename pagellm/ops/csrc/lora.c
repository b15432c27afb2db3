/* LoRA's grouped shrink and expand for the CPU (Punica's SGMV), float32: one call adds the delta of every
 * adapted token of a step to a layer's output.
 *
 * The step's adapted tokens are grouped by slot into segments (slot, start, end) over `rows`, the token index
 * of each grouped row. For each segment, with A = a[slot] ([cap, in], rows [0, w) in use) and Bt = bt[slot]
 * ([cap, out], B transposed with the scaling folded in):
 *   shrink: h[g][r] = sum_k x[rows[g]][k] * A[r][k]           (threads split the ranks: A's row stays in cache)
 *   expand: out[rows[g]][n] += sum_r h[g][r] * Bt[r][n]        (threads split the columns: Bt's block stays in cache)
 * Tokens outside every segment are untouched: requests without an adapter cost nothing.
 */
#include <stdint.h>
#include <string.h>

#define COLUMN_BLOCK 256
#define ROW_BLOCK 4

static float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < n; k++) sum += a[k] * b[k];
    return sum;
}

int pagellm_lora_sgmv_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride, const float *a,
                          const float *bt, int64_t cap, int64_t in_features, int64_t out_features,
                          const int64_t *rows, const int64_t *segments, int64_t num_segments,
                          const int64_t *widths, int64_t num_slots, float *h) {
    for (int64_t s = 0; s < num_segments; s++) {
        int64_t slot = segments[3 * s];
        if (slot < 0 || slot >= num_slots || widths[slot] < 0 || widths[slot] > cap) return -1;
    }
    const int64_t num_blocks = (out_features + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
    /* One parallel region, two work-shared loops over every segment at once: two barriers per call, however
     * many slots are active (each barrier costs a time slice when the cores are oversubscribed). */
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_segments * cap; item++) {
            const int64_t s = item / cap, r = item % cap;
            const int64_t slot = segments[3 * s], start = segments[3 * s + 1], end = segments[3 * s + 2];
            if (r >= widths[slot]) continue;
            const float *ar = a + (slot * cap + r) * in_features;
            int64_t g = start;
            for (; g + 4 <= end; g += 4) {  /* four rows per pass over A's row */
                const float *x0 = x + rows[g] * x_stride, *x1 = x + rows[g + 1] * x_stride;
                const float *x2 = x + rows[g + 2] * x_stride, *x3 = x + rows[g + 3] * x_stride;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int64_t k = 0; k < in_features; k++) {
                    const float av = ar[k];
                    s0 += av * x0[k];
                    s1 += av * x1[k];
                    s2 += av * x2[k];
                    s3 += av * x3[k];
                }
                h[g * cap + r] = s0;
                h[(g + 1) * cap + r] = s1;
                h[(g + 2) * cap + r] = s2;
                h[(g + 3) * cap + r] = s3;
            }
            for (; g < end; g++) h[g * cap + r] = dot(ar, x + rows[g] * x_stride, in_features);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_segments * num_blocks; item++) {
            const int64_t s = item / num_blocks, block = item % num_blocks;
            const int64_t slot = segments[3 * s], start = segments[3 * s + 1], end = segments[3 * s + 2];
            const int64_t width = widths[slot];
            if (width == 0) continue;
            const float *Bt = bt + slot * cap * out_features;
            const int64_t n0 = block * COLUMN_BLOCK;
            const int64_t n1 = n0 + COLUMN_BLOCK < out_features ? n0 + COLUMN_BLOCK : out_features;
            const int64_t len = n1 - n0;
            for (int64_t g = start; g < end; g += ROW_BLOCK) {  /* up to four rows per pass over Bt's block */
                const int64_t count = end - g < ROW_BLOCK ? end - g : ROW_BLOCK;
                float acc[ROW_BLOCK][COLUMN_BLOCK];
                for (int64_t i = 0; i < count; i++) memcpy(acc[i], out + rows[g + i] * out_stride + n0,
                                                           (size_t)len * sizeof(float));
                for (int64_t r = 0; r < width; r++) {
                    const float *b = Bt + r * out_features + n0;
                    for (int64_t i = 0; i < count; i++) {
                        const float coef = h[(g + i) * cap + r];
                        float *ai = acc[i];
#pragma omp simd
                        for (int64_t n = 0; n < len; n++) ai[n] += coef * b[n];
                    }
                }
                for (int64_t i = 0; i < count; i++) memcpy(out + rows[g + i] * out_stride + n0, acc[i],
                                                           (size_t)len * sizeof(float));
            }
        }
    }
    return 0;
}
