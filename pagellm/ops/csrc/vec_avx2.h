/* AVX2 width: eight floats, one ymm register. */
#ifndef PAGELLM_VEC_WIDTH_H
#define PAGELLM_VEC_WIDTH_H

#define VEC 8
/* The 16-bit lanes holding the high halves of VEC little-endian 32-bit lanes. */
#define HIGH_HALVES 1, 3, 5, 7, 9, 11, 13, 15
/* 16-bit lanes of (zeros, bits) that put each bfloat16 in the high half of a 32-bit lane. */
#define WIDEN_LANES 0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15
#define ISA_NAME "avx2"
typedef float fvec __attribute__((vector_size(32)));
typedef int32_t ivec __attribute__((vector_size(32)));
typedef uint32_t uvec __attribute__((vector_size(32)));
typedef uint16_t hvec __attribute__((vector_size(16)));

static inline float vsum(fvec v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

#include <immintrin.h>

/* Half floats (IEEE binary16 bits) to float32, exactly: one F16C instruction (VCVTPH2PS). */
#define HAVE_HALF_CONVERT 1
static inline fvec from_half_bits(hvec bits) { return (fvec)_mm256_cvtph_ps((__m128i)bits); }

/* VEC signed bytes from p as float32: two instructions (VPMOVSXBD, VCVTDQ2PS). */
#define HAVE_INT8_WIDEN 1
static inline fvec from_int8(const void *p) {
    return (fvec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* VEC bytes from p, each the high byte of a 16-bit lane: one load and one unpack (GCC 12 makes four
 * instructions of the vector-extension widening). */
#define HAVE_HIGH_BYTES 1
static inline hvec high_bytes(const void *p) {
    return (hvec)_mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)p));
}

/* VEC signed bytes from p, each sign-extended to its 16-bit lane: one PMOVSXBW. */
static inline hvec signed_halves(const void *p) {
    return (hvec)_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
}

/* Lane i = the sum of v[i]'s lanes: eight horizontal sums in 7 adds and 14 shuffles by halving all eight
 * vectors together. The lanes come out in the order 2 * (i % 4) + i / 4, so the inputs are taken in the
 * inverse order, 4 * (i % 2) + i / 2. */
static inline fvec vsums(const fvec *v) {
#define IN(i) ((__m256)v[4 * ((i) % 2) + (i) / 2])
    __m256 halves[4], quarters[2];
    for (int j = 0; j < 4; ++j) /* [x.lo + x.hi, y.lo + y.hi] */
        halves[j] = _mm256_add_ps(_mm256_permute2f128_ps(IN(2 * j), IN(2 * j + 1), 0x20),
                                  _mm256_permute2f128_ps(IN(2 * j), IN(2 * j + 1), 0x31));
    for (int j = 0; j < 2; ++j) /* two lanes per input vector */
        quarters[j] = _mm256_add_ps(_mm256_shuffle_ps(halves[2 * j], halves[2 * j + 1], 0x44),
                                    _mm256_shuffle_ps(halves[2 * j], halves[2 * j + 1], 0xEE));
    return (fvec)_mm256_add_ps(_mm256_shuffle_ps(quarters[0], quarters[1], 0x88),
                               _mm256_shuffle_ps(quarters[0], quarters[1], 0xDD));
#undef IN
}

#endif
