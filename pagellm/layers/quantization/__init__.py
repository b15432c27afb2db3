"""Which weight format a model loads with: the checkpoint's `quantization_config` (AWQ, GPTQ, compressed-
tensors, FP8 ...), a GGUF file's own types, or `quantization=` for online quantization of a float checkpoint.
Each format is a QuantizationConfig registered here under vLLM's name for it."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from pagellm.layers.quantization.base import QuantizationConfig

# vLLM's method name -> "module:factory", the factory taking (the checkpoint's quantization_config dict or None,
# the method asked for by quantization=) and returning the config. Imported only when a model uses it.
QUANTIZATION_METHODS: dict[str, str] = {
    "awq": "pagellm.layers.quantization.awq:awq_config",
    "gptq": "pagellm.layers.quantization.gptq:gptq_config",
    "compressed-tensors": "pagellm.layers.quantization.compressed_tensors:compressed_tensors_config",
    "fp8": "pagellm.layers.quantization.fp8:fp8_config",
    "int8": "pagellm.layers.quantization.w8a8:online_int8_config",
    "experts_int8": "pagellm.layers.quantization.experts_int8:experts_int8_config",
    "mxfp4": "pagellm.layers.quantization.mxfp4:mxfp4_config",
}


def supported_methods() -> list[str]:
    return sorted(QUANTIZATION_METHODS)


def checkpoint_quantization(hf_config) -> dict | None:
    """The checkpoint's quantization_config as a dict (transformers keeps some as objects), or None."""
    config = hf_config.get("quantization_config") if isinstance(hf_config, dict) else getattr(
        hf_config, "quantization_config", None)
    if not config:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    method = config.get("quant_method")
    config["quant_method"] = getattr(method, "value", method)  # some are enums
    return config


def check_quantization_supported(hf_config, requested: str | None = None) -> str | None:
    """The method the model loads with (None: unquantized), or a ValueError naming what was found or asked
    for and the methods pagellm runs."""
    checkpoint = checkpoint_quantization(hf_config)
    found = checkpoint["quant_method"] if checkpoint else None
    if found is not None and requested is not None and requested != found:
        raise ValueError(f"quantization={requested!r} but the checkpoint is quantized with {found!r}; leave "
                         "quantization unset (the checkpoint's method is used) or pass that method.")
    method = found or requested
    if method is not None and method not in QUANTIZATION_METHODS:
        where = f"the checkpoint's quantization_config.quant_method={method!r}" if found else f"quantization={method!r}"
        supported = ", ".join(supported_methods()) or "none yet"
        raise ValueError(f"{where} is not supported; pagellm loads {supported}, GGUF files (kept in their blocks) "
                         "and unquantized float32/float16/bfloat16 checkpoints.")
    return method


def quantization_config_for(hf_config, requested: str | None = None) -> QuantizationConfig | None:
    """The QuantizationConfig the model's layers take their methods from (None: unquantized)."""
    method = check_quantization_supported(hf_config, requested)
    if method is None:
        return None
    module_name, factory_name = QUANTIZATION_METHODS[method].split(":")
    factory: Callable[[dict | None, str | None], QuantizationConfig] = getattr(
        importlib.import_module(module_name), factory_name)
    return factory(checkpoint_quantization(hf_config), requested)
