"""Triton kernels on GGUF weights kept in their quantized blocks: the GPU's counterpart of gguf_kernels.GGUFKernels.

The weight is the same uint8 tensor [out_features, in_features / block_weights * block_bytes] (ggml's block_*
layouts, each output row's blocks contiguous), on the device. Every kernel reads it through one per-type decoder,
`_plane`: a block of QK weights is P planes of L lanes, weight p * L + l of the block being lane l of plane p,
and each plane is a few byte loads, shifts and masks per lane (Q4_0: plane 0 is the low nibbles of the 16 quant
bytes, plane 1 their high nibbles; Q4_K: plane p is nibble p % 2 of the 32 bytes from (p // 2) * 32, under scale
and min p). A plane of BLOCK_B consecutive blocks is a [rows, BLOCK_B * L] tile of weights whose columns are known
columns of x, so it multiplies those columns directly: nothing is re-ordered, and no dequantized copy of the
weight exists outside registers and shared memory.

- `matmul` (y = x @ W^T, float32 accumulation, y in x's dtype), one kernel, two ways of multiplying a tile:
  up to MATVEC_MAX_ROWS rows of x (decode), broadcast products summed in registers over a few output rows per
  program (many programs: the product is bound by the weight's bytes, read once from memory); above, tl.dot on
  [BLOCK_M, BLOCK_B * L] x [BLOCK_B * L, BLOCK_N] tiles, the weight tile dequantized to x's dtype (float16 or
  bfloat16; float32 at IEEE precision, not tf32, so that a float32 model stays float32).
- `dequantize_rows` (an embedding's gather, the tied LM head's rows): equal to gguf's dequantization (launched
  without fused multiply-adds, so the GPU rounds each product and sum as numpy does), rounded once to the dtype.

The tiles (matmul_tiles) are the fastest of sweeps on an H200 (benchmarks/gguf_gpu_tiles.py);
benchmarks/gpu_check.sh runs the CUDA tests and times the products against a dense bf16 layer
(benchmarks/gguf_gpu.py). On CPU tensors the kernels run under TRITON_INTERPRET=1 (float32 and float16
activations; the interpreter mishandles bfloat16), which is how tests/test_triton_gguf.py checks them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from pagellm.ops.gguf_kernels import KERNEL_TYPES, _format, _rows_of, row_bytes

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Rows of x up to which `matmul` takes the broadcast (matrix-vector) products; tl.dot from there (measured: at 8
# rows the dot tiles took 0.6-0.8x the broadcast tiles' time on an H200, at 4 rows 1.07-1.5x).
MATVEC_MAX_ROWS = 4


@dataclass(frozen=True)
class BlockGeometry:
    """A type's block seen by the kernels: QK weights in BYTES bytes, as PLANES planes of LANES lanes."""

    type_id: int
    weights: int
    bytes: int
    planes: int
    lanes: int


def _geometry(type_name: str) -> BlockGeometry:
    type_id, fmt = _format(type_name)
    planes, lanes = {"Q8_0": (1, 32)}.get(type_name, (8, 32) if type_name.endswith("_K") else (2, 16))
    assert planes * lanes == fmt.block_size
    return BlockGeometry(type_id, fmt.block_size, fmt.block_bytes, planes, lanes)


GEOMETRY: dict[str, BlockGeometry] = {name: _geometry(name) for name in KERNEL_TYPES}


# ---- the per-type decoder ---------------------------------------------------------------------------------------


@triton.jit
def _plane(w_ptr, h_ptr, s_ptr, base, lane, mask, p, TYPE: tl.constexpr):
    """Weights p * L + lane of the blocks at byte offsets `base` ([R, B, 1] int64) as float32 [R, B, L], with
    gguf's float32 operations in gguf's order. w_ptr/h_ptr/s_ptr: the weight as uint8, float16 (a half at byte
    offset o is element o // 2: every half of every block is at an even offset) and int8; masked lanes read
    zeros and give 0. Loads are written out rather than wrapped in helpers: the interpreter pays milliseconds
    for every call of a jit function."""
    if TYPE == 2 or TYPE == 3 or TYPE == 6 or TYPE == 7:
        # Q4_0: f16 d | 16 bytes of nibbles; w = d * (q - 8).   Q4_1: f16 d | f16 m | nibbles; w = d * q + m.
        # Q5_0: f16 d | u32 qh | nibbles; w = d * (q - 16).      Q5_1: f16 d | f16 m | u32 qh | nibbles; d * q + m.
        # Weight j of a block: nibble j // 16 of byte j % 16; the fifth bit is bit j of qh (little-endian).
        AFFINE: tl.constexpr = TYPE == 3 or TYPE == 7
        FIFTH_BIT: tl.constexpr = TYPE == 6 or TYPE == 7
        HEAD: tl.constexpr = 4 if AFFINE else 2
        QS: tl.constexpr = HEAD + 4 if FIFTH_BIT else HEAD
        q = (tl.load(w_ptr + base + QS + lane, mask=mask, other=0).to(tl.int32) >> (4 * p)) & 15
        if FIFTH_BIT:
            high = tl.load(w_ptr + base + HEAD + 2 * p + lane // 8, mask=mask, other=0).to(tl.int32)
            q = q | (((high >> (lane % 8)) & 1) << 4)
        d = tl.load(h_ptr + base // 2, mask=mask, other=0.0).to(tl.float32)
        if AFFINE:
            w = q.to(tl.float32) * d + tl.load(h_ptr + base // 2 + 1, mask=mask, other=0.0).to(tl.float32)
        else:
            w = (q - (16 if FIFTH_BIT else 8)).to(tl.float32) * d
    elif TYPE == 20 or TYPE == 1000 or TYPE == 1001 or TYPE == 1002 or TYPE == 1003:
        # IQ4_NL: f16 d | 16 bytes of nibbles as Q4_0's; w = d * grid[q] (ggml's kvalues_iq4nl). NF4 / BNB_FP4
        # (pagellm's, for bitsandbytes' 4-bit weights): the same blocks on bitsandbytes' code books times 127
        # (gguf_quants.NF4_VALUES / BNB_FP4_VALUES); MXFP4_F16 (pagellm's, for MXFP4): on e2m1's values times 2.
        # NVFP4_F16 (pagellm's, for NVFP4): f16 d0 | f16 d1 | nibbles on MXFP4's grid; plane p (weights 16p ..
        # 16p + 15) takes d_p.
        HEAD: tl.constexpr = 4 if TYPE == 1003 else 2
        q = (tl.load(w_ptr + base + HEAD + lane, mask=mask, other=0).to(tl.int32) >> (4 * p)) & 15
        if TYPE == 20:
            low = tl.where((q & 4) != 0, tl.where((q & 2) != 0, tl.where((q & 1) != 0, -10, -22),
                                                  tl.where((q & 1) != 0, -35, -49)),
                           tl.where((q & 2) != 0, tl.where((q & 1) != 0, -65, -83), tl.where((q & 1) != 0, -104, -127)))
            high = tl.where((q & 4) != 0, tl.where((q & 2) != 0, tl.where((q & 1) != 0, 113, 89),
                                                  tl.where((q & 1) != 0, 69, 53)),
                           tl.where((q & 2) != 0, tl.where((q & 1) != 0, 38, 25), tl.where((q & 1) != 0, 13, 1)))
        elif TYPE == 1000:
            low = tl.where((q & 4) != 0, tl.where((q & 2) != 0, tl.where((q & 1) != 0, 0, -12),
                                                  tl.where((q & 1) != 0, -23, -36)),
                           tl.where((q & 2) != 0, tl.where((q & 1) != 0, -50, -67), tl.where((q & 1) != 0, -88, -127)))
            high = tl.where((q & 4) != 0, tl.where((q & 2) != 0, tl.where((q & 1) != 0, 127, 92),
                                                  tl.where((q & 1) != 0, 71, 56)),
                           tl.where((q & 2) != 0, tl.where((q & 1) != 0, 43, 31), tl.where((q & 1) != 0, 20, 10)))
        elif TYPE == 1002 or TYPE == 1003:
            low = tl.where((q & 4) != 0, tl.where((q & 2) != 0, tl.where((q & 1) != 0, 12, 8),
                                                  tl.where((q & 1) != 0, 6, 4)),
                           tl.where((q & 2) != 0, tl.where((q & 1) != 0, 3, 2), tl.where((q & 1) != 0, 1, 0)))
            high = -low
        else:
            low = tl.where((q & 4) != 0, tl.where((q & 2) != 0, tl.where((q & 1) != 0, 32, 21),
                                                  tl.where((q & 1) != 0, 64, 42)),
                           tl.where((q & 2) != 0, tl.where((q & 1) != 0, 127, 85), tl.where((q & 1) != 0, 1, 0)))
            high = tl.where((q & 4) != 0, tl.where((q & 2) != 0, tl.where((q & 1) != 0, -32, -21),
                                                  tl.where((q & 1) != 0, -64, -42)),
                           tl.where((q & 2) != 0, tl.where((q & 1) != 0, -127, -85), tl.where((q & 1) != 0, -1, 0)))
        value = tl.where((q & 8) != 0, high, low)
        w = value.to(tl.float32) * tl.load(h_ptr + base // 2 + (p if TYPE == 1003 else 0), mask=mask,
                                           other=0.0).to(tl.float32)
    elif TYPE == 8:  # Q8_0: f16 d | 32 int8; w = d * q
        q = tl.load(s_ptr + base + 2 + lane, mask=mask, other=0)
        w = q.to(tl.float32) * tl.load(h_ptr + base // 2, mask=mask, other=0.0).to(tl.float32)
    elif TYPE == 10:  # Q2_K: 16 bytes of scale | min << 4 (group i), 64 bytes of 2-bit quants, f16 d, f16 dmin
        # Plane p: bits 2 * (p % 4) of bytes (p // 4) * 32 + lane; groups 2p (lanes 0-15) and 2p + 1.
        q = (tl.load(w_ptr + base + 16 + (p // 4) * 32 + lane, mask=mask, other=0).to(tl.int32) >> (2 * (p % 4))) & 3
        packed = tl.where(lane < 16, tl.load(w_ptr + base + 2 * p, mask=mask, other=0),
                          tl.load(w_ptr + base + 2 * p + 1, mask=mask, other=0)).to(tl.int32)
        d = tl.load(h_ptr + base // 2 + 40, mask=mask, other=0.0).to(tl.float32)
        dmin = tl.load(h_ptr + base // 2 + 41, mask=mask, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * (d * (packed & 15).to(tl.float32)) - dmin * (packed >> 4).to(tl.float32)
    elif TYPE == 11:  # Q3_K: 32 bytes of high bits, 64 of 2-bit lows, 12 of 6-bit scales, f16 d
        # Plane p: low bits as Q2_K's, high bit p of byte lane; q = low - 4 where that bit is clear.
        low = (tl.load(w_ptr + base + 32 + (p // 4) * 32 + lane, mask=mask, other=0).to(tl.int32) >> (2 * (p % 4))) & 3
        high = (tl.load(w_ptr + base + lane, mask=mask, other=0).to(tl.int32) >> p) & 1
        q = low - ((high ^ 1) << 2)
        # Scale i of groups 2p, 2p + 1 (lanes 0-15, 16-31): nibble i // 8 of byte 96 + i % 8, and two bits
        # 2 * (i // 4) of byte 104 + i % 4.
        i = 2 * p + lane // 16
        scale = ((tl.load(w_ptr + base + 96 + i % 8, mask=mask, other=0).to(tl.int32) >> (4 * (i // 8))) & 15) \
            | (((tl.load(w_ptr + base + 104 + i % 4, mask=mask, other=0).to(tl.int32) >> (2 * (i // 4))) & 3) << 4)
        d = tl.load(h_ptr + base // 2 + 54, mask=mask, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * (d * (scale - 32).to(tl.float32))
    elif TYPE == 12 or TYPE == 13:
        # Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles. Q5_K: the same with 32 bytes
        # of fifth bits (bit p of byte lane) before the nibbles. Plane p: nibble p % 2 of bytes (p // 2) * 32 +
        # lane; w = (d * scale) * q - dmin * min with scale and min p of the 12 bytes a | b | c (4 each): for p < 4
        # the low 6 bits of a[p] and b[p], from 4 on c[j]'s nibbles under a[j]'s and b[j]'s top 2 bits (j = p - 4).
        QS: tl.constexpr = 48 if TYPE == 13 else 16
        q = (tl.load(w_ptr + base + QS + (p // 2) * 32 + lane, mask=mask, other=0).to(tl.int32) >> (4 * (p % 2))) & 15
        if TYPE == 13:
            q = q | (((tl.load(w_ptr + base + 16 + lane, mask=mask, other=0).to(tl.int32) >> p) & 1) << 4)
        a = tl.load(w_ptr + base + 4 + p % 4, mask=mask, other=0).to(tl.int32)
        b = tl.load(w_ptr + base + 8 + p % 4, mask=mask, other=0).to(tl.int32)
        if p < 4:
            scale = a & 63
            minimum = b & 63
        else:
            c = tl.load(w_ptr + base + 12 + p % 4, mask=mask, other=0).to(tl.int32)
            scale = (c & 15) | ((a >> 6) << 4)
            minimum = (c >> 4) | ((b >> 6) << 4)
        d = tl.load(h_ptr + base // 2, mask=mask, other=0.0).to(tl.float32)
        dmin = tl.load(h_ptr + base // 2 + 1, mask=mask, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * (d * scale.to(tl.float32)) - dmin * minimum.to(tl.float32)
    else:  # TYPE == 14, Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d
        # Plane p (half p // 4 of the block): nibble (p % 4) // 2 of ql byte 64 (p // 4) + 32 (p % 2) + lane, bits
        # 2 (p % 4) of qh byte 32 (p // 4) + lane; groups 2p, 2p + 1; w = (d * scale) * (q - 32).
        low = (tl.load(w_ptr + base + (p // 4) * 64 + (p % 2) * 32 + lane, mask=mask, other=0).to(tl.int32)
               >> (4 * ((p % 4) // 2))) & 15
        high = (tl.load(w_ptr + base + 128 + (p // 4) * 32 + lane, mask=mask, other=0).to(tl.int32)
                >> (2 * (p % 4))) & 3
        q = (low | (high << 4)) - 32
        scale = tl.where(lane < 16, tl.load(s_ptr + base + 192 + 2 * p, mask=mask, other=0),
                         tl.load(s_ptr + base + 193 + 2 * p, mask=mask, other=0))
        d = tl.load(h_ptr + base // 2 + 104, mask=mask, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * (d * scale.to(tl.float32))
    return w


# ---- the kernels -------------------------------------------------------------------------------------------------


@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, h_ptr, s_ptr, y_ptr, M, N, num_blocks, weight_row_bytes, stride_xm, stride_ym,
    TYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr, P: tl.constexpr, L: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, LATE_SUM: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] W[n, k] for BLOCK_M rows of x and BLOCK_N output features per program, BLOCK_B
    blocks of each weight row per step; each step takes the blocks' P planes in turn."""
    first_row = tl.program_id(0) * BLOCK_N
    out_rows = first_row + tl.arange(0, BLOCK_N)
    x_rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    # The program's weight rows from one 64-bit start; offsets within them fit in 32 bits.
    tile_start = first_row.to(tl.int64) * weight_row_bytes
    w_tile, h_tile, s_tile = w_ptr + tile_start, h_ptr + tile_start // 2, s_ptr + tile_start
    lane = tl.arange(0, L)[None, None, :]
    step_blocks = tl.arange(0, BLOCK_B)[None, :, None]
    row_base = (tl.arange(0, BLOCK_N) * weight_row_bytes)[:, None, None]
    row_ok = (out_rows < N)[:, None, None]
    # x's columns of a plane, as a [BLOCK_M, BLOCK_B * L] tile: block j // L, lane j % L.
    column = tl.arange(0, BLOCK_B * L)
    x_cols = (column // L) * QK + column % L
    x_start = x_ptr + (x_rows.to(tl.int64) * stride_xm)[:, None]
    x_ok = (x_rows < M)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if LATE_SUM:  # broadcast products summed across lanes once, after the loop, not at every step
        partial = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_B * L], dtype=tl.float32)
    # One loop over (step of BLOCK_B blocks, plane) pairs: a single loop body of one plane's code.
    for step in range(0, tl.cdiv(num_blocks, BLOCK_B) * P):
        first = (step // P) * BLOCK_B
        p = step % P
        blocks = first + step_blocks
        base = row_base + blocks * BLOCK_BYTES
        w = _plane(w_tile, h_tile, s_tile, base, lane, row_ok & (blocks < num_blocks), p, TYPE)
        w = tl.reshape(w, (BLOCK_N, BLOCK_B * L))
        x_mask = x_ok & (first + column // L < num_blocks)[None, :]
        x = tl.load(x_start + (first * QK + p * L + x_cols)[None, :], mask=x_mask, other=0.0)
        if USE_DOT:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
        elif LATE_SUM:
            partial += x.to(tl.float32)[:, None, :] * w[None, :, :]
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    if LATE_SUM:
        acc = tl.sum(partial, axis=2)
    y = y_ptr + x_rows.to(tl.int64)[:, None] * stride_ym + out_rows[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(x_rows < M)[:, None] & (out_rows < N)[None, :])


@triton.jit
def _dequantize_kernel(
    w_ptr, h_ptr, s_ptr, ids_ptr, out_ptr, num_rows, num_blocks, weight_row_bytes, in_features,
    TYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr, P: tl.constexpr, L: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """out[i] = W[ids[i]], BLOCK_B blocks of the row per program (i = program_id(0)). An id outside the weight's
    rows reads nothing and writes NaN (ids on the device are not checked on the host: that would wait for it)."""
    slot = tl.program_id(0)
    row = tl.load(ids_ptr + slot).to(tl.int64)
    row_ok = (row >= 0) & (row < num_rows)
    row_start = tl.where(row_ok, row, 0) * weight_row_bytes
    blocks = (tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B))[None, :, None]
    lane = tl.arange(0, L)[None, None, :]
    block_ok = blocks < num_blocks
    read_ok = tl.where(row_ok, block_ok, False)  # not `block_ok & row_ok`: the interpreter refuses that mask
    out = out_ptr + slot.to(tl.int64) * in_features + blocks * QK + lane
    for p in range(P):  # a loop, not unrolled: the code, and its compile time, stay one plane's
        w = _plane(w_ptr + row_start, h_ptr + row_start // 2, s_ptr + row_start, blocks * BLOCK_BYTES, lane,
                   read_ok, p, TYPE)
        w = tl.where(row_ok, w, float("nan"))
        tl.store(out + p * L, w.to(out_ptr.dtype.element_ty), mask=block_ok)


# ---- the host side -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """One launch's tiles: BLOCK_M rows of x, BLOCK_N output features, BLOCK_B blocks per step."""

    block_m: int
    block_n: int
    block_b: int
    use_dot: bool
    num_warps: int
    num_stages: int = 3  # Triton's default on CUDA: loads of the next steps in flight while one computes
    late_sum: bool = False  # broadcast tiles: sum the products across a step's weights once, after the loop


def matmul_tiles(rows: int, geometry: BlockGeometry) -> TileConfig:
    """Tiles for `rows` rows of x, the fastest across Q4_0, Q8_0, Q4_K and Q6_K in two sweeps on an H200
    (benchmarks/gguf_gpu_tiles.py; Triton 3.6): up to MATVEC_MAX_ROWS rows, broadcast products over 4 output
    features per program under one warp, 256 weights a step (512 from 3 rows), the products summed after the loop
    for 1-2 rows; from 5 rows, dot tiles of 16 x 32 to 16 rows, 64 x 64 to 64 rows and 128 x 64 above, 4 warps
    and 2 stages. Wider programs and more warps were slower for decode in every type swept."""
    lanes = geometry.lanes
    if rows <= MATVEC_MAX_ROWS:
        block_m = triton.next_power_of_2(rows)
        per_step = 256 if rows <= 2 else 512
        return TileConfig(block_m, 4, per_step // lanes, False, 1, late_sum=rows <= 2)
    if rows <= 16:
        return TileConfig(16, 32, 128 // lanes, True, 4, 2)
    if rows <= 64:
        return TileConfig(max(32, triton.next_power_of_2(rows)), 64, 128 // lanes, True, 4, 2)
    return TileConfig(128, 64, 64 // lanes, True, 4, 2)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_device(tensor: torch.Tensor, what: str) -> None:
    if tensor.is_cuda or (tensor.is_cpu and _interpreting()):
        return
    raise ValueError(f"the Triton GGUF kernels take CUDA tensors (CPU tensors only under TRITON_INTERPRET=1); "
                     f"{what} is on {tensor.device}. Fix: use gguf_kernels.gguf_ops() for CPU tensors")


def _check_weight(weight: torch.Tensor, type_name: str, out_features: int, in_features: int) -> None:
    expected = (out_features, row_bytes(type_name, in_features))
    if weight.dtype != torch.uint8 or weight.shape != expected or not weight.is_contiguous():
        raise ValueError(f"a {type_name} weight of {out_features} x {in_features} must be a contiguous uint8 tensor of "
                         f"shape {expected} (each output row's blocks), not {weight.dtype} {tuple(weight.shape)}")
    _check_device(weight, "the weight")


def _views(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight's bytes as uint8, float16 (every block's halves are at even offsets of an even-sized block)
    and int8, for the kernels' three kinds of load."""
    return weight, weight.view(torch.float16), weight.view(torch.int8)


class TritonGGUFKernels:
    """GGUFKernels' interface on CUDA tensors (and CPU tensors under TRITON_INTERPRET=1): activations float32,
    float16 or bfloat16, outputs in x's dtype, float32 accumulation."""

    isa = "triton"

    @staticmethod
    def supports(type_name: str) -> bool:
        return type_name in GEOMETRY

    def _geometry(self, type_name: str) -> BlockGeometry:
        geometry = GEOMETRY.get(type_name)
        if geometry is None:
            _format(type_name)  # an unknown name gets the loader's error
            raise ValueError(f"the Triton GGUF kernels compute with {', '.join(KERNEL_TYPES)}, not {type_name!r}; "
                             f"use TorchGGUFOps (dequantized) for it")
        return geometry

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, type_name: str, out_features: int, in_features: int,
               out: torch.Tensor | None = None, tiles: TileConfig | None = None) -> torch.Tensor:
        """x [..., in_features] @ W^T -> [..., out_features] in x's dtype (written into `out` if given); `tiles`
        overrides matmul_tiles' choice (tests and benchmarks)."""
        geometry = self._geometry(type_name)
        _check_weight(weight, type_name, out_features, in_features)
        if x.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"x is {x.dtype}; the Triton GGUF kernels take float32, float16 or bfloat16 activations")
        if x.device != weight.device:
            raise ValueError(f"x is on {x.device} and the weight on {weight.device}; both must be on one device")
        rows = _rows_of(x, in_features)
        m = rows.shape[0]
        y = self._output(x, m, out_features, out)
        if m == 0 or out_features == 0:
            return y.view(*x.shape[:-1], out_features)
        tiles = tiles or matmul_tiles(m, geometry)
        grid = (triton.cdiv(out_features, tiles.block_n), triton.cdiv(m, tiles.block_m))
        _matmul_kernel[grid](
            rows, *_views(weight), y, m, out_features, in_features // geometry.weights, weight.shape[1],
            rows.stride(0), y.stride(0),
            TYPE=geometry.type_id, QK=geometry.weights, BLOCK_BYTES=geometry.bytes, P=geometry.planes,
            L=geometry.lanes, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_B=tiles.block_b,
            USE_DOT=tiles.use_dot, DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
            LATE_SUM=tiles.late_sum and not tiles.use_dot, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def _output(x: torch.Tensor, rows: int, out_features: int, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
        if out.dtype != x.dtype or out.device != x.device or out.numel() != rows * out_features \
                or out.shape[-1] != out_features or not out.is_contiguous():
            raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device}; this product writes a contiguous "
                             f"{x.dtype} tensor of {tuple(x.shape[:-1])} x {out_features} on {x.device}")
        return out.view(rows, out_features)

    def dequantize_rows(self, weight: torch.Tensor, type_name: str, row_ids: torch.Tensor | np.ndarray,
                        in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows row_ids of W as a [len(row_ids), in_features] tensor of `dtype` on the weight's device: gguf's
        dequantization, rounded once to `dtype`. Ids given on the host are checked against the rows here; ids
        already on the device are not (the check would wait for the device): a row outside gives NaN."""
        geometry = self._geometry(type_name)
        num_rows = weight.shape[0]
        _check_weight(weight, type_name, num_rows, in_features)
        if dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"dequantize_rows writes float32, float16 or bfloat16, not {dtype}")
        ids = self._row_ids(row_ids, num_rows, weight.device)
        out = torch.empty(ids.numel(), in_features, dtype=dtype, device=weight.device)
        if ids.numel() == 0:
            return out
        num_blocks = in_features // geometry.weights
        block_b = max(1, 256 // geometry.lanes)
        grid = (ids.numel(), triton.cdiv(num_blocks, block_b))
        launch = dict(TYPE=geometry.type_id, QK=geometry.weights, BLOCK_BYTES=geometry.bytes, P=geometry.planes,
                      L=geometry.lanes, BLOCK_B=block_b, num_warps=4)
        if not _interpreting():  # round each product and sum on its own, as gguf does
            launch["enable_fp_fusion"] = False
        _dequantize_kernel[grid](*_views(weight), ids, out, num_rows, num_blocks, weight.shape[1], in_features,
                                 **launch)
        return out

    @staticmethod
    def _row_ids(row_ids: torch.Tensor | np.ndarray, num_rows: int, device: torch.device) -> torch.Tensor:
        ids = torch.as_tensor(row_ids).reshape(-1)
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"row_ids must be integers, not {ids.dtype}")
        if ids.device.type == "cpu":
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
                bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                raise IndexError(f"row id {bad} is outside this weight's {num_rows} rows (0 .. {num_rows - 1})")
            ids = ids.to(device)
        return ids.to(torch.int64).contiguous()
