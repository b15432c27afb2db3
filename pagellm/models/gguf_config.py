"""Model configs for GGUF files, without transformers.

Importing transformers (any of it) costs an engine ~20 MiB of resident modules, more than a fifth of a small GGUF
(README, "Memory"), and its model config modules pull in its activations, its kernel hub, accelerate,
torch.distributed.tensor and sympy besides. A GGUF's config here is a plain object of the same `model_type` holding
the fields transformers' class would hold beyond `PretrainedConfig`'s common ones: that class's defaults (tables
below), the file's values, and the fields its `__post_init__` derives. `tests/test_gguf_config.py` checks every
field against transformers' own class for each architecture the loader reads; `to_transformers()` builds that class
where a caller needs it (the HF export, the oracles).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable


class GGUFModelConfig:
    """A GGUF model's config: the fields of transformers' class of the same name less the GGUF prefix, under the
    same model_type; `attribute_map`'s aliases read and write the field they stand for, as transformers' do."""

    model_type = ""
    attribute_map: dict[str, str] = {}

    def __init__(self, **fields: Any) -> None:
        for key, value in fields.items():
            setattr(self, key, value)

    def __setattr__(self, key: str, value: Any) -> None:
        super().__setattr__(type(self).attribute_map.get(key, key), value)

    def __getattr__(self, key: str) -> Any:
        # Reached only for names not set: an alias reads its field.
        target = type(self).attribute_map.get(key)
        if target is None:
            raise AttributeError(f"{type(self).__name__} has no field {key!r}")
        return getattr(self, target)

    def __repr__(self) -> str:
        return f"{type(self).__name__} {self.to_dict()}"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def get_text_config(self, *args: Any, **kwargs: Any) -> GGUFModelConfig:
        return self  # a text-only model: its own text config, as transformers' gives

    def to_dict(self) -> dict[str, Any]:
        return {**copy.deepcopy(vars(self)), "model_type": self.model_type}

    @classmethod
    def transformers_class(cls) -> str:
        return cls.__name__.removeprefix("GGUF")

    def to_transformers(self):
        """The same config as transformers' own class (imports its model config module), which derives its
        derived fields again from the same inputs, so to the same values."""
        import transformers

        fields = {key: value for key, value in self.to_dict().items() if key != "model_type"}
        return getattr(transformers, self.transformers_class())(**fields)


class GGUFLlamaConfig(GGUFModelConfig):
    model_type = "llama"


class GGUFQwen2Config(GGUFModelConfig):
    model_type = "qwen2"


class GGUFQwen3Config(GGUFModelConfig):
    model_type = "qwen3"


class GGUFGemma3TextConfig(GGUFModelConfig):
    model_type = "gemma3_text"


class GGUFMixtralConfig(GGUFModelConfig):
    model_type = "mixtral"
    attribute_map = {"num_experts": "num_local_experts"}


class GGUFOlmoeConfig(GGUFModelConfig):
    model_type = "olmoe"
    attribute_map = {"num_local_experts": "num_experts"}


class GGUFQwen3MoeConfig(GGUFModelConfig):
    model_type = "qwen3_moe"
    attribute_map = {"num_experts": "num_local_experts"}


class GGUFDeepseekV2Config(GGUFModelConfig):
    model_type = "deepseek_v2"
    attribute_map = {"num_experts": "n_routed_experts"}


class GGUFDeepseekV3Config(GGUFModelConfig):
    model_type = "deepseek_v3"
    attribute_map = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}


class GGUFGptOssConfig(GGUFModelConfig):
    model_type = "gpt_oss"
    attribute_map = {"num_experts": "num_local_experts"}


def _heads_default(values: dict[str, Any]) -> None:
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]


def _llama_derived(values: dict[str, Any]) -> None:
    if values.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    _heads_default(values)


def _qwen_derived(values: dict[str, Any]) -> None:
    if not values["use_sliding_window"]:
        values["sliding_window"] = None
    _heads_default(values)
    if values.get("layer_types") is None:
        values["layer_types"] = [
            "sliding_attention" if values["sliding_window"] is not None and i >= values["max_window_layers"]
            else "full_attention" for i in range(values["num_hidden_layers"])]


def _gemma3_derived(values: dict[str, Any]) -> None:
    values["_sliding_window_pattern"] = values.get("sliding_window_pattern", 6)
    if values.get("layer_types") is None:
        values["layer_types"] = [
            "sliding_attention" if (i + 1) % values["_sliding_window_pattern"] else "full_attention"
            for i in range(values["num_hidden_layers"])]


def _qwen3_moe_derived(values: dict[str, Any]) -> None:
    if not values["use_sliding_window"]:
        values["sliding_window"] = None
    if values.get("mlp_only_layers") is None:
        values["mlp_only_layers"] = []


def _gpt_oss_derived(values: dict[str, Any]) -> None:
    _llama_derived(values)
    if values.get("layer_types") is None:
        values["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                 for i in range(values["num_hidden_layers"])]
    if values.get("rope_parameters") is None:
        values["rope_parameters"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 4096,
                                     "rope_theta": 150000.0}


def _deepseek_derived(values: dict[str, Any]) -> None:
    values["qk_head_dim"] = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]
    values["head_dim"] = values["qk_rope_head_dim"]
    _heads_default(values)


@dataclass(frozen=True)
class _Family:
    config_class: type[GGUFModelConfig]
    defaults: dict[str, Any]
    derive: Callable[[dict[str, Any]], None]


_DECODER = dict(hidden_act="silu", initializer_range=0.02, use_cache=True, tie_word_embeddings=False,
                attention_dropout=0.0, rms_norm_eps=1e-6, rope_parameters=None)
_LLAMA = dict(_DECODER, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048, pad_token_id=None,
              bos_token_id=1, eos_token_id=2, pretraining_tp=1, attention_bias=False, mlp_bias=False, head_dim=None)
_QWEN = dict(_DECODER, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=32768,
             use_sliding_window=False, sliding_window=None, max_window_layers=28, layer_types=None,
             pad_token_id=None, bos_token_id=None, eos_token_id=None)
_DEEPSEEK = dict({key: value for key, value in _LLAMA.items() if key != "mlp_bias"}, n_shared_experts=2,
                 n_routed_experts=64, output_router_logits=False, routed_scaling_factor=1.0, kv_lora_rank=512,
                 q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=None,
                 topk_group=None, num_experts_per_tok=None,
                 first_k_dense_replace=0, norm_topk_prob=False, moe_intermediate_size=1407, vocab_size=102400)

# Keyed by transformers' class name; the defaults are that class's (transformers 5), the derivations its
# __post_init__'s.
_FAMILIES: dict[str, _Family] = {family.config_class.transformers_class(): family for family in (
    _Family(GGUFLlamaConfig, _LLAMA, _llama_derived),
    _Family(GGUFQwen2Config, _QWEN, _qwen_derived),
    _Family(GGUFQwen3Config, dict(_QWEN, head_dim=128, attention_bias=False), _qwen_derived),
    _Family(GGUFGemma3TextConfig, {
        **{key: value for key, value in _DECODER.items() if key != "hidden_act"},
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
        "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "layer_types": None, "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "use_bidirectional_attention": False}, _gemma3_derived),
    _Family(GGUFMixtralConfig, dict(
        _DECODER, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=None, max_position_embeddings=131072,
        rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=1, eos_token_id=2, sliding_window=None,
        num_experts_per_tok=2, num_local_experts=8, output_router_logits=False, router_aux_loss_coef=0.001,
        router_jitter_noise=0.0), _heads_default),
    _Family(GGUFOlmoeConfig, dict(
        _DECODER, vocab_size=50304, hidden_size=2048, intermediate_size=2048, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=None, max_position_embeddings=4096, rms_norm_eps=1e-5,
        pad_token_id=1, bos_token_id=None, eos_token_id=50279, attention_bias=False, clip_qkv=None,
        num_experts_per_tok=8, num_experts=64, output_router_logits=False, router_aux_loss_coef=0.01,
        norm_topk_prob=False), _heads_default),
    _Family(GGUFQwen3MoeConfig, dict(
        _DECODER, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768, attention_bias=False,
        use_sliding_window=False, sliding_window=None, decoder_sparse_step=1, moe_intermediate_size=768,
        num_experts_per_tok=8, num_local_experts=128, norm_topk_prob=False, output_router_logits=False,
        router_aux_loss_coef=0.001, mlp_only_layers=None, pad_token_id=None, bos_token_id=None,
        eos_token_id=None), _qwen3_moe_derived),
    _Family(GGUFGptOssConfig, dict(
        _DECODER, vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, num_experts_per_tok=4, num_local_experts=128, swiglu_alpha=1.702, swiglu_limit=7.0,
        router_aux_loss_coef=0.001, output_router_logits=False, layer_types=None, pad_token_id=None,
        bos_token_id=None, eos_token_id=None, attention_bias=True), _gpt_oss_derived),
    _Family(GGUFDeepseekV2Config, dict(_DEEPSEEK, topk_method="greedy", mlp_bias=False), _deepseek_derived),
    _Family(GGUFDeepseekV3Config, dict(
        _DEEPSEEK, vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096, bos_token_id=0,
        eos_token_id=1, rope_interleave=True, num_nextn_predict_layers=1), _deepseek_derived),
)}


def gguf_model_config(transformers_class: str, **fields: Any) -> GGUFModelConfig:
    """The config transformers' `transformers_class(**fields)` would give, without importing that class."""
    family = _FAMILIES[transformers_class]
    cls = family.config_class
    values = copy.deepcopy(family.defaults)
    # Alias names (Qwen3-MoE's num_experts) land on the field they stand for, as transformers' setattr maps them.
    values.update({cls.attribute_map.get(key, key): value for key, value in fields.items()})
    family.derive(values)
    return cls(**values)
