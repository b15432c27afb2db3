"""quant_method "modelopt" (NVIDIA TensorRT Model Optimizer's exported checkpoints, vLLM's ModelOptFp8Config and
ModelOptNvFp4Config):

- "FP8": float8_e4m3fn `weight`, a per-tensor `weight_scale` and a static per-tensor `input_scale` per module;
- "FP8_PER_CHANNEL_PER_TOKEN": `weight_scale` per output channel ([N]), activations dynamic per token;
- "FP8_PB_WO": weight-only blocks of 128 x 128, `weight_scale` [N / 128, 1, K / 128, 1];
- "NVFP4" (W4A4) and "W4A16_NVFP4" (the same weights without input scales): uint8 `weight` [N, K / 2] of e2m1
  codes, float8_e4m3fn `weight_scale` [N, K / 16] and a float32 `weight_scale_2` factor; kept in 4 bits as the
  GGUF kernels' NVFP4_F16 blocks (nvfp4.py). The config's `group_size` must be 16 (its default).

The config is config.json's `quantization_config`, flat (`quant_algo`, `ignore`, `kv_cache_scheme`, `group_size`) or
nested as `hf_quant_config.json` has it (`{"quantization": {"quant_algo", "kv_cache_quant_algo", "exclude_modules",
"group_size"}}`), which the loader reads where config.json has none. Excluded modules stay dense: a whole name, a
name contained in the module's (older exports' convention, which vLLM keeps) or an fnmatch wildcard.

Activations stay in the model's dtype, as in every fp8 format here (Fp8LinearMethod) and for NVFP4's 4-bit ones,
so input scales are loaded and not applied. A calibrated KV cache's scales (`k_scale`, `v_scale`) are passed over:
pagellm's 8-bit KV caches scale each row as it is written (kv_cache_dtype="fp8"), and the log says so. MXFP8 and
mixed precision exports are refused naming them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig, SkipsKVCacheScales
from pagellm.layers.quantization.nvfp4 import GROUP_SIZE, MODELOPT, NVFP4LinearMethod, NVFP4Pieces, kernels_in_use
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.quantization.w8a8 import Fp8LinearMethod, all_or_none, checkpoint_module_names

PB_WO_BLOCK = (128, 128)
FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO")
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
READ_ALGOS = FP8_ALGOS + NVFP4_ALGOS
REFUSED_ALGOS = {
    "MXFP8": "ModelOpt's MXFP8 export is not read (pagellm quantizes to MXFP8 online: quantization=\"mxfp8\")",
    "MIXED_PRECISION": "per-layer mixed formats are not read",
}


class _BlockScales4D(Fp8LinearMethod):
    """FP8_PB_WO: the block-wise method, its scales taken as ModelOpt exports them, [N / 128, 1, K / 128, 1]."""

    def __init__(self) -> None:
        super().__init__("block", PB_WO_BLOCK)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype) -> None:
        super().create_weights(layer, input_size, output_sizes, params_dtype)
        scale = getattr(layer, self.scale_name)

        def load(param, tensor, shard=None):
            if tensor.dim() == 4:
                tensor = tensor.reshape(tensor.shape[0], tensor.shape[2])
            type(layer).weight_loader(layer, param, tensor, shard)

        scale.weight_loader = load


@dataclass(frozen=True)
class ModelOptSettings:
    """What pagellm reads of a modelopt quantization config, flat or nested."""

    algo: str
    exclude_modules: list[str]
    group_size: int | str | None = None  # as the config writes it: checked by the algorithm that uses it


def _settings(config: dict) -> ModelOptSettings:
    nested = config.get("quantization")
    if nested is not None:
        if not isinstance(nested, dict):
            raise ValueError(f"modelopt quantization config's 'quantization' is {nested!r}, not a dict")
        algo, exclude = nested.get("quant_algo"), nested.get("exclude_modules") or []
        group_size = nested.get("group_size")
    else:
        algo, exclude = config.get("quant_algo"), config.get("ignore") or config.get("exclude_modules") or []
        group_size = config.get("group_size")
    if not algo:
        raise ValueError("the modelopt quantization config names no quant_algo")
    algo = str(algo).upper()
    if algo in REFUSED_ALGOS:
        raise ValueError(f"modelopt quant_algo {algo!r} is not supported: {REFUSED_ALGOS[algo]}; pagellm reads "
                         f"ModelOpt's {', '.join(READ_ALGOS)} checkpoints")
    if algo not in READ_ALGOS:
        raise ValueError(f"modelopt quant_algo {algo!r} is unknown; pagellm reads {', '.join(READ_ALGOS)}")
    if not isinstance(exclude, list) or not all(isinstance(entry, str) for entry in exclude):
        raise ValueError(f"modelopt exclude_modules / ignore is {exclude!r}, not a list of module names")
    return ModelOptSettings(algo, exclude, group_size)


class ModelOptConfig(SkipsKVCacheScales, QuantizationConfig):
    """A modelopt checkpoint: the algorithm's method for every linear layer but the excluded ones."""

    name = "modelopt"

    def __init__(self, algo: str, exclude_modules: list[str], method: LinearMethod) -> None:
        self.algo = algo
        self.exclude_modules = list(exclude_modules)
        self.dense = UnquantizedLinearMethod()
        self.method = method

    @classmethod
    def from_config(cls, config: dict) -> ModelOptConfig:
        settings = _settings(config)
        if settings.algo in NVFP4_ALGOS:
            return ModelOptNvFp4Config.from_settings(settings)
        return ModelOptFp8Config(settings.algo, settings.exclude_modules)

    def excluded(self, name: str) -> bool:
        """vLLM's is_layer_excluded: a name contained in `name` (a whole one included), or an fnmatch wildcard."""
        return any(entry in name or fnmatch.fnmatchcase(name, entry) for entry in self.exclude_modules)

    def linear_method(self, prefix: str) -> LinearMethod:
        if prefix.endswith("embed_tokens"):
            return self.dense
        names = checkpoint_module_names(prefix, self.excluded)
        excluded = all_or_none(prefix, names, [self.excluded(name) for name in names], "the modelopt config excludes")
        return self.dense if excluded else self.method

    def _dense_part(self) -> str:
        return f", dense: {', '.join(self.exclude_modules)}" if self.exclude_modules else ""


class ModelOptFp8Config(ModelOptConfig):
    """FP8, FP8_PER_CHANNEL_PER_TOKEN and FP8_PB_WO on the fp8 methods (w8a8.py), activations unquantized."""

    def __init__(self, algo: str, exclude_modules: list[str]) -> None:
        if algo == "FP8":
            method: LinearMethod = Fp8LinearMethod("tensor", static_input=True)
        elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
            method = Fp8LinearMethod("channel")
        else:
            method = _BlockScales4D()
        super().__init__(algo, exclude_modules, method)

    def describe(self) -> str:
        what = {"FP8": "per-tensor weight scales, static input scales in the checkpoint",
                "FP8_PER_CHANNEL_PER_TOKEN": "per-channel weight scales",
                "FP8_PB_WO": "weight scales per block of 128 x 128"}[self.algo]
        return f"modelopt {self.algo} (float8_e4m3fn weights, {what}; activations in the model dtype" \
               f"{self._dense_part()})"


class ModelOptNvFp4Config(ModelOptConfig):
    """NVFP4 / W4A16_NVFP4: the weights kept in NVFP4_F16 blocks (nvfp4.py), activations unquantized."""

    def __init__(self, algo: str, exclude_modules: list[str]) -> None:
        super().__init__(algo, exclude_modules, NVFP4LinearMethod())
        # A module's tensors are NVFP4 where its weight is uint8 codes, whatever the exclude list says: one a
        # layer does not take in blocks arrives dequantized.
        self.nvfp4 = NVFP4Pieces(MODELOPT, lambda module: True, algo == "NVFP4")

    @classmethod
    def from_settings(cls, settings: ModelOptSettings) -> ModelOptNvFp4Config:
        if settings.group_size not in (None, GROUP_SIZE, str(GROUP_SIZE)):
            raise ValueError(f"modelopt {settings.algo} with group_size={settings.group_size!r}: NVFP4 scales groups "
                             f"of {GROUP_SIZE} weights, which pagellm's NVFP4 blocks hold; a checkpoint with other "
                             "groups is another format")
        return cls(settings.algo, settings.exclude_modules)

    def linear_method(self, prefix: str) -> LinearMethod:
        method = super().linear_method(prefix)
        if method is self.method:
            self.nvfp4.serve(prefix)
        return method

    def checkpoint_tensors(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        return self.nvfp4.checkpoint_tensors(weights)

    def describe(self) -> str:
        inputs = "; the checkpoint's input scales not applied" if self.algo == "NVFP4" else ""
        return (f"modelopt {self.algo} (e2m1 weights in groups of {GROUP_SIZE} with fp8 scales, kept as NVFP4_F16 "
                f"blocks on the GGUF kernels: {kernels_in_use(self.method)}; activations in the model dtype{inputs}"
                f"{self._dense_part()})")


def modelopt_config(checkpoint_config: dict | None, requested: str | None) -> ModelOptConfig:
    """The registry's factory for "modelopt": a checkpoint format only."""
    if checkpoint_config is None:
        raise ValueError(f"quantization={requested!r} reads NVIDIA ModelOpt checkpoints (config.json's "
                         "quantization_config or hf_quant_config.json); this one is not quantized. For online fp8 "
                         "use quantization='fp8_per_tensor' (or fp8_per_channel, fp8_per_block, mxfp8).")
    config = ModelOptConfig.from_config(checkpoint_config)
    if requested == "modelopt_fp4" and config.algo not in NVFP4_ALGOS:
        raise ValueError(f"quantization='modelopt_fp4' is vLLM's name for ModelOpt's NVFP4 checkpoints; this one is "
                         f"{config.algo}. Leave quantization unset (or pass 'modelopt').")
    return config
