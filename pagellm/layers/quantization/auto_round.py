"""Intel AutoRound checkpoints (quant_method "auto-round", vLLM's AutoRoundConfig): weights rounded by AutoRound's
signed-gradient tuning, stored in AutoGPTQ's or AutoAWQ's layout (`packing_format` "auto_round:auto_gptq", the
default, or "auto_round:auto_awq"), so they run as GPTQ (in input order) or AWQ checkpoints on the same kernels.

The config: bits, group_size, sym, data_type ("int"; AutoRound's mx_fp / nv_fp / fp8 exports are refused),
`block_name_to_quantize` (or `to_quant_block_names`: the blocks it quantized, a list or a comma-separated string;
modules outside them are float) and `extra_config`, per-module overrides {module: {bits, group_size, sym}} where
bits of 16 or more leave the module float. For the GPTQ layout these become GPTQModel's `dynamic` rules, which
pagellm's GPTQ config reads (an exact module name each, first match wins, as vLLM's get_layer_config matches them).
"""

from __future__ import annotations

import re

from pagellm.layers.quantization.awq import AWQConfig
from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig
from pagellm.layers.quantization.gptq import GPTQConfig
from pagellm.layers.quantization.group_quant import all_shards_agree

PACKING_FORMATS = ("auto_round:auto_gptq", "auto_round:auto_awq")
FLOAT_BITS = 16  # extra_config bits from which a module is left unquantized (vLLM's check_quantized)


class AutoRoundGPTQConfig(GPTQConfig):
    name = "auto-round"

    def describe(self) -> str:
        return f"auto-round, {super().describe()}"


class AutoRoundAWQConfig(AWQConfig):
    """AWQ's layout, with modules outside `blocks` (and float ones of extra_config) dense."""

    name = "auto-round"

    def __init__(self, config: dict, blocks: list[str]) -> None:
        super().__init__(config)
        self.blocks = blocks

    def linear_method(self, prefix: str) -> LinearMethod:
        def in_blocks(module: str) -> bool:
            return any(module.startswith(f"{block}.") for block in self.blocks)

        if self.blocks and not all_shards_agree(prefix, in_blocks, "block_name_to_quantize"):
            return self.dense
        return super().linear_method(prefix)

    def describe(self) -> str:
        return f"auto-round, {super().describe()}"


def _blocks(config: dict) -> list[str]:
    blocks = config.get("block_name_to_quantize") or config.get("to_quant_block_names") or []
    if isinstance(blocks, str):
        blocks = blocks.split(",")
    return [name.strip() for entry in blocks for name in (entry if isinstance(entry, list) else [entry])
            if name.strip()]


def auto_round_config(config: dict | None, requested: str | None) -> QuantizationConfig:
    if not config:
        raise ValueError("quantization='auto-round' names the format of Intel AutoRound checkpoints; this checkpoint "
                         "is not quantized (pagellm does not run AutoRound's tuning)")
    packing = config.get("packing_format", PACKING_FORMATS[0])
    data_type = config.get("data_type", "int")
    if data_type != "int":
        raise ValueError(f"AutoRound checkpoint with data_type={data_type!r}: pagellm reads AutoRound's integer "
                         f"weights (data_type 'int') in the {' or '.join(PACKING_FORMATS)} layouts")
    if packing not in PACKING_FORMATS:
        raise ValueError(f"AutoRound checkpoint with packing_format={packing!r}: pagellm reads "
                         f"{', '.join(PACKING_FORMATS)} (AutoGPTQ's and AutoAWQ's layouts)")
    bits, group_size, sym = config.get("bits"), config.get("group_size"), bool(config.get("sym", True))
    extra: dict[str, dict] = dict(config.get("extra_config") or {})
    blocks = _blocks(config)
    float_modules = [name for name, overrides in extra.items() if overrides.get("bits", bits) >= FLOAT_BITS]
    if packing.endswith("auto_awq"):
        overridden = [name for name, overrides in extra.items()
                      if name not in float_modules and any(overrides.get(key, value) != value for key, value in
                                                          (("bits", bits), ("group_size", group_size), ("sym", sym)))]
        if overridden:
            raise ValueError(f"AutoRound checkpoint in AWQ's layout with per-module settings for {overridden[:3]}: "
                             "pagellm's AWQ layers take one bit width and group size per model")
        # AutoAWQ's layout stores qzeros whether or not the rounding was symmetric (sym: each the midpoint).
        return AutoRoundAWQConfig({"bits": bits, "group_size": group_size, "zero_point": True, "version": "gemm",
                                   "modules_to_not_convert": float_modules}, blocks)
    dynamic: dict[str, dict] = {}
    for name, overrides in extra.items():
        pattern = f"^{re.escape(name)}$"
        if name in float_modules:
            dynamic[f"-:{pattern}"] = {}
        else:
            dynamic[f"+:{pattern}"] = {key: overrides[key] for key in ("bits", "group_size", "sym") if key in overrides}
    if blocks:
        dynamic["-:^(?!(" + "|".join(re.escape(block) for block in blocks) + r")\.)"] = {}
    return AutoRoundGPTQConfig({"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym,
                                "desc_act": False, "checkpoint_format": "gptq", "dynamic": dynamic})
