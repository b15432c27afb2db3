"""`speculative_config`, with vLLM's field names: parsed from a dict (LLM(speculative_config=...), or the JSON of
`pagellm serve --speculative-config`), every bad value refused naming the field. Imports no torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

METHODS = ("ngram", "suffix")
# vLLM's other methods: named in the refusal, so that a user learns what pagellm lacks rather than a typo.
_UNSUPPORTED_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp",
                        "ngram_gpu", "custom_class")
# When neither prompt_lookup bound is given (vLLM's default window).
DEFAULT_PROMPT_LOOKUP = 5
# Batches of more sequences than this decode with no drafts when disable_by_batch_size is unset: a batch that
# large already fills the step's compute, so verifying drafts costs more than it saves (see speculator.py).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# vLLM's fields that pagellm accepts at their defaults only (they select draft models, kernels or samplers).
_DEFAULT_ONLY = {
    "model": None, "draft_tensor_parallel_size": None, "tensor_parallel_size": None, "quantization": None,
    "revision": None, "code_revision": None, "max_model_len": None, "parallel_drafting": False,
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

    @classmethod
    def from_dict(cls, raw: object) -> SpeculativeConfig:
        if dataclasses.is_dataclass(raw) and not isinstance(raw, type):
            raw = dataclasses.asdict(raw)
        if not isinstance(raw, dict):
            raise SpeculativeConfigError(f"speculative_config={raw!r:.200} must be a dict (JSON object), e.g. "
                                         '{"method": "ngram", "num_speculative_tokens": 4}.')
        values = dict(raw)
        method = values.pop("method", None)
        if method is None and values.get("model") is not None:
            raise SpeculativeConfigError(
                f"speculative_config.model={values['model']!r}: draft models are not supported by pagellm; use "
                f'"method": one of {", ".join(METHODS)} (no extra model).')
        if method not in METHODS:
            known = " (a vLLM method pagellm does not run)" if method in _UNSUPPORTED_METHODS else ""
            raise SpeculativeConfigError(f"speculative_config.method={method!r} is not supported{known}; use one of "
                                         f"{', '.join(METHODS)}.")
        k = values.pop("num_speculative_tokens", None)
        _check_int("num_speculative_tokens", k, 1, "the drafts proposed per step, e.g. 4")
        for name, default in _DEFAULT_ONLY.items():
            if name in values and values.pop(name) not in (default, None):
                raise SpeculativeConfigError(
                    f"speculative_config.{name}={raw[name]!r:.100} is not supported: pagellm speculates with "
                    f"{'/'.join(METHODS)} only (no draft model); leave {name} unset.")
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
        return config

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


def _check_int(name: str, value: object, low: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SpeculativeConfigError(f"speculative_config.{name}={value!r} is out of range; allowed: an int >= "
                                     f"{low} ({meaning}).")
