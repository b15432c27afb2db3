"""AWQ checkpoints (AutoAWQ's GEMM format, vLLM's "awq"): 4-bit weights with a zero point and a scale per group of
`group_size` input features.

The checkpoint's tensors per linear layer, as AutoAWQ's WQLinear_GEMM writes them (awq/modules/linear/gemm.py,
`from_linear`) and vLLM's awq.py / awq_triton.py read them:
  qweight  int32 [in_features, out_features / 8]: eight 4-bit weights per word along the OUTPUT features, in
           AWQ's interleaved order: the nibble at bits 4i..4i+3 of word [k, c] is column 8c + AWQ_ORDER[i],
           AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7] (so column 8c + j sits in nibble AWQ_REVERSE_ORDER[j]);
  qzeros   int32 [in_features / group_size, out_features / 8]: the zero points, packed the same way;
  scales   float16 [in_features / group_size, out_features].
W[n, k] = (q[k, n] - zero[k // group_size, n]) * scale[k // group_size, n].

Tensor parallelism: a column-parallel rank holds a slice of the packed output words (shard sizes must be
multiples of 8), a row-parallel rank a slice of the input rows and of the groups (its inputs must be whole
groups); a per-channel checkpoint (group_size -1) keeps its one group on every rank.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig, is_lm_head
from pagellm.layers.quantization.group_quant import (
    EMBEDDING_SUFFIX,
    GroupQuantLinearMethod,
    all_shards_agree,
)
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.weights import set_weight_attrs
from pagellm.ops.wna16 import GroupQuantWeight, Parts, pack_rows

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
PACK = 8  # 4-bit values per int32


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, columns / 8] in AWQ's order -> int32 values [rows, columns] in column order."""
    shifts = torch.tensor([4 * nibble for nibble in AWQ_REVERSE_ORDER], dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & 0xF  # [rows, words, 8]: entry j is column 8 * word + j
    return values.reshape(packed.shape[0], packed.shape[1] * PACK)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_awq (how AutoAWQ packs): values [rows, columns] in 0..15 -> int32 [rows, columns / 8]."""
    rows, columns = values.shape
    if columns % PACK:
        raise ValueError(f"{columns} columns do not fill whole words of {PACK}")
    grouped = values.to(torch.int64).view(rows, columns // PACK, PACK)
    words = torch.zeros(rows, columns // PACK, dtype=torch.int64, device=values.device)
    for nibble, column in enumerate(AWQ_ORDER):
        words |= grouped[:, :, column] << (4 * nibble)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class AWQLinearMethod(GroupQuantLinearMethod):
    format_name = "AWQ"
    checkpoint_params = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int) -> None:
        super().__init__(bits=4)
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        for size in output_sizes:
            if size % PACK:
                raise ValueError(f"{layer.prefix}: {size} output features per shard and rank are not a multiple of "
                                 f"{PACK}, which AWQ packs into one word; use a smaller tensor_parallel_size")
        if input_size % PACK:
            raise ValueError(f"{layer.prefix}: {input_size} input features are not a multiple of {PACK}")
        per_channel = self.group_size == -1
        if not per_channel and input_size % self.group_size:
            raise ValueError(f"{layer.prefix}: {input_size} input features per rank are not whole groups of "
                             f"{self.group_size}; use a smaller tensor_parallel_size")
        groups = 1 if per_channel else input_size // self.group_size
        # A per-channel checkpoint's one group spans every rank's inputs: each rank loads it whole.
        group_dim = None if per_channel else 0
        output_size = sum(output_sizes)
        qweight = nn.Parameter(torch.empty(input_size, output_size // PACK, dtype=torch.int32), requires_grad=False)
        set_weight_attrs(qweight, input_dim=0, output_dim=1, packed_dim=1, pack_factor=PACK)
        qzeros = nn.Parameter(torch.empty(groups, output_size // PACK, dtype=torch.int32), requires_grad=False)
        set_weight_attrs(qzeros, input_dim=group_dim, output_dim=1, packed_dim=1, pack_factor=PACK)
        # float32 holds a checkpoint's float16 (or bfloat16) scales exactly, whatever the model's dtype.
        scales = nn.Parameter(torch.empty(groups, output_size, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scales, input_dim=group_dim, output_dim=1)
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)

    def parts(self, layer: nn.Module) -> Parts:
        q = unpack_awq(layer.qweight.data)  # [in, out]
        zeros = unpack_awq(layer.qzeros.data).to(torch.float32)
        scales = layer.scales.data.to(torch.float32)
        in_features = q.shape[0]
        group_size = in_features if self.group_size == -1 else self.group_size
        g_idx = (torch.arange(in_features, device=q.device) // group_size).to(torch.int32)
        return [(0, GroupQuantWeight(4, pack_rows(q, 4), scales, -scales * zeros, g_idx))]


class AWQConfig(QuantizationConfig):
    """quantization_config of an AWQ checkpoint, as transformers' AwqConfig or AutoAWQ's quant_config.json
    spells it (bits or w_bit, group_size or q_group_size, zero_point, version, modules_to_not_convert)."""

    name = "awq"

    def __init__(self, config: dict) -> None:
        bits = config.get("bits", config.get("w_bit"))
        self.group_size = config.get("group_size", config.get("q_group_size"))
        zero_point = config.get("zero_point", True)
        version = str(config.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"AWQ checkpoint with bits={bits!r}: pagellm runs 4-bit AWQ (AutoAWQ's GEMM format)")
        if not isinstance(self.group_size, int) or not (self.group_size == -1 or self.group_size > 0):
            raise ValueError(f"AWQ checkpoint with group_size={self.group_size!r}: it must be a positive number "
                             "of input features, or -1 for one group per output")
        if not zero_point:
            raise ValueError("AWQ checkpoint with zero_point=false: AutoAWQ's GEMM format stores zero points, "
                             "and pagellm runs that format only")
        if version != "gemm":
            raise ValueError(f"AWQ checkpoint with version={version!r}: pagellm reads the GEMM layout "
                             "(version 'gemm'); GEMV and other kernels' layouts differ")
        self.modules_to_not_convert: list[str] = list(config.get("modules_to_not_convert") or [])
        self.method = AWQLinearMethod(self.group_size)
        self.dense = UnquantizedLinearMethod()

    def linear_method(self, prefix: str) -> LinearMethod:
        if prefix.endswith(EMBEDDING_SUFFIX) or is_lm_head(prefix):
            return self.dense
        skipped = all_shards_agree(prefix, lambda module: any(name in module for name in self.modules_to_not_convert),
                                   "modules_to_not_convert")
        return self.dense if skipped else self.method

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group size {self.group_size}"
        skipped = f", not converted: {self.modules_to_not_convert}" if self.modules_to_not_convert else ""
        return f"awq (4-bit weights with zero points, {group}, GEMM layout{skipped})"


def awq_config(config: dict | None, requested: str | None) -> AWQConfig:
    if not config:
        raise ValueError("quantization='awq' needs an AWQ checkpoint (config.json with a quantization_config whose "
                         "quant_method is 'awq'); pagellm does not quantize to AWQ itself")
    quant_config = AWQConfig(config)
    logger.info("weights: %s", quant_config.describe())
    return quant_config
