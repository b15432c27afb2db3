"""Triton kernels for 8-bit weights, the CUDA path of pagellm/ops/w8a8_kernels.py (tested on CPU tensors under
TRITON_INTERPRET=1, fp32 and fp16 activations; the interpreter mishandles bf16).

- int8 W8A8: `quantize_rows_kernel` quantizes each row of x to int8 as the CPU kernels do (dynamic max|x| / 127
  or a static scale, rounded to nearest even, clamped to [-127, 127], NaN scale for a non-finite row), then
  `int8_gemm_kernel` sums int8 x int8 products in int32 with tl.dot and applies acc * (s_x * s_w) + bias in
  float32: the same int32 sums as the CPU kernels and the torch reference.
- fp8 weights: `fp8_gemm_kernel` widens each weight tile to the activations' dtype inside the GEMM (fp8 e4m3
  bits moved into float16's fields with integer ops: exact, and not dependent on the GPU having fp8 types),
  multiplies with tl.dot, and scales each output column per K block (once at the end for per-channel scales).

Divisions use div_rn and float32 dots ask for IEEE precision, so that results do not depend on the GPU's fast
approximations (TF32 would break agreement with the float32 reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.ops.w8a8_kernels import hadamard_rows

# The float16 bits of an fp8 e4m3 byte sign-extended to 16 bits and shifted left by 7 (see csrc/w8a8.c): the
# mask 0xBF80 clears the sign's copy at bit 14; as an int16 it is -16512.
_FP16_FIELDS = tl.constexpr(-16512)  # a kernel reads only constexpr globals on a GPU


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, static_scale, STATIC: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """One program per row: q[row, :K] int8 and scale[row] float32."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    bad = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offsets < K
        x = tl.load(x_ptr + row * stride_x + k0 + offsets, mask=mask, other=0.0).to(tl.float32)
        magnitude = tl.abs(x)
        finite = magnitude < float("inf")  # False for inf and NaN
        bad += tl.where(finite, 0, 1)
        amax = tl.maximum(amax, tl.where(finite, magnitude, 0.0))
    largest = tl.max(amax, axis=0)
    non_finite = tl.sum(bad, axis=0) > 0
    if STATIC:
        scale = static_scale + 0.0 * largest
        inverse = tl.math.div_rn(1.0, scale)
    else:
        scale = tl.math.div_rn(largest, 127.0)
        inverse = tl.where(largest != 0.0, tl.math.div_rn(127.0, tl.where(largest != 0.0, largest, 1.0)), 0.0)
    inverse = tl.where(non_finite, 0.0, inverse)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offsets < K
        x = tl.load(x_ptr + row * stride_x + k0 + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.where(non_finite, 0.0, x * inverse)
        v = tl.minimum(tl.maximum(v, -127.0), 127.0)
        v = (v + 12582912.0) - 12582912.0  # to nearest even: |v| <= 127 < 2^22
        tl.store(q_ptr + row * stride_q + k0 + offsets, v.to(tl.int8), mask=mask)
    tl.store(scale_ptr + row, tl.where(non_finite, float("nan"), scale))


@triton.jit
def int8_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, M, N, K, stride_a, stride_b,
                     stride_c, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """c [M, N] = (a [M, K] int8 . b [N, K] int8^T in int32) * (a_scale[m] * b_scale[n]) + bias[n]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + ks < K
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_a + (k0 + ks)[None, :],
                    mask=(rows[:, None] < M) & k_mask[None, :], other=0)
        b = tl.load(b_ptr + cols[None, :].to(tl.int64) * stride_b + (k0 + ks)[:, None],
                    mask=(cols[None, :] < N) & k_mask[:, None], other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
    a_scale = tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
    b_scale = tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)
    y = acc.to(tl.float32) * (a_scale[:, None] * b_scale[None, :])
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_c + cols[None, :], y.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_gemm_kernel(a_ptr, b_ptr, scale_ptr, bias_ptr, c_ptr, M, N, K, block_k, stride_a, stride_b, stride_s,
                    stride_c, HAS_BIAS: tl.constexpr, ONE_BLOCK: tl.constexpr, IEEE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c [M, N] = a [M, K] . (b [N, K] fp8 bytes, widened) ^T with scale[n, k // block_k] (times 256, which the
    widening divides out) per column and K block; BLOCK_K divides block_k unless ONE_BLOCK."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + ks < K
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_a + (k0 + ks)[None, :],
                    mask=(rows[:, None] < M) & k_mask[None, :], other=0.0)
        raw = tl.load(b_ptr + cols[None, :].to(tl.int64) * stride_b + (k0 + ks)[:, None],
                      mask=(cols[None, :] < N) & k_mask[:, None], other=0)
        fields = (raw.to(tl.int8, bitcast=True).to(tl.int16) << 7) & _FP16_FIELDS
        b = fields.to(tl.float16, bitcast=True).to(a.dtype)
        if IEEE:
            part = tl.dot(a, b, input_precision="ieee")
        else:
            part = tl.dot(a, b)
        if ONE_BLOCK:
            acc += part
        else:
            scale = tl.load(scale_ptr + cols.to(tl.int64) * stride_s + k0 // block_k, mask=cols < N, other=0.0)
            acc += part * scale[None, :]
    if ONE_BLOCK:
        acc = acc * tl.load(scale_ptr + cols.to(tl.int64) * stride_s, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_c + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


# Tile sizes: tl.dot needs 16 or more along each dimension.
BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features in its last dimension; this weight takes {in_features}")
    return x.reshape(-1, in_features).contiguous()


def quantize_rows(x: torch.Tensor, static_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [rows, K], scale float32 [rows]), as w8a8_kernels.quantize_rows_int8 computes them."""
    rows = _rows(x, x.shape[-1])
    count, in_features = rows.shape
    q = torch.empty(count, in_features, dtype=torch.int8, device=x.device)
    scale = torch.empty(count, dtype=torch.float32, device=x.device)
    if count:
        block = min(1024, triton.next_power_of_2(in_features))
        quantize_rows_kernel[(count,)](rows, q, scale, in_features, rows.stride(0), q.stride(0),
                                       1.0 if static_scale is None else float(static_scale),
                                       STATIC=static_scale is not None, BLOCK_K=block)
    return q, scale


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: float | None,
                bias: torch.Tensor | None, rotation: int = 1) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for int8 W [N, K] with per-channel scales, x quantized to int8 per row (rotated
    first by w8a8_kernels.hadamard_rows in float32 where `rotation` > 1: a rotated weight's)."""
    out_features, in_features = weight.shape
    rows = _rows(x, in_features)
    if rotation > 1:
        rows = hadamard_rows(rows.float(), rotation)
    q, x_scale = quantize_rows(rows, input_scale)
    y = torch.empty(q.shape[0], out_features, dtype=x.dtype, device=x.device)
    if q.shape[0]:
        grid = (triton.cdiv(q.shape[0], BLOCK_M), triton.cdiv(out_features, BLOCK_N))
        int8_gemm_kernel[grid](q, x_scale, weight, weight_scale, bias if bias is not None else x_scale, y,
                               q.shape[0], out_features, in_features, q.stride(0), weight.stride(0), y.stride(0),
                               HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y.view(*x.shape[:-1], out_features)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_k: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for float8_e4m3fn W [N, K] with scales [N, ceil(K / block_k)]."""
    out_features, in_features = weight.shape
    rows = _rows(x, in_features)
    one_block = block_k >= in_features
    tile_k = BLOCK_K if one_block else next((b for b in (64, 32, 16) if block_k % b == 0), None)
    if tile_k is None:
        raise ValueError(f"the Triton fp8 kernel takes K blocks of a multiple of 16, not {block_k}")
    # fp32 activations multiply in fp32 (IEEE); half ones in their own dtype, which holds every fp8 value exactly.
    operand = rows if rows.dtype in (torch.float32, torch.float16, torch.bfloat16) else rows.float()
    y = torch.empty(rows.shape[0], out_features, dtype=x.dtype, device=x.device)
    scaled = (scales.float() * 256).contiguous()
    if rows.shape[0]:
        grid = (triton.cdiv(rows.shape[0], BLOCK_M), triton.cdiv(out_features, BLOCK_N))
        fp8_gemm_kernel[grid](operand, weight.view(torch.uint8), scaled, bias if bias is not None else scaled, y,
                              rows.shape[0], out_features, in_features, block_k, operand.stride(0), weight.stride(0),
                              scaled.stride(0), y.stride(0), HAS_BIAS=bias is not None, ONE_BLOCK=one_block,
                              IEEE=operand.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=tile_k)
    return y.view(*x.shape[:-1], out_features)
