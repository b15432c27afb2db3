/* Eight-float vectors and the helpers both kernel files use. */
#ifndef PAGELLM_VEC8_H
#define PAGELLM_VEC8_H

#include <stdint.h>
#include <string.h>

/* Eight floats: GCC/Clang vector extensions, which become AVX2 with -march=native on x86 and pairs of
 * NEON registers on Arm, with no intrinsics to port. */
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

static inline f32x8 load8(const float *p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }
static inline f32x8 splat8(float x) { return (f32x8){x, x, x, x, x, x, x, x}; }
static inline float sum8(f32x8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* exp(x) for x <= 0 (scores minus their maximum), Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2,
 * a degree-6 polynomial for e^r, 2^n through the exponent bits. About 1 ulp, like libm's expf, at a
 * fraction of the cost of calling it per score. */
static inline f32x8 exp8_nonpositive(f32x8 x) {
    const i32x8 tiny = x < splat8(-87.0f); /* e^-87 is already below every sum it joins */
    x = (f32x8)(((i32x8)x & ~tiny) | ((i32x8)splat8(-87.0f) & tiny));
    const i32x8 n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i32x8); /* round(), x <= 0 */
    const f32x8 nf = __builtin_convertvector(n, f32x8);
    const f32x8 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f; /* ln2 split in two: exact n * hi */
    f32x8 p = splat8(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return p * (f32x8)((n + 127) << 23);
}

#endif
