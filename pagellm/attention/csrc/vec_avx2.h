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

#endif
