/* Fused elementwise layers for the CPU, in float32 or bfloat16: each is one pass over its rows where the
 * torch expressions they replace take four to eight (RMSNorm: cast, square, mean, rsqrt, two products;
 * rotary: slices, negation, concatenation, two products and a sum per tensor). At decode batch sizes
 * those kernels are launch- and memory-bound, so the passes are what costs.
 *
 * Numerics follow the reference (transformers' Llama) expression by expression. All arithmetic is float32;
 * in bfloat16, every place where the reference's torch op would store a bfloat16 tensor rounds to bfloat16
 * (to nearest even) at the same point, so the results are those of the unfused bfloat16 model, not merely
 * close to them. In float32 those roundings are no-ops and vanish after inlining.
 * Rows are split across threads from PARALLEL_MIN_ELEMENTS elements on (torch's grain size): on a quiet
 * 2-core AMD EPYC (avx512f avx512_bf16) a parallel region costs under 0.5 us, but when other processes hold
 * its cores, a decode-sized call (16 x 576) that waits for a second thread took 20 ms instead of 18 us.
 */
#include "vec.h"

#define PARALLEL_MIN_ELEMENTS 32768

/* The value a torch op of the model's dtype would store: rounded in bfloat16, as is in float32. */
static ALWAYS_INLINE fvec as_stored(fvec v, const int bf16) { return bf16 ? round_bf16(v) : v; }

/* Stores v (rounded in bfloat16) and returns what was stored, widened: one rounding for both uses. */
static ALWAYS_INLINE fvec store_n_stored(void *p, int64_t index, int64_t n, fvec v, const int bf16) {
    if (!bf16) {
        store_n(p, index, n, v, 0);
        return v;
    }
    const hvec bits = to_bf16_bits(v);
    if (n == VEC) memcpy((uint16_t *)p + index, &bits, sizeof bits);
    else memcpy((uint16_t *)p + index, &bits, n * sizeof(uint16_t));
    return from_bf16_bits(bits);
}

/* residual (if not NULL) += x, then out = weight * norm(h) with h the sum (or x). transformers' LlamaRMSNorm
 * takes the statistics in float32, casts the normalised row back to the model's dtype, and only then
 * multiplies by the weight (in the model's dtype): two roundings in bfloat16, kept here. */
static ALWAYS_INLINE void add_rms_norm_rows(const void *x, void *residual, const void *weight, void *out, int64_t rows,
                                            int64_t hidden, float eps, const int bf16, const int gemma) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const char *in = (const char *)x + r * hidden * size;
        char *h = residual ? (char *)residual + r * hidden * size : (char *)in;
        fvec squares = splat(0.0f);
        for (int64_t i = 0; i < hidden; i += VEC) {
            const int64_t n = piece(i, hidden);
            fvec v = load_n(in, i, n, bf16);
            if (residual) v = store_n_stored(h, i, n, v + load_n(h, i, n, bf16), bf16);
            squares += v * v;
        }
        const float inverse_rms = 1.0f / sqrtf(vsum(squares) / (float)hidden + eps);
        char *o = (char *)out + r * hidden * size;
        for (int64_t i = 0; i < hidden; i += VEC) {
            const int64_t n = piece(i, hidden);
            const fvec normed = load_n(h, i, n, bf16) * inverse_rms;
            if (gemma) store_n(o, i, n, load_n(weight, i, n, 0) * normed, bf16);
            else store_n(o, i, n, load_n(weight, i, n, bf16) * as_stored(normed, bf16), bf16);
        }
    }
}

void add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t hidden,
                  float eps, int bf16) {
    if (bf16) add_rms_norm_rows(x, residual, weight, out, rows, hidden, eps, 1, 0);
    else add_rms_norm_rows(x, residual, weight, out, rows, hidden, eps, 0, 0);
}

/* The same with transformers' Gemma3RMSNorm's numerics: the float32 normalised row is multiplied by a float32
 * weight (Gemma's 1 + weight, summed once by the caller) and rounded once, to the activations' dtype. In float32
 * it is add_rms_norm given that weight. */
void gemma_rms_norm(const void *x, void *residual, const float *weight, void *out, int64_t rows, int64_t hidden,
                    float eps, int bf16) {
    if (bf16) add_rms_norm_rows(x, residual, weight, out, rows, hidden, eps, 1, 1);
    else add_rms_norm_rows(x, residual, weight, out, rows, hidden, eps, 0, 1);
}

/* into[i] += x[i] for n elements, rounded as a torch add in the activations' dtype rounds it. */
static ALWAYS_INLINE void add_into_elements(void *into, const void *x, int64_t n, const int bf16) {
    for (int64_t i = 0; i < n; i += VEC) {
        const int64_t m = piece(i, n);
        store_n(into, i, m, load_n(into, i, m, bf16) + load_n(x, i, m, bf16), bf16);
    }
}

void add_into(void *into, const void *x, int64_t n, int bf16) {
    if (bf16) add_into_elements(into, x, n, 1);
    else add_into_elements(into, x, n, 0);
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i]; silu(g) = g * sigmoid(g), with the sigmoid
 * taken from e^-|g| so the exponential never overflows. The reference stores silu(gate) before the product
 * (one more rounding in bfloat16). */
static ALWAYS_INLINE void silu_and_mul_rows(const void *gate_up, void *out, int64_t rows, int64_t width,
                                            const int bf16) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for if (rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const char *gate = (const char *)gate_up + r * 2 * width * size, *up = gate + width * size;
        char *o = (char *)out + r * width * size;
        for (int64_t i = 0; i < width; i += VEC) {
            const int64_t n = piece(i, width);
            const fvec g = load_n(gate, i, n, bf16);
            const fvec magnitude = (fvec)((ivec)g & ~(ivec)splat(-0.0f));
            const fvec e = exp_nonpositive(-magnitude);
            const fvec numerator = vselect(g < splat(0.0f), e, splat(1.0f));
            const fvec silu = as_stored(g * (numerator / (1.0f + e)), bf16);
            store_n(o, i, n, silu * load_n(up, i, n, bf16), bf16);
        }
    }
}

void silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16) {
    if (bf16) silu_and_mul_rows(gate_up, out, rows, width, 1);
    else silu_and_mul_rows(gate_up, out, rows, width, 0);
}

/* Rotary embedding in place on the first num_heads heads of each row (the query and key heads at the
 * start of the fused qkv projection's output): x * cos + rotate_half(x) * sin, with float32 cos/sin rows
 * [max_positions][head_dim] looked up by position. The reference casts cos and sin to the model's dtype and
 * stores each product and the sum: in bfloat16 each is rounded here at the same place. */
static ALWAYS_INLINE void rotary_rows(void *qkv, int64_t rows, int64_t row_stride, int64_t num_heads,
                                      int64_t head_dim, const float *cos_table, const float *sin_table,
                                      const int64_t *positions, const int bf16) {
    const int64_t half = head_dim / 2, size = bf16 ? 2 : 4;
#pragma omp parallel for if (rows * num_heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *cos = cos_table + positions[r] * head_dim, *sin = sin_table + positions[r] * head_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
            char *x = (char *)qkv + (r * row_stride + h * head_dim) * size;
            for (int64_t i = 0; i < half; i += VEC) {
                const int64_t n = piece(i, half);
                const fvec first = load_n(x, i, n, bf16), second = load_n(x, i + half, n, bf16);
                const fvec cos_first = as_stored(load_n(cos, i, n, 0), bf16);
                const fvec sin_first = as_stored(load_n(sin, i, n, 0), bf16);
                const fvec cos_second = as_stored(load_n(cos, i + half, n, 0), bf16);
                const fvec sin_second = as_stored(load_n(sin, i + half, n, 0), bf16);
                const fvec rotated_first =
                    as_stored(first * cos_first, bf16) + as_stored(-second * sin_first, bf16);
                const fvec rotated_second =
                    as_stored(second * cos_second, bf16) + as_stored(first * sin_second, bf16);
                store_n(x, i, n, rotated_first, bf16);
                store_n(x, i + half, n, rotated_second, bf16);
            }
        }
    }
}

void rotary_inplace(void *qkv, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim,
                    const float *cos_table, const float *sin_table, const int64_t *positions, int bf16) {
    if (bf16) rotary_rows(qkv, rows, row_stride, num_heads, head_dim, cos_table, sin_table, positions, 1);
    else rotary_rows(qkv, rows, row_stride, num_heads, head_dim, cos_table, sin_table, positions, 0);
}

/* Which vector width this library was built for (cpu_build.py checks it after loading). */
const char *pagellm_isa(void) { return ISA_NAME; }
