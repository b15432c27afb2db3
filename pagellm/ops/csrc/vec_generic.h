/* Generic width: four floats, the vector every 64-bit target has in hardware (SSE2, NEON). Built without
 * -march, so the compiler lowers the vector extensions to whatever the baseline target has. */
#ifndef PAGELLM_VEC_WIDTH_H
#define PAGELLM_VEC_WIDTH_H

#define VEC 4
/* The 16-bit lanes holding the high halves of VEC little-endian 32-bit lanes. */
#define HIGH_HALVES 1, 3, 5, 7
/* 16-bit lanes of (zeros, bits) that put each bfloat16 in the high half of a 32-bit lane. */
#define WIDEN_LANES 0, 4, 0, 5, 0, 6, 0, 7
#define ISA_NAME "generic"
typedef float fvec __attribute__((vector_size(16)));
typedef int32_t ivec __attribute__((vector_size(16)));
typedef uint32_t uvec __attribute__((vector_size(16)));
typedef uint16_t hvec __attribute__((vector_size(8)));

static inline float vsum(fvec v) { return (v[0] + v[2]) + (v[1] + v[3]); }

/* Lane i = the sum of v[i]'s lanes. */
static inline fvec vsums(const fvec *v) { return (fvec){vsum(v[0]), vsum(v[1]), vsum(v[2]), vsum(v[3])}; }

#endif
