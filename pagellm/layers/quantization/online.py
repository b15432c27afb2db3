"""vLLM's online quantization frontend (`quantization=` fp8_per_tensor | fp8_per_channel | fp8_per_block | mxfp8 |
int8_per_channel_weight_only | online, and `quantization_config`; pagellm/online_quantization.py resolves them):
a float checkpoint's dense linear layers and its experts quantized as they load, each to its own format, the
layers `ignore` names left in the model's dtype.

Every fp8 format here is float8_e4m3fn weights on the fp8 kernels (csrc/w8a8.c on the CPU, Triton on CUDA), which
take a scale per output column and block of inputs; they differ only in those scales. int8 is the group-quantized
kernels' 8-bit path with one group per row (as experts_int8 runs its experts).
"""

from __future__ import annotations

import torch

from pagellm.layers.fused_moe import ExpertLinearsMoEMethod, FusedMoEMethodBase, UnquantizedFusedMoEMethod
from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig
from pagellm.layers.quantization.experts_int8 import OnlineInt8WeightOnlyMethod
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.quantization.w8a8 import (OnlineFp8LinearMethod, OnlineQuantization, OnlineQuantizedLinearMethod,
                                              all_or_none, checkpoint_module_names, is_embedding_or_head)
from pagellm.online_quantization import SHORTHANDS, OnlineSpec
from pagellm.ops import w8a8_kernels as wk

FP8_BLOCK = (128, 128)  # vLLM's fp8_per_block (kFp8Static128BlockSym)
MX_BLOCK = 32  # OCP MX: one E8M0 scale per 32 values along the inputs


class OnlineFp8BlocksLinearMethod(OnlineFp8LinearMethod):
    """float8_e4m3fn weights with a scale per block of `block_n` outputs by `block_k` inputs (partial blocks at the
    edges): per output channel with (1, K), vLLM's fp8_per_block with (128, 128), MXFP8 with (1, 32) and
    power-of-two scales."""

    def __init__(self, block_n: int | None, block_k: int | None, power_of_two: bool = False) -> None:
        self.block_n, self.block_k, self.power_of_two = block_n, block_k, power_of_two

    def quantize(self, weight: torch.Tensor) -> wk.Fp8Linear:
        out_features, in_features = weight.shape
        block_n, block_k = self.block_n or out_features, self.block_k or in_features
        q, scales = wk.quantize_fp8_blocks(weight, block_n, block_k, self.power_of_two)
        return wk.choose_fp8_linear(q, scales, block_k)


def online_linear_method(weight_format: str) -> OnlineQuantizedLinearMethod:
    """The layer method of one of online_quantization.WEIGHT_FORMATS."""
    if weight_format == "fp8_per_tensor_static":
        return OnlineFp8LinearMethod()
    if weight_format == "fp8_per_channel_static":
        return OnlineFp8BlocksLinearMethod(1, None)
    if weight_format == "fp8_per_block_static":
        return OnlineFp8BlocksLinearMethod(*FP8_BLOCK)
    if weight_format == "mxfp8":
        return OnlineFp8BlocksLinearMethod(1, MX_BLOCK, power_of_two=True)
    if weight_format == "int8_per_channel_static":
        return OnlineInt8WeightOnlyMethod()
    raise ValueError(f"no online method for weight format {weight_format!r}")


class OnlineConfig(QuantizationConfig):
    name = "online"

    def __init__(self, spec: OnlineSpec, requested: str | None) -> None:
        self.spec = spec
        self.requested = requested
        self.dense = UnquantizedLinearMethod()
        self._methods: dict[str, OnlineQuantizedLinearMethod] = {}  # one per weight format, shared by its layers

    def _method(self, weight_format: str) -> OnlineQuantizedLinearMethod:
        if weight_format not in self._methods:
            self._methods[weight_format] = online_linear_method(weight_format)
        return self._methods[weight_format]

    def linear_method(self, prefix: str) -> LinearMethod:
        if is_embedding_or_head(prefix) or (self.spec.linear is None and not self.spec.targets):
            return self.dense
        names = checkpoint_module_names(prefix,
                                        lambda name: self.spec.ignores(name) or bool(self.spec.targets_of(name)))
        ignored = all_or_none(prefix, names, [self.spec.ignores(name) for name in names],
                              "quantization_config.ignore names", ": name all of them or none")
        if self.spec.targets:
            weight_format = self._target_format(prefix, names, ignored, "linear")
            return self.dense if weight_format is None else self._method(weight_format)
        return self.dense if ignored else self._method(self.spec.linear)

    def fused_moe_method(self, prefix: str) -> FusedMoEMethodBase:
        ignored = self.spec.ignores(prefix)
        weight_format = self._target_format(prefix, [prefix], ignored, "moe") if self.spec.targets else (
            None if ignored else self.spec.moe)
        if weight_format is None:
            return UnquantizedFusedMoEMethod()
        # The experts' linear layers ask a config of their own (as experts_int8's do): all of this format.
        return ExpertLinearsMoEMethod(OnlineQuantization(self.name, self._method(weight_format), weight_format))

    def _target_format(self, prefix: str, names: list[str], ignored: bool, field: str) -> str | None:
        """The weight format `targets` gives the layer whose checkpoint modules are `names` (None: no pattern
        matches them), refusing what vLLM refuses: a layer both ignored and targeted, fused shards matched by
        different patterns or only some, several patterns for one module, a shorthand without a `field` format."""
        matched = [self.spec.targets_of(name) for name in names]
        if not any(matched):
            return None
        if ignored:
            raise ValueError(f"{prefix} matches both quantization_config.ignore and targets "
                             f"({[m[0][0] for m in matched if m]}); a layer may be named by one of them only")
        if not all(matched) or any(len(m) > 1 for m in matched) or len({m[0] for m in matched}) > 1:
            raise ValueError(f"{prefix}: quantization_config.targets matches its modules {names} as "
                             f"{[[pattern for pattern, _ in m] for m in matched]}; each module needs exactly one "
                             "pattern, and fused shards the same one")
        pattern, shorthand = matched[0][0]
        weight_format = getattr(SHORTHANDS[shorthand], field)
        if weight_format is None:
            kind = "linear layers" if field == "linear" else "experts"
            raise ValueError(f"quantization_config.targets[{pattern!r}]={shorthand!r} matches {prefix}, but that "
                             f"shorthand has no format for {kind}")
        return weight_format

    def describe(self) -> str:
        asked = f"quantization={self.requested!r}" if self.requested else "quantization_config"
        return f"online ({asked}; {self.spec.describe()}; quantized at load, activations in the model dtype)"


def ptpc_fp8_config(checkpoint_config: dict | None, requested: str | None) -> OnlineConfig:
    """vLLM's quantization="ptpc_fp8" (ROCm's online fp8 with per-token activation and per-channel weight scales): its
    weights are fp8_per_channel's; activations stay in the model's dtype here, as in every fp8 format."""
    return OnlineConfig(SHORTHANDS["fp8_per_channel"], requested)
