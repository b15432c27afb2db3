/* The KV cache's element formats, read and written by every kernel: the definitions are
 * pagellm/attention/kv_spec.py's (KVCacheFormat), which the torch path and the tests use as the reference.
 *
 * Unquantized caches hold the model's float32 or bfloat16 values. Quantized caches (fp8 e4m3, fp8 e5m2, int8)
 * hold one byte per value, and each (block, KV head) run of the cache is
 *     codes[block_size][head_dim] | scales[block_size] (bfloat16 bits)
 * with value = code * scale per row (one token's keys or values of one head). The kernels read the codes in
 * registers, VEC at a time, and fold each row's scale into what multiplies the row (its score, its softmax
 * weight) rather than scaling every element.
 */
#ifndef PAGELLM_KV_FORMAT_H
#define PAGELLM_KV_FORMAT_H

#include "../../ops/csrc/vec.h"

/* KVCacheFormat.code */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_E4M3 = 3, KV_E5M2 = 4, KV_INT8 = 5 };

#define KV_SCALE_BYTES 2

static ALWAYS_INLINE int kv_quantized(const int format) { return format >= KV_E4M3; }

static ALWAYS_INLINE int64_t kv_element_bytes(const int format) {
    return format == KV_F32 ? 4 : format <= KV_F16 ? 2 : 1;
}

/* Elements (bytes when quantized) of one (block, KV head) run. */
static ALWAYS_INLINE int64_t kv_run_elements(int64_t block_size, int64_t head_dim, const int format) {
    return kv_quantized(format) ? block_size * (head_dim + KV_SCALE_BYTES) : block_size * head_dim;
}

typedef uint8_t bytevec __attribute__((vector_size(VEC)));

#ifndef HAVE_HIGH_BYTES
/* VEC bytes from p, each the high byte of a 16-bit lane. */
static ALWAYS_INLINE hvec high_bytes(const void *p) {
    bytevec bytes;
    memcpy(&bytes, p, sizeof bytes);
    return __builtin_convertvector(bytes, hvec) << 8;
}
#endif

/* VEC codes from p as float32 in the unit kv_scale_factor gives back: e4m3 codes come out 2^-8 times their
 * value (the half-float exponent bias, 15, exceeds e4m3's by 8), e5m2 and int8 codes as they are. */
static ALWAYS_INLINE fvec widen_codes(const uint8_t *p, const int format) {
#ifdef HAVE_HALF_CONVERT
    /* An e5m2 code is the top byte of a half float; an e4m3 code becomes one shifted up 7 bits past a zero fifth
     * exponent bit, its sign (sign-extended into the byte above) at the top: a sign-extending load, a shift and
     * a mask (the builds with half-float conversion have signed_halves), one instruction fewer than moving the
     * code into the high byte and shifting it back (README, "An Emerald Rapids Xeon"). The conversion is exact,
     * subnormals included; measured on a 2-core AMD EPYC (avx2), L1-resident, convert + multiply-add, in that
     * earlier form: 0.31 ns per value, as fast as widening bfloat16 (0.32), against 0.65 for a 256-float lookup
     * table, 0.76 for that table through VPGATHERDD and 0.81 for the integer construction below. */
    if (format == KV_E4M3) return from_half_bits((signed_halves(p) << 7) & (uint16_t)0xBF80);
#endif
#ifdef HAVE_INT8_WIDEN
    if (format == KV_INT8) return from_int8(p);
    const hvec halves = high_bytes(p);
#else
    const hvec halves = high_bytes(p);
    /* int8: each byte moved to the top of its 32-bit lane (as bfloat16 bits are) and shifted back down with its
     * sign; GCC 12 scalarises a widening __builtin_convertvector from int8 to int32 (three times slower). */
    if (format == KV_INT8) return __builtin_convertvector((ivec)from_bf16_bits(halves) >> 24, fvec);
#endif
#ifdef HAVE_HALF_CONVERT
    return from_half_bits(halves);
#else
    /* Without half-float instructions: exponent and mantissa moved into a float's and rebased to the half
     * float's bias; subnormal codes (exponent 0) are their mantissa times 2^-17 (e4m3: 2^-9 * 2^-8) or 2^-16
     * (e5m2). x is the code sign-extended, so its bit 31 is the code's sign. */
    const ivec x = (ivec)from_bf16_bits(halves) >> 24;
    const ivec magnitude = x & 0x7F;
    const int mantissa_bits = format == KV_E4M3 ? 3 : 2;
    const fvec normal = (fvec)((magnitude << (23 - mantissa_bits)) + (112 << 23));
    const fvec subnormal = __builtin_convertvector(magnitude, fvec) * (format == KV_E4M3 ? 0x1p-17f : 0x1p-16f);
    const fvec value = vselect(magnitude < (1 << mantissa_bits), subnormal, normal);
    return (fvec)((ivec)value | (x & (int32_t)0x80000000));
#endif
}

/* What a row's scale is multiplied by to apply to widen_codes' units. */
static ALWAYS_INLINE float kv_scale_factor(const int format) { return format == KV_E4M3 ? 256.0f : 1.0f; }

/* The scale of row i of a run's scales, in widen_codes' units. */
static ALWAYS_INLINE float kv_row_scale(const void *scales, int64_t i, const int format) {
    uint16_t bits;
    memcpy(&bits, (const char *)scales + i * KV_SCALE_BYTES, sizeof bits);
    const uint32_t wide = (uint32_t)bits << 16;
    float scale;
    memcpy(&scale, &wide, sizeof scale);
    return scale * kv_scale_factor(format);
}

/* VEC elements from element `index` of a cache of `format` as float32: values, or codes in widen_codes' units.
 * `format` is a constant after inlining, so each caller specialises. */
static ALWAYS_INLINE fvec load_kv(const void *cache, int64_t index, const int format) {
    if (kv_quantized(format)) return widen_codes((const uint8_t *)cache + index, format);
    return load_any(cache, index, format == KV_BF16);
}

/* ---- writing: kv_spec.py's KVCacheFormat.quantize, byte for byte ---- */

static ALWAYS_INLINE float kv_max_value(const int format) {
    return format == KV_E4M3 ? 448.0f : format == KV_E5M2 ? 57344.0f : 127.0f;
}

/* float32 -> bfloat16 bits, to nearest even (as torch's cast), for one finite value: also exact for subnormals,
 * which AVX-512's conversion instruction would flush. */
static ALWAYS_INLINE uint16_t bf16_bits_of(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Codes of VEC values y already divided by the row's scale and within +-kv_max_value, each in the low byte of
 * its lane: round to nearest even into the format, as torch's casts to float8 and round() do. */
static ALWAYS_INLINE uvec encode_codes(fvec y, const int format) {
    if (format == KV_INT8)  /* adding 1.5 * 2^23 rounds |y| < 2^22 to an integer in the low mantissa bits */
        return ((uvec)(y + 12582912.0f) - 0x4B400000u) & 0xFFu;
    const int e4m3 = format == KV_E4M3;
    const uvec bits = (uvec)y, sign = (bits >> 24) & 0x80u, a = bits & 0x7FFFFFFFu;
    /* Normal: drop the float's extra mantissa bits (20 for e4m3, 21 for e5m2) to nearest even, then rebase the
     * exponent from 127 to the format's bias (7, 15); a carry out of the mantissa bumps the exponent. */
    const int drop = e4m3 ? 20 : 21;
    const uvec normal = ((a + ((1u << (drop - 1)) - 1u) + ((a >> drop) & 1u)) >> drop) -
                        (e4m3 ? 120u << 3 : 112u << 2);
    /* Subnormal (below 2^-6, 2^-14): a multiple of 2^-9 (2^-16); |y| times its inverse plus 2^23 rounds it into
     * the low mantissa bits. The product is exact, so a fused multiply-add rounds the same. */
    const uvec subnormal = (uvec)((fvec)a * (e4m3 ? 512.0f : 65536.0f) + 8388608.0f) - 0x4B000000u;
    const ivec is_subnormal = (ivec)(a < (e4m3 ? 0x3C800000u : 0x38800000u));
    return sign | (uvec)vselect(is_subnormal, (fvec)subnormal, (fvec)normal);
}

/* One row of n values (float32, or bfloat16 if bf16) quantized into n codes and its bfloat16 scale. */
static ALWAYS_INLINE void quantize_row(const void *row, int64_t n, const int bf16, uint8_t *restrict codes,
                                       void *scale_out, const int format) {
    fvec maxes = splat(0.0f);
    for (int64_t i = 0; i < n; i += VEC) {
        const int64_t m = n - i < VEC ? n - i : VEC;
        const fvec x = m == VEC ? load_any(row, i, bf16) : load_part(row, i, m, bf16);
        const fvec magnitude = (fvec)((uvec)x & 0x7FFFFFFFu);
        maxes = vselect(magnitude > maxes, magnitude, maxes);
    }
    float amax = maxes[0];
    for (int i = 1; i < VEC; ++i) amax = maxes[i] > amax ? maxes[i] : amax;
    const uint16_t scale_bits = bf16_bits_of(amax / kv_max_value(format));
    memcpy(scale_out, &scale_bits, sizeof scale_bits);
    const uint32_t wide = (uint32_t)scale_bits << 16;
    float scale;
    memcpy(&scale, &wide, sizeof scale);
    const fvec limit = splat(kv_max_value(format));
    for (int64_t i = 0; i < n; i += VEC) {
        const int64_t m = n - i < VEC ? n - i : VEC;
        const fvec x = m == VEC ? load_any(row, i, bf16) : load_part(row, i, m, bf16);
        fvec y = scale > 0.0f ? x / scale : splat(0.0f);  /* a row of zeros has scale 0 and codes 0 */
        y = vselect(y > limit, limit, y);
        y = vselect(y < -limit, -limit, y);
        const uvec encoded = encode_codes(y, format);
        for (int64_t j = 0; j < m; ++j) codes[i + j] = (uint8_t)encoded[j];
    }
}

#endif
