"""GPTQ checkpoints (AutoGPTQ, GPTQModel and transformers/optimum write them; vLLM's "gptq"): 4- or 8-bit weights
with a scale and zero point per group of input features, symmetric or not, in input order or in the order the
quantizer visited the features (desc_act, "act-order").

The checkpoint's tensors per linear layer, as AutoGPTQ's QuantLinear.pack writes them
(auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py) and vLLM's gptq.py reads them:
  qweight  int32 [in_features / pack, out_features], pack = 32 / bits values per word along the INPUT features:
           bits j*bits .. of word [i, n] hold q[i * pack + j, n];
  qzeros   int32 [groups, out_features / pack]: zero points packed along the outputs the same way, stored minus
           one (AutoGPTQ's `zeros -= 1` before packing; the kernels add it back). GPTQModel's checkpoint_format
           "gptq_v2" stores them as they are;
  scales   float16 [groups, out_features];
  g_idx    int32 [in_features]: the group of each input feature. In input order groups are k // group_size; with
           desc_act the quantizer walked the features by decreasing activation size and g_idx[perm[i]] =
           i // group_size (auto_gptq/quantization/gptq.py).
W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]; sym=True only fixes zero = 2^(bits - 1).

Tensor parallelism: a row-parallel rank holds a slice of the packed input rows and of g_idx; with desc_act its
features belong to any group, so every rank loads all groups' scales and zeros and keeps the ones its features
use. Each shard of a fused layer (q/k/v, gate/up) has its own g_idx row: a quantizer could give them different
orders, and the kernels then run the shards as separate parts.
"""

from __future__ import annotations

import functools
import logging
import re

import torch
from torch import nn

from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig, is_lm_head
from pagellm.layers.quantization.group_quant import (
    EMBEDDING_SUFFIX,
    GroupQuantLinearMethod,
    all_shards_agree,
    checkpoint_modules,
    load_shard_row,
    parts_by_input_order,
)
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.weights import set_weight_attrs
from pagellm.ops.wna16 import BITS, Parts, unpack_rows

logger = logging.getLogger(__name__)

CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # -> what is added to a stored zero point


def unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows, columns / pack] packed along the columns (field j of word c is column c * pack + j) ->
    int32 values [rows, columns]."""
    return unpack_rows(packed.t(), bits).t()


class GPTQLinearMethod(GroupQuantLinearMethod):
    format_name = "GPTQ"
    checkpoint_params = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, bits: int, group_size: int, zero_offset: int) -> None:
        super().__init__(bits)
        self.group_size = group_size
        self.zero_offset = zero_offset
        self.pack = 32 // bits

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        pack = self.pack
        for size in output_sizes:
            if size % pack:
                raise ValueError(f"{layer.prefix}: {size} output features per shard and rank are not a multiple of "
                                 f"{pack}, which GPTQ packs zero points by; use a smaller tensor_parallel_size")
        if input_size % pack:
            raise ValueError(f"{layer.prefix}: {input_size} input features per rank are not a multiple of {pack}, "
                             "which GPTQ packs weights by; use a smaller tensor_parallel_size")
        # Every group of the whole layer, on every rank (see the module docstring).
        total_inputs = input_size * (layer.group.size if layer.splits_input else 1)
        group_size = total_inputs if self.group_size == -1 else self.group_size
        groups = -(-total_inputs // group_size)
        output_size = sum(output_sizes)
        qweight = nn.Parameter(torch.empty(input_size // pack, output_size, dtype=torch.int32), requires_grad=False)
        set_weight_attrs(qweight, input_dim=0, output_dim=1, packed_dim=0, pack_factor=pack)
        qzeros = nn.Parameter(torch.empty(groups, output_size // pack, dtype=torch.int32), requires_grad=False)
        set_weight_attrs(qzeros, output_dim=1, packed_dim=1, pack_factor=pack)
        # float32 holds a checkpoint's float16 (or bfloat16) scales exactly, whatever the model's dtype.
        scales = nn.Parameter(torch.empty(groups, output_size, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scales, output_dim=1)
        g_idx = nn.Parameter(torch.empty(len(output_sizes), input_size, dtype=torch.int32), requires_grad=False)
        set_weight_attrs(g_idx, weight_loader=functools.partial(load_shard_row, layer, "g_idx", True))
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)
        layer.register_parameter("g_idx", g_idx)

    def parts(self, layer: nn.Module) -> Parts:
        qweight = layer.qweight.data
        zeros = unpack_columns(layer.qzeros.data, self.bits).to(torch.float32) + self.zero_offset
        scales = layer.scales.data.to(torch.float32)
        offsets = -scales * zeros
        return parts_by_input_order(layer, self.bits, qweight, scales, offsets, layer.g_idx.data)


class GPTQConfig(QuantizationConfig):
    """quantization_config of a GPTQ checkpoint (bits, group_size, desc_act, sym, lm_head, checkpoint_format,
    modules_in_block_to_quantize, and GPTQModel's per-module `dynamic` rules)."""

    name = "gptq"

    def __init__(self, config: dict) -> None:
        self.settings = self._settings(config, "quantization_config")
        self.lm_head = bool(config.get("lm_head", False))
        checkpoint_format = config.get("checkpoint_format") or "gptq"
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"GPTQ checkpoint with checkpoint_format={checkpoint_format!r}: pagellm reads "
                             f"{', '.join(CHECKPOINT_FORMATS)} (Marlin's repacked layout differs)")
        self.checkpoint_format = checkpoint_format
        blocks = config.get("modules_in_block_to_quantize") or []
        self.modules_in_block_to_quantize = [name for entry in blocks
                                             for name in (entry if isinstance(entry, list) else [entry])]
        self.dynamic: dict[str, dict] = dict(config.get("dynamic") or {})
        for pattern, overrides in self.dynamic.items():
            if not pattern.startswith("-:"):
                self._settings({**config, **overrides}, f"dynamic rule {pattern!r}")
        self.dense = UnquantizedLinearMethod()
        self._methods: dict[tuple, GPTQLinearMethod] = {}

    @staticmethod
    def _settings(config: dict, where: str) -> tuple[int, int, bool, bool]:
        bits, group_size = config.get("bits"), config.get("group_size", -1)
        if bits not in BITS:
            raise ValueError(f"GPTQ checkpoint with {where} bits={bits!r}: pagellm runs {' and '.join(map(str, BITS))}"
                             "-bit GPTQ")
        if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
            raise ValueError(f"GPTQ checkpoint with {where} group_size={group_size!r}: it must be a positive number "
                             "of input features, or -1 for one group per output")
        return bits, group_size, bool(config.get("desc_act", False)), bool(config.get("sym", True))

    def _rule(self, module: str):
        """GPTQModel's first `dynamic` rule matching `module`: False (not quantized), a dict of overrides, or
        None."""
        for pattern, overrides in self.dynamic.items():
            if pattern.startswith("-:"):
                if re.match(pattern[2:], module):
                    return False
            elif re.match(pattern.removeprefix("+:"), module):
                return overrides
        return None

    def linear_method(self, prefix: str) -> LinearMethod:
        is_head = is_lm_head(prefix)
        if prefix.endswith(EMBEDDING_SUFFIX) or (is_head and not self.lm_head):
            return self.dense
        listed = self.modules_in_block_to_quantize
        if listed and not is_head and not all_shards_agree(
                prefix, lambda module: any(name in module for name in listed), "modules_in_block_to_quantize"):
            return self.dense
        rules = {module: self._rule(module) for module in checkpoint_modules(prefix)}
        if len({repr(rule) for rule in rules.values()}) > 1:
            raise ValueError(f"{prefix} fuses {', '.join(rules)}, but the checkpoint's dynamic rules treat them "
                             f"differently ({rules}); pagellm needs a fused layer's shards stored alike")
        rule = next(iter(rules.values()))
        if rule is False:
            return self.dense
        settings = self._settings({**self._base_config(), **rule}, f"dynamic rule for {prefix}") if rule \
            else self.settings
        bits, group_size = settings[0], settings[1]
        if (bits, group_size) not in self._methods:
            self._methods[bits, group_size] = GPTQLinearMethod(bits, group_size,
                                                               CHECKPOINT_FORMATS[self.checkpoint_format])
        return self._methods[bits, group_size]

    def _base_config(self) -> dict:
        bits, group_size, desc_act, sym = self.settings
        return {"bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym}

    def describe(self) -> str:
        bits, group_size, desc_act, sym = self.settings
        group = "per channel" if group_size == -1 else f"group size {group_size}"
        order = "desc_act" if desc_act else "input order"
        extras = [f"checkpoint_format {self.checkpoint_format}"] if self.checkpoint_format != "gptq" else []
        if self.lm_head:
            extras.append("quantized lm_head")
        if self.dynamic:
            extras.append(f"{len(self.dynamic)} dynamic rules")
        tail = "".join(f", {extra}" for extra in extras)
        return f"gptq ({bits}-bit weights, {group}, {order}, {'symmetric' if sym else 'asymmetric'}{tail})"


def gptq_config(config: dict | None, requested: str | None) -> GPTQConfig:
    if not config:
        raise ValueError("quantization='gptq' needs a GPTQ checkpoint (config.json with a quantization_config whose "
                         "quant_method is 'gptq'); pagellm does not quantize to GPTQ itself")
    quant_config = GPTQConfig(config)
    logger.info("weights: %s", quant_config.describe())
    return quant_config
