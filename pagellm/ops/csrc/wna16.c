/* Matrix products on group-quantized integer weights (AWQ and GPTQ checkpoints: 4- or 8-bit weights with a
 * scale and a zero point per group of input features), without a dequantized copy of the weight.
 *
 * Layout (pagellm/ops/wna16.py builds it from either format at load):
 *   packed      int32 [n_blocks][k_rows][NB]: output columns in blocks of NB, each block's packed rows
 *               contiguous. Internal input row k' of column c of block b is field k' % pack of
 *               packed[b][k' / pack][c], fields of `bits` bits from the least significant end (GPTQ's order).
 *   gparams     float [n_blocks][n_groups][2][NB]: per group and column, the scale s and the offset o = -s * zero,
 *               so that weight = s * q + o.
 *   group_rows  int32 [n_groups]: packed rows of each group; the groups lie one after the other along k'.
 *   src         int32 [k_rows * pack]: the input feature of internal row k' (-1: a padding row), or NULL where
 *               internal row k' is input feature k'. GPTQ's act-order (desc_act) checkpoints are stored with their
 *               rows sorted by group (each group's rows contiguous, padded to whole packed rows), and x is
 *               gathered through src per call, as ExLlama does.
 *
 * wna16_matmul: y [rows, out] = x [rows, in] W^T (+ bias). Per group g and column n,
 *   sum_k x_k (s q_k + o) = s * sum_k x_k q_k + o * sum_k x_k,
 * so the inner loop multiplies x by the integer weights as they come out of their fields, and the scale and
 * offset are applied once per group. A field is taken out with one AND and converted as it lies (q * 2^(bits j)
 * for field j, exact in float32) against x pre-scaled by 2^(-bits j); the top field is shifted down instead,
 * since its AND would set the sign bit. Columns are split over the threads by blocks; each block's weights are
 * read from memory once per call and stay in L2 while every pass of up to 8 rows of x reuses them. Each output is
 * summed by one thread in a fixed order, so results do not depend on the thread count.
 * wna16_dequantize_t: columns of W as float32, transposed (input features as rows, in input order): a tile for a
 * dense GEMM x @ tile, or the whole weight as a reference.
 *
 * Written once with GCC/Clang vector extensions; pagellm/ops/cpu_build.py builds it per instruction set
 * (AVX-512, AVX2 with FMA, generic), with OpenMP against the libgomp torch already loaded.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h"
#include "isa_name.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* The generic build passes 32-byte vectors between static inlined functions only: no ABI boundary. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

/* Output columns per block (four 8-float vectors). */
#define NB 32
/* Rows of x per pass over a block: their accumulators stay in registers. */
#define MAX_PASS_ROWS 8
/* Below this many multiply-adds a call runs on the calling thread (a parallel region costs microseconds, more
 * when other processes hold the cores). */
#define PARALLEL_MIN_WORK (1 << 18)
/* Packed rows (of NB words, 128 bytes) ahead that the product prefetches: 1 KiB; 4 ran slower, 16 no faster. */
#define PREFETCH_ROWS 8

static ALWAYS_INLINE f32x8 splat(float x) { return (f32x8){x, x, x, x, x, x, x, x}; }

static ALWAYS_INLINE u32x8 load_u32x8(const int32_t *p) {
    u32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE f32x8 load_f32x8(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE void store_f32x8(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }

/* Field j of each lane, converted to float as it lies in the word: q * 2^(bits j), or q for the top field. */
static ALWAYS_INLINE f32x8 field(u32x8 v, const int bits, const int j) {
    const int pack = 32 / bits;
    const uint32_t mask = (1u << bits) - 1;
    const u32x8 lanes = j == pack - 1 ? v >> (bits * j) : v & (mask << (bits * j));
    return __builtin_convertvector((i32x8)lanes, f32x8);
}

/* R rows of x times C 8-column vectors of one block (columns chunk * 8 * C ..), every group: out[r][column] +=.
 * xs: the pass's rows of x pre-scaled per field, interleaved [k_rows * pack][R]; xsum [R][n_groups]. */
static ALWAYS_INLINE void block_tile(const int32_t *block, const float *gp, const int32_t *group_rows,
                                     int64_t n_groups, const float *xs, const float *xsum, float (*out)[NB],
                                     const int chunk, const int bits, const int C, const int R) {
    const int pack = 32 / bits;
    const int first = chunk * 8 * C;
    /* One row alone gets two accumulators per vector (even and odd fields): twice the independent chains. */
    const int S = R == 1 ? 2 : 1;
    const int32_t *w = block + first;
    const float *x = xs;
    for (int64_t g = 0; g < n_groups; ++g) {
        f32x8 acc[MAX_PASS_ROWS][4];
        for (int a = 0; a < R * S; ++a)
            for (int c = 0; c < C; ++c) acc[a][c] = splat(0.0f);
        for (int32_t p = 0; p < group_rows[g]; ++p, w += NB, x += pack * R) {
            /* Both lines of the packed row PREFETCH_ROWS ahead: a thread streams one block at a time, and the
             * hardware prefetcher alone left the row loop waiting on memory. (A hint: it never faults past the end.) */
            if (chunk == 0) {
                __builtin_prefetch(w + PREFETCH_ROWS * NB);
                __builtin_prefetch(w + PREFETCH_ROWS * NB + 16);
            }
            u32x8 v[4];
            for (int c = 0; c < C; ++c) v[c] = load_u32x8(w + 8 * c);
#pragma GCC unroll 8
            for (int j = 0; j < pack; ++j) {
                f32x8 q[4];
                for (int c = 0; c < C; ++c) q[c] = field(v[c], bits, j);
                for (int r = 0; r < R; ++r) {
                    const f32x8 xv = splat(x[j * R + r]);
                    for (int c = 0; c < C; ++c) acc[r * S + j % S][c] += xv * q[c];
                }
            }
        }
        const float *scale = gp + g * 2 * NB + first, *offset = scale + NB;
        for (int c = 0; c < C; ++c) {
            const f32x8 s = load_f32x8(scale + 8 * c), o = load_f32x8(offset + 8 * c);
            for (int r = 0; r < R; ++r) {
                float *dst = out[r] + first + 8 * c;
                const f32x8 sum = S == 2 ? acc[2 * r][c] + acc[2 * r + 1][c] : acc[r][c];
                store_f32x8(dst, load_f32x8(dst) + s * sum + o * splat(xsum[r * n_groups + g]));
            }
        }
    }
}

/* One pass of R rows over a whole block, in chunks of C vectors with C * R <= 8 accumulators. */
static ALWAYS_INLINE void block_pass(const int32_t *block, const float *gp, const int32_t *group_rows,
                                    int64_t n_groups, const float *xs, const float *xsum, float (*out)[NB],
                                    const int bits, const int R) {
    const int C = R == 1 ? 4 : R == 2 ? 4 : R <= 4 ? 2 : 1;
    for (int chunk = 0; chunk < 4 / C; ++chunk)
        block_tile(block, gp, group_rows, n_groups, xs, xsum, out, chunk, bits, C, R);
}

typedef void (*PassFunction)(const int32_t *, const float *, const int32_t *, int64_t, const float *, const float *,
                             float (*)[NB]);

#define PASS_FOR(BITS, R)                                                                                       \
    static void pass_##BITS##_##R(const int32_t *block, const float *gp, const int32_t *group_rows,            \
                                  int64_t n_groups, const float *xs, const float *xsum, float (*out)[NB]) {    \
        block_pass(block, gp, group_rows, n_groups, xs, xsum, out, BITS, R);                                   \
    }
PASS_FOR(4, 1)
PASS_FOR(4, 2)
PASS_FOR(4, 3)
PASS_FOR(4, 4)
PASS_FOR(4, 8)
PASS_FOR(8, 1)
PASS_FOR(8, 2)
PASS_FOR(8, 3)
PASS_FOR(8, 4)
PASS_FOR(8, 8)

/* Rows of x a pass takes when `remaining` are left: 8, 4, then what is left (1..3). */
static ALWAYS_INLINE int pass_rows(int64_t remaining) { return remaining >= 8 ? 8 : remaining >= 4 ? 4 : (int)remaining; }

static PassFunction pass_function(int bits, int rows) {
    static const PassFunction four[] = {NULL, pass_4_1, pass_4_2, pass_4_3, pass_4_4, NULL, NULL, NULL, pass_4_8};
    static const PassFunction eight[] = {NULL, pass_8_1, pass_8_2, pass_8_3, pass_8_4, NULL, NULL, NULL, pass_8_8};
    return bits == 4 ? four[rows] : eight[rows];
}

static ALWAYS_INLINE float load_x(const void *x, int64_t index, int bf16) {
    if (!bf16) return ((const float *)x)[index];
    const uint32_t bits = (uint32_t)((const uint16_t *)x)[index] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Rows first .. first + R of x gathered into internal order and interleaved ([k'][R]), each field's value
 * pre-scaled by 2^(-bits j) (exact: a power of two), and each row's plain sums of x over the groups. */
static void prepare_pass(const void *x, int x_bf16, int64_t x_stride, int64_t first, int R, const int32_t *src,
                         int bits, const int32_t *group_rows, int64_t n_groups, float *xs, float *xsum) {
    const int pack = 32 / bits;
    float field_scale[8];
    for (int j = 0; j < pack; ++j) field_scale[j] = j == pack - 1 ? 1.0f : 1.0f / (float)(1u << (bits * j));
    for (int r = 0; r < R; ++r) {
        const int64_t x_row = (first + r) * x_stride;
        int64_t k = 0;
        for (int64_t g = 0; g < n_groups; ++g) {
            float sum = 0.0f;
            const int64_t end = k + (int64_t)group_rows[g] * pack;
            for (; k < end; ++k) {
                const int64_t feature = src != NULL ? src[k] : k;
                const float value = feature >= 0 ? load_x(x, x_row + feature, x_bf16) : 0.0f;
                sum += value;
                xs[k * R + r] = value * field_scale[k % pack];
            }
            xsum[r * n_groups + g] = sum;
        }
    }
}

/* float32 -> bfloat16, rounded to nearest even (NaN to 0x7FC0), as torch rounds. */
static ALWAYS_INLINE uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if (value != value) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* A pass's sums for one block of columns (+ bias, if not NULL) into rows first .. first + taken of y. */
static ALWAYS_INLINE void store_block(float out[MAX_PASS_ROWS][NB], int taken, int64_t width, const float *bias,
                                      int64_t column, void *y, int y_bf16, int64_t y_stride, int64_t first) {
    for (int r = 0; r < taken; ++r) {
        const int64_t at = (first + r) * y_stride + column;
        for (int64_t c = 0; c < width; ++c) {
            const float value = out[r][c] + (bias != NULL ? bias[column + c] : 0.0f);
            if (y_bf16) ((uint16_t *)y)[at + c] = to_bf16(value);
            else ((float *)y)[at + c] = value;
        }
    }
}

/* y [rows][y_stride] (columns 0 .. out_features; float32, or bfloat16 if y_bf16) = x [rows][x_stride] (float32, or
 * bfloat16 if x_bf16) W^T (+ bias[out_features] if not NULL). Returns 1 if the scratch for x could not be allocated,
 * 2 for bits other than 4 and 8. */
int wna16_matmul(const int32_t *packed, const float *gparams, const int32_t *group_rows, const int32_t *src,
                 int bits, int64_t n_groups, int64_t k_rows, int64_t out_features, const void *x, int x_bf16,
                 int64_t rows, int64_t x_stride, void *y, int y_bf16, int64_t y_stride, const float *bias) {
    if (bits != 4 && bits != 8) return 2;
    if (rows <= 0 || out_features <= 0) return 0;
    const int pack = 32 / bits;
    const int64_t k_internal = k_rows * pack, n_blocks = (out_features + NB - 1) / NB;
    int64_t n_passes = 0;
    for (int64_t row = 0; row < rows; row += pass_rows(rows - row)) ++n_passes;
    float *xs = malloc(sizeof(float) * (size_t)(rows * k_internal));
    float *xsum = malloc(sizeof(float) * (size_t)(rows * (n_groups > 0 ? n_groups : 1)));
    int64_t *pass_first = malloc(sizeof(int64_t) * (size_t)n_passes);
    if (xs == NULL || xsum == NULL || pass_first == NULL) {
        free(xs);
        free(xsum);
        free(pass_first);
        return 1;
    }
    for (int64_t p = 0, row = 0; p < n_passes; row += pass_rows(rows - row)) pass_first[p++] = row;
    const int parallel = rows * k_internal * n_blocks * NB >= PARALLEL_MIN_WORK;
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < n_passes; ++p) {
            const int64_t first = pass_first[p];
            prepare_pass(x, x_bf16, x_stride, first, pass_rows(rows - first), src, bits, group_rows, n_groups,
                         xs + first * k_internal, xsum + first * n_groups);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < n_blocks; ++b) {
            const int32_t *block = packed + b * k_rows * NB;
            const float *gp = gparams + b * n_groups * 2 * NB;
            const int64_t column = b * NB, width = out_features - column < NB ? out_features - column : NB;
            float out[MAX_PASS_ROWS][NB];
            for (int64_t p = 0; p < n_passes; ++p) {
                const int64_t first = pass_first[p];
                const int taken = pass_rows(rows - first);
                memset(out, 0, sizeof out);
                pass_function(bits, taken)(block, gp, group_rows, n_groups, xs + first * k_internal,
                                           xsum + first * n_groups, out);
                store_block(out, taken, width, bias, column, y, y_bf16, y_stride, first);
            }
        }
    }
    free(xs);
    free(xsum);
    free(pass_first);
    return 0;
}

/* Field j of each lane as its integer value, converted to float. */
static ALWAYS_INLINE f32x8 field_value(u32x8 v, const int bits, const int j) {
    const uint32_t mask = (1u << bits) - 1;
    return __builtin_convertvector((i32x8)((v >> (bits * j)) & mask), f32x8);
}

static ALWAYS_INLINE void dequantize_block(const int32_t *block, const float *gp, const int32_t *group_rows,
                                          int64_t n_groups, const int32_t *src, int64_t width, float *out,
                                          int64_t out_stride, const int bits) {
    const int pack = 32 / bits;
    const int32_t *w = block;
    int64_t k = 0;
    for (int64_t g = 0; g < n_groups; ++g) {
        f32x8 s[4], o[4];
        for (int c = 0; c < 4; ++c) {
            s[c] = load_f32x8(gp + g * 2 * NB + 8 * c);
            o[c] = load_f32x8(gp + g * 2 * NB + NB + 8 * c);
        }
        for (int32_t p = 0; p < group_rows[g]; ++p, w += NB) {
            u32x8 v[4];
            for (int c = 0; c < 4; ++c) v[c] = load_u32x8(w + 8 * c);
            for (int j = 0; j < pack; ++j, ++k) {
                const int64_t feature = src != NULL ? src[k] : k;
                if (feature < 0) continue;
                float *row = out + feature * out_stride;
                if (width == NB) {
                    for (int c = 0; c < 4; ++c) store_f32x8(row + 8 * c, s[c] * field_value(v[c], bits, j) + o[c]);
                } else {
                    float values[NB];
                    for (int c = 0; c < 4; ++c) store_f32x8(values + 8 * c, s[c] * field_value(v[c], bits, j) + o[c]);
                    memcpy(row, values, sizeof(float) * (size_t)width);
                }
            }
        }
    }
}

/* One weight of a group that wna16_matmul_experts runs in one call (a mixture-of-experts layer's experts, one
 * projection): wna16_matmul's leading arguments. */
typedef struct {
    const int32_t *packed;
    const float *gparams;
    const int32_t *group_rows;
    const int32_t *src;
    int64_t n_groups, k_rows;
} Wna16Weight;

/* A pass of wna16_matmul_experts: `taken` rows of x from `first`, times weight `weight`, its scratch at the
 * offsets given. */
typedef struct {
    int64_t first, xs, xsum;
    int32_t weight, taken;
} ExpertPass;

/* wna16_matmul (without bias) for several weights of `bits` bits and `out_features` outputs in one parallel
 * region: weight ids[i] times the next counts[i] rows of x (in the order of i), into the same rows of y. A
 * decode step's experts each take a few rows: one call for all of them spares a call, its scratch and a fork of
 * the threads per expert. Returns as wna16_matmul. */
int wna16_matmul_experts(const Wna16Weight *weights, int bits, int64_t out_features, const int32_t *ids,
                         const int64_t *counts, int64_t n, const void *x, int x_bf16, int64_t x_stride, void *y,
                         int y_bf16, int64_t y_stride) {
    if (bits != 4 && bits != 8) return 2;
    if (n <= 0 || out_features <= 0) return 0;
    const int pack = 32 / bits;
    const int64_t n_blocks = (out_features + NB - 1) / NB;
    int64_t n_passes = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t row = 0; row < counts[i]; row += pass_rows(counts[i] - row)) ++n_passes;
    ExpertPass *passes = malloc(sizeof(ExpertPass) * (size_t)(n_passes > 0 ? n_passes : 1));
    if (passes == NULL) return 1;
    int64_t xs_total = 0, xsum_total = 0, work = 0;
    for (int64_t i = 0, p = 0, first = 0; i < n; first += counts[i++]) {
        const Wna16Weight *w = weights + ids[i];
        for (int64_t row = 0; row < counts[i]; row += pass_rows(counts[i] - row), ++p) {
            const int taken = pass_rows(counts[i] - row);
            passes[p] = (ExpertPass){first + row, xs_total, xsum_total, ids[i], taken};
            xs_total += taken * w->k_rows * pack;
            xsum_total += taken * (w->n_groups > 0 ? w->n_groups : 1);
            work += taken * w->k_rows * pack * n_blocks * NB;
        }
    }
    float *xs = malloc(sizeof(float) * (size_t)(xs_total > 0 ? xs_total : 1));
    float *xsum = malloc(sizeof(float) * (size_t)(xsum_total > 0 ? xsum_total : 1));
    if (xs == NULL || xsum == NULL) {
        free(xs);
        free(xsum);
        free(passes);
        return 1;
    }
    const int64_t items = n_passes * n_blocks;
#pragma omp parallel if (work >= PARALLEL_MIN_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < n_passes; ++p) {
            const ExpertPass *pass = passes + p;
            const Wna16Weight *w = weights + pass->weight;
            prepare_pass(x, x_bf16, x_stride, pass->first, pass->taken, w->src, bits, w->group_rows, w->n_groups,
                         xs + pass->xs, xsum + pass->xsum);
        }
        /* Items in (pass, block) order: a thread's share walks one expert's blocks in turn. */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            const ExpertPass *pass = passes + item / n_blocks;
            const Wna16Weight *w = weights + pass->weight;
            const int64_t b = item % n_blocks, column = b * NB;
            const int64_t width = out_features - column < NB ? out_features - column : NB;
            float out[MAX_PASS_ROWS][NB];
            memset(out, 0, sizeof out);
            pass_function(bits, pass->taken)(w->packed + b * w->k_rows * NB, w->gparams + b * w->n_groups * 2 * NB,
                                             w->group_rows, w->n_groups, xs + pass->xs, xsum + pass->xsum, out);
            store_block(out, pass->taken, width, NULL, column, y, y_bf16, y_stride, pass->first);
        }
    }
    free(xs);
    free(xsum);
    free(passes);
    return 0;
}

/* out [in_features][out_stride] = columns n_first .. n_first + n_count of W^T (n_first a multiple of NB; out_stride
 * >= n_count): each input feature's row in input order (padding rows dropped), a tile for a dense GEMM x @ tile.
 * Returns 2 for bits other than 4 and 8, 3 for an n_first that is not a block boundary. */
int wna16_dequantize_t(const int32_t *packed, const float *gparams, const int32_t *group_rows, const int32_t *src,
                       int bits, int64_t n_groups, int64_t k_rows, int64_t n_first, int64_t n_count, float *out,
                       int64_t out_stride) {
    if (bits != 4 && bits != 8) return 2;
    if (n_first % NB) return 3;
    const int64_t first_block = n_first / NB, n_blocks = (n_count + NB - 1) / NB;
#pragma omp parallel for schedule(static) if (n_count * k_rows * (32 / bits) >= PARALLEL_MIN_WORK / 4)
    for (int64_t i = 0; i < n_blocks; ++i) {
        const int64_t b = first_block + i, width = n_count - i * NB < NB ? n_count - i * NB : NB;
        const int32_t *block = packed + b * k_rows * NB;
        const float *gp = gparams + b * n_groups * 2 * NB;
        if (bits == 4)
            dequantize_block(block, gp, group_rows, n_groups, src, width, out + i * NB, out_stride, 4);
        else
            dequantize_block(block, gp, group_rows, n_groups, src, width, out + i * NB, out_stride, 8);
    }
    return 0;
}

/* rows [in_features][NB] float32 (a block's dequantized columns, `width` of them, a multiple of 16) -> out
 * [width / 16][in_features / 2][16][2] bfloat16 rounded to nearest even (NaN to 0x7FC0): linear_bf16's packed
 * layout, where each input pair of 16 columns is 16 words holding the first input's bfloat16 in their low half
 * and the second's in their high half. */
static void pack_block_bf16(const float *rows, int64_t in_features, int64_t width, uint16_t *out) {
    const int64_t pairs = in_features / 2;
    uint32_t *words = (uint32_t *)out;
    for (int64_t panel = 0; panel < width / 16; ++panel) {
        for (int64_t pair = 0; pair < pairs; ++pair) {
            for (int half = 0; half < 2; ++half) {
                u32x8 rounded[2];
                for (int i = 0; i < 2; ++i) {
                    const f32x8 v = load_f32x8(rows + (2 * pair + i) * NB + panel * 16 + half * 8);
                    const u32x8 bits = (u32x8)v, nan = (u32x8)(v != v);
                    rounded[i] = ((bits + 0x7FFFu + ((bits >> 16) & 1u)) & ~nan) | (0x7FC00000u & nan);
                }
                const u32x8 packed = (rounded[0] >> 16) | (rounded[1] & 0xFFFF0000u);
                memcpy(words + (panel * pairs + pair) * 16 + half * 8, &packed, sizeof packed);
            }
        }
    }
}

/* Sixteen columns (one linear_bf16 panel) of two consecutive input features as one 64-byte row of its packed
 * layout: word j = column j's bfloat16 of `first` in the low half, of `second` in the high half, each rounded
 * to nearest even as pack_block_bf16 rounds (VCVTNE2PS2BF16 and a word interleave where the build has
 * avx512_bf16; it reads subnormal values as zero, which no dequantized weight of a real checkpoint is). */
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

static ALWAYS_INLINE u32x16 bf16_pair_row(f32x16 first, f32x16 second) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)second, (__m512)first); /* first's in words 0..15 */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return (u32x16)_mm512_permutexvar_epi16(interleave, both);
#else
    const u32x16 a = (u32x16)first, b = (u32x16)second;
    const u32x16 a_nan = (u32x16)(first != first), b_nan = (u32x16)(second != second);
    const u32x16 ra = ((a + 0x7FFFu + ((a >> 16) & 1u)) & ~a_nan) | (0x7FC00000u & a_nan);
    const u32x16 rb = ((b + 0x7FFFu + ((b >> 16) & 1u)) & ~b_nan) | (0x7FC00000u & b_nan);
    return (ra >> 16) | (rb & 0xFFFF0000u);
#endif
}

/* Field j of each lane as its integer value, converted to float (field_value's 16 lanes). */
static ALWAYS_INLINE f32x16 field_value16(u32x16 v, const int bits, const int j) {
    const uint32_t mask = (1u << bits) - 1;
    return __builtin_convertvector((i32x16)((v >> (bits * j)) & mask), f32x16);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* Act-order layouts put the input features out of order: each internal row's 16 columns go to its feature's
 * half of the pair row, one masked store of 16-bit lanes (the other feature of the pair writes the other half). */
#define HAVE_SCATTERED_BF16_ROWS 1
static ALWAYS_INLINE void store_feature_row(uint16_t *pair_row, f32x16 values, int64_t feature) {
    const __m512i words = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)values));
    if (feature & 1) _mm512_mask_storeu_epi16(pair_row, 0xAAAAAAAAu, _mm512_slli_epi32(words, 16));
    else _mm512_mask_storeu_epi16(pair_row, 0x55555555u, words);
}
#endif

/* A block's columns (`width`: 16 or NB) straight into linear_bf16's packed layout, each weight computed (as
 * dequantize_block computes it), rounded in registers and written once: with the features in order (no src)
 * each pair of fields of a packed row is one pair of input features; in act order each feature's row is
 * stored into its half of its pair (HAVE_SCATTERED_BF16_ROWS only). */
static ALWAYS_INLINE void dequantize_block_bf16(const int32_t *block, const float *gp, const int32_t *group_rows,
                                               int64_t n_groups, const int32_t *src, int64_t in_features,
                                               int64_t width, uint16_t *out, const int bits) {
    const int pack = 32 / bits, panels = (int)(width / 16);
    const int64_t pairs = in_features / 2;
    const int32_t *w = block;
    int64_t k = 0;
    for (int64_t g = 0; g < n_groups; ++g) {
        f32x16 s[2], o[2];
        for (int c = 0; c < panels; ++c) {
            memcpy(&s[c], gp + g * 2 * NB + 16 * c, sizeof s[c]);
            memcpy(&o[c], gp + g * 2 * NB + NB + 16 * c, sizeof o[c]);
        }
        for (int32_t p = 0; p < group_rows[g]; ++p, w += NB, k += pack) {
            u32x16 v[2];
            for (int c = 0; c < panels; ++c) memcpy(&v[c], w + 16 * c, sizeof v[c]);
            if (src == NULL) {
                for (int j = 0; j < pack; j += 2) {
                    const int64_t pair = (k + j) / 2;
                    if (pair >= pairs) return; /* the last packed row's fields past in_features */
                    for (int c = 0; c < panels; ++c) {
                        const u32x16 row = bf16_pair_row(s[c] * field_value16(v[c], bits, j) + o[c],
                                                         s[c] * field_value16(v[c], bits, j + 1) + o[c]);
                        memcpy(out + (c * pairs + pair) * 32, &row, sizeof row);
                    }
                }
            }
#ifdef HAVE_SCATTERED_BF16_ROWS
            else {
                for (int j = 0; j < pack; ++j) {
                    const int64_t feature = src[k + j];
                    if (feature < 0) continue;
                    for (int c = 0; c < panels; ++c)
                        store_feature_row(out + (c * pairs + feature / 2) * 32,
                                          s[c] * field_value16(v[c], bits, j) + o[c], feature);
                }
            }
#endif
        }
    }
}

/* Block b of the layout (its first `width` columns) into `out` in linear_bf16's packed layout. `rows`: float32
 * scratch [in_features][NB] for act order where the build cannot scatter (dequantize_block, then
 * pack_block_bf16); unused otherwise. */
static void block_into_bf16(const int32_t *packed, const float *gparams, const int32_t *group_rows,
                            const int32_t *src, int bits, int64_t n_groups, int64_t k_rows, int64_t in_features,
                            int64_t b, int64_t width, uint16_t *out, float *rows) {
    const int32_t *block = packed + b * k_rows * NB;
    const float *gp = gparams + b * n_groups * 2 * NB;
#ifndef HAVE_SCATTERED_BF16_ROWS
    if (src != NULL) {
        if (bits == 4) dequantize_block(block, gp, group_rows, n_groups, src, width, rows, NB, 4);
        else dequantize_block(block, gp, group_rows, n_groups, src, width, rows, NB, 8);
        pack_block_bf16(rows, in_features, width, out);
        return;
    }
#else
    (void)rows;
#endif
    if (bits == 4) dequantize_block_bf16(block, gp, group_rows, n_groups, src, in_features, width, out, 4);
    else dequantize_block_bf16(block, gp, group_rows, n_groups, src, in_features, width, out, 8);
}

/* Whether block_into_bf16 needs its float32 scratch for this layout. */
static int needs_rows_scratch(const int32_t *src) {
#ifdef HAVE_SCATTERED_BF16_ROWS
    (void)src;
    return 0;
#else
    return src != NULL;
#endif
}

/* out [n_count / 16][in_features / 2][16][2] bfloat16 = columns n_first .. n_first + n_count of W (n_first a
 * multiple of NB, n_count of 16), each weight s q + o computed as wna16_dequantize_t computes it and rounded once
 * to bfloat16, in linear_bf16's packed layout (csrc/linear_bf16.c). Returns 2 and 3 as wna16_dequantize_t does, 4
 * for an odd in_features or an n_count that is not a multiple of 16, 5 if memory ran out. */
int wna16_dequantize_bf16_packed(const int32_t *packed, const float *gparams, const int32_t *group_rows,
                                 const int32_t *src, int bits, int64_t n_groups, int64_t k_rows, int64_t in_features,
                                 int64_t n_first, int64_t n_count, uint16_t *out) {
    if (bits != 4 && bits != 8) return 2;
    if (n_first % NB) return 3;
    if (in_features <= 0 || in_features % 2 != 0 || n_count < 0 || n_count % 16 != 0) return 4;
    const int64_t first_block = n_first / NB, n_blocks = (n_count + NB - 1) / NB;
    int failed = 0;
#pragma omp parallel if (n_count * k_rows * (32 / bits) >= PARALLEL_MIN_WORK / 4)
    {
        float *rows = needs_rows_scratch(src) ? malloc(sizeof(float) * (size_t)(in_features * NB)) : NULL;
        if (needs_rows_scratch(src) && rows == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_blocks; ++i) {
            if (needs_rows_scratch(src) && rows == NULL) continue;
            const int64_t width = n_count - i * NB < NB ? n_count - i * NB : NB;
            block_into_bf16(packed, gparams, group_rows, src, bits, n_groups, k_rows, in_features, first_block + i,
                            width, out + i * NB * in_features, rows);
        }
        free(rows);
    }
    return failed ? 5 : 0;
}

/* One weight as the decode stack calls its products (decode_stack.c: gguf_matmul's signature): its
 * wna16_matmul arguments and bits, and where bfloat16 rows go to linear_bf16's tiles (as WNA16Kernels.product
 * sends them). */
typedef struct {
    Wna16Weight weight;
    int64_t bits;
    BF16Tiles tiles;
} Wna16StackLayer;

static int stack_layer_columns(const void *w, int64_t K, int64_t N, int64_t first, int64_t n, uint16_t *tile) {
    (void)N;
    const Wna16StackLayer *layer = w;
    const Wna16Weight *weight = &layer->weight;
    return wna16_dequantize_bf16_packed(weight->packed, weight->gparams, weight->group_rows, weight->src,
                                        (int)layer->bits, weight->n_groups, weight->k_rows, K, first, n, tile);
}

/* wna16_matmul behind gguf_matmul's signature (`type` unused; activations and outputs in one dtype, rows
 * contiguous, no bias), for the decode stack; bfloat16 rows from the layer's tiles.min_rows on linear_bf16's
 * tiles. Returns wna16_matmul's codes (1: memory ran out), 2 for inputs it does not take. */
int wna16_stack_product(int type, const void *w, const void *x, int x_bf16, int64_t rows, int64_t K, int64_t N,
                        void *y, int y_bf16) {
    (void)type;
    if (x_bf16 != y_bf16 || rows < 0 || K <= 0) return 2;
    if (rows == 0) return 0;
    const Wna16StackLayer *layer = w;
    if (bf16_tiles_take(&layer->tiles, x_bf16, rows))
        return bf16_tiles_product(&layer->tiles, layer, stack_layer_columns, x, rows, K, N, y, N);
    const Wna16Weight *weight = &layer->weight;
    return wna16_matmul(weight->packed, weight->gparams, weight->group_rows, weight->src, (int)layer->bits,
                        weight->n_groups, weight->k_rows, N, x, x_bf16, rows, K, y, y_bf16, N, NULL);
}

/* y [rows, N] bfloat16 (rows y_stride apart) = bfloat16 x @ W^T on the layer's tiles whatever the row count (the
 * layers' own products, pagellm/ops/wna16.py's _tiles_into). Returns 1 if memory ran out, 2 for a refusal. */
int wna16_tiles_product(const Wna16StackLayer *layer, const uint16_t *x, int64_t rows, int64_t K, int64_t N,
                        uint16_t *y, int64_t y_stride) {
    return bf16_tiles_product(&layer->tiles, layer, stack_layer_columns, x, rows, K, N, y, y_stride);
}

/* Columns per block of the layout (the wrapper checks it against its own). */
int wna16_block_columns(void) { return NB; }

const char *pagellm_isa(void) { return ISA_NAME; }
