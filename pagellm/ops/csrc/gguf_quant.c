/* Matrix products and row gathers on GGUF weights kept in their quantized blocks (ggml's block_* layouts),
 * so that a model's weights stay at their file size in memory and a decode step reads 4-8 bits per weight.
 *
 * Weights: uint8 [out_features, in_features / block_weights * block_bytes], row-major as a GGUF stores a 2-D
 * tensor: each output row's blocks are contiguous. Types are GGML's ids (gguf.GGMLQuantizationType):
 *   Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, IQ4_NL 20 (blocks of 32 weights, one scale each)
 *   Q2_K 10, Q3_K 11, Q4_K 12, Q5_K 13, Q6_K 14 (super-blocks of 256 weights, a scale per 16 or 32)
 * and three of pagellm's own in IQ4_NL's layout with another 16-value grid: for bitsandbytes' 4-bit weights
 * (pagellm/layers/quantization/bitsandbytes.py) NF4 1000 and BNB_FP4 1001, for MXFP4's (a GGUF's, gpt-oss's
 * experts) MXFP4_F16 1002, its power-of-two scale held as an f16; and for NVFP4's 16-weight blocks
 * (pagellm/layers/quantization/nvfp4.py) NVFP4_F16 1003: MXFP4_F16's grid and nibbles after two f16 scales, one
 * per 16 weights (20 bytes per 32 weights).
 *
 * gguf_matmul: y [rows, out] = x [rows, in] W^T, as llama.cpp computes it: each row of x is quantized to int8
 * (blocks of 32 with a float scale and the scaled sum for the 32-weight formats, llama.cpp's Q8_1; blocks of
 * 256 with sums per 16 for the k-quants, its Q8_K), and each block of weights meets its block of activations
 * in integer dot products (u8 x s8 into int32); only the per-block scales are float. The weight is unpacked
 * once per pass of up to ROWS_PER_PASS rows of x, and outputs are handed out to threads in tiles whose weights
 * stay in cache while every pass of rows uses them. Each output is summed by one thread in a fixed order, so
 * results do not depend on the thread count. The AVX-512 VNNI build runs every format from 64 rows on 512-bit
 * tiles instead (vnni_tiles: the weight repacked per call into strips of 16 outputs, activations in blocks of 32).
 * gguf_dequantize_rows: chosen rows of W as float32 or bfloat16 (an embedding's gather, or tiles of W for a
 * dense GEMM), rounding exactly where gguf's numpy dequantizer does (hence -ffp-contract=off for this file);
 * gguf_dequantize_packed: a tile of W in bfloat16 in linear_bf16's packed layout, for its AMX tiles.
 *
 * Built with OpenMP against the libgomp torch already loaded (see pagellm/ops/cpu_build.py), so it runs
 * on torch's thread pool with torch's thread count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h"
#include "gguf_simd.h"
#include "isa_name.h"

enum {
    Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
    IQ4_NL = 20, NF4 = 1000, BNB_FP4 = 1001, MXFP4_F16 = 1002, NVFP4_F16 = 1003
};
/* M(type) for every type: the specialised functions below are made, and dispatched to, by type. */
#define EACH_TYPE(M)                                                                                              \
    M(Q4_0) M(Q4_1) M(Q5_0) M(Q5_1) M(Q8_0) M(IQ4_NL) M(NF4) M(BNB_FP4) M(MXFP4_F16) M(NVFP4_F16) M(Q2_K) M(Q3_K) \
    M(Q4_K) M(Q5_K) M(Q6_K)

#define QK 32
#define QK_K 256
/* Rows of x that share one unpacking of a weight block; their accumulators stay in registers. */
#define ROWS_PER_PASS 4
/* Outputs of one tile hold about this many weight bytes: they stay in L2 while every pass of rows reads them. */
#define TILE_WEIGHT_BYTES (64 * 1024)
/* How far ahead of the block being unpacked its weight row is prefetched. */
#define PREFETCH_AHEAD 1024
/* Weight rows a one-row product reads side by side (dot_outputs_*), so that this many streams from memory are
 * in flight at once: one stream at a time left a core's memory idle while it computed. */
#define STREAMS 4
/* Below this many multiply-adds a call runs on the calling thread: a parallel region is ~1 us on a quiet
 * machine, but waits for a busy core where other processes hold them (see cpu_ops.c). */
#define PARALLEL_MIN_WORK (1 << 18)

static int block_weights(int type) {
    switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case IQ4_NL: case NF4: case BNB_FP4: case MXFP4_F16:
    case NVFP4_F16:
        return QK;
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: return QK_K;
    default: return 0;
    }
}

static int block_bytes(int type) {
    switch (type) {
    case Q4_0: case IQ4_NL: case NF4: case BNB_FP4: case MXFP4_F16: return 18;
    case Q4_1: case NVFP4_F16: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

static ALWAYS_INLINE int is_k_quant(int type) { return block_weights(type) == QK_K; }

/* The types whose nibbles index a 16-value grid of signed bytes (weight = d grid[q]). */
static ALWAYS_INLINE int grid_quants(int type) {
    return type == IQ4_NL || type == NF4 || type == BNB_FP4 || type == MXFP4_F16 || type == NVFP4_F16;
}

/* The 32-weight types with a scale per 16 weights (d for weights 0-15, d_high for 16-31). */
static ALWAYS_INLINE int two_scales(int type) { return type == NVFP4_F16; }

/* Types whose unpacked quants are signed bytes (weight = d q): Q8_0's stored ones, the grid types' values. */
static ALWAYS_INLINE int signed_quants(int type) { return type == Q8_0 || grid_quants(type); }

/* ---- weight blocks, unpacked to one byte per weight in the activations' order ---------------------------- */

/* A 32-weight block: weight k = d * (q[k] - offset) + m (d_high instead of d for k >= 16: the same but in
 * NVFP4_F16); q is signed for Q8_0 and the grid types, unsigned otherwise. */
typedef struct {
    u8x32 q;
    float d, d_high, m;
    f32x8 halves; /* NVFP4_F16: d in lanes 0-3, d_high in 4-7, as the int32 lanes of a product hold the halves */
    int offset;
} Block32;

/* The two f16 scales at p as {d, d, d, d, d_high, d_high, d_high, d_high}. */
static ALWAYS_INLINE f32x8 half_scales(const uint8_t *p) {
#if defined(__AVX2__) && defined(__F16C__)
    /* one conversion of both and one permute (building it from two floats: one row ~30% slower, Sapphire Rapids) */
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
    return (f32x8)_mm256_permutevar8x32_ps(_mm256_castps128_ps256(both), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
#else
    const float d = half_to_float(p), d_high = half_to_float(p + 2);
    return (f32x8){d, d, d, d, d_high, d_high, d_high, d_high};
#endif
}

/* 16 bytes of nibbles -> 32 bytes: the low nibbles are weights 0-15, the high nibbles 16-31. */
static ALWAYS_INLINE u8x32 nibbles_32(const uint8_t *p) {
#if defined(__AVX2__)
    /* the 16 bytes broadcast to both halves (a load), the high half shifted: no cross-lane insert (one-row Q4_0
     * +14%, Q5_0 +10% on an Intel Xeon with AMX; presumably the insert's shuffle port was the row kernels' queue) */
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    const __m256i halves = _mm256_blend_epi32(both, _mm256_srli_epi16(both, 4), 0xF0);
    return (u8x32)_mm256_and_si256(halves, _mm256_set1_epi8(0xF));
#else
    const u8x16 v = load_u8x16(p);
    const u8x16 low = v & 0xF, high = v >> 4;
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                                   20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
#endif
}

/* Q5_0/Q5_1's fifth bits: bit k of the little-endian uint32 at p, as 16 in byte k (0 where clear). */
static ALWAYS_INLINE u8x32 fifth_bits(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    /* one zero-masked move of 16s beside the mask's: in dot_outputs_32's four-row loop VPMOVM2B and an AND ran a
     * quarter slower than the shuffles below, this 9% faster than them (Intel Xeon with AMX) */
    return (u8x32)_mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(16));
#else
    const u8x32 copies = (u8x32)((u32x8){0} + bits);
    /* byte k takes byte k / 8 of the word, from a copy in its own 16-byte lane (an in-lane shuffle) */
    const u8x32 spread = __builtin_shufflevector(copies, copies, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 18,
                                                 18, 18, 18, 18, 18, 18, 18, 19, 19, 19, 19, 19, 19, 19, 19);
    const u8x32 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                       1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    return (u8x32)((spread & bit) != 0) & 16;
#endif
}

/* The grid types' values: nibble k stands for the k-th of these, times the block's scale. IQ4_NL's are ggml's
 * kvalues_iq4nl; NF4's and BNB_FP4's are bitsandbytes' code books (its get_4bit_type) times 127, rounded
 * (pagellm/models/gguf_quants.py, NF4_VALUES and BNB_FP4_VALUES, says what that rounding costs); MXFP4_F16's are
 * ggml's kvalues_mxfp4, e2m1's values times 2 (exact: the scale is halved), NVFP4_F16's too. */
#define IQ4_NL_GRID -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113
#define NF4_GRID -127, -88, -67, -50, -36, -23, -12, 0, 10, 20, 31, 43, 56, 71, 92, 127
#define BNB_FP4_GRID 0, 1, 85, 127, 42, 64, 21, 32, 0, -1, -85, -127, -42, -64, -21, -32
#define MXFP4_GRID 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12

static ALWAYS_INLINE u8x32 grid_values(const int type, u8x32 nibbles) {
#if defined(__AVX2__)
    /* one in-lane byte shuffle: the 16 values in both halves, indexed by the nibbles */
    const __m256i grid = type == NF4         ? _mm256_setr_epi8(NF4_GRID, NF4_GRID)
                         : type == BNB_FP4   ? _mm256_setr_epi8(BNB_FP4_GRID, BNB_FP4_GRID)
                         : type == MXFP4_F16 || type == NVFP4_F16 ? _mm256_setr_epi8(MXFP4_GRID, MXFP4_GRID)
                                             : _mm256_setr_epi8(IQ4_NL_GRID, IQ4_NL_GRID);
    return (u8x32)_mm256_shuffle_epi8(grid, (__m256i)nibbles);
#else
    static const int8_t iq4_nl[16] = {IQ4_NL_GRID}, nf4[16] = {NF4_GRID}, bnb_fp4[16] = {BNB_FP4_GRID},
                        mxfp4[16] = {MXFP4_GRID};
    const int8_t *grid = type == NF4                                ? nf4
                         : type == BNB_FP4                          ? bnb_fp4
                         : type == MXFP4_F16 || type == NVFP4_F16 ? mxfp4
                                                                    : iq4_nl;
    u8x32 values;
    for (int k = 0; k < 32; ++k) values[k] = (uint8_t)grid[nibbles[k]];
    return values;
#endif
}

static ALWAYS_INLINE Block32 unpack_32(const int type, const uint8_t *b) {
    Block32 u = {.d = half_to_float(b), .m = 0.0f, .offset = 0};
    u.d_high = u.d;
    switch (type) {
    case Q4_0: /* f16 d, 16 bytes of nibbles; w = d (q - 8) */
        u.q = nibbles_32(b + 2);
        u.offset = 8;
        break;
    case Q4_1: /* f16 d, f16 m, 16 bytes of nibbles; w = d q + m */
        u.m = half_to_float(b + 2);
        u.q = nibbles_32(b + 4);
        break;
    case Q5_0: /* f16 d, uint32 fifth bits, 16 bytes of nibbles; w = d (q - 16) */
        u.q = nibbles_32(b + 6) | fifth_bits(b + 2);
        u.offset = 16;
        break;
    case Q5_1: /* f16 d, f16 m, uint32 fifth bits, 16 bytes of nibbles; w = d q + m */
        u.m = half_to_float(b + 2);
        u.q = nibbles_32(b + 8) | fifth_bits(b + 4);
        break;
    case IQ4_NL: case NF4: case BNB_FP4: case MXFP4_F16: /* f16 d, 16 bytes of nibbles, as Q4_0's; w = d grid[q] */
        u.q = grid_values(type, nibbles_32(b + 2));
        break;
    case NVFP4_F16: /* f16 d, f16 d_high, 16 bytes of nibbles */
        u.d_high = half_to_float(b + 2);
        u.halves = half_scales(b);
        u.q = grid_values(type, nibbles_32(b + 4));
        break;
    default: /* Q8_0: f16 d, 32 int8; w = d q */
        u.q = load_u8x32(b + 2);
        break;
    }
    return u;
}

/* A 256-weight super-block: weight k of group g (16 weights) = d * scale_g * (q[k] - offset) - dmin * min_g. */
typedef struct {
    u8x32 q[8];      /* weights 32j .. 32j + 31, unsigned */
    i16x16 scale[8]; /* chunk j's scales per pair of its bytes: lanes 0-7 its first 16 weights' group, 8-15 the next */
    i16x16 mins;     /* per group: the multiple of its activation sum to subtract (min_g, or offset * scale_g) */
    float d, dmin;   /* dmin multiplies `mins` (d itself where the format has no mins) */
    int offset;
} Block256;

/* Sixteen per-16 scales (lanes of `wide`) into the per-chunk pairs. Each pair is taken from a vector holding
 * eight of the scales in both 16-byte halves, so that every broadcast stays within a half (one VPSHUFB). */
static ALWAYS_INLINE void scales_per_16(Block256 *s, i16x16 wide) {
    const i16x16 low = __builtin_shufflevector(wide, wide, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    const i16x16 high = __builtin_shufflevector(wide, wide, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
#define PAIR(v, a) \
    __builtin_shufflevector(v, v, a, a, a, a, a, a, a, a, a + 9, a + 9, a + 9, a + 9, a + 9, a + 9, a + 9, a + 9)
    s->scale[0] = PAIR(low, 0);
    s->scale[1] = PAIR(low, 2);
    s->scale[2] = PAIR(low, 4);
    s->scale[3] = PAIR(low, 6);
    s->scale[4] = PAIR(high, 0);
    s->scale[5] = PAIR(high, 2);
    s->scale[6] = PAIR(high, 4);
    s->scale[7] = PAIR(high, 6);
#undef PAIR
}

/* Q4_K/Q5_K: eight 6-bit scales and eight 6-bit mins in 12 bytes (ggml's get_scale_min_k4): scale j < 4 is
 * the low 6 bits of byte j, min j < 4 of byte j + 4; scale/min j >= 4 take the low/high nibble of byte j + 4
 * and the top two bits of byte j - 4 / j. Each chunk's scale is broadcast from a vector holding the eight in
 * both 16-byte halves, so that every broadcast stays within a half (one VPSHUFB). */
static ALWAYS_INLINE void k4_scales(Block256 *s, const uint8_t *p) {
    uint32_t a[3];
    memcpy(a, p, sizeof a);
    const uint32_t scales_low = a[0] & 0x3F3F3F3Fu, scales_high = (a[2] & 0x0F0F0F0Fu) | ((a[0] >> 2) & 0x30303030u);
    const uint32_t mins_low = a[1] & 0x3F3F3F3Fu, mins_high = ((a[2] >> 4) & 0x0F0F0F0Fu) | ((a[1] >> 2) & 0x30303030u);
    const uint32_t packed[4] = {scales_low, scales_high, mins_low, mins_high};
    u8x16 bytes;
    memcpy(&bytes, packed, sizeof bytes);
    const i16x16 wide = __builtin_convertvector(bytes, i16x16); /* lanes 0-7 scales, 8-15 mins */
    const i16x16 twice = __builtin_shufflevector(wide, wide, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
#define IN_HALVES(v, a) \
    __builtin_shufflevector(v, v, a, a, a, a, a, a, a, a, a + 8, a + 8, a + 8, a + 8, a + 8, a + 8, a + 8, a + 8)
    s->scale[0] = IN_HALVES(twice, 0);
    s->scale[1] = IN_HALVES(twice, 1);
    s->scale[2] = IN_HALVES(twice, 2);
    s->scale[3] = IN_HALVES(twice, 3);
    s->scale[4] = IN_HALVES(twice, 4);
    s->scale[5] = IN_HALVES(twice, 5);
    s->scale[6] = IN_HALVES(twice, 6);
    s->scale[7] = IN_HALVES(twice, 7);
#undef IN_HALVES
    s->mins = __builtin_shufflevector(wide, wide, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
}

static ALWAYS_INLINE void unpack_256(const int type, const uint8_t *b, Block256 *s) {
    switch (type) {
    case Q4_K: { /* f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes: chunk c's low nibbles, then its high */
        s->d = half_to_float(b);
        s->dmin = half_to_float(b + 2);
        s->offset = 0;
        k4_scales(s, b + 4);
        for (int c = 0; c < 4; ++c) {
            const u8x32 v = load_u8x32(b + 16 + 32 * c);
            s->q[2 * c] = v & 0xF;
            s->q[2 * c + 1] = v >> 4;
        }
        break;
    }
    case Q5_K: { /* as Q4_K, with 32 bytes of fifth bits before the nibbles: bit j of byte k is weight 32j + k's */
        s->d = half_to_float(b);
        s->dmin = half_to_float(b + 2);
        s->offset = 0;
        k4_scales(s, b + 4);
        const u8x32 high = load_u8x32(b + 16);
        for (int c = 0; c < 4; ++c) {
            const u8x32 v = load_u8x32(b + 48 + 32 * c);
            s->q[2 * c] = (v & 0xF) | (((high >> (2 * c)) & 1) << 4);
            s->q[2 * c + 1] = (v >> 4) | (((high >> (2 * c + 1)) & 1) << 4);
        }
        break;
    }
    case Q6_K: { /* 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d; w = d scale (q - 32) */
        s->d = s->dmin = half_to_float(b + 208);
        s->offset = 32;
        i8x16 scales;
        memcpy(&scales, b + 192, sizeof scales);
        const i16x16 wide = __builtin_convertvector(scales, i16x16);
        scales_per_16(s, wide);
        s->mins = wide * 32;
        for (int h = 0; h < 2; ++h) { /* each half: weights 128h + 32j + k */
            const u8x32 low0 = load_u8x32(b + 64 * h), low1 = load_u8x32(b + 64 * h + 32);
            const u8x32 high = load_u8x32(b + 128 + 32 * h);
            s->q[4 * h + 0] = (low0 & 0xF) | ((high & 3) << 4);
            s->q[4 * h + 1] = (low1 & 0xF) | (((high >> 2) & 3) << 4);
            s->q[4 * h + 2] = (low0 >> 4) | (((high >> 4) & 3) << 4);
            s->q[4 * h + 3] = (low1 >> 4) | (((high >> 6) & 3) << 4);
        }
        break;
    }
    case Q3_K: { /* 32 bytes of high bits, 64 of 2-bit lows, 12 of 6-bit scales, f16 d; w = d (scale - 32) q,
                    q = low - 4 where the high bit is clear: stored here as low + 4 high with offset 4 */
        s->d = s->dmin = half_to_float(b + 108);
        s->offset = 4;
        uint32_t a[3];
        memcpy(a, b + 96, sizeof a);
        /* scale i: low nibble of byte i (i < 8) or high nibble of byte i - 8, bits 4-5 from byte 8 + i % 4 */
        const uint32_t packed[4] = {
            (a[0] & 0x0F0F0F0Fu) | ((a[2] & 0x03030303u) << 4),
            (a[1] & 0x0F0F0F0Fu) | (((a[2] >> 2) & 0x03030303u) << 4),
            ((a[0] >> 4) & 0x0F0F0F0Fu) | (((a[2] >> 4) & 0x03030303u) << 4),
            ((a[1] >> 4) & 0x0F0F0F0Fu) | (((a[2] >> 6) & 0x03030303u) << 4),
        };
        u8x16 bytes;
        memcpy(&bytes, packed, sizeof bytes);
        const i16x16 wide = __builtin_convertvector(bytes, i16x16) - 32;
        scales_per_16(s, wide);
        s->mins = wide * 4;
        const u8x32 high = load_u8x32(b);
        for (int h = 0; h < 2; ++h) {
            const u8x32 low = load_u8x32(b + 32 + 32 * h);
            for (int j = 0; j < 4; ++j)
                s->q[4 * h + j] = ((low >> (2 * j)) & 3) | (((high >> (4 * h + j)) & 1) << 2);
        }
        break;
    }
    default: { /* Q2_K: 16 bytes of 4-bit scale | 4-bit min, 64 of 2-bit quants, f16 d, f16 dmin */
        s->d = half_to_float(b + 80);
        s->dmin = half_to_float(b + 82);
        s->offset = 0;
        const u8x16 packed = load_u8x16(b);
        scales_per_16(s, __builtin_convertvector(packed & 0xF, i16x16));
        s->mins = __builtin_convertvector(packed >> 4, i16x16);
        for (int h = 0; h < 2; ++h) {
            const u8x32 low = load_u8x32(b + 16 + 32 * h);
            for (int j = 0; j < 4; ++j) s->q[4 * h + j] = (low >> (2 * j)) & 3;
        }
        break;
    }
    }
}

/* ---- activations, quantized per row ------------------------------------------------------------------ */

/* x[k] ~ d * qs[k]; s = d * the sum of qs (what the offsets and mins of the 32-weight formats multiply). */
typedef struct {
    int8_t qs[QK];
    float d, s;
} ActivationBlock32;

/* x[k] ~ d * qs[k]; bsums: the sums of qs per 16. Aligned so that its loads never straddle a cache line. */
typedef struct __attribute__((aligned(32))) {
    int8_t qs[QK_K];
    int16_t bsums[16];
    float d;
} ActivationBlock256;

/* Quantizes n (a multiple of 8) values from x[start] to qs and returns their scale d = max |x| / 127:
 * qs = x * (127 / max |x|) rounded to nearest even. A NaN or infinity makes d NaN (and qs 0), so that it
 * reaches the outputs as it would through a float product. */
static ALWAYS_INLINE float quantize_values(const void *x, int64_t start, const int n, const int bf16, int8_t *qs) {
    f32x8 amax = splat_f32(0.0f);
    for (int i = 0; i < n; i += 8) {
        const f32x8 v = load_x8(x, start + i, bf16);
        const f32x8 magnitude = (f32x8)((i32x8)v & 0x7FFFFFFF);
        amax = max_f32(magnitude, amax);
        amax = (f32x8)((i32x8)amax | ((i32x8)(v != v) & 0x7FC00000)); /* a NaN stays */
    }
    float max = 0.0f;
    int finite = 1;
    for (int k = 0; k < 8; ++k) {
        if (!(amax[k] <= 3.4028235e38f)) finite = 0;
        max = amax[k] > max ? amax[k] : max;
    }
    if (!finite) {
        memset(qs, 0, n);
        return NAN;
    }
    const float inverse = max != 0.0f ? 127.0f / max : 0.0f;
    for (int i = 0; i < n; i += 8) {
        /* |x * inverse| <= 127.5: adding and subtracting 1.5 * 2^23 rounds it to an integer, to nearest even */
        const f32x8 scaled = load_x8(x, start + i, bf16) * inverse;
        const i32x8 rounded = __builtin_convertvector((scaled + 12582912.0f) - 12582912.0f, i32x8);
        const i8x32 bytes = (i8x32)rounded;
        const i8x8 low = __builtin_shufflevector(bytes, bytes, 0, 4, 8, 12, 16, 20, 24, 28);
        memcpy(qs + i, &low, sizeof low);
    }
    return max / 127.0f;
}

static ALWAYS_INLINE int block_sum(const int8_t *qs, const int n) {
    int sum = 0;
    for (int i = 0; i < n; ++i) sum += qs[i];
    return sum;
}

static void quantize_row_32(const void *x, int64_t row, int64_t in_features, const int bf16, ActivationBlock32 *out) {
    for (int64_t b = 0; b < in_features / QK; ++b) {
        ActivationBlock32 *block = out + b;
        block->d = quantize_values(x, row * in_features + b * QK, QK, bf16, block->qs);
        block->s = block->d * (float)block_sum(block->qs, QK);
    }
}

static void quantize_row_256(const void *x, int64_t row, int64_t in_features, const int bf16,
                             ActivationBlock256 *out) {
    for (int64_t b = 0; b < in_features / QK_K; ++b) {
        ActivationBlock256 *block = out + b;
        block->d = quantize_values(x, row * in_features + b * QK_K, QK_K, bf16, block->qs);
        for (int g = 0; g < 16; ++g) block->bsums[g] = (int16_t)block_sum(block->qs + 16 * g, 16);
    }
}

/* ---- the products ----------------------------------------------------------------------------------- */

/* One 32-weight block's share of an output: the integer dot product into *acc (scaled), the offset's or the
 * minimum's share into *side. Every row kernel adds its blocks through this (and add_block_256), so an output's
 * bits do not depend on which kernel computed it.
 * sum_k (d (q_k - offset) + m) x_k = d dx sum_k q_k qx_k + (m - offset d) s_x: the 4- and 5-bit formats multiply
 * their unsigned quants as they are (one instruction, where signed ones take the sign trick's two more) and add
 * the offset's and the minimum's share on the side; Q8_0's and the grid types' quants are signed already. */
static ALWAYS_INLINE void add_block_32(const int type, const Block32 *u, const ActivationBlock32 *xb, f32x8 *acc,
                                       float *side) {
    const i8x32 xq = load_i8x32(xb->qs);
    const i32x8 dot = signed_quants(type) ? dot_s8s8((i8x32)u->q, xq) : dot_u8s8(u->q, xq);
    /* lanes 0-3 hold weights 0-15's products, lanes 4-7 those of 16-31 */
    const f32x8 scale = two_scales(type) ? u->halves * xb->d : splat_f32(u->d * xb->d);
    *acc = fmadd(to_f32(dot), scale, *acc);
    if (!signed_quants(type)) *side += (type == Q4_1 || type == Q5_1 ? u->m : -(float)u->offset * u->d) * xb->s;
}

/* A super-block's share: dx (d sum_g scale_g sum_k q_k qx_k - dmin sum_g mins_g bsum_g). */
static ALWAYS_INLINE f32x8 add_block_256(const Block256 *s, const ActivationBlock256 *xb, f32x8 acc) {
    i32x8 sum = dot_scaled(s->q[0], load_i8x32(xb->qs), s->scale[0]);
    for (int j = 1; j < 8; ++j) sum += dot_scaled(s->q[j], load_i8x32(xb->qs + 32 * j), s->scale[j]);
    const i32x8 mins = madd_i16(load_i16x16(xb->bsums), s->mins);
    acc = fmadd(to_f32(sum), splat_f32(xb->d * s->d), acc);
    return fmadd(to_f32(mins), splat_f32(-(xb->d * s->dmin)), acc);
}

/* out[r] = weight row `w` (nb blocks) . activation row r, for r < R (rows `stride` blocks apart). R is a
 * constant after inlining: the R accumulators live in registers and each block is unpacked once for all.
 * Even and odd blocks go to separate accumulators, so that consecutive blocks' multiply-adds do not wait for
 * each other (one accumulator held Q8_0 to one block per FMA latency). */
static ALWAYS_INLINE void dot_rows_32(const int type, const uint8_t *w, int64_t nb, const ActivationBlock32 *x,
                                      int64_t stride, const int R, float *out) {
    f32x8 acc[ROWS_PER_PASS][2];
    float side[ROWS_PER_PASS][2];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < 2; ++i) {
            acc[r][i] = splat_f32(0.0f);
            side[r][i] = 0.0f;
        }
    const int bytes = block_bytes(type);
    for (int64_t b = 0; b < nb; b += 2) {
        __builtin_prefetch(w + b * bytes + PREFETCH_AHEAD, 0, 3);
        for (int i = 0; i < 2 && b + i < nb; ++i) {
            const Block32 u = unpack_32(type, w + (b + i) * bytes);
            for (int r = 0; r < R; ++r) add_block_32(type, &u, x + r * stride + b + i, &acc[r][i], &side[r][i]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum_f32(acc[r][0] + acc[r][1]) + (side[r][0] + side[r][1]);
}

static ALWAYS_INLINE void dot_rows_256(const int type, const uint8_t *w, int64_t nb, const ActivationBlock256 *x,
                                       int64_t stride, const int R, float *out) {
    f32x8 acc[ROWS_PER_PASS];
    for (int r = 0; r < R; ++r) acc[r] = splat_f32(0.0f);
    const int bytes = block_bytes(type);
    for (int64_t b = 0; b < nb; ++b) {
        for (int line = 0; line < bytes; line += 64) __builtin_prefetch(w + b * bytes + PREFETCH_AHEAD + line, 0, 3);
        Block256 s;
        unpack_256(type, w + b * bytes, &s);
        for (int r = 0; r < R; ++r) acc[r] = add_block_256(&s, x + r * stride + b, acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum_f32(acc[r]);
}

/* One row of x against C weight rows w[c] (C <= STREAMS), block by block in lockstep: each output's arithmetic
 * is dot_rows_32's or dot_rows_256's at R = 1, to the bit; reading C rows at once keeps C streams in flight. */
static ALWAYS_INLINE void dot_outputs_32(const int type, const uint8_t *const *w, int64_t nb,
                                         const ActivationBlock32 *x, const int C, float *out) {
    f32x8 acc[STREAMS][2];
    float side[STREAMS][2];
    for (int c = 0; c < C; ++c)
        for (int i = 0; i < 2; ++i) {
            acc[c][i] = splat_f32(0.0f);
            side[c][i] = 0.0f;
        }
    const int bytes = block_bytes(type);
    for (int64_t b = 0; b < nb; b += 2) {
        for (int c = 0; c < C; ++c) __builtin_prefetch(w[c] + b * bytes + PREFETCH_AHEAD, 0, 3);
        for (int i = 0; i < 2 && b + i < nb; ++i)
            for (int c = 0; c < C; ++c) {
                const Block32 u = unpack_32(type, w[c] + (b + i) * bytes);
                add_block_32(type, &u, x + b + i, &acc[c][i], &side[c][i]);
            }
    }
    for (int c = 0; c < C; ++c) out[c] = hsum_f32(acc[c][0] + acc[c][1]) + (side[c][0] + side[c][1]);
}

static ALWAYS_INLINE void dot_outputs_256(const int type, const uint8_t *const *w, int64_t nb,
                                          const ActivationBlock256 *x, const int C, float *out) {
    f32x8 acc[STREAMS];
    for (int c = 0; c < C; ++c) acc[c] = splat_f32(0.0f);
    const int bytes = block_bytes(type);
    for (int64_t b = 0; b < nb; ++b)
        for (int c = 0; c < C; ++c) {
            for (int line = 0; line < bytes; line += 64)
                __builtin_prefetch(w[c] + b * bytes + PREFETCH_AHEAD + line, 0, 3);
            Block256 s;
            unpack_256(type, w[c] + b * bytes, &s);
            acc[c] = add_block_256(&s, x + b, acc[c]);
        }
    for (int c = 0; c < C; ++c) out[c] = hsum_f32(acc[c]);
}

static ALWAYS_INLINE void store_one(void *y, int64_t index, float v, int bf16) {
    if (!bf16) {
        ((float *)y)[index] = v;
        return;
    }
    const u16x8 bits = to_bf16(splat_f32(v));
    ((uint16_t *)y)[index] = bits[0];
}

/* Q2_K and Q3_K read one row at a time: their unpacking, not memory, bounds them, and four rows side by side
 * measured 10-17% slower (an Intel Xeon with AMX, 2 cores, AVX-512 and AVX2 builds alike). */
static ALWAYS_INLINE int streams_of(const int type) { return type == Q2_K || type == Q3_K ? 1 : STREAMS; }

/* out[c] = weight row rows[c] . row `row` of the quantized activations xq, for c < C. */
static ALWAYS_INLINE void dot_outputs(const int type, const uint8_t *const *rows, int64_t nb, const void *xq,
                                      int64_t row, const int C, float *out) {
    if (is_k_quant(type))
        dot_outputs_256(type, rows, nb, (const ActivationBlock256 *)xq + row * nb, C, out);
    else
        dot_outputs_32(type, rows, nb, (const ActivationBlock32 *)xq + row * nb, C, out);
}

/* Outputs [first, last) of one row of x: streams_of(type) parts of the range, an output of each at a time. */
static ALWAYS_INLINE void one_row_pass(const int type, const uint8_t *w, int64_t nb, const void *xq, int64_t row,
                                       int64_t first, int64_t last, int64_t out_features, void *y, int y_bf16) {
    const int streams = streams_of(type);
    const int64_t part = (last - first + streams - 1) / streams, row_bytes = nb * block_bytes(type);
    for (int64_t k = 0; k < part; ++k) {
        const uint8_t *rows[STREAMS];
        int64_t outputs[STREAMS];
        int count = 0;
        for (int c = 0; c < streams; ++c) {
            const int64_t o = first + c * part + k;
            if (o < last) {
                outputs[count] = o;
                rows[count++] = w + o * row_bytes;
            }
        }
        float out[STREAMS];
        if (count == STREAMS)
            dot_outputs(type, rows, nb, xq, row, STREAMS, out);
        else /* the last parts' tails, or a type read one row at a time */
            for (int c = 0; c < count; ++c) dot_outputs(type, rows + c, nb, xq, row, 1, out + c);
        for (int c = 0; c < count; ++c) store_one(y, row * out_features + outputs[c], out[c], y_bf16);
    }
}

/* Outputs [first, last) for rows [row, row + R) of x. */
static ALWAYS_INLINE void output_pass(const int type, const uint8_t *w, int64_t nb, const void *xq, int64_t row,
                                      const int R, int64_t first, int64_t last, int64_t out_features, void *y,
                                      int y_bf16) {
    if (R == 1) {
        one_row_pass(type, w, nb, xq, row, first, last, out_features, y, y_bf16);
        return;
    }
    for (int64_t o = first; o < last; ++o) {
        const uint8_t *weight_row = w + o * nb * block_bytes(type);
        float out[ROWS_PER_PASS];
        if (is_k_quant(type))
            dot_rows_256(type, weight_row, nb, (const ActivationBlock256 *)xq + row * nb, nb, R, out);
        else
            dot_rows_32(type, weight_row, nb, (const ActivationBlock32 *)xq + row * nb, nb, R, out);
        for (int r = 0; r < R; ++r) store_one(y, (row + r) * out_features + o, out[r], y_bf16);
    }
}

/* One specialised function per (type, rows per pass) and per (activation block, input dtype), called through
 * pointers from the parallel region: OpenMP outlines a region before inlining, so a region inside an inlined
 * body would run one unspecialised copy with the type as a variable. The output dtype stays a variable (one
 * branch per output), which halves the code to compile. */
typedef void (*PassFunction)(const uint8_t *w, int64_t nb, const void *xq, int64_t row, int64_t first, int64_t last,
                             int64_t out_features, void *y, int y_bf16);
typedef void (*QuantizeFunction)(const void *x, int64_t row, int64_t in_features, void *out);

#define PASS_FOR(T, R)                                                                                            \
    static void pass_##T##_##R(const uint8_t *w, int64_t nb, const void *xq, int64_t row, int64_t first,         \
                               int64_t last, int64_t out_features, void *y, int y_bf16) {                         \
        output_pass(T, w, nb, xq, row, R, first, last, out_features, y, y_bf16);                                  \
    }
#define PASSES_FOR(T) PASS_FOR(T, 1) PASS_FOR(T, 2) PASS_FOR(T, 3) PASS_FOR(T, 4)
EACH_TYPE(PASSES_FOR)

/* The pass functions of `type` for 1 .. ROWS_PER_PASS rows, or 0 for a type it does not know. */
static int pass_functions(int type, PassFunction passes[ROWS_PER_PASS]) {
#define CASE(T)                                                                                                   \
    case T:                                                                                                       \
        passes[0] = pass_##T##_1, passes[1] = pass_##T##_2, passes[2] = pass_##T##_3, passes[3] = pass_##T##_4;  \
        return 1;
    switch (type) {
        EACH_TYPE(CASE)
    default: return 0;
    }
#undef CASE
}

static void quantize_32_f32(const void *x, int64_t row, int64_t in_features, void *out) {
    quantize_row_32(x, row, in_features, 0, out);
}
static void quantize_32_bf16(const void *x, int64_t row, int64_t in_features, void *out) {
    quantize_row_32(x, row, in_features, 1, out);
}
static void quantize_256_f32(const void *x, int64_t row, int64_t in_features, void *out) {
    quantize_row_256(x, row, in_features, 0, out);
}
static void quantize_256_bf16(const void *x, int64_t row, int64_t in_features, void *out) {
    quantize_row_256(x, row, in_features, 1, out);
}

/* The row kernels' activations: bytes per block of them (ActivationBlock256 for the k-quants, else
 * ActivationBlock32), and the function quantizing a row of x into them. */
static size_t activation_block_bytes(const int k_quant) {
    return k_quant ? sizeof(ActivationBlock256) : sizeof(ActivationBlock32);
}
static QuantizeFunction quantize_function(const int k_quant, const int x_bf16) {
    return k_quant ? (x_bf16 ? quantize_256_bf16 : quantize_256_f32) : (x_bf16 ? quantize_32_bf16 : quantize_32_f32);
}

/* ---- 512-bit VPDPBUSD tiles for many rows, the AVX-512 VNNI build's ---------------------------------------- */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_VNNI_TILES 1
/* From this many rows of x, the products run on tiles (vnni_tiles) instead of the row kernels above, which pay
 * their unpacking, float scales and a horizontal sum per block, row and output; the tiles repack each weight
 * once per call and sum each output in another order than the row kernels. On a 2-core AMD EPYC Zen 4 (weights
 * from memory, 640 -> 8192) they overtook the row kernel from 6-8 rows (Q8_0 6 rows 132/119 GFLOP/s, 8 rows
 * 147/153; Q5_0 6 rows 103/143). They start at 64 all the same: below that a step's rows are computed as they
 * would be in any smaller step, so a speculative verification step (at most 8 sequences x 1 + 7 tokens by
 * default) computes each row's bits as the plain decode steps without speculation do. */
#define TILE_MIN_ROWS 64
/* The quants' offset once taken as unsigned bytes: weight = d (u - offset) + m. Q8_0's and the grid types' signed
 * quants are taken + 128, so that the weights are VPDPBUSD's unsigned operand and the activations its signed one. */
static ALWAYS_INLINE int tile_offset(const int type) {
    return signed_quants(type) ? 128 : type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
}

/* A block of 32 activations as the tiles take them for every type: ActivationBlock32's quants and scale, the
 * sum of the quants and the sums of each 16 (the offsets' share, in integers: per 16 for NVFP4_F16's per-16
 * scales) and d times the sums of each 16 (what the k-quants' per-16 constants multiply). */
typedef struct {
    int8_t qs[QK];
    float d;
    int32_t sum, sum16[2];
    float s16[2];
} TileActivations;

static void quantize_tile_row(const void *x, int64_t row, int64_t in_features, const int bf16, TileActivations *out) {
    for (int64_t b = 0; b < in_features / QK; ++b) {
        TileActivations *block = out + b;
        block->d = quantize_values(x, row * in_features + b * QK, QK, bf16, block->qs);
        const int low = block_sum(block->qs, 16), high = block_sum(block->qs + 16, 16);
        block->sum = low + high;
        block->sum16[0] = low;
        block->sum16[1] = high;
        block->s16[0] = block->d * (float)low;
        block->s16[1] = block->d * (float)high;
    }
}

/* Outputs per strip (one zmm of int32 sums), strips and rows per tile. */
#define STRIP 16
#define TILE_STRIPS 2
#define TILE_ROWS 4
/* A strip's chunk of 32 inputs: 8 groups of 4 inputs, each 64 bytes holding the 16 outputs' 4 quants side by
 * side, as VPDPBUSD multiplies them; then per scale group (the 32 inputs, or each 16 of them for the k-quants
 * and NVFP4_F16) the 16 outputs' scale and added constant as floats: weight = scale * q + constant. */
#define STRIP_QUANT_BYTES (8 * 64)
static ALWAYS_INLINE int scale_groups(const int type) { return is_k_quant(type) || two_scales(type) ? 2 : 1; }
static ALWAYS_INLINE int64_t strip_chunk_bytes(const int type) {
    return STRIP_QUANT_BYTES + 2 * scale_groups(type) * STRIP * 4;
}

/* The 16 outputs' 4 quants of each group of a chunk, side by side: output c's 32 quants into column c. */
static ALWAYS_INLINE void place_quants(uint8_t *quants, int64_t c, u8x32 q) {
    uint32_t words[8];
    memcpy(words, &q, sizeof q);
    for (int g = 0; g < 8; ++g) memcpy(quants + g * 64 + c * 4, words + g, 4);
}

/* Outputs [first, first + count) (count <= STRIP) of W, repacked into one strip (missing outputs are zeros).
 * Row by row, each read front to back (the strip's 16 rows are one contiguous run of W): read block by block
 * across the rows instead, Q8_0's strips came from memory at a third of their rate from cache. */
static ALWAYS_INLINE void repack_strip(const int type, const uint8_t *w, int64_t nb, int64_t first, int64_t count,
                                       uint8_t *strip) {
    const int bytes = block_bytes(type);
    const int64_t row_bytes = nb * bytes, chunk_bytes = strip_chunk_bytes(type);
    const int64_t chunks = nb * (block_weights(type) / QK);
    if (count < STRIP) memset(strip, 0, chunks * chunk_bytes);
    for (int64_t c = 0; c < count; ++c) {
        const uint8_t *weight_row = w + (first + c) * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            if (!is_k_quant(type)) {
                uint8_t *chunk = strip + b * chunk_bytes;
                float *scale = (float *)(chunk + STRIP_QUANT_BYTES), *constant = scale + scale_groups(type) * STRIP;
                const Block32 u = unpack_32(type, weight_row + b * bytes);
                place_quants(chunk, c, signed_quants(type) ? u.q ^ 0x80 : u.q);
                scale[c] = u.d;
                constant[c] = u.m;
                if (two_scales(type)) scale[STRIP + c] = u.d_high; /* no constant: tile_pass reads none for it */
                continue;
            }
            /* a super-block: weight k of group g = d scale_g q_k - dmin mins_g, 8 chunks of two groups */
            Block256 sb;
            unpack_256(type, weight_row + b * bytes, &sb);
            for (int j = 0; j < 8; ++j) {
                uint8_t *chunk = strip + (b * 8 + j) * chunk_bytes;
                float *scale = (float *)(chunk + STRIP_QUANT_BYTES), *constant = scale + 2 * STRIP;
                place_quants(chunk, c, sb.q[j]);
                for (int h = 0; h < 2; ++h) {
                    scale[h * STRIP + c] = sb.d * (float)sb.scale[j][8 * h];
                    constant[h * STRIP + c] = -(sb.dmin * (float)sb.mins[2 * j + h]);
                }
            }
        }
    }
}

/* 16 outputs of a row into y (float32, or bfloat16 rounded as store_one rounds), the first `count`. */
static ALWAYS_INLINE void store_strip(void *y, int64_t index, __m512 v, int64_t count, int bf16) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)y + index, (__mmask16)((1u << count) - 1), v);
        return;
    }
    float lanes[STRIP];
    _mm512_storeu_ps(lanes, v);
    f32x8 halves[2];
    memcpy(halves, lanes, sizeof lanes);
    uint16_t bits[STRIP];
    const u16x8 low = to_bf16(halves[0]), high = to_bf16(halves[1]);
    memcpy(bits, &low, sizeof low);
    memcpy(bits + 8, &high, sizeof high);
    memcpy((uint16_t *)y + index, bits, count * sizeof(uint16_t));
}

/* Rows [row, row + R) of x against S repacked strips (strip s at strips + s * strip_bytes), outputs from `first`
 * (`count` of them, <= S * STRIP). Per scale group (32 inputs; 16 for the k-quants and NVFP4_F16), each
 * (row, strip) gathers the group's products in int32 lanes (VPDPBUSD, the row's 4 activation bytes broadcast),
 * then adds scale * dx * (sum - offset * the group's activations' sum) + constant * dx * that sum to its float
 * lanes: one float scale per group for 16 outputs. */
static ALWAYS_INLINE void tile_pass(const int type, const uint8_t *strips, int64_t strip_bytes, int64_t chunks,
                                    const TileActivations *x, int64_t row, const int R, const int S, int64_t first,
                                    int64_t count, int64_t out_features, void *y, int y_bf16) {
    const int k_quant = is_k_quant(type);
    const int offset = k_quant ? 0 : tile_offset(type);
    const int has_constant = k_quant || type == Q4_1 || type == Q5_1;
    const int groups = scale_groups(type), per_group = 8 / groups; /* scale groups per chunk, 4-input groups each */
    const int64_t chunk_bytes = strip_chunk_bytes(type);
    __m512 acc[TILE_ROWS][TILE_STRIPS];
    for (int r = 0; r < R; ++r)
        for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
    const TileActivations *rows = x + row * chunks;
    for (int64_t b = 0; b < chunks; ++b) {
        const uint8_t *chunk = strips + b * chunk_bytes;
        for (int h = 0; h < groups; ++h) {
            __m512i sums[TILE_ROWS][TILE_STRIPS];
            for (int r = 0; r < R; ++r)
                for (int s = 0; s < S; ++s) sums[r][s] = _mm512_setzero_si512();
            for (int g = h * per_group; g < (h + 1) * per_group; ++g) {
                __m512i weights[TILE_STRIPS];
                for (int s = 0; s < S; ++s) weights[s] = _mm512_loadu_si512(chunk + s * strip_bytes + g * 64);
                for (int r = 0; r < R; ++r) {
                    int32_t four;
                    memcpy(&four, rows[r * chunks + b].qs + 4 * g, sizeof four);
                    const __m512i activations = _mm512_set1_epi32(four);
                    for (int s = 0; s < S; ++s)
                        sums[r][s] = _mm512_dpbusd_epi32(sums[r][s], weights[s], activations);
                }
            }
            __m512 scale[TILE_STRIPS], constant[TILE_STRIPS];
            for (int s = 0; s < S; ++s) {
                const float *floats = (const float *)(chunk + s * strip_bytes + STRIP_QUANT_BYTES);
                scale[s] = _mm512_loadu_ps(floats + h * STRIP);
                constant[s] = has_constant ? _mm512_loadu_ps(floats + (groups + h) * STRIP) : _mm512_setzero_ps();
            }
            for (int r = 0; r < R; ++r) {
                const TileActivations *xb = rows + r * chunks + b;
                const __m512i correction = _mm512_set1_epi32(offset * (groups == 2 ? xb->sum16[h] : xb->sum));
                const __m512 dx = _mm512_set1_ps(xb->d);
                const __m512 sx = _mm512_set1_ps(k_quant ? xb->s16[h] : xb->d * (float)xb->sum);
                for (int s = 0; s < S; ++s) {
                    const __m512i sum = offset ? _mm512_sub_epi32(sums[r][s], correction) : sums[r][s];
                    acc[r][s] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale[s], dx), acc[r][s]);
                    if (has_constant) acc[r][s] = _mm512_fmadd_ps(constant[s], sx, acc[r][s]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int s = 0; s < S; ++s) {
            const int64_t left = count - s * STRIP;
            if (left > 0)
                store_strip(y, (row + r) * out_features + first + s * STRIP, acc[r][s], left < STRIP ? left : STRIP,
                            y_bf16);
        }
}

typedef void (*TilePassFunction)(const uint8_t *strips, int64_t strip_bytes, int64_t chunks,
                                 const TileActivations *x, int64_t row, int64_t first, int64_t count,
                                 int64_t out_features, void *y, int y_bf16);

#define TILE_PASS_FOR(T, R)                                                                                       \
    static void tile_##T##_##R(const uint8_t *strips, int64_t strip_bytes, int64_t chunks,                        \
                               const TileActivations *x, int64_t row, int64_t first, int64_t count,             \
                               int64_t out_features, void *y, int y_bf16) {                                       \
        tile_pass(T, strips, strip_bytes, chunks, x, row, R, TILE_STRIPS, first, count, out_features, y, y_bf16); \
    }
#define TILE_PASSES_FOR(T) TILE_PASS_FOR(T, 1) TILE_PASS_FOR(T, 2) TILE_PASS_FOR(T, 3) TILE_PASS_FOR(T, 4)
EACH_TYPE(TILE_PASSES_FOR)

#define REPACK_FOR(T)                                                                                             \
    static void repack_##T(const uint8_t *w, int64_t nb, int64_t first, int64_t count, uint8_t *strip) {          \
        repack_strip(T, w, nb, first, count, strip);                                                              \
    }
EACH_TYPE(REPACK_FOR)
typedef void (*RepackFunction)(const uint8_t *w, int64_t nb, int64_t first, int64_t count, uint8_t *strip);

/* The tile functions of `type` (0 for a type it does not know). */
static int tile_functions(int type, TilePassFunction passes[TILE_ROWS], RepackFunction *repack) {
#define CASE(T)                                                                                                   \
    case T:                                                                                                       \
        passes[0] = tile_##T##_1, passes[1] = tile_##T##_2, passes[2] = tile_##T##_3, passes[3] = tile_##T##_4;  \
        *repack = repack_##T;                                                                                     \
        return 1;
    switch (type) {
        EACH_TYPE(CASE)
    default: return 0;
    }
#undef CASE
}

/* y = x W^T on tiles, x already quantized in blocks of 32 (xq, whatever the type's block): threads take
 * TILE_STRIPS strips (32 outputs) at a time, repack their weights once into a buffer of their own
 * (strip_chunk_bytes per 32 inputs and strip, in L1/L2), and run every row of x through them TILE_ROWS at a
 * time. nb: the weight's blocks per row. Returns 1 if a buffer cannot be allocated. */
static int vnni_tiles(int type, const uint8_t *w, const TileActivations *xq, int64_t rows, int64_t nb,
                      int64_t out_features, void *y, int y_bf16, int parallel) {
    TilePassFunction passes[TILE_ROWS];
    RepackFunction repack;
    tile_functions(type, passes, &repack);
    const int64_t chunks = nb * (block_weights(type) / QK);
    const int64_t strip_bytes = chunks * strip_chunk_bytes(type), width = TILE_STRIPS * STRIP;
    const int64_t tiles = (out_features + width - 1) / width;
    int failed = 0;
#pragma omp parallel if (parallel) reduction(| : failed)
    {
        uint8_t *strips = aligned_alloc(64, TILE_STRIPS * strip_bytes);
        if (strips == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            if (strips == NULL) continue;
            const int64_t first = t * width, count = out_features - first < width ? out_features - first : width;
            for (int s = 0; s < TILE_STRIPS; ++s) {
                const int64_t left = count - s * STRIP;
                repack(w, nb, first + s * STRIP, left <= 0 ? 0 : left < STRIP ? left : STRIP,
                       strips + s * strip_bytes);
            }
            for (int64_t row = 0; row < rows; row += TILE_ROWS) {
                const int64_t n = rows - row < TILE_ROWS ? rows - row : TILE_ROWS;
                passes[n - 1](strips, strip_bytes, chunks, xq, row, first, count, out_features, y, y_bf16);
            }
        }
        free(strips);
    }
    return failed;
}
#endif

/* y [rows, out_features] (float32, or bfloat16 if y_bf16) = x [rows, in_features] (float32, or bfloat16 if
 * x_bf16) W^T. Returns 2 for a type it does not know or an in_features that is not a whole number of blocks,
 * 1 if the quantized activations' buffer cannot be allocated. */
int gguf_matmul(int type, const uint8_t *w, const void *x, int x_bf16, int64_t rows, int64_t in_features,
                int64_t out_features, void *y, int y_bf16) {
    const int weights = block_weights(type);
    if (weights == 0 || in_features <= 0 || in_features % weights != 0 || rows < 0 || out_features < 0) return 2;
    if (rows == 0 || out_features == 0) return 0;
    const int k_quant = is_k_quant(type);
    const int64_t nb = in_features / weights, row_bytes = nb * block_bytes(type);
    const int parallel = rows * in_features * out_features >= PARALLEL_MIN_WORK;
#if defined(HAVE_VNNI_TILES)
    if (rows >= TILE_MIN_ROWS) {
        /* activations in blocks of 32 for every type: the tiles' scale groups are 32 or 16 inputs */
        const int64_t chunks = in_features / QK;
        const size_t bytes = (size_t)(rows * chunks) * sizeof(TileActivations);
        TileActivations *x32 = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (x32 == NULL) return 1;
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t r = 0; r < rows; ++r) quantize_tile_row(x, r, in_features, x_bf16, x32 + r * chunks);
        const int failed = vnni_tiles(type, w, x32, rows, nb, out_features, y, y_bf16, parallel);
        free(x32);
        return failed;
    }
#endif
    const size_t block = activation_block_bytes(k_quant);
    const size_t bytes = (size_t)(rows * nb) * block;
    void *xq = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (xq == NULL) return 1;
    PassFunction passes[ROWS_PER_PASS];
    pass_functions(type, passes);
    const QuantizeFunction quantize = quantize_function(k_quant, x_bf16);
    /* At most 64 outputs or TILE_WEIGHT_BYTES a tile, and at least 4 tiles a thread, so that a narrow layer
     * still spreads over every thread (which thread sums an output never changes its value). */
    const int64_t spread = (out_features + 4 * omp_get_max_threads() - 1) / (4 * omp_get_max_threads());
    int64_t tile = TILE_WEIGHT_BYTES / row_bytes;
    tile = tile > 64 ? 64 : tile;
    tile = parallel && tile > spread ? spread : tile;
    tile = tile < 1 ? 1 : tile;
    int64_t tiles = (out_features + tile - 1) / tile;
    if (parallel) { /* as many tiles for every thread, of sizes within one output of each other */
        const int64_t threads = omp_get_max_threads();
        tiles = (tiles + threads - 1) / threads * threads;
        tile = (out_features + tiles - 1) / tiles;
        tiles = (out_features + tile - 1) / tile;
    }
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) quantize(x, r, in_features, (char *)xq + r * nb * block);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t first = t * tile, last = first + tile < out_features ? first + tile : out_features;
            for (int64_t row = 0; row < rows; row += ROWS_PER_PASS) {
                const int64_t n = rows - row < ROWS_PER_PASS ? rows - row : ROWS_PER_PASS;
                passes[n - 1](w, nb, xq, row, first, last, out_features, y, y_bf16);
            }
        }
    }
    free(xq);
    return 0;
}

/* Several weights of one type and shape (a mixture-of-experts layer's experts: table[i] expert i's blocks), each
 * over its own rows of x, in one call: x and y [rows, in / out] hold the runs of sizes[e] rows of experts ids[e],
 * e < experts, in turn; y's rows of run e = x's @ table[ids[e]]^T. The rows are quantized once, then (expert,
 * tile of outputs) items are shared out over the threads in one parallel loop, on the row kernels gguf_matmul
 * runs below its tiles: each output's bits are gguf_matmul's for that expert's rows alone (a row's outputs do not
 * depend on the other rows of its pass, and passes take ROWS_PER_PASS rows of an expert at a time as there). A
 * decode step's experts then pay one call and one fork of the threads instead of one per expert and projection.
 * Every sizes[e] must be below the tiles' TILE_MIN_ROWS where the build has them (gguf_matmul would take them
 * there); returns 2 otherwise or for an unknown type or shape, 1 if the quantized activations' buffer cannot be
 * allocated. */
int gguf_matmul_experts(int type, const uint8_t *const *table, const int32_t *ids, const int64_t *sizes,
                        int64_t experts, const void *x, int x_bf16, int64_t in_features, int64_t out_features, void *y,
                        int y_bf16) {
    const int weights = block_weights(type);
    if (weights == 0 || in_features <= 0 || in_features % weights != 0 || out_features <= 0 || experts < 0) return 2;
    int64_t rows = 0, largest = 0;
    for (int64_t e = 0; e < experts; ++e) {
        if (sizes[e] < 0) return 2;
        rows += sizes[e];
        largest = sizes[e] > largest ? sizes[e] : largest;
    }
#if defined(HAVE_VNNI_TILES)
    if (largest >= TILE_MIN_ROWS) return 2;
#endif
    if (rows == 0) return 0;
    const int k_quant = is_k_quant(type);
    const int64_t nb = in_features / weights, row_bytes = nb * block_bytes(type);
    const size_t block = activation_block_bytes(k_quant);
    const size_t bytes = (size_t)(rows * nb) * block;
    void *xq = aligned_alloc(64, (bytes + 63) / 64 * 64);
    int64_t *first_row = malloc((size_t)(experts + 1) * sizeof *first_row);
    if (xq == NULL || first_row == NULL) {
        free(xq);
        free(first_row);
        return 1;
    }
    first_row[0] = 0;
    for (int64_t e = 0; e < experts; ++e) first_row[e + 1] = first_row[e] + sizes[e];
    PassFunction passes[ROWS_PER_PASS];
    pass_functions(type, passes);
    const QuantizeFunction quantize = quantize_function(k_quant, x_bf16);
    /* gguf_matmul's tiles of outputs (at most 64, or TILE_WEIGHT_BYTES of weights), per expert */
    int64_t tile = TILE_WEIGHT_BYTES / row_bytes;
    tile = tile > 64 ? 64 : tile < 1 ? 1 : tile;
    const int64_t tiles = (out_features + tile - 1) / tile, items = experts * tiles;
    const int parallel = rows * in_features * out_features >= PARALLEL_MIN_WORK;
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) quantize(x, r, in_features, (char *)xq + r * nb * block);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t e = item / tiles, first = (item % tiles) * tile;
            const int64_t last = first + tile < out_features ? first + tile : out_features;
            for (int64_t row = first_row[e]; row < first_row[e + 1]; row += ROWS_PER_PASS) {
                const int64_t n = first_row[e + 1] - row < ROWS_PER_PASS ? first_row[e + 1] - row : ROWS_PER_PASS;
                passes[n - 1](table[ids[e]], nb, xq, row, first, last, out_features, y, y_bf16);
            }
        }
    }
    free(first_row);
    free(xq);
    return 0;
}

/* ---- dequantization ----------------------------------------------------------------------------------- */

#define EIGHT(p) 8 * p, 8 * p + 1, 8 * p + 2, 8 * p + 3, 8 * p + 4, 8 * p + 5, 8 * p + 6, 8 * p + 7

/* The 32 quants minus `offset` as four float vectors (exact: small integers). */
static ALWAYS_INLINE void widen(u8x32 q, const int is_signed, int offset, f32x8 out[4]) {
    i32x8 v[4];
#if defined(__AVX2__)
    /* VPMOVSXBD/VPMOVZXBD per 8 bytes: GCC scalarises the shuffle-and-convert below into byte moves. */
    const __m128i low = _mm256_castsi256_si128((__m256i)q), high = _mm256_extracti128_si256((__m256i)q, 1);
    const __m128i eights[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int p = 0; p < 4; ++p)
        v[p] = (i32x8)(is_signed ? _mm256_cvtepi8_epi32(eights[p]) : _mm256_cvtepu8_epi32(eights[p]));
#else
    if (is_signed) {
        const i8x32 s = (i8x32)q;
        v[0] = __builtin_convertvector(__builtin_shufflevector(s, s, EIGHT(0)), i32x8);
        v[1] = __builtin_convertvector(__builtin_shufflevector(s, s, EIGHT(1)), i32x8);
        v[2] = __builtin_convertvector(__builtin_shufflevector(s, s, EIGHT(2)), i32x8);
        v[3] = __builtin_convertvector(__builtin_shufflevector(s, s, EIGHT(3)), i32x8);
    } else {
        v[0] = __builtin_convertvector(__builtin_shufflevector(q, q, EIGHT(0)), i32x8);
        v[1] = __builtin_convertvector(__builtin_shufflevector(q, q, EIGHT(1)), i32x8);
        v[2] = __builtin_convertvector(__builtin_shufflevector(q, q, EIGHT(2)), i32x8);
        v[3] = __builtin_convertvector(__builtin_shufflevector(q, q, EIGHT(3)), i32x8);
    }
#endif
    for (int p = 0; p < 4; ++p) out[p] = to_f32(v[p] - offset);
}

static ALWAYS_INLINE void store8(void *out, int64_t index, f32x8 v, int bf16) {
    if (!bf16) {
        memcpy((float *)out + index, &v, sizeof v);
        return;
    }
    const u16x8 bits = weights_to_bf16(v);
    memcpy((uint16_t *)out + index, &bits, sizeof bits);
}

/* One row of in_features weights, in gguf's float32 operations and order:
 * 32-weight formats (q - offset) * d (+ m); k-quants (q - offset) * (d * scale) (- dmin * min). */
static ALWAYS_INLINE void dequantize_row(const int type, const uint8_t *w, int64_t in_features, void *out,
                                         int bf16) {
    const int64_t nb = in_features / block_weights(type);
    const int bytes = block_bytes(type);
    for (int64_t b = 0; b < nb; ++b) {
        f32x8 v[4];
        if (!is_k_quant(type)) {
            const Block32 u = unpack_32(type, w + b * bytes);
            widen(u.q, signed_quants(type), u.offset, v);
            for (int p = 0; p < 4; ++p) {
                f32x8 weights = v[p] * (p < 2 ? u.d : u.d_high);
                if (type == Q4_1 || type == Q5_1) weights = weights + u.m;
                store8(out, b * QK + 8 * p, weights, bf16);
            }
            continue;
        }
        Block256 s;
        unpack_256(type, w + b * bytes, &s);
        for (int j = 0; j < 8; ++j) {
            widen(s.q[j], 0, s.offset, v);
            for (int p = 0; p < 4; ++p) {
                const int group = 2 * j + p / 2;
                f32x8 weights = v[p] * (s.d * (float)s.scale[j][8 * (p / 2)]);
                if (type == Q2_K || type == Q4_K || type == Q5_K) weights = weights - s.dmin * (float)s.mins[group];
                store8(out, b * QK_K + 32 * j + 8 * p, weights, bf16);
            }
        }
    }
}

typedef void (*DequantizeFunction)(const uint8_t *w, int64_t in_features, void *out, int bf16);

#define DEQUANTIZE_FOR(T)                                                                                         \
    static void dequantize_##T(const uint8_t *w, int64_t in_features, void *out, int bf16) {                      \
        dequantize_row(T, w, in_features, out, bf16);                                                             \
    }
EACH_TYPE(DEQUANTIZE_FOR)

static DequantizeFunction dequantize_function(int type) {
#define CASE(T) \
    case T: return dequantize_##T;
    switch (type) {
        EACH_TYPE(CASE)
    default: return NULL;
    }
#undef CASE
}

/* out [n_rows, in_features] (float32, or bfloat16 rounded to nearest even) = rows row_ids[i] of W, or rows
 * first_row + i where row_ids is NULL. The caller checks the row ids against out_features. Returns 2 for a
 * type it does not know or an in_features that is not a whole number of blocks. */
int gguf_dequantize_rows(int type, const uint8_t *w, int64_t in_features, const int64_t *row_ids, int64_t first_row,
                         int64_t n_rows, void *out, int out_bf16) {
    const int weights = block_weights(type);
    if (weights == 0 || in_features <= 0 || in_features % weights != 0 || n_rows < 0) return 2;
    const DequantizeFunction dequantize = dequantize_function(type);
    const int64_t row_bytes = in_features / weights * block_bytes(type), element = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (n_rows * in_features >= PARALLEL_MIN_WORK / 4)
    for (int64_t i = 0; i < n_rows; ++i) {
        const int64_t row = row_ids != NULL ? row_ids[i] : first_row + i;
        dequantize(w + row * row_bytes, in_features, (char *)out + i * in_features * element, out_bf16);
    }
    return 0;
}

#if defined(__AVX512F__)
/* a[i] = row i of a 16 x 16 matrix of 32-bit elements -> a[c] = its column c. */
static ALWAYS_INLINE void transpose_16x16(__m512i a[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
    }
    /* u[g + m], 128-bit lane L: column 4L + m of rows g..g+3 */
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int m = 0; m < 4; ++m) {
        const __m512i low_a = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44);
        const __m512i low_b = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        const __m512i high_a = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
        const __m512i high_b = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
        a[m] = _mm512_shuffle_i32x4(low_a, low_b, 0x88);
        a[4 + m] = _mm512_shuffle_i32x4(low_a, low_b, 0xDD);
        a[8 + m] = _mm512_shuffle_i32x4(high_a, high_b, 0x88);
        a[12 + m] = _mm512_shuffle_i32x4(high_a, high_b, 0xDD);
    }
}
#endif

/* 16 bfloat16 rows of 2 * pairs weights, `pairs` 32-bit pairs apart -> out [pairs][16][2]: each input pair's 16
 * rows side by side, one 64-byte line per pair. */
static void interleave_16_rows(const uint16_t *rows, int64_t pairs, uint16_t *out) {
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k + 16 <= pairs; k += 16) {
        __m512i a[16];
        for (int i = 0; i < 16; ++i) a[i] = _mm512_loadu_si512(rows + 2 * (i * pairs + k));
        transpose_16x16(a);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + 32 * (k + i), a[i]);
    }
#endif
    for (; k < pairs; ++k)
        for (int i = 0; i < 16; ++i) memcpy(out + 32 * k + 2 * i, rows + 2 * (i * pairs + k), 4);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* dequantize_row's bfloat16 for the 32-weight formats, a block per 512-bit register: the same float32 operations
 * in the same order (vector extensions, so that the compiler fuses them as it fuses dequantize_row's), rounded
 * by one VCVTNE2PS2BF16 per block instead of four 8-lane conversions. */
#define HAVE_WIDE_ROW_32 1
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

/* A grid type's 16 values as floats. */
static ALWAYS_INLINE __m512 grid_floats(const int type) {
    return type == NF4                              ? (__m512){NF4_GRID}
           : type == BNB_FP4                        ? (__m512){BNB_FP4_GRID}
           : type == MXFP4_F16 || type == NVFP4_F16 ? (__m512){MXFP4_GRID}
                                                    : (__m512){IQ4_NL_GRID};
}

/* A grid type's block: its 16 values times the scale (32 for NVFP4_F16: times each half's), rounded to bfloat16
 * once each, and every weight picked from them by its nibble (one VPERMW): the same float32 product and rounding
 * per weight as the widening below, in a third fewer instructions. */
static ALWAYS_INLINE __m512i grid_block_bf16(const int type, const uint8_t *block) {
    const int head = two_scales(type) ? 4 : 2;
    const float d = half_to_float(block), d_high = two_scales(type) ? half_to_float(block + 2) : d;
    const __m512 grid = grid_floats(type);
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(grid * d_high, grid * d); /* [16 low-half | 16 high-half] */
    __m512i index = _mm512_cvtepu8_epi16((__m256i)nibbles_32(block + head));
    if (two_scales(type)) /* weights 16-31 take the table's second half */
        index = _mm512_or_si512(index, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1));
    return _mm512_permutexvar_epi16(index, table);
}

static ALWAYS_INLINE void dequantize_row_32_bf16(const int type, const uint8_t *w, int64_t in_features,
                                                 uint16_t *out) {
    const int bytes = block_bytes(type);
    if (grid_quants(type)) {
        for (int64_t b = 0; b < in_features / QK; ++b)
            _mm512_storeu_si512(out + b * QK, grid_block_bf16(type, w + b * bytes));
        return;
    }
    for (int64_t b = 0; b < in_features / QK; ++b) {
        const Block32 u = unpack_32(type, w + b * bytes);
        const __m256i q = (__m256i)u.q;
        const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
        f32x16 v[2];
        for (int h = 0; h < 2; ++h) {
            const i32x16 wide = (i32x16)(signed_quants(type) ? _mm512_cvtepi8_epi32(halves[h])
                                                              : _mm512_cvtepu8_epi32(halves[h]));
            f32x16 weights = __builtin_convertvector(wide - u.offset, f32x16) * u.d;
            if (type == Q4_1 || type == Q5_1) weights = weights + u.m;
            v[h] = weights;
        }
        _mm512_storeu_si512(out + b * QK, (__m512i)_mm512_cvtne2ps_pbh((__m512)v[1], (__m512)v[0]));
    }
}

#define WIDE_ROW_FOR(T)                                                                                            \
    static void dequantize_wide_##T(const uint8_t *w, int64_t in_features, void *out, int bf16) {                  \
        (void)bf16;                                                                                                \
        dequantize_row_32_bf16(T, w, in_features, out);                                                            \
    }
WIDE_ROW_FOR(Q4_0)
WIDE_ROW_FOR(Q4_1)
WIDE_ROW_FOR(Q5_0)
WIDE_ROW_FOR(Q5_1)
WIDE_ROW_FOR(Q8_0)
WIDE_ROW_FOR(IQ4_NL)
WIDE_ROW_FOR(NF4)
WIDE_ROW_FOR(BNB_FP4)
WIDE_ROW_FOR(MXFP4_F16)
WIDE_ROW_FOR(NVFP4_F16)
#endif

/* The row dequantizer of gguf_dequantize_packed, which asks for bfloat16 rows only. */
static DequantizeFunction packed_dequantize_function(int type) {
#ifdef HAVE_WIDE_ROW_32
    switch (type) {
    case Q4_0: return dequantize_wide_Q4_0;
    case Q4_1: return dequantize_wide_Q4_1;
    case Q5_0: return dequantize_wide_Q5_0;
    case Q5_1: return dequantize_wide_Q5_1;
    case Q8_0: return dequantize_wide_Q8_0;
    case IQ4_NL: return dequantize_wide_IQ4_NL;
    case NF4: return dequantize_wide_NF4;
    case BNB_FP4: return dequantize_wide_BNB_FP4;
    case MXFP4_F16: return dequantize_wide_MXFP4_F16;
    case NVFP4_F16: return dequantize_wide_NVFP4_F16;
    default: break;
    }
#endif
    return dequantize_function(type);
}

/* Inputs of 16 rows dequantized at a time before they are interleaved: a multiple of both block sizes, small
 * enough for the stack and L1. */
#define PACK_CHUNK QK_K

/* out = rows first_row .. first_row + n_rows - 1 of W in bfloat16 (rounded as gguf_dequantize_rows rounds them),
 * laid out as linear_bf16's packed weight ([n_rows / 16][in_features / 2][16][2], csrc/linear_bf16.c), so that its
 * tiles multiply a dense tile of W with no row-major copy of it: 16 rows at a time, PACK_CHUNK inputs of each into a
 * buffer on the stack, interleaved from there (a buffer of whole rows, malloc'ed per call, came with more page
 * faults). Returns 2 as gguf_dequantize_rows does and for an n_rows that is not a multiple of 16. */
int gguf_dequantize_packed(int type, const uint8_t *w, int64_t in_features, int64_t first_row, int64_t n_rows,
                           uint16_t *out) {
    const int weights = block_weights(type);
    if (weights == 0 || in_features <= 0 || in_features % weights != 0 || n_rows < 0 || n_rows % 16 != 0) return 2;
    const DequantizeFunction dequantize = packed_dequantize_function(type);
    const int64_t row_bytes = in_features / weights * block_bytes(type), groups = n_rows / 16;
#pragma omp parallel for schedule(static) if (n_rows * in_features >= PARALLEL_MIN_WORK / 4)
    for (int64_t g = 0; g < groups; ++g) {
        uint16_t rows[16 * PACK_CHUNK] __attribute__((aligned(64)));
        const uint8_t *group = w + (first_row + 16 * g) * row_bytes;
        for (int64_t k = 0; k < in_features; k += PACK_CHUNK) {
            const int64_t n = in_features - k < PACK_CHUNK ? in_features - k : PACK_CHUNK;
            const uint8_t *blocks = group + k / weights * block_bytes(type);
            for (int i = 0; i < 16; ++i) dequantize(blocks + i * row_bytes, n, rows + i * n, 1);
            interleave_16_rows(rows, n / 2, out + 16 * g * in_features + 16 * k);
        }
    }
    return 0;
}

/* Rows of x from which gguf_matmul multiplies `type` on the 512-bit tiles; 0 where it never does (a build
 * without AVX-512 VNNI, or a type the tiles do not take). */
int gguf_tile_min_rows(int type) {
#if defined(HAVE_VNNI_TILES)
    TilePassFunction passes[TILE_ROWS];
    RepackFunction repack;
    return tile_functions(type, passes, &repack) ? TILE_MIN_ROWS : 0;
#else
    (void)type;
    return 0;
#endif
}

/* Block geometry as the kernels see it (the wrapper checks it against its own table): 0 for unknown types. */
int gguf_block_weights(int type) { return block_weights(type); }
int gguf_block_bytes(int type) { return block_bytes(type); }

/* One GGUF weight as the decode stack calls its products: its blocks, its type, and where bfloat16 rows go to
 * linear_bf16 on the weight dequantized into its packed layout (as GGUFKernels.matmul sends them to the dense
 * path on AMX's tiles). */
typedef struct {
    const uint8_t *blocks;
    int64_t type;
    BF16Tiles tiles;
} GgufStackLayer;

static int gguf_stack_layer_rows(const void *w, int64_t K, int64_t N, int64_t first, int64_t n, uint16_t *tile) {
    (void)N;
    const GgufStackLayer *layer = w;
    return gguf_dequantize_packed((int)layer->type, layer->blocks, K, first, n, tile);
}

/* gguf_matmul for the decode stack, the layer (GgufStackLayer) at `w` (`type` is its type); bfloat16 rows from
 * its tiles.min_rows on linear_bf16's tiles. Returns gguf_matmul's codes (1: memory ran out, 2: refused). */
int gguf_stack_product(int type, const void *w, const void *x, int x_bf16, int64_t rows, int64_t K, int64_t N,
                       void *y, int y_bf16) {
    const GgufStackLayer *layer = w;
    if (y_bf16 && bf16_tiles_take(&layer->tiles, x_bf16, rows))
        return bf16_tiles_product(&layer->tiles, layer, gguf_stack_layer_rows, x, rows, K, N, y, N);
    return gguf_matmul(type, layer->blocks, x, x_bf16, rows, K, N, y, y_bf16);
}

/* y [rows, N] bfloat16 (rows y_stride apart) = bfloat16 x @ W^T on the layer's tiles whatever the row count
 * (GGUFKernels._matmul_amx). Returns 1 if memory ran out, 2 for a refusal. */
int gguf_tiles_product(const GgufStackLayer *layer, const uint16_t *x, int64_t rows, int64_t K, int64_t N,
                       uint16_t *y, int64_t y_stride) {
    return bf16_tiles_product(&layer->tiles, layer, gguf_stack_layer_rows, x, rows, K, N, y, y_stride);
}

const char *pagellm_isa(void) { return ISA_NAME; }
/* The instructions the integer dot products run on: avx512_vnni, avx_vnni, avx2 (VPMADDUBSW) or generic. */
const char *gguf_dot_instructions(void) { return DOT_INSTRUCTIONS; }
