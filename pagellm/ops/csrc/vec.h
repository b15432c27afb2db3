/* Float vectors of the width chosen at build time, and the helpers every kernel file uses.
 *
 * cpu_build.py compiles the kernels once per instruction set with -DPAGELLM_ISA_AVX512 or -DPAGELLM_ISA_AVX2
 * (or neither: the generic build). Each width header defines VEC floats per vector (fvec), the matching
 * int32 (ivec) and uint16 (hvec) vectors and a horizontal sum; everything else is written once here with
 * GCC/Clang vector extensions, which every target compiles (the arithmetic needs no intrinsics). */
#ifndef PAGELLM_VEC_H
#define PAGELLM_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(PAGELLM_ISA_AVX512)
#include "vec_avx512.h"
#elif defined(PAGELLM_ISA_AVX2)
#include "vec_avx2.h"
#else
#include "vec_generic.h"
#endif

#define ALWAYS_INLINE inline __attribute__((always_inline))

static ALWAYS_INLINE fvec vload(const float *p) { fvec v; memcpy(&v, p, sizeof v); return v; }
static ALWAYS_INLINE void vstore(float *p, fvec v) { memcpy(p, &v, sizeof v); }
/* x in every lane, as one broadcast: x - 0 is x exactly (even -0.0f, which (fvec){0} + x turns into +0.0f),
 * where an element-by-element loop became a chain of masked inserts in GCC 12's AVX-512 code. */
static ALWAYS_INLINE fvec splat(float x) { return x - (fvec){0}; }
static ALWAYS_INLINE fvec vselect(ivec mask, fvec yes, fvec no) {
    return (fvec)(((ivec)yes & mask) | ((ivec)no & ~mask));
}

/* ---- bfloat16: the top half of a float32 ---- */

static ALWAYS_INLINE fvec from_bf16_bits(hvec bits) {
    typedef uint16_t halves __attribute__((vector_size(sizeof(fvec))));
    return (fvec)(halves)__builtin_shufflevector((hvec){0}, bits, WIDEN_LANES);
}

#ifndef HAVE_NATIVE_BF16_ROUND
/* Round to nearest even, as torch's float -> bfloat16 cast does (c10::round_to_nearest_even): add 0x7fff
 * plus the lowest kept bit, keep the top half; NaN stays a quiet NaN. */
static ALWAYS_INLINE hvec to_bf16_bits(fvec v) {
    const uvec bits = (uvec)v;
    const uvec nan = (uvec)(v != v);
    const uvec rounded = ((bits + 0x7fffu + ((bits >> 16) & 1u)) & ~nan) | (0x7fc00000u & nan);
    /* The top halves, picked by a shuffle: a narrowing __builtin_convertvector is scalarised by GCC 12. */
    typedef uint16_t halves __attribute__((vector_size(sizeof(uvec))));
    return __builtin_shufflevector((halves)rounded, (halves)rounded, HIGH_HALVES);
}
#endif

/* v rounded to bfloat16 and widened back: the value a bfloat16 torch op stores between two steps. Without
 * the rounding instruction this stays in 32-bit lanes (clearing the low half), with no narrowing shuffles;
 * a NaN stays a NaN. */
static ALWAYS_INLINE fvec round_bf16(fvec v) {
#ifdef HAVE_NATIVE_BF16_ROUND
    return from_bf16_bits(to_bf16_bits(v));
#else
    const uvec bits = (uvec)v;
    return vselect(v != v, v, (fvec)((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u));
#endif
}

/* VEC elements from element `index` of a float32 (bf16 == 0) or bfloat16 array, as float32. `bf16` is a
 * constant after inlining, so each caller specialises. */
static ALWAYS_INLINE fvec load_any(const void *p, int64_t index, const int bf16) {
    if (!bf16) return vload((const float *)p + index);
    hvec bits;
    memcpy(&bits, (const uint16_t *)p + index, sizeof bits);
    return from_bf16_bits(bits);
}

/* Element `index` of a float32 (bf16 == 0) or bfloat16 array, as float32. */
static ALWAYS_INLINE float scalar_any(const void *p, int64_t index, const int bf16) {
    if (!bf16) return ((const float *)p)[index];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[index] << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Stores VEC float32 values as float32, or rounded once to bfloat16. */
static ALWAYS_INLINE void store_any(void *p, int64_t index, fvec v, const int bf16) {
    if (!bf16) return vstore((float *)p + index, v);
    const hvec bits = to_bf16_bits(v);
    memcpy((uint16_t *)p + index, &bits, sizeof bits);
}

/* The first n (< VEC) elements from `index`, zero-padded; and their store. Row tails go through these. */
static ALWAYS_INLINE fvec load_part(const void *p, int64_t index, int64_t n, const int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    char padded[VEC * 4] = {0};
    memcpy(padded, (const char *)p + index * size, n * size);
    return load_any(padded, 0, bf16);
}

static ALWAYS_INLINE void store_part(void *p, int64_t index, int64_t n, fvec v, const int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    char padded[VEC * 4];
    store_any(padded, 0, v, bf16);
    memcpy((char *)p + index * size, padded, n * size);
}

/* n (<= VEC) elements from `index`: a whole vector, or a row's zero-padded tail. */
static ALWAYS_INLINE fvec load_n(const void *p, int64_t index, int64_t n, const int bf16) {
    return n == VEC ? load_any(p, index, bf16) : load_part(p, index, n, bf16);
}

static ALWAYS_INLINE void store_n(void *p, int64_t index, int64_t n, fvec v, const int bf16) {
    if (n == VEC) store_any(p, index, v, bf16);
    else store_part(p, index, n, v, bf16);
}

/* Elements of a row of `length` from `index` on that one vector holds. */
static ALWAYS_INLINE int64_t piece(int64_t index, int64_t length) {
    return length - index < VEC ? length - index : VEC;
}

/* exp(x) for x <= 0 (scores minus their maximum), Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2,
 * a degree-6 polynomial for e^r, 2^n through the exponent bits. About 1 ulp, like libm's expf, at a
 * fraction of the cost of calling it per element. */
static ALWAYS_INLINE fvec exp_nonpositive(fvec x) {
    x = vselect(x < splat(-87.0f), splat(-87.0f), x); /* e^-87 is already below every sum it joins */
    const ivec n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, ivec); /* round(), x <= 0 */
    const fvec nf = __builtin_convertvector(n, fvec);
    const fvec r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f; /* ln2 split in two: exact n * hi */
    fvec p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return p * (fvec)((n + 127) << 23);
}

#endif
