/* Linear layers on 8-bit weights: int8 W8A8 (vLLM's compressed-tensors int8 schemes and quantization="int8")
 * and FP8 e4m3 weights (compressed-tensors float-quantized, quant_method fp8, quantization="fp8").
 *
 * w8a8_int8_linear: y [rows, N] = (x [rows, K] quantized per row to int8) W^T, integer products into int32, then
 *   y = acc * (x_scale[row] * w_scale[n]) + bias[n] in float32. Each row of x is quantized here, on the fly: with
 *   a static scale s (a checkpoint's input_scale) q = x * (1 / s), else dynamically per row, s = max|x| / 127 and
 *   q = x * (127 / max|x|); both rounded to nearest even and clamped to [-127, 127] (symmetric: -128 would not
 *   fit the AVX2 product below). A row holding a NaN or an infinity gets scale NaN (and q = 0), so that its
 *   outputs are NaN as they would be from a float product; other rows are untouched.
 *   With rotation > 1 (quantization="int8"'s online weights), each row is first multiplied by the block-diagonal
 *   Hadamard matrix of blocks of `rotation` inputs (hadamard_row below) and the rotated row is quantized: the
 *   weight was rotated the same way when it was quantized, so the product is unchanged, while an input channel
 *   far larger than the rest (which a per-row scale would flatten the others against) is spread over its block.
 *   The products: AVX2 has no signed x signed byte product, so VPMADDUBSW multiplies |w| (unsigned) by x with
 *   w's sign (VPSIGNB) into pairs of int16 (|w| <= 128, |x| <= 127: no saturation), and VPMADDWD sums the pairs
 *   into int32; AVX-512 VNNI or AVX-VNNI's VPDPBUSD takes unsigned x + 128 (x XOR 0x80) times signed w straight
 *   into the int32 sums, which then lose 128 * sum_k w[n][k] (colsum, computed when the weight is packed); the
 *   generic build widens to int16 with vector extensions. Every build yields the same exact int32 sums, so the
 *   outputs are identical across instruction sets, thread counts and tile shapes.
 * w8a8_fp8_linear: y = x W^T for fp8 e4m3 weights with a scale per output column and block of K (per-tensor
 *   and per-channel scales are one block of K; DeepSeek-style [128, 128] blocks are K blocks of 128). No CPU
 *   multiplies fp8: each 8-weight group is widened to float32 (through float16 bits and F16C where the build
 *   has it, exact for every finite value) and multiplied with float32 FMAs, or, for bfloat16 rows where the build
 *   has avx512_bf16, 32 weights at a time to bfloat16 pairs (exact too) for VDPBF16PS; activations stay in their
 *   dtype (weight-only, W8A16).
 * w8a8_int8_linear_experts, w8a8_fp8_linear_experts: those products for a mixture-of-experts layer's experts, each
 *   over its own rows, all in one call (a decode step's few rows per expert).
 * w8a8_fp8_dequantize: columns of the fp8 weight as a float32 or bfloat16 [K, n] tile (w * scale, one rounding),
 *   for torch's GEMM at prefill sizes (pagellm/ops/w8a8_kernels.py picks the path by row count).
 *
 * Packed layouts (made by pagellm/ops/w8a8_kernels.py; N padded to a multiple of 8 with zero weights):
 *   int8  [Np / 16][Kp / 4][16][4]: strip s, group g holds W[16s + c][4g + j] at [s][g][c][j] (Np: N rounded up to
 *         16, Kp: K rounded up to 4, both zero-padded). Each (strip, group) is 64 bytes: to the vector paths two
 *         32-byte vectors, the strip's two panels of 8 columns, whose int32 lane c sums column c's 4 products;
 *         to AMX one row of a B tile of 16 columns.
 *   fp8   [Np / 8][K][8]: panel p, input k holds W[8p + c][k] at [p][k][c] (one 8-byte load per panel and k).
 *   fp8 scales [blocks of K][Np] float32, multiplied by 256 (the widening yields w / 256, exactly).
 *
 * Built per instruction set with the flags of pagellm/ops/gguf_kernels.py (-ffp-contract=off: the float
 * epilogues round where the torch reference does), OpenMP on torch's thread pool (see ops/cpu_build.py).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h"
#include "gguf_simd.h"
#include "isa_name.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAVE_AMX_INT8 1
#include "amx_tiles.h"
#else
#define HAVE_AMX_INT8 0
#endif

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

typedef int16_t i16x8 __attribute__((vector_size(16)));

#define PANEL 8
#define STRIP 16 /* int8 columns per packed strip: two vector panels, one AMX tile's width */
#define GROUP 4
/* Register tiles: rows of x by panels of 8 outputs, all accumulators in the 16 vector registers AVX2 has. */
#define INT8_ROWS 4
#define INT8_PANELS 2
#define FP8_ROWS 4
#define FP8_PANELS 2
/* Below this many multiply-adds a call runs on the calling thread (a parallel region costs more there). */
#define PARALLEL_MIN_WORK (1 << 18)
/* |sum| <= K * 255 * 128 must fit int32 in the VNNI build (x + 128 <= 255). */
#define MAX_IN_FEATURES 65536

/* ---- activations ------------------------------------------------------------------------------------ */

static ALWAYS_INLINE float load_one(const void *x, int64_t index, const int bf16) {
    if (!bf16) return ((const float *)x)[index];
    const uint32_t bits = (uint32_t)((const uint16_t *)x)[index] << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* v clamped to [-127, 127] and rounded to nearest even (adding and subtracting 1.5 * 2^23 rounds a float of
 * magnitude below 2^22 to an integer; -ffp-contract=off and no -ffast-math keep the two operations). */
static ALWAYS_INLINE float round_clamped(float v) {
    v = v > 127.0f ? 127.0f : v;
    v = v < -127.0f ? -127.0f : v;
    return (v + 12582912.0f) - 12582912.0f;
}

/* The scale of a row whose largest magnitude is amax (finite), and its inverse; static_scale > 0: that scale. */
static ALWAYS_INLINE float row_scale(float amax, float static_scale, float *inverse) {
    if (static_scale > 0.0f) {
        *inverse = 1.0f / static_scale;
        return static_scale;
    }
    *inverse = amax != 0.0f ? 127.0f / amax : 0.0f;
    return amax / 127.0f;
}

/* AVX-512 builds (cpu_build.py's "avx512" always has BW and VL): 16 floats a register, masked loads and stores. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512BW 1
/* n <= 16 values of x from `index` (zero past n), widened to float32. */
static ALWAYS_INLINE __m512 load_x16(const void *x, int64_t index, int n, const int bf16) {
    const __mmask16 mask = (__mmask16)((1u << n) - 1u); /* n in [0, 16] */
    if (!bf16) return _mm512_maskz_loadu_ps(mask, (const float *)x + index);
    const __m256i halves = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + index);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

/* quantize_row's arithmetic 16 values at a time: the largest magnitude as the largest of the absolute values'
 * bit patterns (non-negative floats order as their bits; an infinity or NaN is above every finite one), the
 * same multiply, clamp (max first: a NaN product becomes -127, as max_f32 makes it) and round to nearest even. */
static float quantize_row16_given(const void *x, int64_t base, int64_t K, int64_t Kp, const int bf16,
                                  float static_scale, uint32_t top, int8_t *q);

static float quantize_row16(const void *x, int64_t row, int64_t K, int64_t Kp, const int bf16, float static_scale,
                            int8_t *q) {
    const int64_t base = row * K;
    __m512i amax_bits = _mm512_setzero_si512();
    for (int64_t i = 0; i < K; i += 16) {
        const __m512i bits = _mm512_castps_si512(load_x16(x, base + i, K - i < 16 ? (int)(K - i) : 16, bf16));
        amax_bits = _mm512_max_epu32(amax_bits, _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)));
    }
    return quantize_row16_given(x, base, K, Kp, bf16, static_scale, (uint32_t)_mm512_reduce_max_epu32(amax_bits), q);
}

/* quantize_row16 past its first pass: `top`, the largest of the row's absolute values' bit patterns, known. */
static float quantize_row16_given(const void *x, int64_t base, int64_t K, int64_t Kp, const int bf16,
                                  float static_scale, uint32_t top, int8_t *q) {
    if (top >= 0x7F800000u) {
        memset(q, 0, (size_t)Kp);
        return NAN;
    }
    float amax, inverse;
    memcpy(&amax, &top, sizeof amax);
    const float scale = row_scale(amax, static_scale, &inverse);
    const __m512 factor = _mm512_set1_ps(inverse), low = _mm512_set1_ps(-127.0f), high = _mm512_set1_ps(127.0f);
    for (int64_t i = 0; i < Kp; i += 16) {
        const int n = Kp - i < 16 ? (int)(Kp - i) : 16, loaded = K - i < n ? (int)(K - i) : n;
        __m512 v = _mm512_mul_ps(load_x16(x, base + i, loaded, bf16), factor);
        v = _mm512_min_ps(_mm512_max_ps(v, low), high);
        const __m128i bytes =
            _mm512_cvtepi32_epi8(_mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_mask_storeu_epi8(q + i, (__mmask16)((1u << n) - 1u), bytes);
    }
    return scale;
}
#else
#define HAVE_AVX512BW 0
#endif

/* Row `row` of x (K values) into q[0 .. Kp) (zero past K); returns its scale. static_scale > 0: that scale. */
static float quantize_row(const void *x, int64_t row, int64_t K, int64_t Kp, const int bf16, float static_scale,
                          int8_t *q) {
#if HAVE_AVX512BW
    return quantize_row16(x, row, K, Kp, bf16, static_scale, q);
#else
    const int64_t base = row * K, full = K / 8 * 8;
    f32x8 amax8 = splat_f32(0.0f);
    for (int64_t i = 0; i < full; i += 8) {
        const f32x8 v = load_x8(x, base + i, bf16);
        amax8 = max_f32((f32x8)((i32x8)v & 0x7FFFFFFF), amax8);
        amax8 = (f32x8)((i32x8)amax8 | ((i32x8)(v != v) & 0x7FC00000)); /* a NaN stays */
    }
    float amax = 0.0f;
    int finite = 1;
    for (int k = 0; k < 8; ++k) {
        if (!(amax8[k] <= 3.4028235e38f)) finite = 0;
        amax = amax8[k] > amax ? amax8[k] : amax;
    }
    for (int64_t i = full; i < K; ++i) {
        const float v = fabsf(load_one(x, base + i, bf16));
        if (!(v <= 3.4028235e38f)) finite = 0;
        amax = v > amax ? v : amax;
    }
    if (!finite) {
        memset(q, 0, (size_t)Kp);
        return NAN;
    }
    float inverse;
    const float scale = row_scale(amax, static_scale, &inverse);
    const f32x8 low = splat_f32(-127.0f), high = splat_f32(127.0f), magic = splat_f32(12582912.0f);
    for (int64_t i = 0; i < full; i += 8) {
        f32x8 v = load_x8(x, base + i, bf16) * inverse;
        v = max_f32(v, low);
        v = -max_f32(-v, -high);
        const i32x8 rounded = __builtin_convertvector((v + magic) - magic, i32x8);
        const i8x32 bytes = (i8x32)rounded;
        const i8x8 packed = __builtin_shufflevector(bytes, bytes, 0, 4, 8, 12, 16, 20, 24, 28);
        memcpy(q + i, &packed, sizeof packed);
    }
    for (int64_t i = full; i < K; ++i) q[i] = (int8_t)round_clamped(load_one(x, base + i, bf16) * inverse);
    for (int64_t i = K; i < Kp; ++i) q[i] = 0;
    return scale;
#endif
}

/* VPDPBUSD multiplies unsigned bytes by signed ones: the vector paths of a VNNI build read x + 128 (x XOR 0x80),
 * biased once per row here rather than once per row and weight group in the product loops. The column sums of
 * the packed weight take the 128 back out. */
static void bias_row(int8_t *q, int64_t Kp) {
    for (int64_t i = 0; i < Kp; ++i) q[i] = (int8_t)((uint8_t)q[i] ^ 0x80u);
}

/* ---- rotated rows ----------------------------------------------------------------------------------- */

#define MAX_ROTATION 4096
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16_unaligned __attribute__((vector_size(64), aligned(4)));

/* Whether `rotation` is a block size the rotated rows take for K inputs: 0 or 1 (none), or a power of two up to
 * MAX_ROTATION dividing K. */
static int rotation_valid(int64_t rotation, int64_t K) {
    if (rotation <= 1) return rotation >= 0;
    return rotation <= MAX_ROTATION && (rotation & (rotation - 1)) == 0 && K % rotation == 0;
}

typedef uint16_t u16x16_unaligned __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* 16 values of x from `index` as float32. */
static ALWAYS_INLINE f32x16 load16(const void *x, int64_t index, const int bf16) {
    if (!bf16) return *(const f32x16_unaligned *)((const float *)x + index);
    const u32x16 wide = __builtin_convertvector(*(const u16x16_unaligned *)((const uint16_t *)x + index), u32x16);
    return (f32x16)(wide << 16);
}

/* partner + value * signs, rounded once: value * +-1 is exact, so this is partner + value or partner - value
 * whether fused (one instruction where the build has AVX-512) or not. */
static ALWAYS_INLINE f32x16 add_signed(f32x16 partner, f32x16 value, f32x16 signs) {
#if defined(__AVX512F__)
    return (f32x16)_mm512_fmadd_ps((__m512)value, (__m512)signs, (__m512)partner);
#else
    return partner + value * signs;
#endif
}

/* One butterfly stage of distance h < 16 inside 16 values: value j and its partner j ^ h become partner + value
 * (lower of the two) and partner - value (upper), as the scalar stage's a + b and a - b (x + (-y) is x - y
 * exactly). */
#define BUTTERFLY16(v, h, ...)                                                                                   \
    do {                                                                                                         \
        static const f32x16 signs = SIGNS##h;                                                                    \
        v = add_signed(__builtin_shufflevector(v, v, __VA_ARGS__), v, signs);                                    \
    } while (0)
#define SIGNS1 {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1}
#define SIGNS2 {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1}
#define SIGNS4 {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1}
#define SIGNS8 {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1}

/* The stages of distance 1, 2, 4 and 8 of 16 values. */
static ALWAYS_INLINE f32x16 butterflies16(f32x16 v) {
    BUTTERFLY16(v, 1, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    BUTTERFLY16(v, 2, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    BUTTERFLY16(v, 4, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    BUTTERFLY16(v, 8, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    return v;
}

static ALWAYS_INLINE void butterfly_pair(f32x16_unaligned *low, f32x16_unaligned *high) {
    const f32x16 a = *low, b = *high;
    *low = a + b;
    *high = a - b;
}

/* The largest of v's absolute values' bit patterns and top's, lane by lane (non-negative floats order as their
 * bits; an infinity or NaN is above every finite one). */
static ALWAYS_INLINE u32x16 magnitude_bits_max(u32x16 top, f32x16 v) {
    const u32x16 bits = (u32x16)v & 0x7FFFFFFFu;
    const u32x16 above = (u32x16)(bits > top);
    return (bits & above) | (top & ~above);
}

/* The largest of out[0 .. K)'s absolute values' bit patterns (quantize_row16's first pass). */
static uint32_t magnitude_bits_top(const float *out, int64_t K) {
    uint32_t top = 0;
    for (int64_t i = 0; i < K; ++i) {
        uint32_t bits;
        memcpy(&bits, out + i, sizeof bits);
        bits &= 0x7FFFFFFFu;
        top = bits > top ? bits : top;
    }
    return top;
}

/* x's row `row` (K values) times the block-diagonal Hadamard matrix of order `rotation` (unnormalized: entries
 * +-1), in float32 into out[0 .. K): per block, butterfly stages of distance 1, 2, 4, ... (a, b) -> (a + b, a - b),
 * the order of pagellm/ops/w8a8_kernels.py's hadamard_rows, so that both give the same floats. The stages up to
 * distance 32 run in registers, 64 values at a time, as the row is loaded. Returns the largest of the rotated
 * values' absolute bit patterns, for quantize_row16_given. */
static uint32_t hadamard_row(const void *x, int64_t row, int64_t K, const int bf16, int64_t rotation, float *out) {
    const int64_t base = row * K;
    if (rotation < 16) {
        for (int64_t i = 0; i < K; ++i) out[i] = load_one(x, base + i, bf16);
        for (int64_t h = 1; h < rotation; h *= 2)
            for (int64_t i = 0; i < K; i += 2 * h)
                for (int64_t j = i; j < i + h; ++j) {
                    const float a = out[j], b = out[j + h];
                    out[j] = a + b;
                    out[j + h] = a - b;
                }
        return magnitude_bits_top(out, K);
    }
    const int64_t width = rotation < 64 ? rotation : 64, vectors = width / 16;
    u32x16 top = {0};
    for (int64_t i = 0; i < K; i += width) {
        f32x16 v[4];
        for (int64_t c = 0; c < vectors; ++c) v[c] = butterflies16(load16(x, base + i + 16 * c, bf16));
        if (vectors >= 2) butterfly_pair(&v[0], &v[1]);
        if (vectors == 4) {
            butterfly_pair(&v[2], &v[3]);
            butterfly_pair(&v[0], &v[2]);
            butterfly_pair(&v[1], &v[3]);
        }
        for (int64_t c = 0; c < vectors; ++c) {
            *(f32x16_unaligned *)(out + i + 16 * c) = v[c];
            top = magnitude_bits_max(top, v[c]);
        }
    }
    if (rotation <= 64) {
        uint32_t largest = 0;
        for (int lane = 0; lane < 16; ++lane) largest = top[lane] > largest ? top[lane] : largest;
        return largest;
    }
    for (int64_t h = 64; h < rotation; h *= 2)
        for (int64_t i = 0; i < K; i += 2 * h)
            for (int64_t j = i; j < i + h; j += 16)
                butterfly_pair((f32x16_unaligned *)(out + j), (f32x16_unaligned *)(out + j + h));
    return magnitude_bits_top(out, K);
}

/* quantize_row of row `row` of x, rotated first where rotation > 1. Returns 0 if memory ran out (q and *scale
 * untouched), else 1. */
static int quantize_input_row(const void *x, int64_t row, int64_t K, int64_t Kp, const int bf16, float static_scale,
                              int64_t rotation, int8_t *q, float *scale) {
    if (rotation <= 1) {
        *scale = quantize_row(x, row, K, Kp, bf16, static_scale, q);
        return 1;
    }
    /* The thread's tile buffer (bf16_tiles.h), free while rows are quantized: malloc'd, so float-aligned. */
    float *rotated = (float *)(void *)thread_tile(2 * (size_t)K);
    if (rotated == NULL) return 0;
    const uint32_t top = hadamard_row(x, row, K, bf16, rotation, rotated);
#if HAVE_AVX512BW
    *scale = quantize_row16_given(rotated, 0, K, Kp, 0, static_scale, top, q);
#else
    (void)top;
    *scale = quantize_row(rotated, 0, K, Kp, 0, static_scale, q);
#endif
    return 1;
}

/* ---- outputs ---------------------------------------------------------------------------------------- */

/* Bias of the 8 columns from col (zero past N or without bias). */
static ALWAYS_INLINE f32x8 load_bias(const void *bias, int64_t col, int64_t N, const int bf16) {
    if (bias == NULL) return splat_f32(0.0f);
    if (col + PANEL <= N) return load_x8(bias, col, bf16);
    f32x8 v = splat_f32(0.0f);
    for (int64_t c = 0; c < N - col; ++c) v[c] = load_one(bias, col + c, bf16);
    return v;
}

/* The 8 values of v at y[row][col ..], those before column N. */
static ALWAYS_INLINE void store_panel(void *y, int64_t row, int64_t col, int64_t N, f32x8 v, const int bf16) {
    const int64_t n = N - col < PANEL ? N - col : PANEL, index = row * N + col;
    if (!bf16) {
        if (n == PANEL) memcpy((float *)y + index, &v, sizeof v);
        else
            for (int64_t c = 0; c < n; ++c) ((float *)y)[index + c] = v[c];
        return;
    }
    const u16x8 bits = to_bf16(v);
    if (n == PANEL) memcpy((uint16_t *)y + index, &bits, sizeof bits);
    else
        for (int64_t c = 0; c < n; ++c) ((uint16_t *)y)[index + c] = bits[c];
}

/* ---- int8 products ---------------------------------------------------------------------------------- */

static ALWAYS_INLINE i32x8 splat_i32(int32_t v) { return (i32x8){v, v, v, v, v, v, v, v}; }

/* Column c's lane += the 4 products of w's bytes 4c .. 4c+3 with x's 4 bytes (x broadcast to every lane). AVX2:
 * `w_abs` is |w|, computed once per weight vector for all rows; VNNI: x holds x + 128 as unsigned bytes
 * (bias_row). */
static ALWAYS_INLINE i32x8 dot_accumulate(i32x8 acc, i8x32 w, u8x32 w_abs, i8x32 x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)w_abs;
    return (i32x8)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)x, (__m256i)w);
#elif defined(__AVXVNNI__)
    (void)w_abs;
    return (i32x8)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)x, (__m256i)w);
#elif defined(__AVX2__)
    const __m256i signed_x = _mm256_sign_epi8((__m256i)x, (__m256i)w);
    const __m256i pairs = _mm256_maddubs_epi16((__m256i)w_abs, signed_x);
    return acc + (i32x8)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else
    (void)w_abs;
    const i16x16 w_even = ((i16x16)w << 8) >> 8, w_odd = (i16x16)w >> 8;
    const i16x16 x_even = ((i16x16)x << 8) >> 8, x_odd = (i16x16)x >> 8;
    return acc + madd_i16(w_even * x_even + w_odd * x_odd, splat_i16(1));
#endif
}

static ALWAYS_INLINE u8x32 abs_bytes(i8x32 w) {
#if defined(__AVX2__) && !HAVE_VNNI
    return (u8x32)_mm256_abs_epi8((__m256i)w);
#else
    (void)w;
    return (u8x32){0};
#endif
}

typedef struct {
    const int8_t *xq; /* [rows][Kp] */
    const float *xs;  /* [rows] */
    const int8_t *packed;
    const int32_t *colsum; /* [Np] */
    const float *wscale;   /* [Np] */
    const void *bias;      /* [N] of y's dtype, or NULL */
    void *y;
    int64_t Kp, N;
    int y_bf16;
} Int8Problem;

/* y[row][col .. col + 8) from the exact int32 sums of its products. */
static ALWAYS_INLINE void int8_output(const Int8Problem *pr, int64_t row, int64_t col, i32x8 sums, f32x8 wscale,
                                      f32x8 bias) {
    const f32x8 out = to_f32(sums) * (splat_f32(pr->xs[row]) * wscale) + bias;
    store_panel(pr->y, row, col, pr->N, out, pr->y_bf16);
}

/* y rows [row, row + R) x panels [panel, panel + P), panel even: P = 2 is one whole strip. R and P are
 * constants after inlining. */
static ALWAYS_INLINE void int8_tile(const Int8Problem *pr, int64_t row, int64_t panel, const int R, const int P) {
    const int64_t groups = pr->Kp / GROUP;
    const int8_t *w_base = pr->packed + panel / 2 * groups * 64;
    const int8_t *x_base = pr->xq + row * pr->Kp;
    i32x8 acc[INT8_ROWS][INT8_PANELS];
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) acc[r][p] = splat_i32(0);
    for (int64_t g = 0; g < groups; ++g) {
        i8x32 w[INT8_PANELS];
        u8x32 w_abs[INT8_PANELS];
        for (int p = 0; p < P; ++p) {
            w[p] = load_i8x32(w_base + g * 64 + p * 32);
            w_abs[p] = abs_bytes(w[p]);
        }
        for (int r = 0; r < R; ++r) {
            int32_t four;
            memcpy(&four, x_base + r * pr->Kp + g * GROUP, sizeof four);
            const i8x32 x = (i8x32)splat_i32(four);
            for (int p = 0; p < P; ++p) acc[r][p] = dot_accumulate(acc[r][p], w[p], w_abs[p], x);
        }
    }
    for (int p = 0; p < P; ++p) {
        const int64_t col = (panel + p) * PANEL;
        f32x8 wscale;
        memcpy(&wscale, pr->wscale + col, sizeof wscale);
        const f32x8 b = load_bias(pr->bias, col, pr->N, pr->y_bf16);
#if HAVE_VNNI
        i32x8 correction;
        memcpy(&correction, pr->colsum + col, sizeof correction);
        correction = correction * 128;
#endif
        for (int r = 0; r < R; ++r) {
            i32x8 sums = acc[r][p];
#if HAVE_VNNI
            sums = sums - correction;
#endif
            int8_output(pr, row + r, col, sums, wscale, b);
        }
    }
}

#if HAVE_AVX512BW
/* v rounded to bfloat16 as gguf_simd.h's to_bf16 rounds (to nearest even, NaN to 0x7FC0), each lane's bfloat16
 * in its high 16 bits (the low 16 are not zero). */
static ALWAYS_INLINE __m512i bf16_bits_high(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}

/* y[row .. row + n_rows)[col .. col + 16) from one strip's int32 sums (acc, row stride 32, the column-sum
 * correction already taken): int8_output's arithmetic, lane for lane, 16 columns at a time with masked stores
 * (8-column panels made the AMX epilogue as long as a block's tile products); columns from N on are not written.
 * Its callers, the VNNI 512-bit tiles and the AMX tiles, exist in AVX-512 builds only. */
static ALWAYS_INLINE void int8_strip_output(const Int8Problem *pr, int64_t row, int64_t n_rows, int64_t col,
                                            const int32_t *acc) {
    const int64_t n = pr->N - col < STRIP ? pr->N - col : STRIP;
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    const __m512 wscale = _mm512_loadu_ps(pr->wscale + col);
    __m512 bias = _mm512_setzero_ps();
    if (pr->bias != NULL) bias = load_x16(pr->bias, col, (int)n, pr->y_bf16);
    for (int64_t r = 0; r < n_rows; ++r) {
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_load_si512(acc + r * 32));
        const __m512 out = _mm512_add_ps(_mm512_mul_ps(sums, _mm512_mul_ps(_mm512_set1_ps(pr->xs[row + r]), wscale)),
                                         bias);
        const int64_t index = (row + r) * pr->N + col;
        if (!pr->y_bf16) {
            _mm512_mask_storeu_ps((float *)pr->y + index, mask, out);
            continue;
        }
        _mm256_mask_storeu_epi16((uint16_t *)pr->y + index, mask,
                                 _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits_high(out), 16)));
    }
}
#endif

typedef void (*Int8TileFunction)(const Int8Problem *pr, int64_t row, int64_t panel);

/* One function per tile shape, called through pointers from the parallel region: OpenMP outlines a region
 * before inlining, so tiles called inside it would not specialise on R and P. */
#define INT8_TILE(R, P) \
    static void int8_tile_##R##_##P(const Int8Problem *pr, int64_t row, int64_t panel) { int8_tile(pr, row, panel, R, P); }
INT8_TILE(1, 1) INT8_TILE(2, 1) INT8_TILE(3, 1) INT8_TILE(4, 1)
INT8_TILE(1, 2) INT8_TILE(2, 2) INT8_TILE(3, 2) INT8_TILE(4, 2)
static const Int8TileFunction INT8_TILES[INT8_PANELS][INT8_ROWS] = {
    {int8_tile_1_1, int8_tile_2_1, int8_tile_3_1, int8_tile_4_1},
    {int8_tile_1_2, int8_tile_2_2, int8_tile_3_2, int8_tile_4_2},
};

/* ---- int8 products in 512-bit registers (AVX-512 VNNI) -------------------------------------------------------
 * One VPDPBUSD on a zmm register takes a whole (strip, group): 16 columns x 4 inputs, the 64 bytes the packed
 * layout keeps together. A tile is up to 8 rows x 2 strips, 16 accumulators of the 32 registers, each x broadcast
 * feeding two products and each weight vector eight. The rows arrive biased (x + 128, see bias_row), so the
 * inner loop is loads and products only; the epilogue is the AMX path's, 16 columns at a time. */

/* Below this many rows the 256-bit tiles of one strip stream the weight faster (a decode's product is a read of
 * the weight; two strips per tile are two streams). */
#define WIDE_MIN_ROWS 6

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define HAVE_VNNI512 1
#define WIDE_ROWS 8
#define WIDE_STRIPS 2
/* Rows of x per pass over the weight: 256 rows of up to 4 KiB inputs stay in L2 while every strip reads them. */
#define WIDE_CHUNK_ROWS 256

/* y rows [row, row + R) x strips [strip, strip + S); R and S constants after inlining. */
static ALWAYS_INLINE void int8_wide_tile(const Int8Problem *pr, int64_t row, int64_t strip, const int R,
                                         const int S) {
    const int64_t groups = pr->Kp / GROUP, strip_bytes = groups * 64;
    const int8_t *w_base = pr->packed + strip * strip_bytes;
    const int8_t *x_base = pr->xq + row * pr->Kp;
    __m512i acc[WIDE_ROWS][WIDE_STRIPS];
    for (int r = 0; r < R; ++r)
        for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i w[WIDE_STRIPS];
        for (int s = 0; s < S; ++s) w[s] = _mm512_loadu_si512(w_base + s * strip_bytes + g * 64);
        for (int r = 0; r < R; ++r) {
            int32_t four;
            memcpy(&four, x_base + r * pr->Kp + g * GROUP, sizeof four);
            const __m512i x = _mm512_set1_epi32(four);
            for (int s = 0; s < S; ++s) acc[r][s] = _mm512_dpbusd_epi32(acc[r][s], x, w[s]);
        }
    }
    int32_t sums[WIDE_ROWS * 32] __attribute__((aligned(64)));
    for (int s = 0; s < S; ++s) {
        const __m512i correction = _mm512_slli_epi32(_mm512_loadu_si512(pr->colsum + (strip + s) * STRIP), 7);
        for (int r = 0; r < R; ++r)
            _mm512_store_si512(sums + r * 32 + s * STRIP, _mm512_sub_epi32(acc[r][s], correction));
    }
    for (int s = 0; s < S; ++s) int8_strip_output(pr, row, R, (strip + s) * STRIP, sums + s * STRIP);
}

#define INT8_WIDE_TILE(R, S) \
    static void int8_wide_tile_##R##_##S(const Int8Problem *pr, int64_t row, int64_t strip) { \
        int8_wide_tile(pr, row, strip, R, S); \
    }
INT8_WIDE_TILE(1, 1) INT8_WIDE_TILE(2, 1) INT8_WIDE_TILE(3, 1) INT8_WIDE_TILE(4, 1)
INT8_WIDE_TILE(5, 1) INT8_WIDE_TILE(6, 1) INT8_WIDE_TILE(7, 1) INT8_WIDE_TILE(8, 1)
INT8_WIDE_TILE(1, 2) INT8_WIDE_TILE(2, 2) INT8_WIDE_TILE(3, 2) INT8_WIDE_TILE(4, 2)
INT8_WIDE_TILE(5, 2) INT8_WIDE_TILE(6, 2) INT8_WIDE_TILE(7, 2) INT8_WIDE_TILE(8, 2)
static const Int8TileFunction INT8_WIDE_TILES[WIDE_STRIPS][WIDE_ROWS] = {
    {int8_wide_tile_1_1, int8_wide_tile_2_1, int8_wide_tile_3_1, int8_wide_tile_4_1, int8_wide_tile_5_1,
     int8_wide_tile_6_1, int8_wide_tile_7_1, int8_wide_tile_8_1},
    {int8_wide_tile_1_2, int8_wide_tile_2_2, int8_wide_tile_3_2, int8_wide_tile_4_2, int8_wide_tile_5_2,
     int8_wide_tile_6_2, int8_wide_tile_7_2, int8_wide_tile_8_2},
};

/* Inside the caller's parallel region, after its rows are quantized and biased. Rows in chunks that stay in L2,
 * strips outer within a chunk: a thread's strips stay in its cache across the chunk's row tiles. */
static void int8_linear_wide(const Int8Problem *pr, int64_t rows, int64_t strips) {
    const int64_t strip_tiles = (strips + WIDE_STRIPS - 1) / WIDE_STRIPS;
    for (int64_t chunk = 0; chunk < rows; chunk += WIDE_CHUNK_ROWS) {
        const int64_t chunk_rows = rows - chunk < WIDE_CHUNK_ROWS ? rows - chunk : WIDE_CHUNK_ROWS;
        const int64_t row_tiles = (chunk_rows + WIDE_ROWS - 1) / WIDE_ROWS;
#pragma omp for collapse(2) schedule(static)
        for (int64_t c = 0; c < strip_tiles; ++c) {
            for (int64_t t = 0; t < row_tiles; ++t) {
                const int64_t strip = c * WIDE_STRIPS, row = chunk + t * WIDE_ROWS;
                const int64_t S = strips - strip < WIDE_STRIPS ? strips - strip : WIDE_STRIPS;
                const int64_t R = rows - row < WIDE_ROWS ? rows - row : WIDE_ROWS;
                INT8_WIDE_TILES[S - 1][R - 1](pr, row, strip);
            }
        }
    }
}
#else
#define HAVE_VNNI512 0
#endif

/* ---- int8 products on AMX tiles ---------------------------------------------------------------------------
 * TDPBSSD multiplies signed by signed bytes into the same exact int32 sums as the vector paths (no +128 bias,
 * so no column-sum correction), so the outputs are theirs bit for bit. The packed weight's (strip, group) rows
 * of 16 columns x 4 bytes are the rows of a B tile: 16 groups of a strip (64 inputs) are one 1 KiB tile load.
 * A block is 32 rows x 2 strips: tiles 0-3 accumulate [row half][strip], 4-5 hold 64 quantized inputs of each
 * row half, 6-7 the two strips' groups. */

const int pagellm_w8a8_amx_available = HAVE_AMX_INT8;

#if HAVE_AMX_INT8
#define AMX_ROWS 32
#define AMX_INPUTS 64
#define AMX_CHUNK_BLOCKS 8 /* 256 rows of x per pass over the weight: they stay in L2 */

int w8a8_amx_ready(void) { return amx_ready(); }

/* A block's int32 sums waiting to be scaled and stored into y, a few rows at a time. */
typedef struct {
    const int32_t *acc;
    int64_t row, n_rows, strip, next;
    int strips;
} Int8Pending;

static ALWAYS_INLINE void int8_store_pending(const Int8Problem *pr, Int8Pending *p, int64_t rows) {
    const int64_t to = p->next + rows < p->n_rows ? p->next + rows : p->n_rows;
    if (to > p->next)
        for (int s = 0; s < p->strips; ++s)
            int8_strip_output(pr, p->row + p->next, to - p->next, (p->strip + s) * STRIP,
                              p->acc + p->next * 32 + s * STRIP);
    p->next = to;
}

/* acc [32][32] int32: 32 quantized rows of x (row stride Kp) times one or two strips. Meanwhile the previous
 * block's rows go out to y a few per step (pending; NULL: none), as linear_bf16.c's amx_block does, for the same
 * reason. */
static ALWAYS_INLINE void amx_int8_block(const Int8Problem *pr, const int8_t *xq, int64_t Kp, const int8_t *strip,
                                         int64_t strip_bytes, int strips, int32_t *acc, Int8Pending *pending) {
    const int64_t steps = Kp / AMX_INPUTS;
    const int64_t per_step = pending != NULL ? (pending->n_rows - pending->next + steps - 1) / steps : 0;
    amx_zero_block();
    for (int64_t k = 0; k < Kp; k += AMX_INPUTS) {
        _tile_loadd(4, xq + k, Kp);
        _tile_loadd(5, xq + 16 * Kp + k, Kp);
        _tile_loadd(6, strip + k / GROUP * 64, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(2, 5, 6);
        if (strips == 2) {
            _tile_loadd(7, strip + strip_bytes + k / GROUP * 64, 64);
            _tile_dpbssd(1, 4, 7);
            _tile_dpbssd(3, 5, 7);
        }
        if (pending != NULL) int8_store_pending(pr, pending, per_step);
    }
    if (pending != NULL) int8_store_pending(pr, pending, pending->n_rows);
    amx_store_block(acc, strips);
}

/* Inside the caller's parallel region, after its rows are quantized. `tail`: the last, partial block of quantized
 * rows, zero-padded to 32 (NULL where rows is a multiple of 32). Work items as linear_bf16.c's linear_bf16_amx
 * hands them out: within a chunk of rows, a block of 32 rows times a group of column blocks whose strips stay in
 * L2, groups only where the call has more than one chunk, and only there a block's rows stored during the next
 * block's steps. */
static void int8_linear_amx(const Int8Problem *pr, int64_t rows, int64_t strips, const int8_t *tail) {
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure(colsb);
    const int64_t strip_bytes = pr->Kp / GROUP * 64, column_blocks = (strips + 1) / 2;
    const int64_t row_blocks = (rows + AMX_ROWS - 1) / AMX_ROWS, threads = omp_get_num_threads();
    const int spread = row_blocks > AMX_CHUNK_BLOCKS;
    int32_t acc[2][AMX_ROWS * 32] __attribute__((aligned(64)));
    for (int64_t chunk = 0; chunk < row_blocks; chunk += AMX_CHUNK_BLOCKS) {
        const int64_t chunk_blocks = row_blocks - chunk < AMX_CHUNK_BLOCKS ? row_blocks - chunk : AMX_CHUNK_BLOCKS;
        const int64_t groups = amx_column_groups(column_blocks, 2 * strip_bytes, chunk_blocks, spread, threads);
#pragma omp for collapse(2) schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            for (int64_t t = 0; t < chunk_blocks; ++t) {
                const int64_t row = (chunk + t) * AMX_ROWS;
                const int64_t n_rows = rows - row < AMX_ROWS ? rows - row : AMX_ROWS;
                const int8_t *block_x = n_rows < AMX_ROWS ? tail : pr->xq + row * pr->Kp;
                const int64_t first = column_blocks * g / groups, last = column_blocks * (g + 1) / groups;
                Int8Pending pending = {.acc = NULL};
                for (int64_t b = first; b < last; ++b) {
                    const int64_t strip = 2 * b;
                    const int n_strips = strips - strip < 2 ? 1 : 2;
                    int32_t *sums = acc[spread && (b & 1)];
                    const int8_t *block_strips = pr->packed + strip * strip_bytes;
                    /* Two calls, as in linear_bf16.c: the unspread one inlines with a literal NULL. */
                    if (spread)
                        amx_int8_block(pr, block_x, pr->Kp, block_strips, strip_bytes, n_strips, sums,
                                       pending.acc != NULL ? &pending : NULL);
                    else
                        amx_int8_block(pr, block_x, pr->Kp, block_strips, strip_bytes, n_strips, sums, NULL);
                    pending = (Int8Pending){.acc = sums, .row = row, .n_rows = n_rows, .strip = strip, .next = 0,
                                            .strips = n_strips};
                    if (!spread) int8_store_pending(pr, &pending, n_rows);
                }
                if (pending.acc != NULL) int8_store_pending(pr, &pending, n_rows);
            }
        }
    }
    _tile_release();
}
#else
int w8a8_amx_ready(void) { return 0; }
#endif

/* x [rows, K] float32 (or bfloat16 if x_bf16) -> y [rows, N] float32 (or bfloat16 if y_bf16; bias in y's
 * dtype or NULL). xq [rows * Kp] and xs [rows] are the caller's scratch for the quantized rows (Kp = K rounded
 * up to 4). Calls of at least amx_min_rows rows take the AMX tiles where the build has them, the OS grants them
 * and Kp is a multiple of 64. rotation: see the top (0 or 1: none). Returns 2 for sizes outside what the layout
 * holds or a rotation it does not take, 3 if memory ran out. */
int w8a8_int8_linear(const void *x, int x_bf16, int64_t rows, int64_t K, int64_t N, const int8_t *packed,
                     const int32_t *colsum, const float *wscale, const void *bias, void *y, int y_bf16,
                     float static_scale, int64_t rotation, int8_t *xq, float *xs, int64_t amx_min_rows) {
    if (K <= 0 || K > MAX_IN_FEATURES || N <= 0 || rows < 0 || !rotation_valid(rotation, K)) return 2;
    if (rows == 0) return 0;
    const int64_t Kp = (K + GROUP - 1) / GROUP * GROUP, strips = (N + STRIP - 1) / STRIP, panels = 2 * strips;
    const Int8Problem pr = {xq, xs, packed, colsum, wscale, bias, y, Kp, N, y_bf16};
    const int64_t column_tiles = (panels + INT8_PANELS - 1) / INT8_PANELS;
    const int64_t row_tiles = (rows + INT8_ROWS - 1) / INT8_ROWS;
#if HAVE_AMX_INT8
    const int on_tiles = rows >= amx_min_rows && Kp % AMX_INPUTS == 0 && amx_ready();
    const int64_t tail_rows = rows % AMX_ROWS;
    int8_t *tail = NULL;
    if (on_tiles && tail_rows != 0 && (tail = calloc((size_t)(AMX_ROWS * Kp), 1)) == NULL) return 3;
#else
    const int on_tiles = 0;
    (void)amx_min_rows;
#endif
    int out_of_memory = 0;
#pragma omp parallel if (rows * K * N >= PARALLEL_MIN_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            if (!quantize_input_row(x, r, K, Kp, x_bf16, static_scale, rotation, xq + r * Kp, xs + r)) {
#pragma omp atomic write
                out_of_memory = 1;
            }
            if (HAVE_VNNI && !on_tiles) bias_row(xq + r * Kp, Kp);
        }
        if (out_of_memory) {
            /* every thread reads it after the loop's barrier: none runs the products */
        } else if (on_tiles) {
#if HAVE_AMX_INT8
#pragma omp single
            if (tail != NULL) memcpy(tail, xq + (rows - tail_rows) * Kp, (size_t)(tail_rows * Kp));
            int8_linear_amx(&pr, rows, strips, tail);
#endif
        } else if (HAVE_VNNI512 && rows >= WIDE_MIN_ROWS) {
#if HAVE_VNNI512
            int8_linear_wide(&pr, rows, strips);
#endif
        } else {
            /* Column tiles outer: a thread keeps its panels' weights in cache for all row tiles. */
#pragma omp for collapse(2) schedule(static)
            for (int64_t c = 0; c < column_tiles; ++c) {
                for (int64_t t = 0; t < row_tiles; ++t) {
                    const int64_t panel = c * INT8_PANELS, row = t * INT8_ROWS;
                    const int64_t P = panels - panel < INT8_PANELS ? panels - panel : INT8_PANELS;
                    const int64_t R = rows - row < INT8_ROWS ? rows - row : INT8_ROWS;
                    INT8_TILES[P - 1][R - 1](&pr, row, panel);
                }
            }
        }
    }
#if HAVE_AMX_INT8
    free(tail);
#endif
    return out_of_memory ? 3 : 0;
}

/* One int8 weight (w8a8_int8_linear's weight arguments), for the calls that take several: the decode stack's
 * (decode_stack.c: gguf_matmul's signature, the weight at `w`) and the experts call (which runs no AMX tiles and
 * reads no amx_min_rows). */
typedef struct {
    const int8_t *packed;
    const int32_t *colsum;
    const float *wscale;
    int64_t amx_min_rows;
    float static_scale;
    int64_t rotation;
} Int8Weight;

/* The calling thread's buffers of quantized rows, kept and grown between calls (a decode step makes one call per
 * layer and product: fresh ones would be allocated each time). Returns 0 if memory ran out. */
static int stack_buffers(int64_t rows, int64_t Kp, int8_t **xq, float **xs) {
    static __thread int8_t *quantized;
    static __thread float *scales;
    static __thread int64_t quantized_bytes, scale_count;
    if (rows * Kp > quantized_bytes) {
        int8_t *grown = realloc(quantized, (size_t)(rows * Kp));
        if (grown == NULL) return 0;
        quantized = grown;
        quantized_bytes = rows * Kp;
    }
    if (rows > scale_count) {
        float *grown = realloc(scales, sizeof(float) * (size_t)rows);
        if (grown == NULL) return 0;
        scales = grown;
        scale_count = rows;
    }
    *xq = quantized;
    *xs = scales;
    return 1;
}

/* w8a8_int8_linear behind gguf_matmul's signature (`type` unused; activations and outputs in one dtype, no bias),
 * its quantized rows in this thread's buffers. Returns 1 if memory ran out, 2 for inputs it does not take. */
int w8a8_stack_product(int type, const void *w, const void *x, int x_bf16, int64_t rows, int64_t K, int64_t N,
                       void *y, int y_bf16) {
    (void)type;
    if (x_bf16 != y_bf16 || rows < 0 || K <= 0) return 2;
    if (rows == 0) return 0;
    const Int8Weight *layer = w;
    int8_t *xq;
    float *xs;
    if (!stack_buffers(rows, (K + GROUP - 1) / GROUP * GROUP, &xq, &xs)) return 1;
    const int failed = w8a8_int8_linear(x, x_bf16, rows, K, N, layer->packed, layer->colsum, layer->wscale, NULL, y,
                                        y_bf16, layer->static_scale, layer->rotation, xq, xs, layer->amx_min_rows);
    return failed == 3 ? 1 : failed;
}

/* The squared distance between row[0 .. K) and its rounding to [-127, 127] steps of `scale` (inverse: 1 / scale). */
static double int8_rounding_error(const float *row, int64_t K, float scale, float inverse) {
    const f32x8 step = splat_f32(scale), factor = splat_f32(inverse), magic = splat_f32(12582912.0f);
    const f32x8 low = splat_f32(-127.0f), high = splat_f32(127.0f);
    f32x8 sums = splat_f32(0.0f);
    const int64_t full = K / 8 * 8;
    for (int64_t k = 0; k < full; k += 8) {
        f32x8 v;
        memcpy(&v, row + k, sizeof v);
        f32x8 q = max_f32(v * factor, low);
        q = -max_f32(-q, -high);
        const f32x8 d = ((q + magic) - magic) * step - v;
        sums += d * d;
    }
    double error = 0.0;
    for (int lane = 0; lane < 8; ++lane) error += sums[lane];
    for (int64_t k = full; k < K; ++k) {
        const double d = (double)round_clamped(row[k] * inverse) * scale - row[k];
        error += d * d;
    }
    return error;
}

/* Per row of w [N, K] (float32), the int8 weight scale quantize_rows_int8_fitted keeps (pagellm/ops/w8a8_kernels.py):
 * of max|row| * ratios[i] / 127, the one whose rounding lies nearest the row in squared error (the first of equal
 * ones); 0 for an all-zero row, NaN for a row holding a NaN or an infinity. */
int w8a8_fit_int8_scales(const float *w, int64_t N, int64_t K, const float *ratios, int64_t n_ratios,
                         float *scales) {
    if (N < 0 || K <= 0 || n_ratios <= 0) return 2;
#pragma omp parallel for schedule(static) if (N * K * n_ratios >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < N; ++r) {
        const float *row = w + r * K;
        float amax = 0.0f;
        int finite = 1;
        for (int64_t k = 0; k < K; ++k) {
            const float v = fabsf(row[k]);
            finite &= v <= 3.4028235e38f;
            amax = v > amax ? v : amax;
        }
        if (!finite || amax == 0.0f) {
            scales[r] = finite ? 0.0f : NAN;
            continue;
        }
        float best = 0.0f;
        double best_error = INFINITY;
        for (int64_t i = 0; i < n_ratios; ++i) {
            const float scale = amax * ratios[i] / 127.0f;
            if (!(scale > 0.0f)) continue;
            const double error = int8_rounding_error(row, K, scale, 1.0f / scale);
            if (error < best_error) {
                best_error = error;
                best = scale;
            }
        }
        scales[r] = best;
    }
    return 0;
}

/* xq [rows * Kp], xs [rows]: the rows as w8a8_int8_linear quantizes them (for tests and the torch paths). */
int w8a8_quantize_rows(const void *x, int x_bf16, int64_t rows, int64_t K, float static_scale, int64_t rotation,
                       int8_t *xq, float *xs) {
    if (K <= 0 || rows < 0 || !rotation_valid(rotation, K)) return 2;
    const int64_t Kp = (K + GROUP - 1) / GROUP * GROUP;
    int out_of_memory = 0;
#pragma omp parallel for schedule(static) if (rows * K >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < rows; ++r)
        if (!quantize_input_row(x, r, K, Kp, x_bf16, static_scale, rotation, xq + r * Kp, xs + r)) {
#pragma omp atomic write
            out_of_memory = 1;
        }
    return out_of_memory ? 3 : 0;
}

/* ---- fp8 e4m3 weights ------------------------------------------------------------------------------- */

/* How far ahead a panel's weights are prefetched: each panel is a short stream (K * 8 bytes) that the hardware
 * prefetcher would only pick up late. */
#define FP8_PREFETCH_BYTES 512

/* 8 fp8 e4m3fn values (sign, 4 exponent bits biased by 7, 3 mantissa bits) as floats divided by 256, exactly:
 * moved into float16's fields (exponent biased by 15), every finite e4m3 value is a float16 2^8 times smaller,
 * subnormals included. Sign-extending the byte to 16 bits and shifting it left by 7 puts the sign at bit 15 and
 * exponent and mantissa at bits 13..7; bit 14 holds a copy of the sign, which the mask clears. The NaN codes
 * (0x7F, 0xFF) would read as +-480: the loader refuses weights holding them (w8a8_kernels.check_fp8_finite). */
static ALWAYS_INLINE f32x8 fp8x8_over_256(const uint8_t *p) {
    i8x8 bytes;
    memcpy(&bytes, p, sizeof bytes);
    const u16x8 half = ((u16x8)__builtin_convertvector(bytes, i16x8) << 7) & 0xBF80;
#if defined(__F16C__)
    return (f32x8)_mm256_cvtph_ps((__m128i)half);
#else
    /* float16 -> float32 in vector extensions: normals rebias the exponent; subnormals (exponent 0) are
     * mantissa * 2^-24. */
    const u32x8 h = __builtin_convertvector(half, u32x8);
    const u32x8 sign = (h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    const u32x8 normal = sign | ((exponent + 112) << 23) | (mantissa << 13);
    const u32x8 subnormal = (u32x8)(to_f32((i32x8)mantissa) * 0x1p-24f) | sign;
    const u32x8 is_subnormal = (u32x8)(exponent == 0);
    return (f32x8)((is_subnormal & subnormal) | (~is_subnormal & normal));
#endif
}

typedef struct {
    const void *x;
    const uint8_t *packed;
    const float *scales; /* [blocks][Np], times 256 */
    const void *bias;
    void *y;
    int64_t K, N, Np, block_k;
    int x_bf16, y_bf16;
} Fp8Problem;

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_FP8_BF16_PAIRS 1
/* Two panels' weights at inputs k and k + 1 (16 columns) as 32 bfloat16 values w / 256 in VDPBF16PS's pair order,
 * column c's (k, k + 1) pair in words 2c and 2c + 1: the 16 bytes of each panel (k's 8 columns, then k + 1's)
 * are interleaved within their lane and moved into bfloat16's fields in the integer unit, exactly (3 mantissa bits
 * fit its 7). A normal e4m3 value's exponent and mantissa shifted left by 4 are bfloat16's fields with the
 * exponent biased by 7; adding 112 to it makes the bias 127 + 8, the value divided by 256. Zero and the
 * subnormals (exponent 0: m 2^-9 for mantissa m) are looked up instead, as normal bfloat16 numbers m 2^-17, which
 * VDPBF16PS needs (it reads subnormal inputs as zero). The sign is bit 15 of the sign-extended byte. */
static ALWAYS_INLINE __m512bh fp8_pairs_over_256(const uint8_t *panel0, const uint8_t *panel1) {
    const __m128i interleave = _mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    /* bfloat16 of m 2^-17 for m = 0..7, indexed by the word's low 5 bits (mantissa, then the exponent's low 2 bits,
     * zero where the table is read). */
    const __m512i subnormals =
        _mm512_zextsi128_si512(_mm_setr_epi16(0x0000, 0x3700, 0x3780, 0x37C0, 0x3800, 0x3820, 0x3840, 0x3860));
    const __m256i bytes = _mm256_shuffle_epi8(
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)panel0)),
                                _mm_loadu_si128((const __m128i *)panel1), 1),
        _mm256_broadcastsi128_si256(interleave));
    const __m512i word = _mm512_cvtepi8_epi16(bytes);
    __m512i magnitude = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(word, 4), _mm512_set1_epi16(0x07F0)),
                                         _mm512_set1_epi16(112 << 7));
    magnitude = _mm512_mask_permutexvar_epi16(magnitude, _mm512_testn_epi16_mask(word, _mm512_set1_epi16(0x78)),
                                              word, subnormals);
    /* magnitude | (word & 0x8000) */
    return (__m512bh)_mm512_ternarylogic_epi32(magnitude, word, _mm512_set1_epi16((short)0x8000), 0xF8);
}

/* fp8_block for two panels and bfloat16 rows on avx512_bf16: each instruction multiplies a pair of inputs for 16
 * columns (VDPBF16PS), where the float path multiplies one input for 8. `chains` independent sums per row keep
 * that many dot products in flight (one row alone would wait on each one's latency). An odd last input is left
 * to the caller. Returns the inputs it covered. */
static ALWAYS_INLINE int64_t fp8_block_pairs(const Fp8Problem *pr, int64_t row, const uint8_t *w_base, int64_t k0,
                                             int64_t k1, const int R, f32x8 part[FP8_ROWS][FP8_PANELS]) {
    const int64_t K = pr->K, panel_bytes = K * PANEL;
    const int chains = R == 1 ? 4 : R == 2 ? 2 : 1;
    const uint16_t *x = (const uint16_t *)pr->x;
    __m512 sums[4][FP8_ROWS];
    for (int i = 0; i < chains; ++i)
        for (int r = 0; r < R; ++r) sums[i][r] = _mm512_setzero_ps();
    int64_t k = k0;
    for (; k + 2 * chains <= k1; k += 2 * chains) {
        __builtin_prefetch(w_base + k * PANEL + FP8_PREFETCH_BYTES);
        __builtin_prefetch(w_base + panel_bytes + k * PANEL + FP8_PREFETCH_BYTES);
        for (int i = 0; i < chains; ++i) {
            const int64_t kk = k + 2 * i;
            const __m512bh w = fp8_pairs_over_256(w_base + kk * PANEL, w_base + panel_bytes + kk * PANEL);
            for (int r = 0; r < R; ++r) {
                uint32_t pair;
                memcpy(&pair, x + (row + r) * K + kk, sizeof pair);
                sums[i][r] = _mm512_dpbf16_ps(sums[i][r], w, (__m512bh)_mm512_set1_epi32((int)pair));
            }
        }
    }
    for (; k + 2 <= k1; k += 2) {
        const __m512bh w = fp8_pairs_over_256(w_base + k * PANEL, w_base + panel_bytes + k * PANEL);
        for (int r = 0; r < R; ++r) {
            uint32_t pair;
            memcpy(&pair, x + (row + r) * K + k, sizeof pair);
            sums[0][r] = _mm512_dpbf16_ps(sums[0][r], w, (__m512bh)_mm512_set1_epi32((int)pair));
        }
    }
    for (int r = 0; r < R; ++r) {
        __m512 total = sums[0][r];
        for (int i = 1; i < chains; ++i) total = _mm512_add_ps(total, sums[i][r]);
        part[r][0] = (f32x8)_mm512_castps512_ps256(total);
        part[r][1] = (f32x8)_mm512_extractf32x8_ps(total, 1);
    }
    return k - k0;
}
#else
#define HAVE_FP8_BF16_PAIRS 0
#endif

/* One K block's sums part[r][p] = sum over k in [k0, k1) of x[row + r][k] w[k][panel + p]. With few rows and
 * panels (a decode step's single row), even and odd k go to separate sums, so that more FMAs are in flight
 * than one chain of dependent ones allows. Two panels of bfloat16 rows take fp8_block_pairs where the build has
 * avx512_bf16. */
static ALWAYS_INLINE void fp8_block(const Fp8Problem *pr, int64_t row, const uint8_t *w_base, int64_t k0, int64_t k1,
                                   const int R, const int P, f32x8 part[FP8_ROWS][FP8_PANELS]) {
    const int64_t K = pr->K, panel_bytes = K * PANEL;
#if HAVE_FP8_BF16_PAIRS
    if (P == 2 && pr->x_bf16) {
        const int64_t k = k0 + fp8_block_pairs(pr, row, w_base, k0, k1, R, part);
        if (k < k1) {
            for (int p = 0; p < P; ++p) {
                const f32x8 w = fp8x8_over_256(w_base + p * panel_bytes + k * PANEL);
                for (int r = 0; r < R; ++r)
                    part[r][p] = fmadd(splat_f32(load_one(pr->x, (row + r) * K + k, 1)), w, part[r][p]);
            }
        }
        return;
    }
#endif
    const int ways = R * P <= 4 ? 2 : 1;
    f32x8 sums[2][FP8_ROWS][FP8_PANELS];
    for (int i = 0; i < ways; ++i)
        for (int r = 0; r < R; ++r)
            for (int p = 0; p < P; ++p) sums[i][r][p] = splat_f32(0.0f);
    int64_t k = k0;
    for (; k + ways <= k1; k += ways) {
        if ((k & 7) < ways)
            for (int p = 0; p < P; ++p) __builtin_prefetch(w_base + p * panel_bytes + k * PANEL + FP8_PREFETCH_BYTES);
        for (int i = 0; i < ways; ++i) {
            f32x8 w[FP8_PANELS];
            for (int p = 0; p < P; ++p) w[p] = fp8x8_over_256(w_base + p * panel_bytes + (k + i) * PANEL);
            for (int r = 0; r < R; ++r) {
                const f32x8 xv = splat_f32(load_one(pr->x, (row + r) * K + k + i, pr->x_bf16));
                for (int p = 0; p < P; ++p) sums[i][r][p] = fmadd(xv, w[p], sums[i][r][p]);
            }
        }
    }
    for (; k < k1; ++k) {
        for (int p = 0; p < P; ++p) {
            const f32x8 w = fp8x8_over_256(w_base + p * panel_bytes + k * PANEL);
            for (int r = 0; r < R; ++r)
                sums[0][r][p] = fmadd(splat_f32(load_one(pr->x, (row + r) * K + k, pr->x_bf16)), w, sums[0][r][p]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) part[r][p] = ways == 2 ? sums[0][r][p] + sums[1][r][p] : sums[0][r][p];
}

/* y rows [row, row + R) x panels [panel, panel + P): (sum over K blocks of the block's sums times its scale)
 * + bias. `blocked` (a constant after inlining): more than one K block; with one, no second set of
 * accumulators is kept beside the sums. */
static ALWAYS_INLINE void fp8_tile(const Fp8Problem *pr, int64_t row, int64_t panel, const int R, const int P,
                                   const int blocked) {
    const int64_t K = pr->K;
    const uint8_t *w_base = pr->packed + panel * K * PANEL;
    f32x8 acc[FP8_ROWS][FP8_PANELS];
    if (!blocked) {
        fp8_block(pr, row, w_base, 0, K, R, P, acc);
        for (int p = 0; p < P; ++p) {
            f32x8 scale;
            memcpy(&scale, pr->scales + (panel + p) * PANEL, sizeof scale);
            for (int r = 0; r < R; ++r) acc[r][p] = acc[r][p] * scale;
        }
    } else {
        for (int r = 0; r < R; ++r)
            for (int p = 0; p < P; ++p) acc[r][p] = splat_f32(0.0f);
        for (int64_t k0 = 0, block = 0; k0 < K; k0 += pr->block_k, ++block) {
            f32x8 part[FP8_ROWS][FP8_PANELS];
            fp8_block(pr, row, w_base, k0, k0 + pr->block_k < K ? k0 + pr->block_k : K, R, P, part);
            for (int p = 0; p < P; ++p) {
                f32x8 scale;
                memcpy(&scale, pr->scales + block * pr->Np + (panel + p) * PANEL, sizeof scale);
                for (int r = 0; r < R; ++r) acc[r][p] = fmadd(part[r][p], scale, acc[r][p]);
            }
        }
    }
    for (int p = 0; p < P; ++p) {
        const int64_t col = (panel + p) * PANEL;
        const f32x8 b = load_bias(pr->bias, col, pr->N, pr->y_bf16);
        for (int r = 0; r < R; ++r) store_panel(pr->y, row + r, col, pr->N, acc[r][p] + b, pr->y_bf16);
    }
}

typedef void (*Fp8TileFunction)(const Fp8Problem *pr, int64_t row, int64_t panel);

#define FP8_TILE(R, P)                                                                                            \
    static void fp8_tile_##R##_##P(const Fp8Problem *pr, int64_t row, int64_t panel) {                            \
        fp8_tile(pr, row, panel, R, P, 0);                                                                        \
    }                                                                                                             \
    static void fp8_blocked_tile_##R##_##P(const Fp8Problem *pr, int64_t row, int64_t panel) {                    \
        fp8_tile(pr, row, panel, R, P, 1);                                                                        \
    }
FP8_TILE(1, 1) FP8_TILE(2, 1) FP8_TILE(3, 1) FP8_TILE(4, 1)
FP8_TILE(1, 2) FP8_TILE(2, 2) FP8_TILE(3, 2) FP8_TILE(4, 2)
static const Fp8TileFunction FP8_TILES[2][FP8_PANELS][FP8_ROWS] = {
    {{fp8_tile_1_1, fp8_tile_2_1, fp8_tile_3_1, fp8_tile_4_1},
     {fp8_tile_1_2, fp8_tile_2_2, fp8_tile_3_2, fp8_tile_4_2}},
    {{fp8_blocked_tile_1_1, fp8_blocked_tile_2_1, fp8_blocked_tile_3_1, fp8_blocked_tile_4_1},
     {fp8_blocked_tile_1_2, fp8_blocked_tile_2_2, fp8_blocked_tile_3_2, fp8_blocked_tile_4_2}},
};

/* x [rows, K] float32 (or bfloat16) -> y [rows, N] float32 (or bfloat16), bias in y's dtype or NULL; block_k
 * the K extent of one scale (K for per-tensor and per-channel scales). Returns 2 for sizes it cannot take. */
int w8a8_fp8_linear(const void *x, int x_bf16, int64_t rows, int64_t K, int64_t N, const uint8_t *packed,
                    const float *scales, int64_t block_k, const void *bias, void *y, int y_bf16) {
    if (K <= 0 || N <= 0 || rows < 0 || block_k <= 0) return 2;
    if (rows == 0) return 0;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const Fp8Problem pr = {x, packed, scales, bias, y, K, N, panels * PANEL, block_k, x_bf16, y_bf16};
    const int64_t column_tiles = (panels + FP8_PANELS - 1) / FP8_PANELS;
    const int64_t row_tiles = (rows + FP8_ROWS - 1) / FP8_ROWS;
#pragma omp parallel for collapse(2) schedule(static) if (rows * K * N >= PARALLEL_MIN_WORK)
    for (int64_t c = 0; c < column_tiles; ++c) {
        for (int64_t t = 0; t < row_tiles; ++t) {
            const int64_t panel = c * FP8_PANELS, row = t * FP8_ROWS;
            const int64_t P = panels - panel < FP8_PANELS ? panels - panel : FP8_PANELS;
            const int64_t R = rows - row < FP8_ROWS ? rows - row : FP8_ROWS;
            FP8_TILES[block_k < K][P - 1][R - 1](&pr, row, panel);
        }
    }
    return 0;
}

/* out [K][n_panels * 8] (float32, or bfloat16 rounded to nearest even) = columns [8 first_panel, 8 (first_panel
 * + n_panels)) of W^T, each weight times its scale (one float32 rounding). Returns 2 for sizes it cannot take. */
int w8a8_fp8_dequantize(const uint8_t *packed, int64_t K, int64_t Np, const float *scales, int64_t block_k,
                        int64_t first_panel, int64_t n_panels, void *out, int out_bf16) {
    if (K <= 0 || Np <= 0 || block_k <= 0 || first_panel < 0 || n_panels < 0 || (first_panel + n_panels) * PANEL > Np)
        return 2;
    const int64_t width = n_panels * PANEL;
#pragma omp parallel for schedule(static) if (K * width >= PARALLEL_MIN_WORK / 4)
    for (int64_t k = 0; k < K; ++k) {
        const float *scale_row = scales + (k / block_k) * Np;
        for (int64_t p = 0; p < n_panels; ++p) {
            const int64_t panel = first_panel + p;
            f32x8 scale;
            memcpy(&scale, scale_row + panel * PANEL, sizeof scale);
            const f32x8 v = fp8x8_over_256(packed + panel * K * PANEL + k * PANEL) * scale;
            if (out_bf16) {
                const u16x8 bits = to_bf16(v);
                memcpy((uint16_t *)out + k * width + p * PANEL, &bits, sizeof bits);
            } else {
                memcpy((float *)out + k * width + p * PANEL, &v, sizeof v);
            }
        }
    }
    return 0;
}

/* out [n_blocks][K / 2][16][2] bfloat16 = output columns [16 first_block, 16 (first_block + n_blocks)) of the
 * weight in linear_bf16's packed layout (its csrc/linear_bf16.c: for each input pair, the 16 columns' two weights
 * side by side), each weight times its scale rounded once as w8a8_fp8_dequantize rounds it, so that linear_bf16
 * (AMX's tiles where the CPU has them) runs the dense path's product. AVX-512 builds only (linear_bf16 needs
 * avx512_bf16, so no other build calls it). Returns 2 for sizes it cannot take (K odd, columns past Np) and in
 * other builds. */
int w8a8_fp8_dequantize_bf16_packed(const uint8_t *packed, int64_t K, int64_t Np, const float *scales,
                                    int64_t block_k, int64_t first_block, int64_t n_blocks, uint16_t *out) {
#if HAVE_AVX512BW
    if (K <= 0 || K % 2 != 0 || Np <= 0 || block_k <= 0 || first_block < 0 || n_blocks < 0 ||
        (first_block + n_blocks) * STRIP > Np)
        return 2;
    const int64_t pairs = K / 2;
    /* The scales' row changes every block_k inputs: found per run of inputs sharing it (pairs of inputs, each
     * with its own row, where block_k is odd), not by a division per input. */
    const int64_t run = block_k % 2 == 0 ? block_k : 2;
#pragma omp parallel for schedule(static) if (K * n_blocks * STRIP >= PARALLEL_MIN_WORK / 4)
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t column = (first_block + b) * STRIP;
        const uint8_t *low = packed + (column / PANEL) * K * PANEL, *high = low + K * PANEL;
        uint16_t *block_out = out + b * pairs * 32;
        for (int64_t first = 0; first < K; first += run) {
            const int64_t last = first + run < K ? first + run : K;
            /* The pairs' scales: one row for both inputs where block_k is even, else each input's own. */
            const __m512 scale_0 = _mm512_loadu_ps(scales + (first / block_k) * Np + column);
            const __m512 scale_1 =
                block_k % 2 ? _mm512_loadu_ps(scales + ((first + 1) / block_k) * Np + column) : scale_0;
            for (int64_t k = first; k < last; k += 2) {
                __m512i rounded[2];
                for (int i = 0; i < 2; ++i) {
                    const __m128i bytes =
                        _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(low + (k + i) * PANEL)),
                                           _mm_loadl_epi64((const __m128i *)(high + (k + i) * PANEL)));
                    /* fp8x8_over_256's float16 fields, 16 at a time. */
                    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                                          _mm256_set1_epi16((short)0xBF80));
                    rounded[i] = bf16_bits_high(_mm512_mul_ps(_mm512_cvtph_ps(half), i ? scale_1 : scale_0));
                }
                /* Lane j: the pair's first weight in its low half, the second in its high half: the packed layout. */
                const __m512i second = _mm512_and_si512(rounded[1], _mm512_set1_epi32((int)0xFFFF0000));
                _mm512_storeu_si512(block_out + k / 2 * 32,
                                    _mm512_or_si512(_mm512_srli_epi32(rounded[0], 16), second));
            }
        }
    }
    return 0;
#else
    (void)packed, (void)K, (void)Np, (void)scales, (void)block_k, (void)first_block, (void)n_blocks, (void)out;
    return 2;
#endif
}

/* ---- a mixture-of-experts layer's experts in one call ------------------------------------------------------
 * A decode step gives each expert it uses a few rows, and one call per expert and projection costs more in calls
 * and forks of the threads than the products take. The experts calls run a projection for all of a step's
 * experts at once: rows [0, counts[0]) of x times weight ids[0], the next counts[1] rows times weight ids[1], and
 * so on, into the same rows of y (x and y contiguous). Each expert's rows go in tiles of the few-row path's
 * height from its first row, as the one-weight call tiles them, so that every output is that call's bit for bit;
 * a (row tile, column tile) pair is one work item, items in row tile order: a thread's share walks one expert's
 * columns in turn. */

/* A row tile of one expert: rows [first, first + rows) times weight `weight`. */
typedef struct {
    int64_t first;
    int32_t weight, rows;
} ExpertRows;

/* Sizes and ids a grouped call takes (counts >= 0, ids within the n_weights weights); *rows: their sum. */
static int experts_valid(int64_t n_weights, const int32_t *ids, const int64_t *counts, int64_t n, int64_t *rows) {
    *rows = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (counts[i] < 0 || ids[i] < 0 || ids[i] >= n_weights) return 0;
        *rows += counts[i];
    }
    return 1;
}

/* The experts' row tiles of up to tile_rows rows, *count of them (to be freed); NULL if memory ran out. */
static ExpertRows *expert_row_tiles(const int32_t *ids, const int64_t *counts, int64_t n, int tile_rows,
                                    int64_t *count) {
    int64_t tiles = 0;
    for (int64_t i = 0; i < n; ++i) tiles += (counts[i] + tile_rows - 1) / tile_rows;
    ExpertRows *out = malloc(sizeof(ExpertRows) * (size_t)(tiles > 0 ? tiles : 1));
    if (out == NULL) return NULL;
    for (int64_t i = 0, t = 0, first = 0; i < n; first += counts[i++])
        for (int64_t row = 0; row < counts[i]; row += tile_rows) {
            const int64_t left = counts[i] - row;
            out[t++] = (ExpertRows){first + row, ids[i], (int32_t)(left < tile_rows ? left : tile_rows)};
        }
    *count = tiles;
    return out;
}

/* w8a8_int8_linear (no bias) for experts: see above. Every row takes the few-row tiles, so the call is meant
 * for experts of fewer rows than the wide and AMX tiles start at (w8a8_int8_experts_max_rows). xq [rows * Kp]
 * and xs [rows] as w8a8_int8_linear's. Returns 2 for sizes or ids it cannot take, 3 if memory ran out. */
int w8a8_int8_linear_experts(const Int8Weight *weights, int64_t n_weights, const int32_t *ids,
                             const int64_t *counts, int64_t n, const void *x, int x_bf16, int64_t K, int64_t N,
                             void *y, int y_bf16, int8_t *xq, float *xs) {
    int64_t rows;
    if (K <= 0 || K > MAX_IN_FEATURES || N <= 0 || n < 0 || !experts_valid(n_weights, ids, counts, n, &rows))
        return 2;
    for (int64_t i = 0; i < n; ++i)
        if (!rotation_valid(weights[ids[i]].rotation, K)) return 2;
    if (rows == 0) return 0;
    int64_t n_tiles;
    ExpertRows *tiles = expert_row_tiles(ids, counts, n, INT8_ROWS, &n_tiles);
    if (tiles == NULL) return 3;
    const int64_t Kp = (K + GROUP - 1) / GROUP * GROUP, panels = 2 * ((N + STRIP - 1) / STRIP);
    const int64_t column_tiles = (panels + INT8_PANELS - 1) / INT8_PANELS, items = n_tiles * column_tiles;
    int out_of_memory = 0;
#pragma omp parallel if (rows * K * N >= PARALLEL_MIN_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n_tiles; ++t) {
            const Int8Weight *w = weights + tiles[t].weight;
            for (int64_t r = tiles[t].first; r < tiles[t].first + tiles[t].rows; ++r) {
                if (!quantize_input_row(x, r, K, Kp, x_bf16, w->static_scale, w->rotation, xq + r * Kp, xs + r)) {
#pragma omp atomic write
                    out_of_memory = 1;
                }
                if (HAVE_VNNI) bias_row(xq + r * Kp, Kp);
            }
        }
        /* every thread reads it after the loop's barrier: all run the products or none */
        if (!out_of_memory) {
#pragma omp for schedule(static)
            for (int64_t item = 0; item < items; ++item) {
                const ExpertRows *tile = tiles + item / column_tiles;
                const Int8Weight *w = weights + tile->weight;
                const Int8Problem pr = {xq, xs, w->packed, w->colsum, w->wscale, NULL, y, Kp, N, y_bf16};
                const int64_t panel = item % column_tiles * INT8_PANELS;
                const int64_t P = panels - panel < INT8_PANELS ? panels - panel : INT8_PANELS;
                INT8_TILES[P - 1][tile->rows - 1](&pr, tile->first, panel);
            }
        }
    }
    free(tiles);
    return out_of_memory ? 3 : 0;
}

/* The most rows an expert may have for w8a8_int8_linear_experts to run the tiles w8a8_int8_linear would (this
 * build's wide VNNI tiles start at WIDE_MIN_ROWS; AMX's tiles at the caller's amx_min_rows). */
int64_t w8a8_int8_experts_max_rows(void) { return HAVE_VNNI512 ? WIDE_MIN_ROWS - 1 : INT64_MAX; }

/* One fp8 weight (w8a8_fp8_linear's weight arguments), for the calls that take several: the experts call, the
 * decode stack's. */
typedef struct {
    const uint8_t *packed;
    const float *scales;
    int64_t block_k;
} Fp8Weight;

/* w8a8_fp8_linear (no bias) for experts: see above. Returns 2 for sizes or ids it cannot take, 3 if memory ran
 * out. */
int w8a8_fp8_linear_experts(const Fp8Weight *weights, int64_t n_weights, const int32_t *ids,
                            const int64_t *counts, int64_t n, const void *x, int x_bf16, int64_t K, int64_t N,
                            void *y, int y_bf16) {
    int64_t rows;
    if (K <= 0 || N <= 0 || n < 0 || !experts_valid(n_weights, ids, counts, n, &rows)) return 2;
    for (int64_t i = 0; i < n; ++i)
        if (weights[ids[i]].block_k <= 0) return 2;
    if (rows == 0) return 0;
    int64_t n_tiles;
    ExpertRows *tiles = expert_row_tiles(ids, counts, n, FP8_ROWS, &n_tiles);
    if (tiles == NULL) return 3;
    const int64_t panels = (N + PANEL - 1) / PANEL, column_tiles = (panels + FP8_PANELS - 1) / FP8_PANELS;
    const int64_t items = n_tiles * column_tiles;
#pragma omp parallel for schedule(static) if (rows * K * N >= PARALLEL_MIN_WORK)
    for (int64_t item = 0; item < items; ++item) {
        const ExpertRows *tile = tiles + item / column_tiles;
        const Fp8Weight *w = weights + tile->weight;
        const Fp8Problem pr = {x, w->packed, w->scales, NULL, y, K, N, panels * PANEL, w->block_k, x_bf16, y_bf16};
        const int64_t panel = item % column_tiles * FP8_PANELS;
        const int64_t P = panels - panel < FP8_PANELS ? panels - panel : FP8_PANELS;
        FP8_TILES[w->block_k < K][P - 1][tile->rows - 1](&pr, tile->first, panel);
    }
    free(tiles);
    return 0;
}

/* One fp8 layer as its tiles product and the decode stack call it: its weight, where bfloat16 rows go to
 * linear_bf16's tiles (as W8A8Kernels.fp8_linear sends them; the stack only for weights of whole 16-column blocks,
 * no padding), and the packed weight's columns (N rounded up to 8). */
typedef struct {
    Fp8Weight weight;
    BF16Tiles tiles;
    int64_t padded_columns;
} Fp8StackLayer;

static int fp8_stack_layer_columns(const void *w, int64_t K, int64_t N, int64_t first, int64_t n, uint16_t *tile) {
    (void)N;
    const Fp8StackLayer *layer = w;
    const Fp8Weight *weight = &layer->weight;
    if (first % STRIP != 0 || n % STRIP != 0 || first + n > layer->padded_columns) return 2;
    return w8a8_fp8_dequantize_bf16_packed(weight->packed, K, layer->padded_columns, weight->scales, weight->block_k,
                                           first / STRIP, n / STRIP, tile);
}

/* w8a8_fp8_linear behind gguf_matmul's signature, for the decode stack (`type` unused; activations and outputs in
 * one dtype, no bias), the layer (Fp8StackLayer) at `w`; bfloat16 rows from its tiles.min_rows on linear_bf16's
 * tiles. Returns 1 if memory ran out, 2 for inputs it does not take. */
int w8a8_fp8_stack_product(int type, const void *w, const void *x, int x_bf16, int64_t rows, int64_t K, int64_t N,
                           void *y, int y_bf16) {
    (void)type;
    if (x_bf16 != y_bf16 || rows < 0 || K <= 0) return 2;
    if (rows == 0) return 0;
    const Fp8StackLayer *layer = w;
    if (bf16_tiles_take(&layer->tiles, x_bf16, rows))
        return bf16_tiles_product(&layer->tiles, layer, fp8_stack_layer_columns, x, rows, K, N, y, N);
    const Fp8Weight *weight = &layer->weight;
    return w8a8_fp8_linear(x, x_bf16, rows, K, N, weight->packed, weight->scales, weight->block_k, NULL, y, y_bf16)
               ? 2
               : 0;
}

/* y [rows, n] bfloat16 (rows y_stride apart) = bfloat16 x @ W^T over the weight's first n columns (whole 16-column
 * blocks: fp8_stack_layer_columns refuses others) on the layer's tiles (W8A8Kernels.fp8_linear_dense). Returns 1 if
 * memory ran out, 2 for a refusal. */
int w8a8_fp8_tiles_product(const Fp8StackLayer *layer, const uint16_t *x, int64_t rows, int64_t K, int64_t n,
                           uint16_t *y, int64_t y_stride) {
    return bf16_tiles_product(&layer->tiles, layer, fp8_stack_layer_columns, x, rows, K, n, y, y_stride);
}

const char *pagellm_isa(void) { return ISA_NAME; }
/* The instructions the int8 products run on: avx512_vnni, avx_vnni, avx2 (VPMADDUBSW) or generic. */
const char *w8a8_dot_instructions(void) { return DOT_INSTRUCTIONS; }
