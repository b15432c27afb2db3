/* AVX-512 width: sixteen floats, one zmm register; with avx512_bf16, rounding to bfloat16 is one
 * instruction (VCVTNEPS2BF16, round-to-nearest-even like torch) instead of integer rounding and a shuffle,
 * and bfloat16 dot products are another (VDPBF16PS). */
#ifndef PAGELLM_VEC_WIDTH_H
#define PAGELLM_VEC_WIDTH_H

#include <immintrin.h>

#define VEC 16
/* The 16-bit lanes holding the high halves of VEC little-endian 32-bit lanes. */
#define HIGH_HALVES 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
/* 16-bit lanes of (zeros, bits) that put each bfloat16 in the high half of a 32-bit lane. */
#define WIDEN_LANES \
    0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0, 22, 0, 23, 0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31
#define ISA_NAME "avx512"
typedef float fvec __attribute__((vector_size(64)));
typedef int32_t ivec __attribute__((vector_size(64)));
typedef uint32_t uvec __attribute__((vector_size(64)));
typedef uint16_t hvec __attribute__((vector_size(32)));

static inline float vsum(fvec v) { return _mm512_reduce_add_ps((__m512)v); }

/* Half floats (IEEE binary16 bits) to float32, exactly: one instruction (VCVTPH2PS). */
#define HAVE_HALF_CONVERT 1
static inline fvec from_half_bits(hvec bits) { return (fvec)_mm512_cvtph_ps((__m256i)bits); }

/* VEC signed bytes from p as float32: two instructions (VPMOVSXBD, VCVTDQ2PS). */
#define HAVE_INT8_WIDEN 1
static inline fvec from_int8(const void *p) {
    return (fvec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* VEC bytes from p, each the high byte of a 16-bit lane: a zero-extending load (VPMOVZXBW) and a shift. */
#define HAVE_HIGH_BYTES 1
static inline hvec high_bytes(const void *p) {
    return (hvec)_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8);
}

/* VEC signed bytes from p, each sign-extended to its 16-bit lane: one VPMOVSXBW. */
static inline hvec signed_halves(const void *p) {
    return (hvec)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}

/* Lane i = the sum of v[i]'s lanes: sixteen horizontal sums in 15 adds and 30 shuffles instead of 16 x 8
 * instructions, by halving all sixteen vectors together. The lanes come out in the order 4 * (i % 4) + i / 4,
 * so the inputs are taken in that order (the transposition is its own inverse). */
static inline fvec vsums(const fvec *v) {
#define IN(i) ((__m512)v[4 * ((i) % 4) + (i) / 4])
    __m512 halves[8], quarters[4], eighths[2];
    for (int j = 0; j < 8; ++j) /* [x.q0 + x.q2, x.q1 + x.q3, y.q0 + y.q2, y.q1 + y.q3] */
        halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(IN(2 * j), IN(2 * j + 1), 0x44),
                                  _mm512_shuffle_f32x4(IN(2 * j), IN(2 * j + 1), 0xEE));
    for (int j = 0; j < 4; ++j) /* one 128-bit quarter per input vector */
        quarters[j] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * j], halves[2 * j + 1], 0x88),
                                    _mm512_shuffle_f32x4(halves[2 * j], halves[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; ++j) /* two lanes per input vector */
        eighths[j] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * j], quarters[2 * j + 1], 0x44),
                                   _mm512_shuffle_ps(quarters[2 * j], quarters[2 * j + 1], 0xEE));
    return (fvec)_mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], 0x88),
                               _mm512_shuffle_ps(eighths[0], eighths[1], 0xDD));
#undef IN
}

#ifdef __AVX512BF16__
#define HAVE_NATIVE_BF16_ROUND 1
static inline hvec to_bf16_bits(fvec v) {
    const __m256bh rounded = _mm512_cvtneps_pbh((__m512)v);
    hvec bits;
    memcpy(&bits, &rounded, sizeof bits);
    return bits;
}

#define HAVE_BF16_DOT 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX's bfloat16 tiles too (native.compiler_flags adds -mamx-tile -mamx-bf16 where the CPU has them): the linear,
 * decode and prefill kernels of this build take them, and answer linear_bf16_amx_ready for all three. */
#define HAVE_AMX_BF16 1
#endif
/* acc[i] += a[2i] * b[2i] + a[2i + 1] * b[2i + 1] over 2 * VEC bfloat16 values (VDPBF16PS: exact products,
 * float32 sums; subnormal inputs count as zero). */
static inline fvec dot_bf16_pairs(fvec acc, const uint16_t *a, const uint16_t *b) {
    __m512bh pairs_a, pairs_b;
    memcpy(&pairs_a, a, sizeof pairs_a);
    memcpy(&pairs_b, b, sizeof pairs_b);
    return (fvec)_mm512_dpbf16_ps((__m512)acc, pairs_a, pairs_b);
}
#endif

#endif
