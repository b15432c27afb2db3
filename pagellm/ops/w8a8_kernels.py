"""Linear layers on 8-bit weights: int8 W8A8 and FP8 (e4m3) weights, and the one place that picks their kernel
for a device.

int8 W8A8 (compressed-tensors' int8 schemes, quantization="int8"): weights int8 with a float32 scale per output
channel; activations quantized to int8 per row as each product runs (dynamically, s = max|x| / 127, or with the
checkpoint's static input_scale), rounded to nearest even and clamped to [-127, 127]; integer products summed
exactly in int32, then y = acc * (s_x * s_w) + bias in float32. On the CPU: csrc/w8a8.c (AVX2 VPMADDUBSW, VNNI
VPDPBUSD where the CPU has it, AMX's TDPBSSD tiles from INT8_AMX_MIN_ROWS rows where it has amx_int8, generic
C); on CUDA: Triton (ops/w8a8_triton.py); elsewhere, or without a
compiler, the torch reference below. Every path sums the same int32 values, so they agree to the float32
epilogue (the C kernel and the torch reference bit for bit).

quantization="int8" quantizes a float checkpoint's weights rotated (`quantize_int8_rotated`): each block of
`rotation` input features (up to ONLINE_INT8_ROTATION) times a Hadamard matrix, which the products undo by rotating
each row of x the same way before quantizing it (`hadamard_rows`, csrc/w8a8.c's hadamard_row): x W^T = (x H)(W H)^T
/ rotation. A per-row int8 scale set by one input channel far larger than the rest (this model family's outlier
channels) flattens the others to a few steps; rotated, that channel is spread over its block. The weights' scales
are fitted per output channel (`quantize_rows_int8_fitted`). README, "What the 8-bit schemes cost by themselves".

FP8 (compressed-tensors float-quantized, quant_method "fp8", quantization="fp8"): weights float8_e4m3fn with a
scale per output channel and block of K (per-tensor scales are expanded per channel, exactly; block-wise scales
of [bn, bk] per column and K block). No CPU has fp8 arithmetic: the C kernel widens each group of 8 weights to
float32 (exactly) and multiplies with float32 FMAs, activations kept as they are (weight-only, as vLLM runs FP8
checkpoints on GPUs without fp8 products). From `fp8_dense_min_rows` rows of x on (`fp8_bf16_dense_min_rows` for
bfloat16 rows), tiles of the weight are dequantized instead and a GEMM runs on them (faster once the widening is
shared by enough rows): linear_bf16's for bfloat16 rows where the CPU has avx512_bf16 (the tiles dequantized into
its packed layout), torch's otherwise. On CUDA, Triton dequantizes weight tiles inside its GEMM.

Where the C library cannot be built (no compiler, PAGELLM_NATIVE_KERNELS=0), TorchInt8Linear / TorchFp8Linear
run the same arithmetic in torch (the int8 sums in float64, exact), which is also what the kernels are tested
against.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import pathlib
import subprocess
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagellm.cpu_features import cpu_has_native
from pagellm.ops import cpu_build
from pagellm.ops import gguf_kernels
from pagellm.ops.linear_bf16 import (BF16TilesStruct, LinearBF16, linear_bf16, run_tiles_product,
                                     tiles_product_function)
from pagellm.ops.scratch import thread_scratch
from pagellm.worker.huge_pages import to_weight_memory

logger = logging.getLogger(__name__)

_CSRC = pathlib.Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "w8a8.c"]
_HEADERS = [_CSRC / "gguf_simd.h", _CSRC / "isa_name.h", _CSRC / "bf16_tiles.h", cpu_build.AMX_HEADER]
_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float

# Output columns per packed fp8 panel and int8 strip, and int8 inputs per dot group (csrc/w8a8.c's layouts).
PANEL = 8
STRIP = 16
GROUP = 4
# The int32 sums of the VNNI build bound K (K * 255 * 128 < 2^31).
MAX_IN_FEATURES = 65536
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
# Rows of x from which the fp8 product dequantizes weight tiles into torch's GEMM instead of widening each
# weight inside the fused kernel: the widening costs about as much as the product itself, and the dense path
# pays it once per call instead of once per 4 rows. Where the two met in benchmarks/w8a8_kernels.py (README,
# "8-bit weights"); the AVX-512 build runs the AVX2 code and takes its value until measured there.
FP8_DENSE_MIN_ROWS = {"avx512": 96, "avx2": 96, "generic": 8}
# bfloat16 rows where the CPU multiplies the dense path's dequantized tiles on linear_bf16 (avx512_bf16): the two
# paths met at 12-16 rows on an Emerald Rapids Xeon's AMX tiles (README, "An Emerald Rapids Xeon"), where 64-row
# decode steps on the fused kernel ran at a quarter of the dense path's rate, and at 12 rows on a Zen 4's vector
# products (1.17x the fused kernel's rate at 16 rows, 1.66x at 32; README, "Quantized weights").
FP8_BF16_DENSE_MIN_ROWS = 16
# Rows of x from which the int8 product runs on AMX tiles where the CPU has amx_int8 (the same int32 sums as the
# vector paths); where the two met on SmolLM2's shapes (README, "On a CPU with AMX").
INT8_AMX_MIN_ROWS = 8
# Weight bytes dequantized per tile of the dense path (the only dequantized copy that exists at a time).
DENSE_TILE_BYTES = 4 << 20
# The largest Hadamard block quantization="int8" rotates inputs by (the largest power of two dividing K, up to
# this): blocks of 64 measured better than 512 (README, "What the 8-bit schemes cost by themselves"), and a
# block's rotation costs each row log2(block) passes of additions.
ONLINE_INT8_ROTATION = 64
# The clipped ranges quantize_rows_int8_fitted tries per output channel: max|w| times each ratio (ratio 1, the
# unclipped range, among them: a fitted channel is never further from its weights than quantize_rows_int8's).
WEIGHT_CLIP_RATIOS = tuple(1 - 0.03 * i for i in range(8))
# Weight elements the fitted quantizer works on at a time (its float temporaries are a few times this).
FIT_CHUNK_ELEMENTS = 1 << 22


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check_in_features(in_features: int) -> None:
    if not 0 < in_features <= MAX_IN_FEATURES:
        raise ValueError(f"an 8-bit linear layer takes 1 .. {MAX_IN_FEATURES} input features, not {in_features} "
                         "(the int32 sums of the int8 products would overflow past it)")


# ---- quantizers (torch): the load-time quantizers, and the reference the kernels are tested against ----------


def rotation_block(in_features: int, largest: int = ONLINE_INT8_ROTATION) -> int:
    """The Hadamard block quantization="int8" rotates `in_features` inputs by: the largest power of two dividing
    it, up to `largest` (1: no rotation)."""
    block = 1
    while in_features % (2 * block) == 0 and 2 * block <= largest:
        block *= 2
    return block


def hadamard_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] times the block-diagonal Hadamard matrix of blocks of `block` inputs (Sylvester's, entries +-1,
    unnormalized: H H^T = block * I), in x's dtype, by butterfly stages of distance 1, 2, 4, ... (a, b) -> (a + b,
    a - b): csrc/w8a8.c's hadamard_row in the same order, so that float32 rows agree bit for bit."""
    if block <= 1:
        return x
    if x.shape[-1] % block or block & (block - 1):
        raise ValueError(f"a Hadamard rotation takes blocks of a power of two dividing the {x.shape[-1]} features, "
                         f"not {block}")
    rows = x.reshape(-1, x.shape[-1])
    distance = 1
    while distance < block:
        pairs = rows.view(rows.shape[0], -1, 2, distance)
        low, high = pairs[:, :, 0], pairs[:, :, 1]
        rows = torch.stack((low + high, low - high), dim=2).view(rows.shape)
        distance *= 2
    return rows.view(x.shape)


def quantize_rows_int8(x: torch.Tensor, static_scale: float | None = None,
                       rotation: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q int8 [rows, K], scale float32 [rows]) as the kernels quantize activations: per row
    s = max|x| / 127 and q = x * (127 / max|x|), or with a static scale s, q = x * (1 / s); rounded to nearest
    even and clamped to [-127, 127]. A row holding a NaN or an infinity gets s = NaN and q = 0. With `rotation`
    > 1 each row is rotated first (hadamard_rows in float32). Per-channel weights are quantized the same way (a row
    of W is an output channel)."""
    rows = hadamard_rows(x.reshape(-1, x.shape[-1]).float(), rotation)
    finite = torch.isfinite(rows).all(dim=1)
    # Divisions in float64, rounded once to float32: torch's float32 division by a scalar multiplies by its
    # rounded reciprocal, which is not the correctly rounded quotient the kernels compute.
    if static_scale is None:
        amax = rows.abs().amax(dim=1).double()
        scale = (amax / 127).float()
        inverse = torch.where(amax != 0, 127 / amax, torch.zeros_like(amax)).float()
    else:
        scale = torch.full((rows.shape[0],), static_scale, dtype=torch.float32, device=rows.device)
        inverse = (1 / scale.double()).float()
    q = (rows * inverse[:, None]).clamp(-127, 127).round()
    q = torch.where(finite[:, None], q, torch.zeros_like(q)).to(torch.int8)
    return q, torch.where(finite, scale, torch.full_like(scale, float("nan")))


def quantize_rows_int8_fitted(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int8 [N, K], scale float32 [N]): per output channel the scale max|w| * ratio / 127,
    ratio among WEIGHT_CLIP_RATIOS, whose rounding (values past the clipped range saturating at +-127) lies
    nearest the channel's weights in squared error. An all-zero channel gets scale 0, one holding a NaN or an
    infinity scale NaN and q 0 (as quantize_rows_int8). The search runs in C where the kernels are built (a
    load's cost: every weight rounded once per ratio), in torch elsewhere."""
    out_features, in_features = weight.shape
    kernels = w8a8_kernels() if weight.device.type == "cpu" else None
    q = torch.empty(out_features, in_features, dtype=torch.int8, device=weight.device)
    scale = torch.empty(out_features, dtype=torch.float32, device=weight.device)
    step = max(1, FIT_CHUNK_ELEMENTS // max(in_features, 1))
    for first in range(0, out_features, step):
        rows = weight[first:first + step].float()
        chosen = kernels.fit_int8_scales(rows) if kernels is not None else fitted_scales(rows)
        q[first:first + step] = _round_to_scales(rows, chosen)
        scale[first:first + step] = chosen
    return q, scale


def fitted_scales(rows: torch.Tensor) -> torch.Tensor:
    """quantize_rows_int8_fitted's scales [N] for float32 rows [N, K], searched in torch."""
    finite = torch.isfinite(rows).all(dim=1)
    amax = torch.where(finite, rows.abs().amax(dim=1), torch.zeros_like(rows[:, 0]))
    best_scale = best_error = None
    for ratio in WEIGHT_CLIP_RATIOS:
        scale = amax * ratio / 127
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        error = (rows / divisor).round_().clamp_(-127, 127).mul_(divisor).sub_(rows).square_().sum(dim=1)
        if best_scale is None:
            best_scale, best_error = scale, error
        else:
            best_scale = torch.where(error < best_error, scale, best_scale)
            best_error = torch.minimum(error, best_error)
    return torch.where(finite, best_scale, torch.full_like(best_scale, float("nan")))


def _round_to_scales(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """rows [N, K] rounded to int8 steps of scale [N] (0 where a scale is 0 or NaN)."""
    usable = scale > 0
    divisor = torch.where(usable, scale, torch.ones_like(scale))[:, None]
    q = (rows / divisor).round_().clamp_(-127, 127)
    return torch.where(usable[:, None], q, torch.zeros_like(q)).to(torch.int8)


def quantize_int8_rotated(weight: torch.Tensor,
                          largest: int = ONLINE_INT8_ROTATION) -> tuple[torch.Tensor, torch.Tensor, int]:
    """quantization="int8"'s weights: (q int8 [N, K], scale float32 [N], rotation) for a float weight [N, K],
    rotated by blocks of `rotation` inputs (rotation_block) and divided by the block (so that (x H) (W H / b)^T
    = x W^T), then quantized per channel with fitted scales."""
    rotation = rotation_block(weight.shape[1], largest)
    if rotation == 1:
        return (*quantize_rows_int8_fitted(weight), 1)
    # As a GEMM on [rows * blocks, rotation] (a few times faster than hadamard_rows' stages; the weights need no
    # bit-exact agreement with the kernels, only the activations do).
    hadamard = hadamard_rows(torch.eye(rotation), rotation) / rotation
    rotated = (weight.float().reshape(-1, rotation) @ hadamard).view(weight.shape)
    q, scale = quantize_rows_int8_fitted(rotated)
    return q, scale, rotation


def quantize_fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale []) with scale = max|w| / 448 (vLLM's dynamic per-tensor fp8)."""
    w = weight.float()
    amax = w.abs().amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_fp8_blocks(weight: torch.Tensor, block_n: int, block_k: int,
                        power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight [N, K], float32 scales [N, ceil(K / block_k)]: one per output column and K block, the
    same down each block of `block_n` outputs) for a float weight [N, K], with each block's scale max|w| / 448
    over its weights (the last blocks of a dimension may be partial), or with `power_of_two` the least power of
    two that keeps the block's largest weight within 448 (an MX scale, E8M0: nothing saturates)."""
    w = weight.float()
    out_features, in_features = w.shape
    n_blocks, k_blocks = -(-out_features // block_n), -(-in_features // block_k)
    padded = w.new_zeros(n_blocks * block_n, k_blocks * block_k)
    padded[:out_features, :in_features] = w
    amax = padded.abs().view(n_blocks, block_n, k_blocks, block_k).amax(dim=(1, 3))
    if power_of_two:
        mantissa, exponent = torch.frexp(amax / FP8_MAX)  # amax / 448 = m 2^e, m in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(amax), exponent - (mantissa == 0.5).to(exponent.dtype))
    else:
        scale = amax / FP8_MAX
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    scales = expand_block_scales(scale, out_features, block_n)
    q = w / scales.repeat_interleave(block_k, dim=1)[:, :in_features]
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def check_fp8_finite(weight: torch.Tensor, name: str) -> None:
    """Refuses a float8_e4m3fn weight holding NaN codes (0x7F, 0xFF): no quantizer writes them, and the CPU
    kernel's widening, which skips the test per weight, would read them as +-480."""
    if ((weight.view(torch.uint8) & 0x7F) == 0x7F).any():
        raise ValueError(f"checkpoint weight {name!r} holds float8_e4m3fn NaN values; a quantized weight never "
                         "does, so the checkpoint is damaged: re-export it")


def expand_block_scales(scales: torch.Tensor, out_features: int, block_n: int) -> torch.Tensor:
    """A [ceil(N / bn), blocks of K] grid of block scales as [N, blocks of K] (one row per output column)."""
    return scales.repeat_interleave(block_n, dim=0)[:out_features].contiguous()


def int8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          input_scale: float | None, bias: torch.Tensor | None, rotation: int = 1) -> torch.Tensor:
    """y in x's dtype: the int8 sums computed exactly (float64 holds them), then the kernels' float32 epilogue;
    x's rows rotated first where `rotation` > 1 (the weight is a rotated one, quantize_int8_rotated's)."""
    q, x_scale = quantize_rows_int8(x, input_scale, rotation)
    sums = q.double() @ weight.double().t()
    y = sums.float() * (x_scale[:, None] * weight_scale.float()[None, :])
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def dequantize_fp8(weight: torch.Tensor, scales: torch.Tensor, block_k: int) -> torch.Tensor:
    """float8_e4m3fn [N, K] times scales [N, blocks of K] -> float32 [N, K]."""
    in_features = weight.shape[1]
    return weight.float() * scales.float().repeat_interleave(block_k, dim=1)[:, :in_features]


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_k: int,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """y in x's dtype, from the dequantized weight in float32."""
    y = F.linear(x.float(), dequantize_fp8(weight, scales, block_k), bias.float() if bias is not None else None)
    return y.to(x.dtype)


# ---- packed layouts ------------------------------------------------------------------------------------------


@dataclass
class PackedInt8:
    """An int8 weight as csrc/w8a8.c reads it: strips of 16 outputs by groups of 4 inputs (N and K padded with
    zero weights), the column sums the VNNI build subtracts, and the per-channel scales (zero past N); `rotation`
    > 1 for a rotated weight (quantize_int8_rotated), whose products rotate x's rows likewise."""

    packed: torch.Tensor  # int8 [Np / 16, Kp / 4, 16, 4]
    colsum: torch.Tensor  # int32 [Np]
    scale: torch.Tensor  # float32 [Np]
    in_features: int
    out_features: int
    rotation: int = 1

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.colsum, self.scale]


def pack_int8(weight: torch.Tensor, scale: torch.Tensor, rotation: int = 1) -> PackedInt8:
    """weight int8 [N, K], scale float32 [N] -> PackedInt8."""
    out_features, in_features = weight.shape
    _check_in_features(in_features)
    if weight.dtype != torch.int8 or scale.shape != (out_features,):
        raise ValueError(f"pack_int8 takes an int8 [N, K] weight and a [N] scale, not {weight.dtype} "
                         f"{tuple(weight.shape)} and {tuple(scale.shape)}")
    n_pad, k_pad = _round_up(out_features, STRIP), _round_up(in_features, GROUP)
    padded = torch.zeros(n_pad, k_pad, dtype=torch.int8)
    padded[:out_features, :in_features] = weight
    # In the load's huge-page arena where there is one (a checkpoint's int8 weights, packed once loaded, and online
    # quantization's, packed as the checkpoint loads): a decode step streams the packed weight once, and torch's 4 KiB
    # pages stop the hardware prefetcher at every page of a small layer.
    packed = to_weight_memory(padded.view(n_pad // STRIP, STRIP, k_pad // GROUP, GROUP).permute(0, 2, 1, 3))
    colsum = padded.sum(dim=1, dtype=torch.int32)
    scales = torch.zeros(n_pad, dtype=torch.float32)
    scales[:out_features] = scale.float()
    return PackedInt8(packed, colsum, scales, in_features, out_features, rotation)


@dataclass
class PackedFp8:
    """An fp8 weight as csrc/w8a8.c reads it: panels of 8 outputs with each input's 8 bytes adjacent, and the
    scales per K block and output column (times 256, which the kernel's widening divides out)."""

    packed: torch.Tensor  # uint8 [Np / 8, K, 8]
    scales: torch.Tensor  # float32 [blocks of K, Np]
    block_k: int
    in_features: int
    out_features: int
    # Per kernels' library (its id): the weight as w8a8_fp8_tiles_product reads it (W8A8Kernels._tiles_layer).
    tiles_layers: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def padded_out_features(self) -> int:
        return self.scales.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales]


def pack_fp8(weight: torch.Tensor, scales: torch.Tensor, block_k: int) -> PackedFp8:
    """weight float8_e4m3fn [N, K], scales float32 [N, ceil(K / block_k)] -> PackedFp8."""
    out_features, in_features = weight.shape
    blocks = -(-in_features // block_k)
    if weight.dtype != torch.float8_e4m3fn or scales.shape != (out_features, blocks):
        raise ValueError(f"pack_fp8 takes a float8_e4m3fn [N, K] weight and [N, {blocks}] scales for blocks of "
                         f"{block_k}, not {weight.dtype} {tuple(weight.shape)} and {tuple(scales.shape)}")
    n_pad = _round_up(out_features, PANEL)
    padded = torch.zeros(n_pad, in_features, dtype=torch.uint8)
    padded[:out_features] = weight.view(torch.uint8)
    # In the load's huge-page arena where there is one, as pack_int8's.
    packed = to_weight_memory(padded.view(n_pad // PANEL, PANEL, in_features).permute(0, 2, 1))
    grid = torch.zeros(blocks, n_pad, dtype=torch.float32)
    grid[:, :out_features] = scales.float().t() * 256
    return PackedFp8(packed, grid, block_k, in_features, out_features)


# ---- the C kernels -------------------------------------------------------------------------------------------


def _rows_of(x: torch.Tensor, in_features: int) -> torch.Tensor:
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features in its last dimension; this weight takes {in_features}")
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, in_features).contiguous()


def _check_bias(bias: torch.Tensor | None, dtype: torch.dtype, out_features: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.shape != (out_features,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; this layer has {out_features} outputs")
    return bias.to(dtype).contiguous()


class W8A8Kernels:
    """csrc/w8a8.c with its argument types declared. Activations float32 or bfloat16 (others are computed from
    float32 and returned in their dtype); outputs in x's dtype."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.isa = cpu_build.library_isa(library)
        self.library = library  # for the decode stack's product pointer (pagellm/ops/decode_stack.py)
        library.w8a8_dot_instructions.restype = ctypes.c_char_p
        self.dot_instructions = library.w8a8_dot_instructions().decode()
        self._int8 = library.w8a8_int8_linear
        self._int8.restype = _INT
        self._int8.argtypes = [_PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _INT, _F32, _I64, _PTR,
                               _PTR, _I64]
        self.amx = bool(ctypes.c_int.in_dll(library, "pagellm_w8a8_amx_available").value and library.w8a8_amx_ready())
        self.amx_min_rows = INT8_AMX_MIN_ROWS if self.amx else cpu_build.NEVER_ROWS
        self._quantize = library.w8a8_quantize_rows
        self._quantize.restype = _INT
        self._quantize.argtypes = [_PTR, _INT, _I64, _I64, _F32, _I64, _PTR, _PTR]
        self._fit = library.w8a8_fit_int8_scales
        self._fit.restype = _INT
        self._fit.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR]
        self._fp8 = library.w8a8_fp8_linear
        self._fp8.restype = _INT
        self._fp8.argtypes = [_PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _INT]
        self._int8_experts = library.w8a8_int8_linear_experts
        self._int8_experts.restype = _INT
        self._int8_experts.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _INT, _I64, _I64, _PTR, _INT, _PTR, _PTR]
        library.w8a8_int8_experts_max_rows.restype = _I64
        self.int8_experts_max_rows = min(library.w8a8_int8_experts_max_rows(), self.amx_min_rows - 1)
        self._fp8_experts = library.w8a8_fp8_linear_experts
        self._fp8_experts.restype = _INT
        self._fp8_experts.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _INT, _I64, _I64, _PTR, _INT]
        self._dequantize = library.w8a8_fp8_dequantize
        self._dequantize.restype = _INT
        self._dequantize.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _INT]
        self._dequantize_packed = library.w8a8_fp8_dequantize_bf16_packed  # (tests read the tiles with it)
        self._dequantize_packed.restype = _INT
        self._dequantize_packed.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR]
        self._fp8_tiles = tiles_product_function(library, "w8a8_fp8_tiles_product")
        # bfloat16 dense products on linear_bf16 where this build's library has it (avx512_bf16; AMX's tiles too).
        self._linear_bf16 = linear_bf16(self.isa)
        self.fp8_dense_min_rows = FP8_DENSE_MIN_ROWS[self.isa]
        self.fp8_bf16_dense_min_rows = (FP8_BF16_DENSE_MIN_ROWS if self._linear_bf16 is not None
                                        else self.fp8_dense_min_rows)

    @staticmethod
    def _buffer(name: str, elements: int, dtype: torch.dtype) -> torch.Tensor:
        return thread_scratch("w8a8", name, elements, dtype)

    def quantize_rows(self, x: torch.Tensor, static_scale: float | None = None,
                      rotation: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [rows, K], scale float32 [rows]) as the int8 product quantizes x (equal to quantize_rows_int8)."""
        in_features = x.shape[-1]
        rows = _rows_of(x if x.dtype in ACTIVATION_DTYPES else x.float(), in_features)
        k_pad = _round_up(in_features, GROUP)
        q = torch.empty(rows.shape[0], k_pad, dtype=torch.int8)
        scale = torch.empty(rows.shape[0], dtype=torch.float32)
        if self._quantize(rows.data_ptr(), int(rows.dtype == torch.bfloat16), rows.shape[0], in_features,
                          _static(static_scale), rotation, q.data_ptr(), scale.data_ptr()):
            raise ValueError(f"w8a8_quantize_rows refused in_features={in_features}, rotation={rotation}")
        return q[:, :in_features], scale

    def fit_int8_scales(self, weight: torch.Tensor) -> torch.Tensor:
        """quantize_rows_int8_fitted's scales [N] for a weight [N, K], searched in C (the torch search's choice but
        where two clippings' errors tie to float rounding)."""
        rows = weight.float().contiguous()
        ratios = torch.tensor(WEIGHT_CLIP_RATIOS, dtype=torch.float32)
        scales = torch.empty(rows.shape[0], dtype=torch.float32)
        if self._fit(rows.data_ptr(), rows.shape[0], rows.shape[1], ratios.data_ptr(), len(ratios),
                     scales.data_ptr()):
            raise ValueError(f"w8a8_fit_int8_scales refused a weight of shape {tuple(rows.shape)}")
        return scales

    def int8_linear(self, x: torch.Tensor, weight: PackedInt8, bias: torch.Tensor | None,
                    static_scale: float | None = None) -> torch.Tensor:
        """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, activations quantized to int8 per row."""
        if x.dtype not in ACTIVATION_DTYPES:  # e.g. float16: computed from float32, returned in its dtype
            return self.int8_linear(x.float(), weight, bias, static_scale).to(x.dtype)
        rows = _rows_of(x, weight.in_features)
        count, in_features, out_features = rows.shape[0], weight.in_features, weight.out_features
        bias = _check_bias(bias, x.dtype, out_features)
        y = torch.empty(count, out_features, dtype=x.dtype)
        k_pad = _round_up(in_features, GROUP)
        xq = self._buffer("xq", count * k_pad, torch.int8)
        xs = self._buffer("xs", count, torch.float32)
        bf16 = int(x.dtype == torch.bfloat16)
        if self._int8(rows.data_ptr(), bf16, count, in_features, out_features, weight.packed.data_ptr(),
                      weight.colsum.data_ptr(), weight.scale.data_ptr(),
                      bias.data_ptr() if bias is not None else None, y.data_ptr(), bf16, _static(static_scale),
                      weight.rotation, xq.data_ptr(), xs.data_ptr(), self.amx_min_rows):
            raise ValueError(f"w8a8_int8_linear refused in_features={in_features}, out_features={out_features}, "
                             f"rotation={weight.rotation}")
        return y if rows is x else y.view(*x.shape[:-1], out_features)

    def fp8_linear(self, x: torch.Tensor, weight: PackedFp8, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype: the fused kernel below `fp8_dense_min_rows` rows
        (`fp8_bf16_dense_min_rows` for bfloat16 x), a GEMM on dequantized tiles from there."""
        min_rows = self.fp8_bf16_dense_min_rows if x.dtype == torch.bfloat16 else self.fp8_dense_min_rows
        if x.numel() >= min_rows * weight.in_features:
            return self.fp8_linear_dense(x, weight, bias)
        return self.fp8_linear_fused(x, weight, bias)

    def fp8_linear_fused(self, x: torch.Tensor, weight: PackedFp8, bias: torch.Tensor | None) -> torch.Tensor:
        """`fp8_linear` on the fused kernel whatever the row count."""
        if x.dtype not in ACTIVATION_DTYPES:
            return self.fp8_linear_fused(x.float(), weight, bias).to(x.dtype)
        rows = _rows_of(x, weight.in_features)
        bias = _check_bias(bias, x.dtype, weight.out_features)
        y = torch.empty(rows.shape[0], weight.out_features, dtype=x.dtype)
        bf16 = int(x.dtype == torch.bfloat16)
        if self._fp8(rows.data_ptr(), bf16, rows.shape[0], weight.in_features, weight.out_features,
                     weight.packed.data_ptr(), weight.scales.data_ptr(), weight.block_k,
                     bias.data_ptr() if bias is not None else None, y.data_ptr(), bf16):
            raise ValueError(f"w8a8_fp8_linear refused in_features={weight.in_features}, "
                             f"out_features={weight.out_features}, block_k={weight.block_k}")
        return y if rows is x else y.view(*x.shape[:-1], weight.out_features)

    def fp8_linear_dense(self, x: torch.Tensor, weight: PackedFp8, bias: torch.Tensor | None) -> torch.Tensor:
        """`fp8_linear` as a GEMM on tiles of W^T dequantized in turn (DENSE_TILE_BYTES each), in bfloat16 where x
        is bfloat16 and the CPU multiplies it natively (on linear_bf16 where the CPU has avx512_bf16), else float32
        on torch's."""
        rows = _rows_of(x, weight.in_features)
        gemm_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 and cpu_has_native(torch.bfloat16) else torch.float32
        operand = rows.to(gemm_dtype)
        in_features, out_features = weight.in_features, weight.out_features
        if gemm_dtype == torch.bfloat16 and self._linear_bf16 is not None and in_features % 2 == 0:
            y = self._fp8_dense_on_linear_bf16(operand, weight)
        else:
            y = self._fp8_dense_on_torch(operand, weight)
        if bias is not None:
            y += _check_bias(bias, gemm_dtype, out_features)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y.view(*x.shape[:-1], out_features)

    def fp8_stack_tiles_take(self, weight: PackedFp8) -> bool:
        """Whether the decode stack's product can run this weight's bfloat16 rows on linear_bf16 as
        `fp8_linear_dense` runs them: linear_bf16 here, an even in_features, whole 16-column blocks, no padding."""
        return (self._linear_bf16 is not None and cpu_has_native(torch.bfloat16) and weight.in_features % 2 == 0
                and weight.out_features % LinearBF16.PANEL == 0 and weight.padded_out_features == weight.out_features)

    def _fp8_dense_on_linear_bf16(self, rows: torch.Tensor, weight: PackedFp8) -> torch.Tensor:
        """bfloat16 rows @ W^T on linear_bf16, the weight dequantized DENSE_TILE_BYTES at a time into its packed
        layout (faster than torch's GEMM on plain dequantized tiles up to 1,024 rows, README "An Emerald Rapids
        Xeon"), all in one C call (w8a8_fp8_tiles_product). Whole 16-column blocks only; the last < 16 columns go to
        torch's GEMM."""
        in_features, out_features = weight.in_features, weight.out_features
        whole = out_features // LinearBF16.PANEL * LinearBF16.PANEL
        y = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
        if whole:
            run_tiles_product(self._fp8_tiles, self._tiles_layer(weight), rows, in_features, whole, y,
                              f"in_features={in_features}, columns={whole}")
        if whole < out_features:
            y[:, whole:] = self._fp8_dense_on_torch(rows, weight, whole // PANEL)
        return y

    def _tiles_layer(self, weight: PackedFp8) -> Fp8StackLayer:
        """`weight` with this library's tiles, made once (the C call reads it by address)."""
        layer = weight.tiles_layers.get(id(self.library))
        if layer is None:
            layer = weight.tiles_layers[id(self.library)] = Fp8StackLayer.on_tiles(self, weight)
        return layer

    def _fp8_dense_on_torch(self, operand: torch.Tensor, weight: PackedFp8, first_panel: int = 0) -> torch.Tensor:
        """operand @ W^T over output columns from 8 * first_panel on, torch's GEMM on tiles of W^T dequantized in
        turn into operand's dtype."""
        gemm_dtype = operand.dtype
        in_features, out_features = weight.in_features, weight.out_features
        all_panels = weight.padded_out_features // PANEL
        y = torch.empty(operand.shape[0], out_features - first_panel * PANEL, dtype=gemm_dtype)
        element = torch.finfo(gemm_dtype).bits // 8
        panels = max(1, min(all_panels - first_panel, DENSE_TILE_BYTES // (in_features * element * PANEL)))
        tile = self._buffer(f"tile-{gemm_dtype}", in_features * panels * PANEL, gemm_dtype)
        for first in range(first_panel, all_panels, panels):
            count = min(panels, all_panels - first)
            width = count * PANEL
            dense = tile[: in_features * width].view(in_features, width)
            if self._dequantize(weight.packed.data_ptr(), in_features, weight.padded_out_features,
                                weight.scales.data_ptr(), weight.block_k, first, count, dense.data_ptr(),
                                int(gemm_dtype == torch.bfloat16)):
                raise ValueError(f"w8a8_fp8_dequantize refused in_features={in_features}")
            start, stop = first * PANEL, min(out_features, (first + count) * PANEL)
            y[:, start - first_panel * PANEL:stop - first_panel * PANEL] = torch.mm(operand, dense[:, : stop - start])
        return y

    def fp8_dequantize(self, weight: PackedFp8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight times its scales, [N, K] in float32 or bfloat16 (for tests and inspection)."""
        width = weight.padded_out_features
        out = torch.empty(weight.in_features, width, dtype=dtype)
        if self._dequantize(weight.packed.data_ptr(), weight.in_features, width, weight.scales.data_ptr(),
                            weight.block_k, 0, width // PANEL, out.data_ptr(), int(dtype == torch.bfloat16)):
            raise ValueError(f"w8a8_fp8_dequantize refused in_features={weight.in_features}")
        return out[:, : weight.out_features].t().contiguous()


def _tile_blocks(weight: PackedFp8) -> int:
    """16-column blocks of an fp8 weight per bfloat16 tile for linear_bf16 (about DENSE_TILE_BYTES)."""
    blocks = weight.padded_out_features // LinearBF16.PANEL
    return max(1, min(blocks, DENSE_TILE_BYTES // (weight.in_features * 2 * LinearBF16.PANEL)))


def _static(scale: float | None) -> float:
    """The C kernels' static scale argument: 0 means dynamic per-row scales."""
    if scale is None:
        return 0.0
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"a static input scale must be a finite number > 0, not {scale}")
    return scale


@functools.cache
def _library(isa: str) -> ctypes.CDLL | None:
    try:
        path = cpu_build.build_library(f"pagellm_w8a8_{isa}", _SOURCES, _HEADERS, gguf_kernels.build_flags(isa))
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as error:
        detail = (getattr(error, "stderr", None) or str(error)).strip()
        logger.warning("8-bit CPU kernels unavailable (%s); int8/fp8 layers run on torch",
                       detail.splitlines()[0] if detail else type(error).__name__)
        return None


def w8a8_kernels(isa: str | None = None) -> W8A8Kernels | None:
    """The kernels built for `isa` (default: cpu_build.best_isa(), which honours PAGELLM_CPU_ISA), or None where
    there is no compiler or PAGELLM_NATIVE_KERNELS=0."""
    if os.environ.get("PAGELLM_NATIVE_KERNELS", "1") == "0":
        return None
    library = _library(isa or cpu_build.best_isa())
    return W8A8Kernels(library) if library is not None else None


# ---- one layer's product, on the kernel chosen for its device --------------------------------------------------


class Int8Linear:
    """x @ W^T + bias for one int8 weight (per-channel scales), activations quantized per row (rotated first
    for a rotated weight: `rotation` > 1, quantize_int8_rotated's)."""

    name = "torch"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, input_scale: float | None,
                 rotation: int = 1) -> None:
        _check_in_features(weight.shape[1])
        self.weight = weight
        self.scale = scale.float().contiguous()
        self.input_scale = input_scale
        self.rotation = rotation
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int8_linear_reference(x, self.weight, self.scale, self.input_scale, bias, self.rotation)

    def tensors(self) -> list[torch.Tensor]:
        """What the layer's weight is kept as (counted as weight memory)."""
        return [self.weight, self.scale]


class NativeInt8Linear(Int8Linear):
    name = "native"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, input_scale: float | None,
                 kernels: W8A8Kernels, rotation: int = 1) -> None:
        super().__init__(weight, scale, input_scale, rotation)
        self.kernels = kernels
        self.packed = pack_int8(weight, self.scale, rotation)
        self.name = f"native-{kernels.dot_instructions}"
        self.weight = None  # only the packed copy is kept

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.int8_linear(x, self.packed, bias, self.input_scale)

    def tensors(self) -> list[torch.Tensor]:
        return self.packed.tensors()


class TritonInt8Linear(Int8Linear):
    name = "triton"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from pagellm.ops import w8a8_triton

        return w8a8_triton.int8_linear(x, self.weight, self.scale, self.input_scale, bias, self.rotation)


class Fp8Linear:
    """x @ W^T + bias for one float8_e4m3fn weight with scales per output column and K block."""

    name = "torch"

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, block_k: int) -> None:
        self.weight = weight
        self.scales = scales.float().contiguous()
        self.block_k = block_k
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear_reference(x, self.weight, self.scales, self.block_k, bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scales]


class NativeFp8Linear(Fp8Linear):
    name = "native"

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, block_k: int, kernels: W8A8Kernels) -> None:
        super().__init__(weight, scales, block_k)
        self.kernels = kernels
        self.packed = pack_fp8(weight, self.scales, block_k)
        self.weight = None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.fp8_linear(x, self.packed, bias)

    def tensors(self) -> list[torch.Tensor]:
        return self.packed.tensors()


class Int8WeightStruct(ctypes.Structure):
    """csrc/w8a8.c's Int8Weight: one int8 weight's arguments, for the calls that take several layers' (the decode
    stack, the experts call)."""

    _fields_ = [("packed", _PTR), ("colsum", _PTR), ("wscale", _PTR), ("amx_min_rows", _I64),
                ("static_scale", _F32), ("rotation", _I64)]

    @classmethod
    def of(cls, linear: NativeInt8Linear) -> Int8WeightStruct:
        packed = linear.packed
        return cls(packed.packed.data_ptr(), packed.colsum.data_ptr(), packed.scale.data_ptr(),
                   linear.kernels.amx_min_rows, _static(linear.input_scale), packed.rotation)


class Fp8WeightStruct(ctypes.Structure):
    """csrc/w8a8.c's Fp8Weight: one fp8 weight's arguments, for the calls that take several layers' (the experts
    call, the decode stack)."""

    _fields_ = [("packed", _PTR), ("scales", _PTR), ("block_k", _I64)]

    @classmethod
    def of(cls, linear: NativeFp8Linear) -> Fp8WeightStruct:
        return cls.of_packed(linear.packed)

    @classmethod
    def of_packed(cls, weight: PackedFp8) -> Fp8WeightStruct:
        return cls(weight.packed.data_ptr(), weight.scales.data_ptr(), weight.block_k)


class Fp8StackLayer(ctypes.Structure):
    """csrc/w8a8.c's Fp8StackLayer: one fp8 layer as the decode stack's product (w8a8_fp8_stack_product) reads it,
    bfloat16 rows going to linear_bf16's tiles from the rows where `W8A8Kernels.fp8_linear` sends them there."""

    _fields_ = [("weight", Fp8WeightStruct), ("tiles", BF16TilesStruct), ("padded_columns", _I64)]

    @classmethod
    def of(cls, linear: NativeFp8Linear) -> Fp8StackLayer:
        kernels, weight = linear.kernels, linear.packed
        if not kernels.fp8_stack_tiles_take(weight):
            return cls(Fp8WeightStruct.of_packed(weight), BF16TilesStruct.of(None), weight.padded_out_features)
        return cls.on_tiles(kernels, weight)

    @classmethod
    def on_tiles(cls, kernels: W8A8Kernels, weight: PackedFp8) -> Fp8StackLayer:
        """The weight with its bfloat16 tiles (from the rows where `W8A8Kernels.fp8_linear` takes them)."""
        return cls(Fp8WeightStruct.of_packed(weight),
                   BF16TilesStruct.of(kernels._linear_bf16, kernels.fp8_bf16_dense_min_rows,
                                      _tile_blocks(weight) * LinearBF16.PANEL), weight.padded_out_features)


class _ExpertsProduct:
    """One projection of a mixture-of-experts layer's experts (the kernels of one shape) in one C call per step,
    each expert over its own rows (csrc/w8a8.c's experts calls): what calling each expert's kernel on its rows
    computes, bit for bit, with one call and one fork of the threads for all of them."""

    def __init__(self, linears: list, table: ctypes.Array) -> None:
        first = linears[0]
        if any((linear.in_features, linear.out_features) != (first.in_features, first.out_features)
               or linear.kernels.library is not first.kernels.library for linear in linears):
            raise ValueError("the experts of one projection differ in shape or kernels")
        self.linears = linears  # the table points into their packed tensors
        self.table = table
        self.kernels: W8A8Kernels = first.kernels
        self.in_features, self.out_features = first.in_features, first.out_features

    def _arguments(self, experts: list[int], sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> tuple:
        if (x.shape != (sum(sizes), self.in_features) or out.shape != (x.shape[0], self.out_features)
                or out.dtype is not x.dtype or not x.is_contiguous() or not out.is_contiguous()):
            raise ValueError(f"the experts' rows are {x.dtype} {tuple(x.shape)} and their outputs {out.dtype} "
                             f"{tuple(out.shape)}; this call takes contiguous [{sum(sizes)}, {self.in_features}] "
                             f"and [{sum(sizes)}, {self.out_features}] of one dtype")
        ids, counts = cpu_build.expert_arrays(experts, sizes)
        return (self.table, len(self.table), ids, counts, len(experts), x.data_ptr(), x.dtype is torch.bfloat16,
                self.in_features, self.out_features, out.data_ptr(), out.dtype is torch.bfloat16)


class ExpertsInt8Product(_ExpertsProduct):
    """_ExpertsProduct of int8 W8A8 experts (NativeInt8Linear), for steps whose experts each have fewer rows
    than the single call's wider tiles start at (`takes`)."""

    def __init__(self, linears: list[NativeInt8Linear]) -> None:
        super().__init__(linears, (Int8WeightStruct * len(linears))(*[Int8WeightStruct.of(linear)
                                                                       for linear in linears]))

    def takes(self, sizes: list[int], dtype: torch.dtype) -> bool:
        return dtype in ACTIVATION_DTYPES and max(sizes) <= self.kernels.int8_experts_max_rows

    def __call__(self, experts: list[int], sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> None:
        arguments = self._arguments(experts, sizes, x, out)
        rows = x.shape[0]
        xq = W8A8Kernels._buffer("xq", rows * _round_up(self.in_features, GROUP), torch.int8)
        xs = W8A8Kernels._buffer("xs", rows, torch.float32)
        failed = self.kernels._int8_experts(*arguments, xq.data_ptr(), xs.data_ptr())
        if failed:
            raise _experts_failure("w8a8_int8_linear_experts", failed, len(experts), rows, self)


class ExpertsFp8Product(_ExpertsProduct):
    """_ExpertsProduct of fp8 experts (NativeFp8Linear), for steps whose experts each have fewer rows than the
    dense path starts at (`takes`)."""

    def __init__(self, linears: list[NativeFp8Linear]) -> None:
        table = (Fp8WeightStruct * len(linears))(*[Fp8WeightStruct.of(linear) for linear in linears])
        super().__init__(linears, table)

    def takes(self, sizes: list[int], dtype: torch.dtype) -> bool:
        if dtype not in ACTIVATION_DTYPES:
            return False
        kernels = self.kernels
        min_rows = kernels.fp8_bf16_dense_min_rows if dtype is torch.bfloat16 else kernels.fp8_dense_min_rows
        return max(sizes) < min_rows

    def __call__(self, experts: list[int], sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> None:
        failed = self.kernels._fp8_experts(*self._arguments(experts, sizes, x, out))
        if failed:
            raise _experts_failure("w8a8_fp8_linear_experts", failed, len(experts), x.shape[0], self)


def _experts_failure(name: str, code: int, experts: int, rows: int, product: _ExpertsProduct) -> Exception:
    """The error of an experts call's failure code (csrc/w8a8.c: 3 memory, 2 arguments)."""
    if code == 3:
        return MemoryError(f"{name} could not allocate the row tiles of {experts} experts ({rows} rows)")
    return ValueError(f"{name} refused {experts} experts of {rows} rows ({product.in_features} -> "
                      f"{product.out_features})")


class TritonFp8Linear(Fp8Linear):
    name = "triton"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from pagellm.ops import w8a8_triton

        return w8a8_triton.fp8_linear(x, self.weight, self.scales, self.block_k, bias)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose_int8_linear(weight: torch.Tensor, scale: torch.Tensor, input_scale: float | None,
                       rotation: int = 1) -> Int8Linear:
    """The product for an int8 weight [N, K] with per-channel scales [N] (rotated by blocks of `rotation` inputs
    where > 1) on its device: the C kernels on the CPU, Triton on CUDA, torch elsewhere or where those are
    missing."""
    if weight.device.type == "cpu":
        kernels = w8a8_kernels()
        if kernels is not None:
            return NativeInt8Linear(weight, scale, input_scale, kernels, rotation)
    elif weight.device.type == "cuda" and _triton_available():
        return TritonInt8Linear(weight, scale, input_scale, rotation)
    return Int8Linear(weight, scale, input_scale, rotation)


def choose_fp8_linear(weight: torch.Tensor, scales: torch.Tensor, block_k: int) -> Fp8Linear:
    """The product for a float8_e4m3fn weight [N, K] with scales [N, ceil(K / block_k)] on its device."""
    if weight.device.type == "cpu":
        kernels = w8a8_kernels()
        if kernels is not None:
            return NativeFp8Linear(weight, scales, block_k, kernels)
    elif weight.device.type == "cuda" and _triton_available():
        return TritonFp8Linear(weight, scales, block_k)
    return Fp8Linear(weight, scales, block_k)
