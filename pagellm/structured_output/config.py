"""vLLM's StructuredOutputsConfig (EngineArgs.structured_outputs_config, a dict of its fields), as pagellm
reads it: xgrammar is the one backend; disable_any_whitespace makes JSON output compact."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_BACKENDS = ("auto", "xgrammar")
# vLLM's other fields, accepted at their defaults: each selects a backend or a reasoning parser pagellm has not.
_NEUTRAL_FIELDS = {"disable_additional_properties": False, "reasoning_parser": "", "reasoning_parser_plugin": "",
                   "enable_in_reasoning": False}


@dataclass(frozen=True)
class StructuredOutputsOptions:
    backend: str = "auto"
    disable_any_whitespace: bool = False


def structured_outputs_options(config: dict | None) -> StructuredOutputsOptions:
    """The options a structured_outputs_config dict sets; a ValueError naming the field it cannot take."""
    if config is None:
        return StructuredOutputsOptions()
    if not isinstance(config, dict):
        raise ValueError(f"structured_outputs_config={config!r:.80} must be a dict of vLLM's StructuredOutputsConfig "
                         "fields, e.g. {\"disable_any_whitespace\": true}, or None.")
    allowed = ["backend", "disable_any_whitespace", *_NEUTRAL_FIELDS]
    for name, value in config.items():
        if name not in allowed:
            raise ValueError(f"structured_outputs_config has the field {name!r}, which vLLM's StructuredOutputsConfig "
                             f"does not; allowed: {allowed}.")
        if name in _NEUTRAL_FIELDS and value != _NEUTRAL_FIELDS[name]:
            raise ValueError(f"structured_outputs_config.{name}={value!r} is not supported: pagellm's one backend is "
                             f"xgrammar; leave it at {_NEUTRAL_FIELDS[name]!r}.")
    backend = config.get("backend", "auto")
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(f"structured_outputs_config.backend={backend!r} is not supported; pagellm's structured "
                         f"outputs run on xgrammar: use one of {list(SUPPORTED_BACKENDS)}.")
    disable = config.get("disable_any_whitespace", False)
    if not isinstance(disable, bool):
        raise ValueError(f"structured_outputs_config.disable_any_whitespace={disable!r} must be true or false.")
    return StructuredOutputsOptions(backend, disable)
