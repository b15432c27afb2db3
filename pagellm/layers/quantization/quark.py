"""AMD Quark checkpoints (quant_method "quark", vLLM's QuarkConfig): their W8A8 schemes on pagellm's 8-bit kernels.

quantization_config: `global_quant_config` {weight, input_tensors, output_tensors, bias}, each a tensor spec (dtype
fp8_e4m3 / int8 / ..., qscheme per_tensor / per_channel / per_group, is_dynamic, symmetric); `layer_quant_config`
{pattern: config} overriding it per module (a pattern with "*" is an fnmatch pattern; one without names the modules
it contains, as vLLM matches them); `layer_type_quant_config`; `exclude` (module names, or "re:" expressions
matched from the start, as vLLM matches them: dense); `export.kv_cache_group` (the modules whose output_tensors
are the KV cache's scales, `k_proj.output_scale` ...).

Schemes read, per layer (its fused shards alike):
- fp8 W8A8: float8_e4m3fn weights, per_tensor (`weight_scale` per checkpoint tensor) or per_channel ([N]) scales;
  inputs static per_tensor (`input_scale`, loaded and not applied) or dynamic: the fp8 kernels, activations in the
  model's dtype, as for every fp8 format here;
- int8 W8A8: symmetric int8 weights per_tensor or per_channel, inputs static symmetric per_tensor or dynamic per
  token: the int8 W8A8 kernels (csrc/w8a8.c), as compressed-tensors' int8.
Others (OCP MX fp4 / fp6, NVFP4, W4A8, asymmetric static inputs, quantized outputs or biases) are refused naming
the spec. The KV cache's calibrated scales are passed over (pagellm's 8-bit KV caches scale each row).
"""

from __future__ import annotations

import fnmatch
import json

from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig, SkipsKVCacheScales
from pagellm.layers.quantization.compressed_tensors import equal_or_regex_match
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.quantization.w8a8 import (Fp8LinearMethod, Int8LinearMethod, all_or_none, checkpoint_module_names,
                                              is_embedding_or_head)

WEIGHT_QSCHEMES = ("per_tensor", "per_channel")


def _matches(module: str, pattern: str) -> bool:
    """vLLM's quark matching: fnmatch where the pattern has "*", else the module name contained in the pattern."""
    return fnmatch.fnmatch(module, pattern) if "*" in pattern else module in pattern


class QuarkConfig(SkipsKVCacheScales, QuantizationConfig):
    name = "quark"

    def __init__(self, config: dict) -> None:
        self.global_config = config.get("global_quant_config") or {}
        self.layer_configs: dict[str, dict] = dict(config.get("layer_quant_config") or {})
        if config.get("layer_type_quant_config"):
            raise ValueError("Quark checkpoint with a layer_type_quant_config: pagellm reads global_quant_config with "
                             "per-module layer_quant_config overrides")
        self.exclude: list[str] = list(config.get("exclude") or [])
        self.kv_cache_group: list[str] = list((config.get("export") or {}).get("kv_cache_group") or [])
        self.dense = UnquantizedLinearMethod()
        self._methods: dict[str, LinearMethod] = {}

    def linear_method(self, prefix: str) -> LinearMethod:
        if is_embedding_or_head(prefix):  # vLLM's quark quantizes linear layers only
            return self.dense
        names = checkpoint_module_names(prefix, self._excluded)
        if all_or_none(prefix, names, [self._excluded(name) for name in names], "the Quark checkpoint's exclude lists"):
            return self.dense
        configs = [self._config_of(name) for name in names]
        keys = {json.dumps(self._linear_part(name, config), sort_keys=True) for name, config in zip(names, configs)}
        if len(keys) > 1:
            raise ValueError(f"{prefix} fuses {names}, which the Quark checkpoint quantizes differently; pagellm (as "
                             "vLLM) needs the fused shards quantized alike")
        key = keys.pop()
        if key not in self._methods:
            self._methods[key] = _method(json.loads(key), prefix)
        return self._methods[key]

    def _excluded(self, module: str) -> bool:
        return any(equal_or_regex_match(entry, module) for entry in self.exclude)

    def _config_of(self, module: str) -> dict:
        for pattern, config in self.layer_configs.items():
            if _matches(module, pattern):
                return config
        return self.global_config

    def _linear_part(self, module: str, config: dict) -> dict:
        """The spec that decides a layer's method: its output_tensors are the KV cache's where the module is in
        kv_cache_group (passed over), a quantized output elsewhere."""
        kv = any(_matches(module, pattern) for pattern in self.kv_cache_group)
        is_query = module.endswith("q_proj") and bool(self.kv_cache_group)  # vLLM drops q's output spec with the KV's
        outputs = None if kv or is_query else config.get("output_tensors")
        return {"weight": config.get("weight"), "input_tensors": config.get("input_tensors"),
                "output_tensors": outputs, "bias": config.get("bias")}

    def describe(self) -> str:
        schemes = sorted({_describe(json.loads(key)) for key in self._methods}) or ["none yet"]
        dense = f", dense: {len(self.exclude)} exclude entries" if self.exclude else ""
        return f"quark ({'; '.join(schemes)}; activations kept in the model dtype for fp8{dense})"


def _describe(spec: dict) -> str:
    weight, inputs = spec["weight"], spec["input_tensors"] or {}
    mode = "dynamic" if inputs.get("is_dynamic") else "static"
    return f"{weight['dtype']} W8A8, {weight['qscheme']} weights, {mode} {inputs.get('qscheme')} inputs"


def _method(spec: dict, prefix: str) -> LinearMethod:
    weight, inputs = spec["weight"], spec["input_tensors"]
    where = f"Quark checkpoint's spec for {prefix}"
    if spec["output_tensors"] or spec["bias"]:
        raise ValueError(f"{where} quantizes its outputs or bias; pagellm (as vLLM) reads quantized weights and "
                         "inputs only")
    if not isinstance(weight, dict) or not isinstance(inputs, dict):
        raise ValueError(f"{where}: weight={weight!r}, input_tensors={inputs!r}; pagellm reads Quark's fp8 and int8 "
                         "W8A8 schemes (OCP MX, NVFP4 and W4A8 need GPUs with those units)")
    dtypes = (weight.get("dtype"), inputs.get("dtype"))
    static_weight = not weight.get("is_dynamic") and weight.get("qscheme") in WEIGHT_QSCHEMES
    dynamic_input = bool(inputs.get("is_dynamic"))
    input_per_tensor = inputs.get("qscheme") == "per_tensor"
    if dtypes == ("fp8_e4m3", "fp8_e4m3") and static_weight and (dynamic_input or input_per_tensor):
        return Fp8LinearMethod("tensor" if weight["qscheme"] == "per_tensor" else "channel",
                               static_input=not dynamic_input)
    if dtypes == ("int8", "int8") and static_weight and weight.get("symmetric") is True:
        if dynamic_input and inputs.get("qscheme") == "per_channel":
            return Int8LinearMethod(weight["qscheme"] == "per_channel", static_input=False)
        if not dynamic_input and input_per_tensor and inputs.get("symmetric") is True:
            return Int8LinearMethod(weight["qscheme"] == "per_channel", static_input=True)
    raise ValueError(f"{where}: weight {weight}, inputs {inputs} is not a scheme pagellm reads; it reads fp8_e4m3 "
                     "W8A8 (per_tensor / per_channel weights, static per_tensor or dynamic inputs) and symmetric int8 "
                     "W8A8 (static symmetric per_tensor or dynamic per-token inputs)")


def quark_config(config: dict | None, requested: str | None) -> QuarkConfig:
    if not config:
        raise ValueError("quantization='quark' names the format of AMD Quark checkpoints; this checkpoint is not "
                         "quantized")
    return QuarkConfig(config)
