"""quantization="rtn" (vLLM's RTNConfig): a float checkpoint's linear layers and experts rounded to nearest as they
load, 8- or 4-bit integers with a symmetric scale per group of input features, activations in the model's dtype.
As vLLM, the bits and group size come from the environment (RTN_NUM_BITS: 8 or 4, default 8; RTN_GROUP_SIZE:
default 128, -1 for one group per output) or from a checkpoint config's `bits` / `group_size`.

vLLM's rounding: scale = max|w| * 2 / (2^bits - 1) per group, q = clamp(round(w / scale) + 2^(bits-1), 0,
2^bits - 1), w = (q - 2^(bits-1)) * scale. The weights run on the group-quantized kernels (csrc/wna16.c on the CPU,
Triton on CUDA) as AWQ's and GPTQ's do. A row whose length is not a multiple of the group size ends in a shorter
group (vLLM needs whole groups).
"""

from __future__ import annotations

import os

import torch

from pagellm.layers.quantization.experts_int8 import OnlineGroupQuantMethod
from pagellm.layers.quantization.w8a8 import OnlineQuantization
from pagellm.ops.wna16 import GroupQuantWeight, pack_rows

BITS = (4, 8)


def rtn_weight(weight: torch.Tensor, bits: int, group_size: int) -> GroupQuantWeight:
    """A float weight [N, K] rounded as vLLM's rtn_quantize rounds it, in the group-quantized representation."""
    w = weight.detach().float()
    rows, cols = w.shape
    size = cols if group_size == -1 else group_size
    groups = -(-cols // size)
    padded = torch.nn.functional.pad(w, (0, groups * size - cols)).view(rows, groups, size)
    scale = padded.abs().amax(dim=-1) * 2.0 / (2**bits - 1)  # [N, groups]
    zero = 2 ** (bits - 1)
    per_input = scale.repeat_interleave(size, dim=1)[:, :cols]
    q = torch.where(per_input > 0, (w / torch.where(per_input > 0, per_input, 1.0)).round() + zero,
                    torch.full_like(w, zero)).clamp(0, 2**bits - 1)
    g_idx = (torch.arange(cols, device=w.device) // size).to(torch.int32)
    return GroupQuantWeight(bits, pack_rows(q.to(torch.int32).t().contiguous(), bits), scale.t().contiguous(),
                            (-zero * scale).t().contiguous(), g_idx)


class OnlineRTNMethod(OnlineGroupQuantMethod):
    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size

    def group_weight(self, weight: torch.Tensor) -> GroupQuantWeight:
        return rtn_weight(weight, self.bits, self.group_size)


def rtn_config(checkpoint_config: dict | None, requested: str | None) -> OnlineQuantization:
    """The registry's factory for "rtn": the environment's settings, or a checkpoint config's."""
    config = checkpoint_config or {}
    bits = int(config.get("bits", os.environ.get("RTN_NUM_BITS", "8")))
    group_size = int(config.get("group_size", os.environ.get("RTN_GROUP_SIZE", "128")))
    if bits not in BITS:
        raise ValueError(f"quantization='rtn' with {bits}-bit weights (RTN_NUM_BITS); vLLM and pagellm round to 4 "
                         "or 8 bits")
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"quantization='rtn' with group size {group_size} (RTN_GROUP_SIZE); it must be a positive "
                         "number of input features, or -1 for one group per output")
    groups = "one group per output" if group_size == -1 else f"groups of {group_size} inputs"
    return OnlineQuantization("rtn", OnlineRTNMethod(bits, group_size),
                              f"online round to nearest: {bits}-bit weights, symmetric scales in {groups}, quantized "
                              "at load; activations kept in the model dtype")
