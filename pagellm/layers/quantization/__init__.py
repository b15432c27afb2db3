"""Which weight format a model loads with: the checkpoint's `quantization_config` (AWQ, GPTQ, compressed-
tensors, FP8 ...), a GGUF file's own types, or `quantization=` for online quantization of a float checkpoint.
Each format is a QuantizationConfig registered here under vLLM's name for it."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

from pagellm import online_quantization
from pagellm.config import QUANTIZATION_KERNEL_ALIASES
from pagellm.layers.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)

# vLLM's method name -> "module:factory", the factory taking (the checkpoint's quantization_config dict or None,
# the method asked for by quantization=) and returning the config. Imported only when a model uses it.
QUANTIZATION_METHODS: dict[str, str] = {
    "awq": "pagellm.layers.quantization.awq:awq_config",
    "gptq": "pagellm.layers.quantization.gptq:gptq_config",
    "compressed-tensors": "pagellm.layers.quantization.compressed_tensors:compressed_tensors_config",
    "fp8": "pagellm.layers.quantization.fp8:fp8_config",
    "fbgemm_fp8": "pagellm.layers.quantization.fp8:fbgemm_fp8_config",
    "int8": "pagellm.layers.quantization.w8a8:online_int8_config",
    "experts_int8": "pagellm.layers.quantization.experts_int8:experts_int8_config",
    "mxfp4": "pagellm.layers.quantization.mxfp4:mxfp4_config",
    "modelopt": "pagellm.layers.quantization.modelopt:modelopt_config",
    "bitsandbytes": "pagellm.layers.quantization.bitsandbytes:bitsandbytes_config",
    "auto-round": "pagellm.layers.quantization.auto_round:auto_round_config",
    "quark": "pagellm.layers.quantization.quark:quark_config",
    "rtn": "pagellm.layers.quantization.rtn:rtn_config",
    "hqq": "pagellm.layers.quantization.hqq:hqq_config",
    "ptpc_fp8": "pagellm.layers.quantization.online:ptpc_fp8_config",
    "intel/auto-round": "pagellm.layers.quantization.auto_round:auto_round_config",  # older AutoRound exports
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


def check_quantization_supported(hf_config, requested: str | None = None,
                                 online_config: dict | None = None) -> str | None:
    """The method the model loads with (None: unquantized; "online" for vLLM's online frontend, a shorthand or
    `quantization_config`), or a ValueError naming what was found or asked for and the methods pagellm runs."""
    checkpoint = checkpoint_quantization(hf_config)
    found = checkpoint["quant_method"] if checkpoint else None
    if online_quantization.is_online(requested, online_config):
        online_quantization.resolve(requested, online_config)
        if found is not None:
            asked = f"quantization={requested!r}" if requested else "quantization_config"
            raise ValueError(f"{asked} quantizes a float checkpoint as it loads, but the checkpoint is quantized "
                             f"with {found!r} already; leave quantization and quantization_config unset")
        return "online"
    if online_config is not None:
        online_quantization.resolve(requested, online_config)  # refuses it, naming the online methods
    if requested in QUANTIZATION_KERNEL_ALIASES:
        methods = QUANTIZATION_KERNEL_ALIASES[requested]
        if found not in methods:
            what = f"quantized with {found!r}" if found else "not quantized"
            raise ValueError(f"quantization={requested!r} is vLLM's name for kernels of {' or '.join(methods)} "
                             f"checkpoints; this checkpoint is {what}. Leave quantization unset (the checkpoint's "
                             "own method is used).")
        logger.info("quantization=%r: the checkpoint's %s weights run on pagellm's kernels for them", requested,
                    found)
        return found
    if found is not None and requested is not None and requested != found:
        raise ValueError(f"quantization={requested!r} but the checkpoint is quantized with {found!r}; leave "
                         "quantization unset (the checkpoint's method is used) or pass that method.")
    method = found or requested
    if method is not None and method not in QUANTIZATION_METHODS:
        where = f"the checkpoint's quantization_config.quant_method={method!r}" if found else f"quantization={method!r}"
        why = online_quantization.REFUSED_SHORTHANDS.get(method)
        why = f" ({why})" if why and not found else ""
        raise ValueError(f"{where} is not supported{why}; pagellm loads {', '.join(supported_methods())}, GGUF "
                         "files (kept in their blocks) and unquantized float32/float16/bfloat16 checkpoints, and "
                         f"quantizes float ones as they load with {', '.join(online_quantization.ONLINE_METHODS)}.")
    return method


def check_source_quantization(is_gguf: bool, requested: str | None, online_config: dict | None) -> None:
    """A GGUF file's tensors keep the types the file gives them: `quantization=` other than "gguf" (vLLM's name
    for them), or online settings, would be ignored, so they are refused; "gguf" needs such a file."""
    if is_gguf and (requested not in (None, "gguf") or online_config is not None):
        asked = f"quantization={requested!r}" if requested else "quantization_config"
        raise ValueError(f"{asked} does not apply to a GGUF file, whose tensors keep the types the file gives them "
                         "(quantized ones stay in their blocks); leave it unset, or pass an HF checkpoint directory "
                         "to quantize float weights as they load")
    if not is_gguf and requested == "gguf":
        raise ValueError("quantization='gguf' needs a .gguf model file; this model is an HF checkpoint directory "
                         "(leave quantization unset to use its own format)")


def quantization_config_for(hf_config, requested: str | None = None,
                            online_config: dict | None = None) -> QuantizationConfig | None:
    """The QuantizationConfig the model's layers take their methods from (None: unquantized); `online_config` is
    vLLM's `quantization_config` argument (online quantization's settings, not the checkpoint's)."""
    method = check_quantization_supported(hf_config, requested, online_config)
    if method is None:
        return None
    if method == "online":
        from pagellm.layers.quantization.online import OnlineConfig

        return OnlineConfig(online_quantization.resolve(requested, online_config), requested)
    module_name, factory_name = QUANTIZATION_METHODS[method].split(":")
    factory: Callable[[dict | None, str | None], QuantizationConfig] = getattr(
        importlib.import_module(module_name), factory_name)
    return factory(checkpoint_quantization(hf_config), requested)
