/* LoRA's grouped shrink and expand for the CPU (Punica's SGMV), float32: one call adds the delta of every
 * adapted token of a step to a layer's output.
 *
 * The step's adapted tokens are grouped by slot into segments (slot, start, end) over `rows`, the token index
 * of each grouped row. For each segment, with A = a[slot] ([cap, in], rows [0, w) in use) and Bt = bt[slot]
 * ([cap, out], B transposed with the scaling folded in):
 *   shrink: h[g][r] = sum_k x[rows[g]][k] * A[r][k]           (four rows per pass over A's row)
 *   expand: out[rows[g]][n] += sum_r h[g][r] * Bt[r][n]        (four rows per pass over a block of Bt)
 * The threads split the runs of four rows: each shrinks and expands its own, with no barrier between.
 * Tokens outside every segment are untouched: requests without an adapter cost nothing.
 */
#include <stdint.h>
#include <string.h>

#define COLUMN_BLOCK 256
#define ROW_BLOCK 4
/* The widest slot the kernel takes (its shrunk rows live on the stack): 3 fused shards x rank 256. */
#define MAX_WIDTH 768
/* Below this many multiply-adds a call runs on one thread: waking the team would cost more. */
#define PARALLEL_MIN_MACS 262144

static float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < n; k++) sum += a[k] * b[k];
    return sum;
}

int pagellm_lora_sgmv_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride, const float *a,
                          const float *bt, int64_t cap, int64_t in_features, int64_t out_features,
                          const int64_t *rows, const int64_t *segments, int64_t num_segments,
                          const int64_t *widths, int64_t num_slots) {
    for (int64_t s = 0; s < num_segments; s++) {
        int64_t slot = segments[3 * s];
        if (slot < 0 || slot >= num_slots || widths[slot] < 0 || widths[slot] > cap || widths[slot] > MAX_WIDTH)
            return -1;
    }
    /* Work items: runs of up to ROW_BLOCK rows of one segment, numbered across the segments. Each item shrinks
     * and expands its own rows, so the threads never wait for each other inside the call: one join per call
     * (a barrier costs a time slice when the cores are oversubscribed), and none at all for small steps. */
    int64_t num_items = 0, macs = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        const int64_t length = segments[3 * s + 2] - segments[3 * s + 1];
        num_items += (length + ROW_BLOCK - 1) / ROW_BLOCK;
        macs += length * widths[segments[3 * s]] * (in_features + out_features);
    }
#pragma omp parallel for schedule(static) if (macs >= PARALLEL_MIN_MACS)
    for (int64_t item = 0; item < num_items; item++) {
        int64_t s = 0, first = item;
        for (;; s++) {
            const int64_t blocks = (segments[3 * s + 2] - segments[3 * s + 1] + ROW_BLOCK - 1) / ROW_BLOCK;
            if (first < blocks) break;
            first -= blocks;
        }
        const int64_t slot = segments[3 * s], end = segments[3 * s + 2];
        const int64_t g = segments[3 * s + 1] + first * ROW_BLOCK;
        const int64_t count = end - g < ROW_BLOCK ? end - g : ROW_BLOCK;
        const int64_t width = widths[slot];
        if (width == 0) continue;
        const float *A = a + slot * cap * in_features;
        const float *Bt = bt + slot * cap * out_features;
        const float *xr[ROW_BLOCK];
        for (int64_t i = 0; i < ROW_BLOCK; i++) xr[i] = x + rows[g + (i < count ? i : 0)] * x_stride;
        float hr[ROW_BLOCK][MAX_WIDTH];
        for (int64_t r = 0; r < width; r++) {  /* shrink: the rows' dot products with A's row r, four at once */
            const float *ar = A + r * in_features;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            const float *x0 = xr[0], *x1 = xr[1], *x2 = xr[2], *x3 = xr[3];
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t k = 0; k < in_features; k++) {
                const float av = ar[k];
                s0 += av * x0[k];
                s1 += av * x1[k];
                s2 += av * x2[k];
                s3 += av * x3[k];
            }
            hr[0][r] = s0;
            hr[1][r] = s1;
            hr[2][r] = s2;
            hr[3][r] = s3;
        }
        for (int64_t n0 = 0; n0 < out_features; n0 += COLUMN_BLOCK) {  /* expand, one block of columns at a time */
            const int64_t len = out_features - n0 < COLUMN_BLOCK ? out_features - n0 : COLUMN_BLOCK;
            float acc[ROW_BLOCK][COLUMN_BLOCK];
            for (int64_t i = 0; i < count; i++) memcpy(acc[i], out + rows[g + i] * out_stride + n0,
                                                       (size_t)len * sizeof(float));
            for (int64_t r = 0; r < width; r++) {
                const float *b = Bt + r * out_features + n0;
                for (int64_t i = 0; i < count; i++) {
                    const float coef = hr[i][r];
                    float *ai = acc[i];
#pragma omp simd
                    for (int64_t n = 0; n < len; n++) ai[n] += coef * b[n];
                }
            }
            for (int64_t i = 0; i < count; i++) memcpy(out + rows[g + i] * out_stride + n0, acc[i],
                                                       (size_t)len * sizeof(float));
        }
    }
    return 0;
}
