"""MXFP4 checkpoints (quant_method "mxfp4", as gpt-oss's released weights come): each expert weight is stored as
blocks of 32 FP4 (e2m1) values sharing one power-of-two scale (`*_blocks` [..., groups, 16] bytes, two values
per byte, low nibble first; `*_scales` [..., groups] bytes, the exponent biased by 127).

No pagellm kernel multiplies MXFP4 blocks, so the model dequantizes each expert tensor as it loads
(`dequantize_mxfp4`, exact: every FP4 value times a power of two is representable in bfloat16 and float32) and
every layer runs unquantized; the other layers of these checkpoints (attention, router, embeddings, head) are
stored unquantized already. The weights then take the memory of the bf16 (or float32) model, not the 4-bit
file's: about 4x the experts' size on disk at bf16.
"""

from __future__ import annotations

import torch

from pagellm.layers.quantization.unquantized import Unquantized

# The 16 e2m1 codes' values.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK_BYTES = 16  # 32 values
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] of `dtype`: value 2i of a block from
    byte i's low nibble, 2i + 1 from its high one, each times 2^(scale - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != BLOCK_BYTES \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.dtype} {tuple(blocks.shape)} and scales {scales.dtype} "
                         f"{tuple(scales.shape)}: expected uint8 [..., groups, {BLOCK_BYTES}] and uint8 [..., groups]")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1)
    exponents = (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1).unsqueeze(-1)
    values = torch.ldexp(values, exponents.float())
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * 2 * BLOCK_BYTES).to(dtype)


class Mxfp4Dequantized(Unquantized):
    """An MXFP4 checkpoint run unquantized: its expert tensors dequantized as they load (models/gpt_oss.py)."""

    name = "mxfp4"

    def describe(self) -> str:
        return "mxfp4 checkpoint, experts dequantized at load (unquantized kernels)"


def mxfp4_config(checkpoint_config: dict | None, requested: str | None) -> Mxfp4Dequantized:
    """The registry's factory for "mxfp4": a checkpoint format only, not an online quantization."""
    if checkpoint_config is None:
        raise ValueError(f"quantization={requested!r}: MXFP4 is read from checkpoints that hold it (gpt-oss's); "
                         "pagellm does not quantize a float checkpoint to it. Leave quantization unset, or use "
                         "'fp8' or 'int8' for online quantization.")
    return Mxfp4Dequantized()
