"""`speculative_config`, with vLLM's field names: parsed from a dict (LLM(speculative_config=...), or the JSON of
`pagellm serve --speculative-config`), every bad value refused naming the field. Imports no torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

METHODS = ("ngram", "suffix", "draft_model", "mtp", "eagle")
# Methods that propose without a model of their own.
MODEL_FREE_METHODS = ("ngram", "suffix")
# Heads over the target's hidden states: DeepSeek-V3's multi-token-prediction layer in the target's own
# checkpoint, an EAGLE-1 head in a checkpoint of its own (spec_decode/heads.py).
HEAD_METHODS = ("mtp", "eagle")
# vLLM's older names of a method.
_METHOD_ALIASES = {"deepseek_mtp": "mtp"}
# vLLM's other methods: named in the refusal, so that a user learns what pagellm lacks rather than a typo.
_UNSUPPORTED_METHODS = ("eagle3", "medusa", "mlp_speculator", "ngram_gpu", "custom_class")
# vLLM's `model` values that name the n-gram method rather than a draft model (when method is unset).
_NGRAM_MODEL_NAMES = ("ngram", "[ngram]")
# When neither prompt_lookup bound is given (vLLM's default window).
DEFAULT_PROMPT_LOOKUP = 5
# Batches of more sequences than this decode with no drafts when disable_by_batch_size is unset: a batch that
# large already fills the step's compute, so verifying drafts costs more than it saves (see speculator.py).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# vLLM's fields that pagellm accepts at their defaults only (they select kernels, samplers or draft settings
# pagellm does not have).
_DEFAULT_ONLY = {
    "tensor_parallel_size": None, "code_revision": None, "max_model_len": None, "parallel_drafting": False,
    "speculative_token_tree": None, "rejection_sample_method": "standard", "draft_sample_method": "greedy",
    "num_speculative_tokens_per_batch_size": None, "use_heterogeneous_vocab": False,
}
# Accepted and ignored: hints for vLLM's GPU drafters that change no token.
_NO_EFFECT = ("enforce_eager", "disable_padded_drafter_batch", "disable_eagle_block_drop", "disable_logprobs",
              "disable_log_stats", "attention_backend", "moe_backend", "kv_cache_dtype", "use_local_argmax_reduction",
              "enable_adaptive_verification")


class SpeculativeConfigError(ValueError):
    """A speculative_config pagellm refuses; the message names the field, its value and what is allowed."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    # Above this many running sequences no request is given drafts (vLLM's field; None: pagellm's default).
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model: the draft's checkpoint (a HuggingFace directory, a .gguf file or a cached hub id), its
    # revision and quantization (as the engine's own `revision` / `quantization`).
    model: str | None = None
    revision: str | None = None
    quantization: str | None = None
    draft_tensor_parallel_size: int | None = None

    @classmethod
    def from_dict(cls, raw: object) -> SpeculativeConfig:
        if dataclasses.is_dataclass(raw) and not isinstance(raw, type):
            raw = dataclasses.asdict(raw)
        if not isinstance(raw, dict):
            raise SpeculativeConfigError(f"speculative_config={raw!r:.200} must be a dict (JSON object), e.g. "
                                         '{"method": "ngram", "num_speculative_tokens": 4}.')
        values = dict(raw)
        method = values.pop("method", None)
        model = values.get("model")
        if method is None and model is not None:
            method = _infer_method(model)
        method = _METHOD_ALIASES.get(method, method)
        if method not in METHODS:
            known = " (a vLLM method pagellm does not run)" if method in _UNSUPPORTED_METHODS else ""
            raise SpeculativeConfigError(f"speculative_config.method={method!r} is not supported{known}; use one of "
                                         f"{', '.join(METHODS)}.")
        k = values.pop("num_speculative_tokens", None)
        _check_int("num_speculative_tokens", k, 1, "the drafts proposed per step, e.g. 4")
        for name, default in _DEFAULT_ONLY.items():
            if name in values and values.pop(name) not in (default, None):
                raise SpeculativeConfigError(
                    f"speculative_config.{name}={raw[name]!r:.100} is not supported by pagellm's {method} method; "
                    f"leave {name} unset.")
        for name in _NO_EFFECT:
            values.pop(name, None)
        fields = {f.name for f in dataclasses.fields(cls)} - {"method", "num_speculative_tokens"}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise SpeculativeConfigError(f"speculative_config has unknown field(s) {', '.join(unknown)}; known: "
                                         f"method, num_speculative_tokens, {', '.join(sorted(fields))}.")
        lookup_min, lookup_max = values.pop("prompt_lookup_min", None), values.pop("prompt_lookup_max", None)
        for name, value in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
            if value is not None:
                _check_int(name, value, 1, "an n-gram length in tokens")
        # vLLM's defaults: one bound given stands for both ends; none given means 5.
        lookup_min = lookup_min if lookup_min is not None else (lookup_max or DEFAULT_PROMPT_LOOKUP)
        lookup_max = lookup_max if lookup_max is not None else lookup_min
        if lookup_min > lookup_max:
            raise SpeculativeConfigError(f"speculative_config.prompt_lookup_min={lookup_min} is more than "
                                         f"prompt_lookup_max={lookup_max}; use min <= max.")
        by_batch = values.pop("disable_by_batch_size", None)
        if by_batch is None:
            by_batch = DEFAULT_DISABLE_BY_BATCH_SIZE
        _check_int("disable_by_batch_size", by_batch, 1, "the largest batch of sequences that still speculates")
        config = cls(method, k, lookup_min, lookup_max, by_batch, **values)
        config._check_suffix_fields()
        config._check_model_fields()
        return config

    def _check_model_fields(self) -> None:
        if self.method in MODEL_FREE_METHODS:
            if self.model is not None and self.model not in _NGRAM_MODEL_NAMES:
                raise SpeculativeConfigError(
                    f"speculative_config.model={self.model!r} with method={self.method!r}: that method uses no "
                    'model; leave model unset, or use "method": "draft_model".')
            for name in ("revision", "quantization", "draft_tensor_parallel_size"):
                if getattr(self, name) is not None:
                    raise SpeculativeConfigError(f"speculative_config.{name}={getattr(self, name)!r} is for a draft "
                                                 f"model; method={self.method!r} has none: leave {name} unset.")
            return
        if self.draft_tensor_parallel_size not in (None, 1):
            raise SpeculativeConfigError(
                f"speculative_config.draft_tensor_parallel_size={self.draft_tensor_parallel_size!r} is not "
                "supported; the draft runs on one rank: leave it unset or 1.")
        if self.method == "mtp":
            # The layer is in the target's checkpoint (vLLM sets model to the target's for this method).
            for name in ("model", "revision", "quantization"):
                if getattr(self, name) is not None:
                    raise SpeculativeConfigError(
                        f"speculative_config.{name}={getattr(self, name)!r}: method 'mtp' runs the target's own "
                        f"multi-token-prediction layer, from the target's checkpoint; leave {name} unset.")
            return
        if not isinstance(self.model, str) or not self.model:
            example = "/path/to/eagle-head" if self.method == "eagle" else "/path/to/small-model"
            raise SpeculativeConfigError(
                f"speculative_config.model={self.model!r}: method {self.method!r} needs the {self._model_kind} "
                f'checkpoint, e.g. {{"method": "{self.method}", "model": "{example}", '
                '"num_speculative_tokens": 4}.')
        if _looks_like_path(self.model) and not Path(self.model).expanduser().exists():
            raise SpeculativeConfigError(
                f"speculative_config.model={self.model!r}: {Path(self.model).expanduser().absolute()} does not "
                f"exist; pass the {self._model_kind} HuggingFace directory or .gguf file (or a hub id in the local "
                "cache).")
        for name in ("revision", "quantization"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise SpeculativeConfigError(f"speculative_config.{name}={value!r} must be a str or unset.")

    @property
    def _model_kind(self) -> str:
        return "EAGLE head's" if self.method == "eagle" else "draft's"

    @property
    def uses_draft_model(self) -> bool:
        """A model in the model runner proposes the drafts (a draft model or a head): the scheduler only counts
        them."""
        return self.method not in MODEL_FREE_METHODS

    @property
    def uses_head(self) -> bool:
        return self.method in HEAD_METHODS

    def _check_suffix_fields(self) -> None:
        _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1,
                   "how deep the suffix trees go (match plus drafts)")
        _check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0,
                   "finished requests kept in the global tree (0: none)")
        for name, low, high in (("suffix_decoding_max_spec_factor", 0.0, float("inf")),
                                ("suffix_decoding_min_token_prob", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise SpeculativeConfigError(f"speculative_config.{name}={value!r} is out of range; allowed: a "
                                             f"number in [{low:g}, {high:g}].")


def _infer_method(model: object) -> str:
    """vLLM's inference when only `model` is given: the n-gram names, an EAGLE head named so by its checkpoint
    (EAGLE-3 heads refused rather than run as a draft), else a draft model."""
    if model in _NGRAM_MODEL_NAMES:
        return "ngram"
    if isinstance(model, str) and "eagle3-" in model.lower():
        raise SpeculativeConfigError(
            f"speculative_config.model={model!r} looks like an EAGLE-3 head, which pagellm does not run; use an "
            'EAGLE-1 head with "method": "eagle", a draft model with "method": "draft_model", or ngram, suffix.')
    if isinstance(model, str) and "eagle-" in model.lower():
        return "eagle"
    return "draft_model"


def _looks_like_path(model: str) -> bool:
    """A local path rather than a hub id (org/name), which the loader looks up in the Hugging Face cache."""
    return model.startswith(("/", ".", "~")) or model.endswith(".gguf") or model.count("/") > 1


def _check_int(name: str, value: object, low: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SpeculativeConfigError(f"speculative_config.{name}={value!r} is out of range; allowed: an int >= "
                                     f"{low} ({meaning}).")
