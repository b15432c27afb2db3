"""quant_method "modelopt" (NVIDIA TensorRT Model Optimizer's exported checkpoints, vLLM's ModelOptFp8Config), the
fp8 algorithms:

- "FP8": float8_e4m3fn `weight`, a per-tensor `weight_scale` and a static per-tensor `input_scale` per module;
- "FP8_PER_CHANNEL_PER_TOKEN": `weight_scale` per output channel ([N]), activations dynamic per token;
- "FP8_PB_WO": weight-only blocks of 128 x 128, `weight_scale` [N / 128, 1, K / 128, 1].

The config is config.json's `quantization_config`, flat (`quant_algo`, `ignore`, `kv_cache_scheme`) or nested as
`hf_quant_config.json` has it (`{"quantization": {"quant_algo", "kv_cache_quant_algo", "exclude_modules"}}`), which
the loader reads where config.json has none. Excluded modules stay dense: a whole name, a name contained in the
module's (older exports' convention, which vLLM keeps) or an fnmatch wildcard.

Activations stay in the model's dtype, as in every fp8 format here (Fp8LinearMethod), so input scales are loaded
and not applied. A calibrated KV cache's scales (`k_scale`, `v_scale`) are passed over: pagellm's 8-bit KV caches
scale each row as it is written (kv_cache_dtype="fp8"), and the log says so. NVFP4, W4A16_NVFP4, MXFP8 and mixed
precision exports are refused naming them.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig, SkipsKVCacheScales
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.quantization.w8a8 import Fp8LinearMethod, all_or_none, checkpoint_module_names

PB_WO_BLOCK = (128, 128)
FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO")
REFUSED_ALGOS = {
    "NVFP4": "NVFP4 (4-bit floats, W4A4) runs on Blackwell GPUs",
    "W4A16_NVFP4": "no pagellm kernel multiplies NVFP4 weights",
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


class ModelOptFp8Config(SkipsKVCacheScales, QuantizationConfig):
    name = "modelopt"

    def __init__(self, algo: str, exclude_modules: list[str]) -> None:
        self.algo = algo
        self.exclude_modules = list(exclude_modules)
        self.dense = UnquantizedLinearMethod()
        if algo == "FP8":
            self.method: LinearMethod = Fp8LinearMethod("tensor", static_input=True)
        elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
            self.method = Fp8LinearMethod("channel")
        else:
            self.method = _BlockScales4D()

    @classmethod
    def from_config(cls, config: dict) -> ModelOptFp8Config:
        nested = config.get("quantization")
        if nested is not None:
            if not isinstance(nested, dict):
                raise ValueError(f"modelopt quantization config's 'quantization' is {nested!r}, not a dict")
            algo, exclude = nested.get("quant_algo"), nested.get("exclude_modules") or []
        else:
            algo, exclude = config.get("quant_algo"), config.get("ignore") or config.get("exclude_modules") or []
        if not algo:
            raise ValueError("the modelopt quantization config names no quant_algo")
        algo = str(algo).upper()
        if algo in REFUSED_ALGOS:
            raise ValueError(f"modelopt quant_algo {algo!r} is not supported: {REFUSED_ALGOS[algo]}; pagellm reads "
                             f"ModelOpt's {', '.join(FP8_ALGOS)} checkpoints")
        if algo not in FP8_ALGOS:
            raise ValueError(f"modelopt quant_algo {algo!r} is unknown; pagellm reads {', '.join(FP8_ALGOS)}")
        if not isinstance(exclude, list) or not all(isinstance(entry, str) for entry in exclude):
            raise ValueError(f"modelopt exclude_modules / ignore is {exclude!r}, not a list of module names")
        return cls(algo, exclude)

    def excluded(self, name: str) -> bool:
        """vLLM's is_layer_excluded: a name contained in `name` (a whole one included), or an fnmatch wildcard."""
        return any(entry in name or fnmatch.fnmatchcase(name, entry) for entry in self.exclude_modules)

    def linear_method(self, prefix: str) -> LinearMethod:
        if prefix.endswith("embed_tokens"):
            return self.dense
        names = checkpoint_module_names(prefix, self.excluded)
        excluded = all_or_none(prefix, names, [self.excluded(name) for name in names], "the modelopt config excludes")
        return self.dense if excluded else self.method

    def describe(self) -> str:
        what = {"FP8": "per-tensor weight scales, static input scales in the checkpoint",
                "FP8_PER_CHANNEL_PER_TOKEN": "per-channel weight scales",
                "FP8_PB_WO": "weight scales per block of 128 x 128"}[self.algo]
        excluded = f", dense: {', '.join(self.exclude_modules)}" if self.exclude_modules else ""
        return f"modelopt {self.algo} (float8_e4m3fn weights, {what}; activations in the model dtype{excluded})"


def modelopt_config(checkpoint_config: dict | None, requested: str | None) -> ModelOptFp8Config:
    """The registry's factory for "modelopt": a checkpoint format only."""
    if checkpoint_config is None:
        raise ValueError(f"quantization={requested!r} reads NVIDIA ModelOpt checkpoints (config.json's "
                         "quantization_config or hf_quant_config.json); this one is not quantized. For online fp8 "
                         "use quantization='fp8_per_tensor' (or fp8_per_channel, fp8_per_block, mxfp8).")
    return ModelOptFp8Config.from_config(checkpoint_config)
