"""MXFP4 checkpoints (quant_method "mxfp4", as gpt-oss's released weights come): each expert weight is stored as
blocks of 32 FP4 (e2m1) values sharing one power-of-two scale (`*_blocks` [..., groups, 16] bytes, two values
per byte, low nibble first; `*_scales` [..., groups] bytes, the exponent biased by 127).

The experts stay in those 4 bits: each block becomes one of the GGUF kernels' MXFP4_F16 blocks (models/gguf_quants.py,
mxfp4_f16_blocks: the same codes in ggml's MXFP4 order, the scale as an f16 with the grid's factor 2 taken out),
exact for every scale a model's weights have (2^-23 to 2^16), and run on the GGUF experts' method
(layers/quantization/gguf_moe.py: the native kernels on the CPU, Triton on CUDA, the experts' biases added after
each product), 4.5 bits a weight where the file has 4.25. Where the device has no kernel for them (a CPU without a
C compiler) that method holds them dequantized, exactly. The other layers of these checkpoints (attention, router,
embeddings, head) are stored unquantized and run so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig
from pagellm.layers.quantization.gguf import GGUFWeight
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.models.gguf_quants import ggml_nibbles, mxfp4_f16_blocks

if TYPE_CHECKING:
    from pagellm.layers.quantization.gguf_moe import GGUFFusedMoEMethod

BLOCK_BYTES = 16  # 32 values
KEPT_TYPE = "MXFP4_F16"


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor, name: str = "") -> GGUFWeight:
    """One weight's MXFP4 blocks [rows, groups, 16] and scales [rows, groups] (uint8; value 2i of a block in byte
    i's low nibble, 2i + 1 in its high one) as MXFP4_F16 blocks [rows, groups * 18]: weights 0-15 of a block in
    the low nibbles, 16-31 in the high ones, as ggml orders MXFP4."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 3 \
            or blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{name}: MXFP4 blocks {blocks.dtype} {tuple(blocks.shape)} and scales {scales.dtype} "
                         f"{tuple(scales.shape)}; expected uint8 [rows, groups, {BLOCK_BYTES}] and uint8 "
                         "[rows, groups]")
    rows, groups = scales.shape
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(rows, groups, 2 * BLOCK_BYTES)
    nibbles = ggml_nibbles(codes)
    kept = mxfp4_f16_blocks(scales.reshape(-1).numpy(), nibbles.reshape(-1, BLOCK_BYTES).numpy(), name)
    return GGUFWeight(torch.from_numpy(kept).view(rows, -1), KEPT_TYPE, rows, groups * 2 * BLOCK_BYTES)


class Mxfp4Config(QuantizationConfig):
    """An MXFP4 checkpoint: dense layers unquantized, the experts on the GGUF experts' method in MXFP4_F16 blocks
    (models/gpt_oss.py hands each expert's projections over as mxfp4_weight's blocks)."""

    name = "mxfp4"

    def __init__(self) -> None:
        self.dense = UnquantizedLinearMethod()
        self.moe_method: GGUFFusedMoEMethod | None = None  # made at the first mixture-of-experts layer

    def linear_method(self, prefix: str) -> LinearMethod:
        return self.dense

    def fused_moe_method(self, prefix: str) -> GGUFFusedMoEMethod:
        from pagellm.layers.quantization.gguf_moe import GGUFFusedMoEMethod

        if self.moe_method is None:
            self.moe_method = GGUFFusedMoEMethod()
        return self.moe_method

    def describe(self) -> str:
        ops = self.moe_method.ops if self.moe_method is not None else None
        kernels = ops.isa if ops is not None and ops.supports(KEPT_TYPE) else "none: dequantized"
        return f"mxfp4 (experts kept as {KEPT_TYPE} blocks, 4.5 bits a weight; the GGUF kernels: {kernels})"


def mxfp4_config(checkpoint_config: dict | None, requested: str | None) -> Mxfp4Config:
    """The registry's factory for "mxfp4": a checkpoint format only, not an online quantization."""
    if checkpoint_config is None:
        raise ValueError(f"quantization={requested!r}: MXFP4 is read from checkpoints that hold it (gpt-oss's); "
                         "pagellm does not quantize a float checkpoint to it. Leave quantization unset, or use "
                         "'fp8' or 'int8' for online quantization.")
    return Mxfp4Config()
