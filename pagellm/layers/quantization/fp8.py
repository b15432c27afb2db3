"""quant_method "fp8" (vLLM's Fp8Config): checkpoints of float8_e4m3fn weights with a per-tensor `weight_scale`
per checkpoint tensor, or block-wise `weight_scale_inv` when the config has `weight_block_size` (DeepSeek-V3 /
Qwen3-FP8 style); `activation_scheme` "dynamic" or "static" (an `input_scale` per tensor); `ignored_layers`
(or `modules_to_not_convert`) stay dense. And quantization="fp8" on a float checkpoint: vLLM's
`--quantization fp8` of earlier releases (0.32 spells it fp8_per_tensor), one fp8 scale per weight, computed as
each layer loads.

Activations are not quantized here (pagellm/ops/w8a8_kernels.py: no CPU multiplies fp8, and the Triton kernel
dequantizes weight tiles), so "static" input scales are loaded and not applied.
"""

from __future__ import annotations

from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig, SkipsKVCacheScales
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.quantization.w8a8 import (Fp8LinearMethod, OnlineFp8LinearMethod, OnlineQuantization, all_or_none,
                                              checkpoint_module_names, is_embedding_or_head)

ACTIVATION_SCHEMES = ("dynamic", "static")


class Fp8Config(SkipsKVCacheScales, QuantizationConfig):
    name = "fp8"

    def __init__(self, activation_scheme: str, ignored_layers: list[str], block: tuple[int, int] | None) -> None:
        self.activation_scheme = activation_scheme
        self.ignored_layers = list(ignored_layers)
        self.block = block
        self.dense = UnquantizedLinearMethod()
        if block is None:
            self.method = Fp8LinearMethod("tensor", static_input=activation_scheme == "static")
        else:
            self.method = Fp8LinearMethod("block", block, scale_name="weight_scale_inv")

    @classmethod
    def from_config(cls, config: dict) -> Fp8Config:
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"quantization_config.activation_scheme={scheme!r} is not supported; fp8 checkpoints "
                             f"take {' or '.join(ACTIVATION_SCHEMES)}")
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        block = config.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
                    isinstance(b, int) and b > 0 for b in block)):
                raise ValueError(f"quantization_config.weight_block_size={block!r} must be two positive ints "
                                 "[block_n, block_k]")
            if scheme != "dynamic":
                raise ValueError("quantization_config.weight_block_size with activation_scheme='static' is not "
                                 "supported (vLLM takes block-wise fp8 with dynamic activations only)")
            block = (block[0], block[1])
        return cls(scheme, ignored, block)

    def linear_method(self, prefix: str) -> LinearMethod:
        # The embedding and LM head are stored dense (vLLM's Fp8Config quantizes linear layers only).
        if is_embedding_or_head(prefix):
            return self.dense
        names = checkpoint_module_names(prefix, lambda name: name in self.ignored_layers)
        ignored = all_or_none(prefix, names, [name in self.ignored_layers for name in names], "ignored_layers lists")
        return self.dense if ignored else self.method

    def describe(self) -> str:
        scales = f"block-wise scales of {list(self.block)}" if self.block else "per-tensor scales"
        ignored = f", dense: {', '.join(self.ignored_layers)}" if self.ignored_layers else ""
        return (f"fp8 (float8_e4m3fn weights, {scales}, {self.activation_scheme} activation scales in the "
                f"checkpoint; activations kept in the model dtype{ignored})")


class FbgemmFp8Config(Fp8Config):
    """quant_method "fbgemm_fp8" (Meta's FP8 releases, transformers' FbgemmFp8Config, vLLM's FBGEMMFp8Config):
    float8_e4m3fn weights with a float32 `weight_scale` [N, 1] per output channel; `modules_to_not_convert` (full
    module names) stay dense. Its activations are quantized to fp8 per token with scales bounded by
    `activation_scale_ub` on GPUs with fp8 units; pagellm keeps them in the model's dtype (as vLLM does where it
    runs these weights on its weight-only Marlin kernel)."""

    name = "fbgemm_fp8"

    def __init__(self, ignored_layers: list[str], activation_scale_ub: float | None) -> None:
        super().__init__("dynamic", ignored_layers, None)
        self.method = Fp8LinearMethod("channel")
        self.activation_scale_ub = activation_scale_ub

    def describe(self) -> str:
        names = self.ignored_layers
        ignored = "" if not names else f", dense: {', '.join(names) if len(names) <= 3 else f'{len(names)} modules'}"
        return (f"fbgemm_fp8 (float8_e4m3fn weights, a scale per output channel; activations kept in the model dtype, "
                f"the checkpoint's activation_scale_ub={self.activation_scale_ub} unused{ignored})")


def fbgemm_fp8_config(checkpoint_config: dict | None, requested: str | None) -> FbgemmFp8Config:
    """The registry's factory for "fbgemm_fp8": a checkpoint format only."""
    if checkpoint_config is None:
        raise ValueError("quantization='fbgemm_fp8' names the format of Meta's FP8 checkpoints; this checkpoint is "
                         "not quantized. To quantize a float checkpoint to fp8 as it loads, pass "
                         "quantization='fp8_per_channel' (the same per-channel scales)")
    return FbgemmFp8Config(checkpoint_config.get("modules_to_not_convert") or [],
                           checkpoint_config.get("activation_scale_ub"))


def fp8_config(checkpoint_config: dict | None, requested: str | None) -> QuantizationConfig:
    """The registry's factory for "fp8": the checkpoint's config, or online quantization of a float one."""
    if checkpoint_config is not None:
        return Fp8Config.from_config(checkpoint_config)
    return OnlineQuantization("fp8", OnlineFp8LinearMethod(),
                              "online: float8_e4m3fn weights with one scale per weight, quantized at load; "
                              "activations kept in the model dtype")

