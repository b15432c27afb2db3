"""GGML tensor types -> float32, whole tensors at a time, bit for bit equal to the `gguf` package.

`gguf.quants.dequantize` is the reference: it is correct but walks a tensor 16 rows at a time and builds
several temporaries per step. Here each type is a few numpy passes over a chunk of many thousands of
blocks, with the same float32 operations in the same order (so the results are identical, NaN for NaN),
writing straight into the output (the lattice and ternary types, IQ1_S .. IQ3_S and TQ1_0 / TQ2_0, and MXFP4
are decoded by gguf itself). tests/test_gguf_quants.py checks every type against gguf's.

Types no pagellm kernel reads in their own blocks (TRANSCODED_TYPES) are kept in memory as the blocks of one it
reads (kernel_type: IQ4_XS as IQ4_NL, MXFP4 as MXFP4_F16, IQ3_XXS / IQ3_S as Q6_K, the others as Q8_0),
transcode_blocks'.

Four types are pagellm's own (OWN_FORMATS, ids no GGUF uses). Three are IQ4_NL's blocks on another grid: NF4 and
BNB_FP4, with bitsandbytes' code books, which its 4-bit checkpoints are kept as
(pagellm/layers/quantization/bitsandbytes.py), and MXFP4_F16, MXFP4's values with the block's power-of-two scale as
an f16 (a GGUF's MXFP4 tensors, gpt-oss's experts: pagellm/layers/quantization/mxfp4.py). NVFP4_F16 holds NVFP4's
16-weight blocks two to a 32-weight block, MXFP4's grid with an f16 scale per half (NVFP4 checkpoints:
pagellm/layers/quantization/nvfp4.py).

Block layouts follow ggml's `block_*` structs (ggml-common.h); QK_K = 256 weights per super-block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

QK_K = 256
# Blocks per pass: big enough that numpy's per-call cost vanishes, small enough that the temporaries
# (a few bytes per weight) stay in the CPU's cache.
_CHUNK_WEIGHTS = 1 << 18

Dequantizer = Callable[[np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class QuantFormat:
    """One GGML tensor type: `block_size` weights stored in `block_bytes` bytes, and how to decode them.

    `dequantize(blocks, out)` reads uint8 blocks of shape (n, block_bytes) and writes float32 weights of
    shape (n, block_size) into `out`.
    """

    name: str
    block_size: int
    block_bytes: int
    dequantize: Dequantizer


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32 of shape (n, 1)."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(..., m) bytes -> (..., 2, m): low nibbles first, then high nibbles (ggml's order within a group)."""
    out = np.empty((*packed.shape[:-1], 2, packed.shape[-1]), dtype=np.uint8)
    np.bitwise_and(packed, 0x0F, out=out[..., 0, :])
    np.right_shift(packed, 4, out=out[..., 1, :])
    return out


def _bit_planes(packed: np.ndarray, bits: int) -> np.ndarray:
    """(..., m) bytes -> (..., 8 // bits, m): field k holds bits [k*bits, (k+1)*bits) of every byte."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(-1, 1)
    return (packed[..., None, :] >> shifts) & np.uint8((1 << bits) - 1)


def _scale_into(out: np.ndarray, quants: np.ndarray, scale: np.ndarray) -> None:
    """out = float32(quants) * scale, broadcast over the last axis of `quants` (a single rounding, as gguf)."""
    np.multiply(quants, scale[..., None], out=out, dtype=np.float32)


def _dequantize_f32(blocks: np.ndarray, out: np.ndarray) -> None:
    out[...] = blocks.view(np.float32)


def _dequantize_f16(blocks: np.ndarray, out: np.ndarray) -> None:
    # numpy's cast, not torch's (2.2x faster on a 2-core AMD EPYC, avx2 avx512f avx512_bf16) because torch
    # rewrites every NaN as 0x7fffffff, and gguf's result, the reference, keeps the payload.
    out[...] = blocks.view(np.float16)


def _dequantize_bf16(blocks: np.ndarray, out: np.ndarray) -> None:
    # bfloat16 is the top half of a float32: shift the bits into place (gguf does the same).
    out.view(np.int32)[...] = blocks.view(np.int16).astype(np.int32) << 16


def _dequantize_q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """block_q4_0: f16 d, 16 bytes of nibbles; w = d * (q - 8)."""
    quants = _nibbles(blocks[:, 2:]).reshape(len(blocks), 32)
    quants -= 8  # wraps in uint8; read as int8 it is q - 8
    _scale_into(out, quants.view(np.int8), _f16(blocks, 0)[:, 0])


def _dequantize_q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """block_q4_1: f16 d, f16 m, 16 bytes of nibbles; w = d * q + m."""
    _scale_into(out, _nibbles(blocks[:, 4:]).reshape(len(blocks), 32), _f16(blocks, 0)[:, 0])
    out += _f16(blocks, 2)


def _q5_quants(blocks: np.ndarray, high_bits_at: int) -> np.ndarray:
    """The 5-bit quants of block_q5_0/q5_1: bit j of the little-endian u32 qh is the fifth bit of weight j."""
    high = np.unpackbits(blocks[:, high_bits_at : high_bits_at + 4], axis=1, bitorder="little")
    quants = _nibbles(blocks[:, high_bits_at + 4 :]).reshape(len(blocks), 32)
    quants |= high << 4
    return quants


def _dequantize_q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """block_q5_0: f16 d, u32 qh, 16 bytes of nibbles; w = d * (q - 16)."""
    quants = _q5_quants(blocks, 2)
    quants -= 16
    _scale_into(out, quants.view(np.int8), _f16(blocks, 0)[:, 0])


def _dequantize_q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """block_q5_1: f16 d, f16 m, u32 qh, 16 bytes of nibbles; w = d * q + m."""
    _scale_into(out, _q5_quants(blocks, 4), _f16(blocks, 0)[:, 0])
    out += _f16(blocks, 2)


def _dequantize_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """block_q8_0: f16 d, 32 int8; w = d * q."""
    _scale_into(out, blocks[:, 2:].view(np.int8), _f16(blocks, 0)[:, 0])


def _dequantize_q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """block_q2_K: 16 bytes of 4-bit scale | 4-bit min, 64 bytes of 2-bit quants, f16 d, f16 dmin.

    16 groups of 16 weights; w = (d * scale) * q - dmin * min.
    """
    n = len(blocks)
    scales = blocks[:, :16]
    group_scale = _f16(blocks, 80) * (scales & 0x0F)
    group_min = _f16(blocks, 82) * (scales >> 4)
    quants = _bit_planes(blocks[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    grouped = out.reshape(n, 16, 16)
    _scale_into(grouped, quants, group_scale)
    grouped -= group_min[..., None]


def _dequantize_q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """block_q3_K: 32 bytes of high bits, 64 bytes of 2-bit low bits, 12 bytes of 6-bit scales, f16 d.

    16 groups of 16 weights; q = low - (4 if the high bit is clear), w = (d * (scale - 32)) * q.
    """
    n = len(blocks)
    packed_scales = blocks[:, 96:108]
    low4 = _nibbles(packed_scales[:, :8]).reshape(n, 16)
    high2 = _bit_planes(packed_scales[:, 8:12], 2).reshape(n, 16)
    scales = (low4 | (high2 << 4)).view(np.int8) - np.int8(32)
    group_scale = _f16(blocks, 108) * scales
    low = _bit_planes(blocks[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    high = _bit_planes(blocks[:, :32], 1).reshape(n, 16, 16)
    quants = low.view(np.int8) - ((high ^ 1) << 2).view(np.int8)
    _scale_into(out.reshape(n, 16, 16), quants, group_scale)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins packed in 12 bytes (get_scale_min_k4 in ggml)."""
    n = len(packed)
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.empty((n, 8), dtype=np.uint8)
    mins = np.empty((n, 8), dtype=np.uint8)
    np.bitwise_and(d, 0x3F, out=scales[:, :4])
    np.bitwise_and(m, 0x3F, out=mins[:, :4])
    scales[:, 4:] = (md & 0x0F) | ((d >> 2) & 0x30)
    mins[:, 4:] = (md >> 4) | ((m >> 2) & 0x30)
    return scales, mins


def _k_quant_affine(blocks: np.ndarray, out: np.ndarray, quants: np.ndarray) -> None:
    """Q4_K/Q5_K: 8 groups of 32 weights; w = (d * scale) * q - dmin * min."""
    n = len(blocks)
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    grouped = out.reshape(n, 8, 32)
    _scale_into(grouped, quants, _f16(blocks, 0) * scales)
    grouped -= (_f16(blocks, 2) * mins)[..., None]


def _dequantize_q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """block_q4_K: f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles."""
    n = len(blocks)
    _k_quant_affine(blocks, out, _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32))


def _dequantize_q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """block_q5_K: f16 d, f16 dmin, 12 bytes of scales/mins, 32 bytes of fifth bits, 128 bytes of nibbles."""
    n = len(blocks)
    quants = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    quants |= _bit_planes(blocks[:, 16:48], 1) << 4
    _k_quant_affine(blocks, out, quants)


def _dequantize_q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """block_q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d.

    16 groups of 16 weights; w = (d * scale) * (q - 32).
    """
    n = len(blocks)
    quants = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    quants |= _bit_planes(blocks[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 8, 32) << 4
    quants -= 32
    group_scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8)
    _scale_into(out.reshape(n, 16, 16), quants.view(np.int8).reshape(n, 16, 16), group_scale)


# IQ4_NL / IQ4_XS: a 4-bit index into this non-linear grid (ggml's kvalues_iq4nl), times the block's scale.
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_codes(packed: np.ndarray) -> np.ndarray:
    """(n, groups, 16) bytes of nibbles -> int8 grid values (n, groups, 32): low nibbles first, then high."""
    return IQ4_VALUES[_nibbles(packed).reshape(*packed.shape[:-1], 32)]


def _iq4_xs_scales(blocks: np.ndarray) -> np.ndarray:
    """block_iq4_xs's eight 6-bit sub-block scales, less 32, as float32 (n, 8): the low 4 bits from scales_l (two
    per byte, low nibble first), the high 2 from scales_h (two bits per sub-block, from bit 0)."""
    low = _nibbles(blocks[:, 4:8]).transpose(0, 2, 1).reshape(-1, 8)
    high = (blocks[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3
    return ((low | (high.astype(np.uint8) << 4)).astype(np.int16) - 32).astype(np.float32)


def _dequantize_iq4_nl(blocks: np.ndarray, out: np.ndarray) -> None:
    """block_iq4_nl: f16 d, 16 bytes of nibbles; w = d * grid[q]."""
    _scale_into(out, _iq4_codes(blocks[:, 2:]), _f16(blocks, 0)[:, 0])


# bitsandbytes' 4-bit code books (bitsandbytes.functional.get_4bit_type: NF4's 16 quantiles of a normal
# distribution, its FP4's sign-magnitude values), each block's values a code times the block's absmax. The kernels
# multiply int8 grids (IQ4_NL's way), so the codes are held times 127, rounded: within 0.0037 (NF4) and 0.0040
# (FP4) of a block's absmax, where the codes themselves lie 0.08-0.31 apart.
NF4_CODES = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                      -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                      0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                      0.7229568362236023, 1.0], dtype=np.float32)
BNB_FP4_CODES = np.array([0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3],
                         dtype=np.float32) / np.float32(12)
GRID_SCALE = 127
NF4_VALUES = np.round(NF4_CODES * GRID_SCALE).astype(np.int8)
BNB_FP4_VALUES = np.round(BNB_FP4_CODES * GRID_SCALE).astype(np.int8)
# MXFP4's e2m1 values times 2 (ggml's kvalues_mxfp4), sign in the nibble's top bit; a block's weights are these
# times 2^(e - 128) for its e8m0 exponent e (ggml's GGML_E8M0_TO_FP32_HALF).
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def _grid_dequantizer(values: np.ndarray) -> Dequantizer:
    """IQ4_NL's block (f16 d, 16 bytes of nibbles: low nibbles weights 0-15, high 16-31) on another grid."""
    def dequantize_blocks(blocks: np.ndarray, out: np.ndarray) -> None:
        codes = values[_nibbles(blocks[:, 2:]).reshape(len(blocks), 32)]
        _scale_into(out, codes, _f16(blocks, 0)[:, 0])

    return dequantize_blocks


def _dequantize_nvfp4_f16(blocks: np.ndarray, out: np.ndarray) -> None:
    """NVFP4_F16 (pagellm's): f16 d0, f16 d1, 16 bytes of nibbles (low nibbles weights 0-15, high 16-31) on
    MXFP4's grid; weights 0-15 are d0 * grid[q], 16-31 d1 * grid[q]."""
    n = len(blocks)
    codes = MXFP4_VALUES[_nibbles(blocks[:, 4:])]  # (n, 2, 16): the two halves
    scales = blocks[:, :4].copy().view(np.float16).astype(np.float32)  # (n, 2)
    _scale_into(out.reshape(n, 2, 16), codes, scales)


def _dequantize_iq4_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    """block_iq4_xs: f16 d, uint16 scales_h, 4 bytes scales_l, 128 bytes of nibbles (16 per 32-weight sub-block);
    w = (d * (scale - 32)) * grid[q]."""
    n = len(blocks)
    codes = _iq4_codes(blocks[:, 8:].reshape(n, 8, 16))
    _scale_into(out.reshape(n, 8, 32), codes, _f16(blocks, 0) * _iq4_xs_scales(blocks))


def _gguf_package_dequantizer(type_id: int) -> Dequantizer:
    """The lattice and ternary types (IQ1_S .. IQ3_S, TQ1_0, TQ2_0) and MXFP4, decoded by the `gguf` package
    itself (its grids are large tables this module does not copy)."""
    def dequantize_blocks(blocks: np.ndarray, out: np.ndarray) -> None:
        import gguf

        out[:] = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(type_id))

    return dequantize_blocks


# GGML type id (ggml.h's enum ggml_type, gguf.GGMLQuantizationType) -> format.
QUANT_FORMATS: dict[int, QuantFormat] = {
    0: QuantFormat("F32", 1, 4, _dequantize_f32),
    1: QuantFormat("F16", 1, 2, _dequantize_f16),
    2: QuantFormat("Q4_0", 32, 18, _dequantize_q4_0),
    3: QuantFormat("Q4_1", 32, 20, _dequantize_q4_1),
    6: QuantFormat("Q5_0", 32, 22, _dequantize_q5_0),
    7: QuantFormat("Q5_1", 32, 24, _dequantize_q5_1),
    8: QuantFormat("Q8_0", 32, 34, _dequantize_q8_0),
    10: QuantFormat("Q2_K", QK_K, 84, _dequantize_q2_k),
    11: QuantFormat("Q3_K", QK_K, 110, _dequantize_q3_k),
    12: QuantFormat("Q4_K", QK_K, 144, _dequantize_q4_k),
    13: QuantFormat("Q5_K", QK_K, 176, _dequantize_q5_k),
    14: QuantFormat("Q6_K", QK_K, 210, _dequantize_q6_k),
    30: QuantFormat("BF16", 1, 2, _dequantize_bf16),
    20: QuantFormat("IQ4_NL", 32, 18, _dequantize_iq4_nl),
    # Kept in memory as another type's blocks (transcode_blocks): no pagellm kernel reads them in their own.
    23: QuantFormat("IQ4_XS", QK_K, 136, _dequantize_iq4_xs),
    16: QuantFormat("IQ2_XXS", QK_K, 66, _gguf_package_dequantizer(16)),
    17: QuantFormat("IQ2_XS", QK_K, 74, _gguf_package_dequantizer(17)),
    18: QuantFormat("IQ3_XXS", QK_K, 98, _gguf_package_dequantizer(18)),
    19: QuantFormat("IQ1_S", QK_K, 50, _gguf_package_dequantizer(19)),
    21: QuantFormat("IQ3_S", QK_K, 110, _gguf_package_dequantizer(21)),
    22: QuantFormat("IQ2_S", QK_K, 82, _gguf_package_dequantizer(22)),
    29: QuantFormat("IQ1_M", QK_K, 56, _gguf_package_dequantizer(29)),
    34: QuantFormat("TQ1_0", QK_K, 54, _gguf_package_dequantizer(34)),
    35: QuantFormat("TQ2_0", QK_K, 66, _gguf_package_dequantizer(35)),
    39: QuantFormat("MXFP4", 32, 17, _gguf_package_dequantizer(39)),
}
# pagellm's own block types (ids past GGML's, csrc/gguf_quant.c's enum): never read from a GGUF file.
OWN_FORMATS: dict[int, QuantFormat] = {
    1000: QuantFormat("NF4", 32, 18, _grid_dequantizer(NF4_VALUES)),
    1001: QuantFormat("BNB_FP4", 32, 18, _grid_dequantizer(BNB_FP4_VALUES)),
    1002: QuantFormat("MXFP4_F16", 32, 18, _grid_dequantizer(MXFP4_VALUES)),
    1003: QuantFormat("NVFP4_F16", 32, 20, _dequantize_nvfp4_f16),
}
# Type name -> (type id, format).
FORMATS_BY_NAME: dict[str, tuple[int, QuantFormat]] = {fmt.name: (type_id, fmt)
                                                       for type_id, fmt in (QUANT_FORMATS | OWN_FORMATS).items()}
# Kernel-less types -> the type whose blocks they are kept as.
TRANSCODED_TYPES = {"IQ4_XS": "IQ4_NL", "IQ3_XXS": "Q6_K", "IQ3_S": "Q6_K", "MXFP4": "MXFP4_F16",
                    **dict.fromkeys(("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ1_M", "TQ1_0", "TQ2_0"), "Q8_0")}
Q8_0_BLOCK_BYTES = 34
IQ4_NL_BLOCK_BYTES = 18
Q6_K_BLOCK_BYTES = 210


def transcode_blocks(blocks: np.ndarray, type_id: int, tensor_name: str = "") -> np.ndarray:
    """A kernel-less type's blocks (n, block_bytes) as blocks of its kernel_type: IQ4_XS as IQ4_NL blocks (n * 8,
    18), each 32-weight sub-block's scale d * (scale - 32) rounded to f16 (2^-11 relative at most; the nibbles as
    they are); MXFP4 as MXFP4_F16 blocks (n, 18) (mxfp4_f16_blocks); IQ3_XXS and IQ3_S as Q6_K blocks (n, 210),
    exactly (_iq3_as_q6_k); the other types as Q8_0 blocks (n * block_size / 32, 34), requantized from their float32
    values as llama.cpp's quantize_row_q8_0 does."""
    fmt = quant_format(type_id)
    n = len(blocks)
    if fmt.name in ("IQ3_XXS", "IQ3_S"):
        return _iq3_as_q6_k(blocks, fmt)
    if fmt.name == "MXFP4":  # block_mxfp4: e8m0 exponent, 16 bytes of nibbles as IQ4_NL's
        return mxfp4_f16_blocks(blocks[:, 0], blocks[:, 1:], tensor_name)
    if fmt.name == "IQ4_XS":
        out = np.empty((n, 8, IQ4_NL_BLOCK_BYTES), dtype=np.uint8)
        out[:, :, :2] = (_f16(blocks, 0) * _iq4_xs_scales(blocks)).astype(np.float16)[..., None].view(np.uint8)
        out[:, :, 2:] = blocks[:, 8:].reshape(n, 8, 16)
        return out.reshape(n * 8, IQ4_NL_BLOCK_BYTES)
    weights = np.empty((n, fmt.block_size), dtype=np.float32)
    fmt.dequantize(blocks, weights)
    return quantize_q8_0(weights.reshape(-1, 32))


# Exponents of MXFP4 scales 2^(e - 128) an f16 holds exactly (its subnormals from 2^-24, its largest power 2^15).
MXFP4_F16_EXPONENTS = (104, 143)


def mxfp4_f16_blocks(exponents: np.ndarray, nibbles: np.ndarray, tensor_name: str = "") -> np.ndarray:
    """MXFP4 blocks, e8m0 exponents (n,) and 16 bytes of codes each (n, 16) in ggml's order (low nibbles weights
    0-15, high ones 16-31), as MXFP4_F16 blocks (n, 18): the scale 2^(e - 128) as an f16 (the grid is e2m1's values
    times 2), then the same 16 bytes. Exact for exponents in MXFP4_F16_EXPONENTS; below them the scale rounds to
    f16's smallest subnormal or zero (the block's weights are at most 12 * 2^-25 in magnitude); above them (weights
    of 2^16 and more) no f16 holds it, and a ValueError says so."""
    exponents = np.asarray(exponents, dtype=np.uint8)
    if exponents.size and int(exponents.max()) > MXFP4_F16_EXPONENTS[1]:
        where = f"tensor {tensor_name!r}: " if tensor_name else ""
        raise ValueError(f"{where}an MXFP4 block scale of 2^{int(exponents.max()) - 127} is beyond the f16 scale "
                         f"pagellm keeps MXFP4 blocks with (up to 2^{MXFP4_F16_EXPONENTS[1] - 127}); such weights "
                         "are not a model's. Fix: check the file, or convert the model to another type")
    out = np.empty((len(exponents), IQ4_NL_BLOCK_BYTES), dtype=np.uint8)
    scales = np.ldexp(np.float32(1), exponents.astype(np.int32) - 128).astype(np.float16)
    out[:, :2] = scales.reshape(-1, 1).view(np.uint8)
    out[:, 2:] = nibbles
    return out


NVFP4_F16_BLOCK_BYTES = 20
F16_MAX = 65504.0


def nvfp4_f16_blocks(packed: np.ndarray, block_scales: np.ndarray, global_scale: float,
                     tensor_name: str = "") -> np.ndarray:
    """One NVFP4 weight [N, K] (K a multiple of 32) as NVFP4_F16 blocks [N, K / 32 * 20]. `packed` uint8 [N, K / 2]
    holds e2m1 codes (sign in bit 3), weight 2i in byte i's low nibble and 2i + 1 in its high one (as ModelOpt and
    compressed-tensors pack them); `block_scales` [N, K / 16] each 16 weights' scale (the checkpoint's fp8 values,
    as floats); weight = e2m1 value * block scale * global_scale. Each half's f16 scale is block scale *
    global_scale / 2 (the grid is e2m1's values times 2), rounded once (2^-11 relative at most; below f16's
    normals, to its subnormal steps of 2^-24); a scale beyond f16's range, or not finite, is refused naming the
    tensor."""
    rows, half_cols = packed.shape
    cols = 2 * half_cols
    if cols % 32 or block_scales.shape != (rows, cols // 16):
        raise ValueError(f"tensor {tensor_name!r}: NVFP4 codes {packed.shape} and block scales {block_scales.shape} "
                         "do not make a weight of 16-weight blocks whose input features are a multiple of 32")
    scales = block_scales.astype(np.float64) * float(global_scale) / 2
    if not np.isfinite(scales).all() or (np.abs(scales) > F16_MAX).any():
        raise ValueError(f"tensor {tensor_name!r}: an NVFP4 block scale times the global scale "
                         f"({np.abs(scales).max()!r} / 2) is not finite or beyond the f16 scales pagellm keeps NVFP4 "
                         "blocks with (65504); such weights are not a model's. Fix: check the checkpoint")
    codes = np.empty((rows, cols), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    out = np.empty((rows, cols // 32, NVFP4_F16_BLOCK_BYTES), dtype=np.uint8)
    out[..., :4] = scales.astype(np.float16).reshape(rows, cols // 32, 2).view(np.uint8)
    out[..., 4:] = ggml_nibbles(codes)
    return out.reshape(rows, -1)


def ggml_nibbles(codes):
    """4-bit codes (uint8, numpy or torch, the last axis in weights' order, a multiple of 32) as ggml's 32-weight
    blocks hold them, [..., blocks, 16]: weight j of a block in byte j's low nibble, weight 16 + j in its high one
    (IQ4_NL's and MXFP4's order, which pagellm's grid types keep)."""
    blocks = codes.reshape(*codes.shape[:-1], -1, 32)
    return blocks[..., :16] | (blocks[..., 16:] << 4)


def _iq3_as_q6_k(blocks: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """IQ3_XXS / IQ3_S blocks as Q6_K blocks of the same float32 values, bit for bit. Each 32-weight sub-block is
    d (0.5 + s) / 2 (IQ3_XXS, s of 4 bits) or d (1 + 2 s) (IQ3_S) times grid values with signs, the grid even from 4
    to 62 (IQ3_XXS) or odd from 1 to 15 (IQ3_S); as Q6_K, its two 16-weight groups take the int8 scale 1 + 2 s, the
    super-block's d is d / 2 (IQ3_XXS) or d, and q - 32 is grid / 2 (or grid) with its sign, within +-31. gguf
    decodes both as one float32 product of the same reals, so the values are the same floats (but where an IQ3_XXS
    d is an f16 subnormal whose halving rounds: weights below 1e-7, off by its rounding)."""
    n = len(blocks)
    d = blocks[:, :2].copy().view(np.float16)[:, 0]
    if fmt.name == "IQ3_XXS":  # f16 d | 64 bytes of grid indices | 8 uint32: 4 x 7 sign bits, a 4-bit scale on top
        sub_scales = (blocks[:, 66:98].copy().view(np.uint32) >> 28).astype(np.int16)
        super_d = (d.astype(np.float32) * np.float32(0.5)).astype(np.float16)
    else:  # IQ3_S: f16 d | 64 bytes of indices | 8 of high bits | 32 of signs | 4 bytes of 4-bit scales
        sub_scales = _nibbles(blocks[:, 106:110]).transpose(0, 2, 1).reshape(n, 8).astype(np.int16)
        super_d = d
    group_scales = (1 + 2 * sub_scales).astype(np.int8)  # (n, 8), one per 32 weights
    values = np.empty((n, QK_K), dtype=np.float32)
    fmt.dequantize(blocks, values)
    steps = super_d.astype(np.float32)[:, None] * group_scales.astype(np.float32)  # gguf's d * scale for Q6_K
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(steps[..., None] != 0, np.rint(values.reshape(n, 8, 32) / steps[..., None]), 0)
    return _pack_q6_k((np.clip(q, -32, 31).astype(np.int16) + 32).astype(np.uint8).reshape(n, QK_K),
                      np.repeat(group_scales, 2, axis=1), super_d)


def _pack_q6_k(q: np.ndarray, scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """block_q6_K from unsigned 6-bit quants (n, 256), int8 scales per 16 weights (n, 16) and f16 d (n,): weight
    128 h + 64 p + j's low nibble is nibble p of ql byte 64 h + j; weight 128 h + 32 b + i's top two bits are bits
    2 b of qh byte 32 h + i (the layout _dequantize_q6_k reads)."""
    n = len(q)
    out = np.empty((n, Q6_K_BLOCK_BYTES), dtype=np.uint8)
    low = (q & 15).reshape(n, 2, 2, 64)
    out[:, :128] = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)
    out[:, 128:192] = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
                       ).reshape(n, 64)
    out[:, 192:208] = scales.astype(np.int8).view(np.uint8)
    out[:, 208:210] = d.astype(np.float16).reshape(n, 1).view(np.uint8)
    return out


def quantize_q8_0(weights: np.ndarray) -> np.ndarray:
    """float32 (n, 32) -> Q8_0 blocks (n, 34): d = max|w| / 127 stored as f16, q = round(w / d) with the float32
    d (llama.cpp's quantize_row_q8_0_ref)."""
    d = np.abs(weights).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d > 0, np.float32(1) / d, np.float32(0))
    out = np.empty((len(weights), Q8_0_BLOCK_BYTES), dtype=np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = np.round(weights * inverse).astype(np.int8).view(np.uint8)
    return out



def kernel_type(name: str) -> str:
    """The type whose blocks the kernels read for a tensor stored in `name`: itself, or for a kernel-less type the
    one it is kept as (transcode_blocks)."""
    return TRANSCODED_TYPES.get(name, name)


def supported_type_names() -> list[str]:
    return [fmt.name for fmt in QUANT_FORMATS.values()]


def quant_format(type_id: int, tensor_name: str = "") -> QuantFormat:
    """The format of GGML type `type_id`, or a ValueError naming it and the supported ones."""
    fmt = QUANT_FORMATS.get(type_id)
    if fmt is None:
        where = f" (tensor {tensor_name!r})" if tensor_name else ""
        raise ValueError(
            f"GGML tensor type {_type_name(type_id)}{where} is not supported; pagellm reads "
            f"{', '.join(supported_type_names())}. Fix: use a GGUF quantized to one of those, or the HF checkpoint."
        )
    return fmt


def _block_format(type_id: int, tensor_name: str) -> QuantFormat:
    """A GGML type's format, or one of pagellm's own (blocks the kernels hold, not a file's)."""
    return OWN_FORMATS[type_id] if type_id in OWN_FORMATS else quant_format(type_id, tensor_name)


def _type_name(type_id: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return f"{GGMLQuantizationType(type_id).name} (id {type_id})"
    except (ImportError, ValueError):
        return f"id {type_id}"


def tensor_nbytes(shape: tuple[int, ...], type_id: int, tensor_name: str = "") -> int:
    """Bytes a tensor of `shape` (numpy order, rows last-contiguous) occupies in the file."""
    fmt = _block_format(type_id, tensor_name)
    row = shape[-1] if shape else 1
    if row % fmt.block_size:
        raise ValueError(
            f"tensor {tensor_name!r}: row length {row} is not a multiple of the {fmt.name} block size {fmt.block_size}"
        )
    return int(np.prod(shape, dtype=np.int64)) // fmt.block_size * fmt.block_bytes


def dequantize(raw: np.ndarray, type_id: int, shape: tuple[int, ...], tensor_name: str = "") -> np.ndarray:
    """A new, writable, C-contiguous float32 array of `shape` from the tensor's raw bytes."""
    fmt = _block_format(type_id, tensor_name)
    n_blocks = tensor_nbytes(shape, type_id, tensor_name) // fmt.block_bytes
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n_blocks, fmt.block_bytes)
    out = np.empty((n_blocks, fmt.block_size), dtype=np.float32)
    step = max(1, _CHUNK_WEIGHTS // fmt.block_size)
    for start in range(0, n_blocks, step):
        fmt.dequantize(blocks[start : start + step], out[start : start + step])
    return out.reshape(shape)
