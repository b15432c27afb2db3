/* 32-byte integer and float vectors for gguf_quant.c, and the few operations whose best instruction differs
 * per instruction set: the u8 x s8 dot products (AVX2: VPMADDUBSW then VPMADDWD; AVX-512 VNNI or AVX-VNNI:
 * VPDPBUSD), half-float loads (F16C) and the fused multiply-add. Everything else in gguf_quant.c is written once
 * with GCC/Clang vector extensions, which the generic build (no -march) lowers to the target's baseline vectors.
 *
 * Every build keeps 32-byte vectors, the AVX-512 one too: at decode sizes the products are bound by memory, and
 * this way the AVX-512 build runs the AVX2 build's code except for the one VNNI instruction (and, from 64 rows,
 * gguf_quant.c's 512-bit tiles, written with AVX-512 intrinsics). Its own header, not
 * vec.h: those helpers are float vectors of the build's width, these are fixed-width integer ones. */
#ifndef PAGELLM_GGUF_SIMD_H
#define PAGELLM_GGUF_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* The generic build passes 32-byte vectors between functions without AVX; they are all static and inlined, so
 * no call crosses an ABI boundary and GCC's note about that ABI does not apply. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef int8_t i8x32 __attribute__((vector_size(32)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int8_t i8x8 __attribute__((vector_size(8)));

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_INSTRUCTIONS "avx512_vnni"
#elif defined(__AVXVNNI__)
#define DOT_INSTRUCTIONS "avx_vnni"
#elif defined(__AVX2__)
#define DOT_INSTRUCTIONS "avx2"
#else
#define DOT_INSTRUCTIONS "generic"
#endif

static ALWAYS_INLINE u8x32 load_u8x32(const void *p) {
    u8x32 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE i8x32 load_i8x32(const void *p) {
    i8x32 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE i16x16 load_i16x16(const void *p) {
    i16x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE u8x16 load_u8x16(const void *p) {
    u8x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Element-wise initializers, one broadcast each ((f32x8){0} + x would be an addition: -0.0f + 0 is +0.0f). */
static ALWAYS_INLINE f32x8 splat_f32(float x) { return (f32x8){x, x, x, x, x, x, x, x}; }
static ALWAYS_INLINE i16x16 splat_i16(int16_t x) { return (i16x16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static ALWAYS_INLINE f32x8 to_f32(i32x8 v) { return __builtin_convertvector(v, f32x8); }

#if !defined(__AVX2__)
/* The generic build's products in vector extensions (element loops were not vectorized): even and odd bytes
 * widened to 16 bits by shifts, which every target has (byte shuffles are scalarised without SSSE3), then
 * multiplied and added pairwise as VPMADDUBSW does (it never saturates in range here). */
static ALWAYS_INLINE i16x16 pair_products(i16x16 a_even, i16x16 a_odd, i8x32 s) {
    const i16x16 s_even = ((i16x16)s << 8) >> 8, s_odd = (i16x16)s >> 8;
    return a_even * s_even + a_odd * s_odd;
}

static ALWAYS_INLINE i16x16 pair_products_u8(u8x32 u, i8x32 s) {
    return pair_products((i16x16)((u16x16)u & 0xFF), (i16x16)((u16x16)u >> 8), s);
}
#endif

/* lane k = a[2k] b[2k] + a[2k+1] b[2k+1]. */
static ALWAYS_INLINE i32x8 madd_i16(i16x16 a, i16x16 b) {
#if defined(__AVX2__)
    return (i32x8)_mm256_madd_epi16((__m256i)a, (__m256i)b);
#else
    const i32x8 a_even = ((i32x8)a << 16) >> 16, a_odd = (i32x8)a >> 16;
    const i32x8 b_even = ((i32x8)b << 16) >> 16, b_odd = (i32x8)b >> 16;
    return a_even * b_even + a_odd * b_odd;
#endif
}

/* lane k = scale[2k] (u[4k] s[4k] + u[4k+1] s[4k+1]) + scale[2k+1] (u[4k+2] s[4k+2] + u[4k+3] s[4k+3]).
 * Exact where each pair sum fits in int16 (VPMADDUBSW saturates there): every caller's u <= 128, |s| <= 127. */
static ALWAYS_INLINE i32x8 dot_scaled(u8x32 u, i8x32 s, i16x16 scale) {
#if defined(__AVX2__)
    return (i32x8)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)s), (__m256i)scale);
#else
    return madd_i16(pair_products_u8(u, s), scale);
#endif
}

/* lane k = the sum of u[4k + j] s[4k + j] over j < 4. */
static ALWAYS_INLINE i32x8 dot_u8s8(u8x32 u, i8x32 s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (i32x8)_mm256_dpbusd_epi32(_mm256_setzero_si256(), (__m256i)u, (__m256i)s);
#elif defined(__AVXVNNI__)
    return (i32x8)_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (__m256i)u, (__m256i)s);
#else
    return dot_scaled(u, s, splat_i16(1));
#endif
}

/* lane k = the sum of w[4k + j] s[4k + j] over j < 4, both signed: |w| times s with w's sign, as the unsigned
 * operand must be (|-128| = 128 still fits the bound above). */
static ALWAYS_INLINE i32x8 dot_s8s8(i8x32 w, i8x32 s) {
#if defined(__AVX2__)
    return dot_u8s8((u8x32)_mm256_sign_epi8((__m256i)w, (__m256i)w), (i8x32)_mm256_sign_epi8((__m256i)s, (__m256i)w));
#else
    return madd_i16(pair_products(((i16x16)w << 8) >> 8, (i16x16)w >> 8, s), splat_i16(1));
#endif
}

/* a * b + c: fused where the build has FMA (the library is compiled with -ffp-contract=off, so that the
 * dequantizers round exactly where the reference does, and fused products are asked for here). */
static ALWAYS_INLINE f32x8 fmadd(f32x8 a, f32x8 b, f32x8 c) {
#if defined(__FMA__)
    return (f32x8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* A fixed order, so a sum does not depend on the build. */
static ALWAYS_INLINE float hsum_f32(f32x8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* IEEE half at p (unaligned) -> float, exactly. */
static ALWAYS_INLINE float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13); /* inf, NaN keeping its payload */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else { /* zero or subnormal: mantissa * 2^-24, exact in float */
        const float magnitude = (float)mantissa * 0x1p-24f;
        return sign ? -magnitude : magnitude;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* bfloat16 bits of v rounded to nearest even, as torch's float -> bfloat16 cast rounds (NaN stays NaN). */
static ALWAYS_INLINE u16x8 to_bf16(f32x8 v) {
    const u32x8 bits = (u32x8)v;
    const u32x8 nan = (u32x8)(v != v);
    const u32x8 rounded = ((bits + 0x7FFFu + ((bits >> 16) & 1u)) & ~nan) | (0x7FC00000u & nan);
    return __builtin_shufflevector((u16x16)rounded, (u16x16)rounded, 1, 3, 5, 7, 9, 11, 13, 15);
}

/* to_bf16 for dequantized weights: one VCVTNEPS2BF16 where the CPU has avx512_bf16. That instruction rounds to
 * nearest even as to_bf16 does but reads float32 subnormals as zero; a dequantized weight is zero or at least
 * the smallest half-float subnormal (2^-24) in magnitude, so it never meets one. (A NaN keeps its sign here.) */
static ALWAYS_INLINE u16x8 weights_to_bf16(f32x8 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    const __m128i bits = (__m128i)_mm256_cvtneps_pbh((__m256)v);
    return (u16x8)bits;
#else
    return to_bf16(v);
#endif
}

static ALWAYS_INLINE f32x8 from_bf16(u16x8 bits) {
    return (f32x8)__builtin_shufflevector((u16x8){0}, bits, 0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15);
}

/* 8 activations from x[index] as float32, x being float32 or (bf16 != 0) bfloat16. */
static ALWAYS_INLINE f32x8 load_x8(const void *x, int64_t index, const int bf16) {
    if (!bf16) {
        f32x8 v;
        memcpy(&v, (const float *)x + index, sizeof v);
        return v;
    }
    u16x8 bits;
    memcpy(&bits, (const uint16_t *)x + index, sizeof bits);
    return from_bf16(bits);
}

static ALWAYS_INLINE f32x8 max_f32(f32x8 a, f32x8 b) {
    const i32x8 greater = a > b;
    return (f32x8)(((i32x8)a & greater) | ((i32x8)b & ~greater));
}

#endif
