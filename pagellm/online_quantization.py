"""vLLM's online quantization arguments (its vllm/config/quantization.py): `quantization=` as one of the shorthands
(fp8_per_tensor, fp8_per_channel, fp8_per_block, mxfp8, int8_per_channel_weight_only) or "online", and
`quantization_config={"linear": ..., "moe": ..., "ignore": [...]}` or `{"targets": {pattern: shorthand}}`, resolved
into one OnlineSpec: which weight format the dense linear layers and the mixture-of-experts experts take as a float
checkpoint loads, and which layers stay in the model's dtype. Imports no torch: the command line's parser checks
these before anything heavy loads.

Activations stay in the model's dtype in every format here (pagellm's fp8 products are weight-only: no CPU
multiplies fp8), which is what vLLM runs on GPUs without fp8 products; vLLM refuses activation overrides for
online quantization, and so does this.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

# vLLM's names (QUANT_KEY_NAMES) of the weight formats pagellm quantizes to at load -> what each stores.
WEIGHT_FORMATS: dict[str, str] = {
    "fp8_per_tensor_static": "float8_e4m3fn weights, one scale per weight",
    "fp8_per_channel_static": "float8_e4m3fn weights, one scale per output channel",
    "fp8_per_block_static": "float8_e4m3fn weights, one scale per block of 128 x 128",
    "mxfp8": "float8_e4m3fn weights, a power-of-two scale per 32 inputs (OCP MX)",
    "int8_per_channel_static": "int8 weights, one scale per output channel",
}
# vLLM's other names, and why pagellm does not quantize to them at load.
REFUSED_WEIGHT_FORMATS: dict[str, str] = {
    "mxfp4": "pagellm reads MXFP4 from checkpoints that hold it (gpt-oss's: leave quantization unset for them) and "
             "does not round a float checkpoint to it",
    "lut_b": "LUT-B is Rubin GPUs' format",
}
ACTIVATION_FORMATS = ("fp8_per_tensor_dynamic", "fp8_per_token", "fp8_per_block_dynamic", "mxfp8")


def matches(entry: str, name: str) -> bool:
    """An `ignore` or `targets` entry against a checkpoint module name: a whole name, an fnmatch pattern, or a "re:"
    regular expression matched from the start (vLLM's matching with fnmatch)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return fnmatch.fnmatchcase(name, entry)


@dataclass(frozen=True)
class OnlineSpec:
    """vLLM's QuantizationConfigArgs: the dense linear layers' weight format, the experts' (None: left in the
    model's dtype), the layers left unquantized (module names, fnmatch patterns or "re:" regular expressions),
    and `targets`, (pattern, shorthand) pairs that say each matched layer's format instead of `linear` and `moe`
    (layers no pattern matches stay unquantized). The embedding and the LM head stay in the model's dtype always,
    as vLLM leaves them."""

    linear: str | None
    moe: str | None
    ignore: tuple[str, ...] = ()
    targets: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        parts = [f"{what}: {fmt} ({WEIGHT_FORMATS[fmt]})" for what, fmt in
                 (("linear layers", self.linear), ("experts", self.moe)) if fmt is not None]
        parts += [f"{pattern}: {shorthand}" for pattern, shorthand in self.targets]
        ignored = f"; left in the model dtype: {', '.join(self.ignore)}" if self.ignore else ""
        return "; ".join(parts) + ignored

    def ignores(self, name: str) -> bool:
        """`name` (a checkpoint module name) is one `ignore` names."""
        return any(matches(entry, name) for entry in self.ignore)

    def targets_of(self, name: str) -> list[tuple[str, str]]:
        """The (pattern, shorthand) pairs of `targets` that match `name`."""
        return [(pattern, shorthand) for pattern, shorthand in self.targets if matches(pattern, name)]


SHORTHANDS: dict[str, OnlineSpec] = {
    "fp8_per_tensor": OnlineSpec("fp8_per_tensor_static", "fp8_per_tensor_static"),
    "fp8_per_channel": OnlineSpec("fp8_per_channel_static", "fp8_per_channel_static"),
    "fp8_per_block": OnlineSpec("fp8_per_block_static", "fp8_per_block_static"),
    "mxfp8": OnlineSpec("mxfp8", "mxfp8"),
    # The experts only: vLLM leaves the dense layers unquantized in this one.
    "int8_per_channel_weight_only": OnlineSpec(None, "int8_per_channel_static"),
}
# ("mxfp4", also a shorthand in vLLM, is the method of gpt-oss's checkpoints here: the registry's mxfp4_config.)
REFUSED_SHORTHANDS: dict[str, str] = {
    "nvfp4_per_token": "NVFP4 runs on Blackwell GPUs through FlashInfer",
    "lut_b_moe": REFUSED_WEIGHT_FORMATS["lut_b"],
}
# `quantization=` values that mean online quantization as vLLM's new frontend spells it.
ONLINE_METHODS = (*SHORTHANDS, "online")
_FIELDS = ("linear", "moe", "ignore", "targets")


def is_online(quantization: str | None, quantization_config: dict | None) -> bool:
    return quantization in ONLINE_METHODS or (quantization is None and quantization_config is not None)


def resolve(quantization: str | None, quantization_config: dict | None) -> OnlineSpec | None:
    """The OnlineSpec `quantization` and `quantization_config` ask for (fields the config sets win over the
    shorthand's, as in vLLM), None where they ask for none; a ValueError naming the value, what is accepted and
    the fix otherwise."""
    if quantization in REFUSED_SHORTHANDS:
        raise ValueError(f"quantization={quantization!r} is not supported: {REFUSED_SHORTHANDS[quantization]}. "
                         f"Online formats pagellm runs: {', '.join(SHORTHANDS)}.")
    if not is_online(quantization, quantization_config):
        if quantization_config is not None:
            raise ValueError(f"quantization_config is taken only with online quantization (quantization one of "
                             f"{', '.join(ONLINE_METHODS)}, or unset), not quantization={quantization!r}; a "
                             "checkpoint's own format is read from its config.json")
        return None
    base = SHORTHANDS.get(quantization) if quantization else None
    if quantization_config is None:
        if base is None:
            raise ValueError('quantization="online" needs quantization_config, e.g. {"linear": "fp8_per_channel", '
                             '"moe": "fp8_per_channel", "ignore": ["re:.*down_proj"]}')
        return base
    if not isinstance(quantization_config, dict):
        raise ValueError(f"quantization_config={quantization_config!r} must be a dict with keys among "
                         f"{', '.join(_FIELDS)}")
    unknown = sorted(set(quantization_config) - set(_FIELDS))
    if unknown:
        raise ValueError(f"quantization_config has {', '.join(map(repr, unknown))}; pagellm takes "
                         f"{', '.join(_FIELDS)} (vLLM's QuantizationConfigArgs)")
    linear = _weight_format(quantization_config.get("linear"), "linear")
    moe = _weight_format(quantization_config.get("moe"), "moe")
    ignore = _ignore(quantization_config.get("ignore"))
    targets = _targets(quantization_config.get("targets"))
    if targets:
        if linear is not None or moe is not None:
            raise ValueError("quantization_config.targets says each matched layer's format and excludes `linear` and "
                             "`moe` (as in vLLM): leave those unset, or drop `targets`")
        return OnlineSpec(None, None, ignore, targets)
    base = base or OnlineSpec(None, None)  # a shorthand sets linear / moe only, never ignore
    spec = OnlineSpec(linear or base.linear, moe or base.moe, ignore)
    if spec.linear is None and spec.moe is None:
        raise ValueError(f"quantization_config={quantization_config!r} quantizes nothing; set `linear` and/or `moe`, "
                         f"e.g. \"fp8_per_channel\"")
    return spec


def _weight_format(value, field: str) -> str | None:
    """A `linear` / `moe` entry: a shorthand (its spec for that field), a weight format's name, or
    {"weight": name, "activation": None}."""
    if value is None:
        return None
    if isinstance(value, dict):
        extra = sorted(set(value) - {"weight", "activation"})
        if extra:
            raise ValueError(f"quantization_config.{field} has {', '.join(map(repr, extra))}; a spec takes weight "
                             "and activation")
        if value.get("activation") is not None:
            raise ValueError(f"quantization_config.{field}.activation={value['activation']!r}: activation overrides "
                             "are not supported for online quantization (as in vLLM); pagellm keeps activations in "
                             "the model's dtype")
        value = value.get("weight")
        if value is None:
            return None
    if not isinstance(value, str):
        raise ValueError(f"quantization_config.{field}={value!r} must be a format's name or "
                         '{"weight": name}')
    if value in SHORTHANDS:
        fmt = getattr(SHORTHANDS[value], field)
        if fmt is None:
            raise ValueError(f"the shorthand {value!r} defines no {field} format; name a weight format instead "
                             f"({', '.join(WEIGHT_FORMATS)})")
        return fmt
    if value in WEIGHT_FORMATS:
        return value
    reason = REFUSED_WEIGHT_FORMATS.get(value) or REFUSED_SHORTHANDS.get(value)
    if reason is None and value in ACTIVATION_FORMATS:
        reason = "it is an activation format"
    why = f" ({reason})" if reason else ""
    raise ValueError(f"quantization_config.{field}={value!r} is not a weight format pagellm quantizes to{why}; use "
                     f"one of {', '.join(WEIGHT_FORMATS)} or a shorthand ({', '.join(SHORTHANDS)})")


def _targets(value) -> tuple[tuple[str, str], ...]:
    """`targets`: {pattern: shorthand}, a pattern as `ignore` takes them, a shorthand of SHORTHANDS."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) and k and isinstance(v, str)
                                              for k, v in value.items()):
        raise ValueError(f"quantization_config.targets={value!r} must map module patterns to shorthands, e.g. "
                         '{"re:.*self_attn.*": "fp8_per_channel"}')
    for pattern, shorthand in value.items():
        if shorthand not in SHORTHANDS:
            why = REFUSED_SHORTHANDS.get(shorthand)
            raise ValueError(f"quantization_config.targets[{pattern!r}]={shorthand!r} is not a shorthand pagellm runs"
                             f"{f' ({why})' if why else ''}; use one of {', '.join(SHORTHANDS)}")
    _check_patterns(value, "targets")
    return tuple(value.items())


def _ignore(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(entry, str) and entry for entry in value):
        raise ValueError(f"quantization_config.ignore={value!r} must be a list of module names, fnmatch patterns "
                         'or "re:" regular expressions')
    _check_patterns(value, "ignore")
    return tuple(value)


def _check_patterns(entries, field: str) -> None:
    for entry in entries:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                raise ValueError(f"quantization_config.{field} entry {entry!r} is not a regular expression: {exc}") \
                    from None
