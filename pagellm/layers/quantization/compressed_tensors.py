"""compressed-tensors checkpoints (llm-compressor's output; quant_method "compressed-tensors"):

- W8A8 int8 ("int-quantized", or "naive-quantized"): int8 `weight` with symmetric `weight_scale` per channel
  ([N, 1]) or per tensor; activations int8, dynamic per token, or static per tensor with `input_scale`.
- FP8 ("float-quantized", or "naive-quantized"): float8_e4m3fn `weight` with `weight_scale` per tensor, per
  channel or per block (`block_structure` [bn, bk]); activations dynamic or static, or none (W8A16). pagellm
  keeps activations in the model's dtype (see pagellm/ops/w8a8_kernels.py).
- W4A16 / W8A16 ("pack-quantized"): 4- or 8-bit integer weights packed into int32, a scale per group of inputs
  or per channel, symmetric or with zero points, optionally "group" act order (weight_g_idx); activations stay
  float. They run on the AWQ/GPTQ kernels (compressed_tensors_wna16.py).
- NVFP4A16 / NVFP4 ("nvfp4-pack-quantized"): 4-bit float (e2m1) weights in groups of 16 (strategy "tensor_group")
  with float8_e4m3fn `weight_scale` and a per-tensor `weight_global_scale`, kept in 4 bits as the GGUF kernels'
  NVFP4_F16 blocks (nvfp4.py); NVFP4's 4-bit activations are not quantized (activations stay in the model's dtype,
  the `input_global_scale` passed over), as in the fp8 formats.

The config (compressed_tensors.QuantizationConfig) maps `config_groups`, each with `targets` (module class names,
of which linear layers answer to "Linear"; module names; or "re:" regular expressions matched from the start of
the name), to a scheme of `weights` / `input_activations` QuantizationArgs (num_bits, type int/float, symmetric,
strategy tensor/channel/group/block/token, dynamic); modules in `ignore` stay dense, and so does any module no
group targets. A fused layer (qkv_proj, gate_up_proj) matches through its checkpoint modules, which must agree.
Everything else (in the one-value-per-byte formats asymmetric or grouped weights and other widths than 8 bits; integer
packs of other widths or with quantized activations; float packs other than NVFP4's, such as MXFP4, and NVFP4 with
another group size or other activations; sparsity, KV cache schemes, transforms) is refused at load, naming what was
found.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig, SkipsKVCacheScales
from pagellm.layers.quantization.compressed_tensors_wna16 import CompressedTensorsWNA16Method
from pagellm.layers.quantization.nvfp4 import (COMPRESSED_TENSORS, GROUP_SIZE, NVFP4LinearMethod, NVFP4Pieces,
                                               kernels_in_use)
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.quantization.w8a8 import Fp8LinearMethod, Int8LinearMethod, checkpoint_module_names

# Formats whose weights are stored one value per byte, as their scheme's dtype.
FORMATS = ("int-quantized", "float-quantized", "naive-quantized")
# Integer weights of fewer bits packed into int32 words.
PACKED_FORMAT = "pack-quantized"
# 4-bit floats (e2m1) two to a byte, a float8_e4m3fn scale per 16 and a global one per tensor.
NVFP4_FORMAT = "nvfp4-pack-quantized"
SUPPORTED = ("W8A8 int8 (symmetric per-channel or per-tensor weights; dynamic per-token or static per-tensor "
             "activations) and FP8 e4m3 (per-tensor, per-channel or block weights; any activations), in the "
             f"{', '.join(FORMATS)} formats; W4A16 and W8A16 (4- or 8-bit integer weights per group or channel, "
             f"symmetric or not, act order 'weight' or 'group'; no activation quantization) in the {PACKED_FORMAT} "
             f"format; NVFP4A16 and NVFP4 (4-bit float weights in groups of {GROUP_SIZE}, activations run "
             f"unquantized) in the {NVFP4_FORMAT} format")
# compressed-tensors' ActivationOrdering and its aliases -> whether the checkpoint stores weight_g_idx.
ACT_ORDERS = {None: False, False: False, "weight": False, "static": False, True: True, "group": True, "dynamic": True}


@dataclass(frozen=True)
class QuantArgs:
    """compressed-tensors' QuantizationArgs, the fields pagellm reads."""

    num_bits: int
    type: str
    symmetric: bool
    strategy: str | None
    dynamic: bool | str
    block_structure: tuple[int, int] | None
    group_size: int | None = None
    actorder: str | bool | None = None

    @classmethod
    def parse(cls, raw: dict, where: str) -> QuantArgs:
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be a dict of QuantizationArgs, not {raw!r:.100}")
        block = raw.get("block_structure")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                                 for b in block)):
                raise ValueError(f"{where}.block_structure={block!r} must be two positive ints [bn, bk]")
            block = (block[0], block[1])
        return cls(num_bits=int(raw.get("num_bits", 8)), type=str(raw.get("type", "int")),
                   symmetric=bool(raw.get("symmetric", True)), strategy=raw.get("strategy"),
                   dynamic=raw.get("dynamic", False), block_structure=block, group_size=raw.get("group_size"),
                   actorder=raw.get("actorder"))


@dataclass(frozen=True)
class SchemeGroup:
    """One of config_groups: which modules, and how their weights and input activations are quantized."""

    name: str
    targets: tuple[str, ...]
    weights: QuantArgs | None
    input_activations: QuantArgs | None
    format: str


def _refuse(group: str, what: str) -> ValueError:
    return ValueError(f"compressed-tensors config_groups.{group}: {what} is not supported; pagellm loads "
                      f"{SUPPORTED}.")


def method_for(group: SchemeGroup) -> LinearMethod:
    """The linear method of a group's scheme, or a ValueError naming what pagellm does not run."""
    weights, activations = group.weights, group.input_activations
    if group.format not in FORMATS + (PACKED_FORMAT, NVFP4_FORMAT):
        raise _refuse(group.name, f"format {group.format!r}")
    if weights is None:
        raise _refuse(group.name, "a scheme without weight quantization")
    if group.format == PACKED_FORMAT:
        return _wna16_method(group, weights, activations)
    if group.format == NVFP4_FORMAT:
        return _nvfp4_method(group, weights, activations)
    if weights.num_bits != 8 or weights.type not in ("int", "float"):
        raise _refuse(group.name, f"{weights.num_bits}-bit {weights.type} weights")
    if not weights.symmetric:
        raise _refuse(group.name, "asymmetric weights (weight_zero_point)")
    if weights.dynamic:
        raise _refuse(group.name, f"dynamic={weights.dynamic!r} weight scales")
    if activations is not None:
        if activations.num_bits != 8 or activations.type != weights.type:
            raise _refuse(group.name, f"{weights.type} weights with {activations.num_bits}-bit {activations.type} "
                                      "activations")
        if activations.dynamic not in (True, False):
            raise _refuse(group.name, f"input_activations.dynamic={activations.dynamic!r}")
    if weights.type == "int":
        return _int8_method(group, weights, activations)
    return _fp8_method(group, weights, activations)


def _int8_method(group: SchemeGroup, weights: QuantArgs, activations: QuantArgs | None) -> LinearMethod:
    if weights.strategy not in ("channel", "tensor"):
        raise _refuse(group.name, f"int8 weights with strategy {weights.strategy!r} (W8A16 groups go through "
                                  "pack-quantized / GPTQ-style kernels)")
    if activations is None:
        raise _refuse(group.name, "int8 weights without input_activations (W8A16 int8)")
    if not activations.symmetric:
        raise _refuse(group.name, "asymmetric int8 activations (input_zero_point)")
    if activations.dynamic and activations.strategy != "token":
        raise _refuse(group.name, f"dynamic int8 activations with strategy {activations.strategy!r} (pagellm "
                                  "quantizes per token)")
    if not activations.dynamic and activations.strategy != "tensor":
        raise _refuse(group.name, f"static int8 activations with strategy {activations.strategy!r}")
    return Int8LinearMethod(per_channel=weights.strategy == "channel", static_input=not activations.dynamic)


def _wna16_method(group: SchemeGroup, weights: QuantArgs, activations: QuantArgs | None) -> LinearMethod:
    if weights.type != "int" or weights.num_bits not in (4, 8):
        raise _refuse(group.name, f"{weights.num_bits}-bit {weights.type} weights in the {PACKED_FORMAT} format")
    if activations is not None:
        raise _refuse(group.name, f"{weights.num_bits}-bit weights with {activations.num_bits}-bit "
                                  f"{activations.type} activations (W{weights.num_bits}A{activations.num_bits})")
    if weights.dynamic:
        raise _refuse(group.name, f"dynamic={weights.dynamic!r} weight scales")
    if weights.strategy not in ("group", "channel"):
        raise _refuse(group.name, f"{PACKED_FORMAT} weights with strategy {weights.strategy!r}")
    group_size = weights.group_size if weights.strategy == "group" else None
    if weights.strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise _refuse(group.name, f"group weights with group_size={group_size!r} (a positive number of inputs)")
    if weights.actorder not in ACT_ORDERS:
        raise _refuse(group.name, f"actorder={weights.actorder!r}")
    group_act_order = ACT_ORDERS[weights.actorder] and group_size is not None
    return CompressedTensorsWNA16Method(weights.num_bits, group_size, weights.symmetric, group_act_order)


def _nvfp4_method(group: SchemeGroup, weights: QuantArgs, activations: QuantArgs | None) -> LinearMethod:
    if weights.type != "float" or weights.num_bits != 4:
        raise _refuse(group.name, f"{weights.num_bits}-bit {weights.type} weights in the {NVFP4_FORMAT} format")
    if weights.strategy != "tensor_group" or weights.group_size != GROUP_SIZE:
        raise _refuse(group.name, f"NVFP4 weights with strategy {weights.strategy!r} and group_size="
                                  f"{weights.group_size!r} (NVFP4 is 'tensor_group' of {GROUP_SIZE})")
    if not weights.symmetric:
        raise _refuse(group.name, "asymmetric NVFP4 weights (weight_zero_point)")
    if weights.dynamic:
        raise _refuse(group.name, f"dynamic={weights.dynamic!r} weight scales")
    if activations is not None and (activations.type, activations.num_bits) != ("float", 4):
        raise _refuse(group.name, f"NVFP4 weights with {activations.num_bits}-bit {activations.type} activations "
                                  "(NVFP4A16 has none, NVFP4 4-bit floats)")
    return NVFP4LinearMethod()


def _fp8_method(group: SchemeGroup, weights: QuantArgs, activations: QuantArgs | None) -> LinearMethod:
    if weights.strategy not in ("channel", "tensor", "block"):
        raise _refuse(group.name, f"fp8 weights with strategy {weights.strategy!r}")
    if weights.strategy == "block" and weights.block_structure is None:
        raise _refuse(group.name, "block fp8 weights without block_structure")
    static = activations is not None and not activations.dynamic
    if static and activations.strategy != "tensor":
        raise _refuse(group.name, f"static fp8 activations with strategy {activations.strategy!r}")
    block = weights.block_structure if weights.strategy == "block" else None
    return Fp8LinearMethod(weights.strategy, block, static_input=static)


def equal_or_regex_match(entry: str, name: str) -> bool:
    """An ignore / exclude entry against a checkpoint module name as vLLM matches it (compressed-tensors' and
    Quark's _is_equal_or_regex_match): "re:" + a regular expression matched from the start, or the name itself."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry == name


def target_matches(target: str, name: str) -> bool:
    """A target or ignore entry against a checkpoint module name: equal_or_regex_match, or a class name
    ("Linear": every linear layer, which is what the layers asked about here are)."""
    return equal_or_regex_match(target, name) or target == "Linear"


class CompressedTensorsConfig(SkipsKVCacheScales, QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[SchemeGroup], ignore: list[str], kv_cache_scheme: dict | None = None) -> None:
        self.groups = groups
        self.ignore = list(ignore)
        self.kv_cache_scheme = kv_cache_scheme
        self.methods = {group.name: method_for(group) for group in groups}
        self.dense = UnquantizedLinearMethod()
        self.nvfp4_groups = {name for name, method in self.methods.items() if isinstance(method, NVFP4LinearMethod)}
        w4a4 = any(group.input_activations is not None for group in groups if group.name in self.nvfp4_groups)
        self.nvfp4 = NVFP4Pieces(COMPRESSED_TENSORS, self._stored_nvfp4, w4a4)
        self._nvfp4_modules: dict[str, bool] = {}

    @classmethod
    def from_config(cls, config: dict) -> CompressedTensorsConfig:
        for key, what in (("sparsity_config", "sparse weights"), ("transform_config", "transforms (QuIP, SpinQuant)")):
            if config.get(key):
                raise ValueError(f"compressed-tensors {key} ({what}) is not supported; pagellm loads {SUPPORTED}, "
                                 "without sparsity or transforms.")
        groups_raw = config.get("config_groups")
        if not isinstance(groups_raw, dict) or not groups_raw:
            raise ValueError("a compressed-tensors quantization_config needs config_groups (a dict of schemes)")
        default_format = config.get("format", "naive-quantized")
        groups = []
        for name, raw in groups_raw.items():
            where = f"config_groups.{name}"
            targets = raw.get("targets")
            if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
                raise ValueError(f"compressed-tensors {where}.targets must be a list of module names or patterns")
            weights = QuantArgs.parse(raw["weights"], f"{where}.weights") if raw.get("weights") else None
            activations = (QuantArgs.parse(raw["input_activations"], f"{where}.input_activations")
                           if raw.get("input_activations") else None)
            if raw.get("output_activations"):
                raise _refuse(name, "output activation quantization")
            groups.append(SchemeGroup(name, tuple(targets), weights, activations, raw.get("format") or default_format))
        ignore = config.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(entry, str) for entry in ignore):
            raise ValueError(f"compressed-tensors ignore={ignore!r:.100} must be a list of module names or patterns")
        kv_cache_scheme = config.get("kv_cache_scheme") or None
        if kv_cache_scheme is not None and not isinstance(kv_cache_scheme, dict):
            raise ValueError(f"compressed-tensors kv_cache_scheme={kv_cache_scheme!r:.100} must be a dict")
        return cls(groups, ignore, kv_cache_scheme)

    def _named(self, name: str) -> bool:
        """Whether an ignore entry or a target names module `name` itself (not by its class)."""
        entries = self.ignore + [target for group in self.groups for target in group.targets]
        return any(entry != "Linear" and target_matches(entry, name) for entry in entries)

    def _group_of(self, name: str) -> str | None:
        """The first group with a target naming `name` (a name or pattern before a class name, as vLLM looks)."""
        for by_class in (False, True):
            for group in self.groups:
                if any(target_matches(t, name) for t in group.targets if (t == "Linear") == by_class):
                    return group.name
        return None

    def linear_method(self, prefix: str) -> LinearMethod:
        if prefix.endswith("embed_tokens"):
            return self.dense  # an embedding table is no linear layer: "Linear" targets leave it dense
        names = checkpoint_module_names(prefix, self._named)
        ignored = [any(target_matches(entry, name) for entry in self.ignore) for name in names]
        if all(ignored):
            return self.dense
        groups = {self._group_of(name) for name in names}
        if any(ignored) or len(groups) > 1:
            raise ValueError(f"{prefix} fuses {names}, which the compressed-tensors config quantizes differently "
                             f"(ignored: {ignored}, groups: {sorted(map(str, groups))}); pagellm (as vLLM) needs "
                             "the fused shards quantized alike")
        group = groups.pop()
        if group in self.nvfp4_groups:
            self.nvfp4.serve(prefix)
        return self.dense if group is None else self.methods[group]

    def _stored_nvfp4(self, module: str) -> bool:
        """Whether the checkpoint stores module `module` in an NVFP4 group (a name, whatever layer takes it)."""
        if module not in self._nvfp4_modules:
            ignored = any(target_matches(entry, module) for entry in self.ignore)
            self._nvfp4_modules[module] = not ignored and self._group_of(module) in self.nvfp4_groups
        return self._nvfp4_modules[module]

    def checkpoint_tensors(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        return self.nvfp4.checkpoint_tensors(weights) if self.nvfp4_groups else weights

    def describe(self) -> str:
        parts = [f"{_describe_scheme(group, self.methods[group.name])} for {', '.join(group.targets)}"
                 for group in self.groups]
        ignore = f"; dense: {', '.join(self.ignore)}" if self.ignore else ""
        kv = "; the kv_cache_scheme's scales not used (pagellm's 8-bit KV caches scale per row)" \
            if self.kv_cache_scheme else ""
        return f"compressed-tensors ({'; '.join(parts)}{ignore}{kv})"


def _describe_scheme(group: SchemeGroup, method: LinearMethod) -> str:
    weights, activations = group.weights, group.input_activations
    if isinstance(method, NVFP4LinearMethod):
        acts = "no activation quantization" if activations is None else \
            "4-bit float activations (run unquantized, in the model dtype)"
        return (f"nvfp4 weights (e2m1 in groups of {GROUP_SIZE}, fp8 scales; kept as NVFP4_F16 blocks on the GGUF "
                f"kernels: {kernels_in_use(method)}), {acts}")
    if group.format == PACKED_FORMAT:
        size = f" {weights.group_size}" if weights.strategy == "group" else ""
        zero = "symmetric" if weights.symmetric else "with zero points"
        order = f", act order {weights.actorder}" if weights.actorder not in (None, False) else ""
        return f"int{weights.num_bits} {weights.strategy}{size} weights ({zero}{order}), float activations"
    dtype = "int8" if weights.type == "int" else "fp8"
    block = f" {list(weights.block_structure)}" if weights.strategy == "block" else ""
    if activations is None:
        acts = "no activation quantization"
    else:
        acts = f"{'dynamic' if activations.dynamic else 'static'} {activations.strategy} activations"
        if dtype == "fp8":
            acts += " (run unquantized)"
    return f"{dtype} {weights.strategy}{block} weights, {acts}"


def compressed_tensors_config(checkpoint_config: dict | None, requested: str | None) -> QuantizationConfig:
    """The registry's factory for "compressed-tensors" (which only a checkpoint's config describes)."""
    if checkpoint_config is None:
        raise ValueError("quantization='compressed-tensors' needs a checkpoint whose config.json holds a "
                         "compressed-tensors quantization_config; this one has none (for online quantization of a "
                         "float checkpoint use quantization='int8' or 'fp8').")
    return CompressedTensorsConfig.from_config(checkpoint_config)
