"""Which model class runs which checkpoint: the one table of supported architectures, and the refusal of
everything else (unknown architectures, quantised checkpoints) before any weight is read.

Model classes are named by module and class, imported only when a model is built, so that reading this
table (the CLI, config validation) does not import every family's code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    name: str
    # HF `architectures` names this family's class runs.
    architectures: tuple[str, ...]
    # HF `model_type`s of those architectures: a config without `architectures` (a GGUF's) is matched by these.
    model_types: tuple[str, ...]
    module: str
    class_name: str
    # Multimodal architectures whose language model this family runs (text in, text out): their config's
    # text_config describes it, and the family's load_weights skips the vision tensors.
    text_of: tuple[str, ...] = ()

    def model_class(self) -> type[nn.Module]:
        return getattr(importlib.import_module(self.module), self.class_name)


FAMILIES = (
    ModelFamily("Llama", ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
                ("llama", "mistral", "qwen2"), "pagellm.models.llama", "LlamaForCausalLM"),
    ModelFamily("Qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "pagellm.models.qwen3", "Qwen3ForCausalLM"),
    ModelFamily("Gemma 3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3_text", "gemma3"),
                "pagellm.models.gemma3", "Gemma3ForCausalLM", text_of=("Gemma3ForConditionalGeneration",)),
    ModelFamily("Phi-3", ("Phi3ForCausalLM",), ("phi3",), "pagellm.models.phi3", "Phi3ForCausalLM"),
    ModelFamily("DeepSeek-V2", ("DeepseekV2ForCausalLM",), ("deepseek_v2",), "pagellm.models.deepseek_v2",
                "DeepseekV2ForCausalLM"),
    ModelFamily("DeepSeek-V3", ("DeepseekV3ForCausalLM",), ("deepseek_v3",), "pagellm.models.deepseek_v2",
                "DeepseekV3ForCausalLM"),
    ModelFamily("Mixtral", ("MixtralForCausalLM",), ("mixtral",), "pagellm.models.mixtral", "MixtralForCausalLM"),
    ModelFamily("Qwen3-MoE", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "pagellm.models.qwen3_moe",
                "Qwen3MoeForCausalLM"),
    ModelFamily("OLMoE", ("OlmoeForCausalLM",), ("olmoe",), "pagellm.models.olmoe", "OlmoeForCausalLM"),
    ModelFamily("gpt-oss", ("GptOssForCausalLM",), ("gpt_oss",), "pagellm.models.gpt_oss", "GptOssForCausalLM"),
)
SUPPORTED_ARCHITECTURES = tuple(arch for family in FAMILIES for arch in family.architectures)
_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}
_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


def _field(config, name: str):
    """A config value, whether `config` is a transformers config or the raw config.json dict."""
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def family_of(config) -> ModelFamily:
    """The family that runs `config` (a transformers config or config.json as a dict), or a ValueError that
    names what the checkpoint is and what pagellm runs. Quantised checkpoints are refused here too."""
    check_not_quantized(config)
    architectures = _field(config, "architectures")
    if architectures:
        for arch in architectures:
            if arch in _BY_ARCHITECTURE:
                return _BY_ARCHITECTURE[arch]
        raise ValueError(
            f"architectures={list(architectures)} is not supported; pagellm runs {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    model_type = _field(config, "model_type")
    if model_type is None:
        return FAMILIES[0]  # a bare config: the Llama layout, as before there was a registry
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(
            f"model_type={model_type!r} (and no `architectures`) is not supported; pagellm runs model types "
            f"{', '.join(_BY_MODEL_TYPE)} ({', '.join(SUPPORTED_ARCHITECTURES)})."
        )
    return _BY_MODEL_TYPE[model_type]


def check_not_quantized(config) -> None:
    """A quantized checkpoint in a format no pagellm layer reads is refused by name before any weight is read."""
    from pagellm.layers.quantization import check_quantization_supported

    check_quantization_supported(config)


def language_model_config(config):
    """The config pagellm builds from: a multimodal checkpoint's text_config (named as the family's own
    architecture), else `config` itself."""
    family = family_of(config)
    architectures = getattr(config, "architectures", None) or []
    is_multimodal = any(arch in family.text_of for arch in architectures) or (
        not architectures and getattr(config, "text_config", None) is not None)
    if not is_multimodal:
        return config
    text_config = config.text_config
    text_config.architectures = [family.architectures[0]]
    return text_config


def model_class_for(config) -> type[nn.Module]:
    return family_of(config).model_class()
