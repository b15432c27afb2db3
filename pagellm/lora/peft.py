"""A PEFT LoRA adapter directory read into per-layer A/B matrices of the model's own (fused) linear layers.

PEFT names its tensors after the checkpoint's modules (`...self_attn.q_proj.lora_A.weight`); pagellm fuses
q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so each adapter module lands on a shard of a fused layer,
as the base weights do. Everything the model cannot run is refused here, with the reason, before a request
uses the adapter: a rank over max_lora_rank, shapes of another base model, missing or malformed files, target
modules the model lacks, and embedding or LM-head adapters.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.layers.linear import LinearBase, ReplicatedLinear, RowParallelLinear
from pagellm.lora.request import LoRARequest
from pagellm.models.llama import STACKED_PARAMS

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# Adapters of these modules change the vocabulary's rows, which the slots of linear layers do not hold.
REFUSED_MODULES = ("embed_tokens", "lm_head")
_PEFT_PREFIX = "base_model.model."


class LoRALoadError(ValueError):
    """An adapter pagellm cannot run; the message names the adapter, what is wrong and what would fit."""


@dataclass(frozen=True)
class TargetLayer:
    """A linear layer an adapter may target, in checkpoint (all-rank) sizes."""

    name: str
    shard_ids: tuple
    shard_sizes: tuple[int, ...]
    input_size: int


@dataclass(frozen=True)
class LoRAWeights:
    """One adapted module: a [rank, in] and b [out, rank] with the adapter's scaling folded into b.
    `shard` names the fused layer's shard it covers (None: every output of the layer)."""

    shard: object
    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    request: LoRARequest
    # Layer name (as the model names its modules: model.layers.0.self_attn.qkv_proj) -> its adapted shards.
    layers: dict[str, list[LoRAWeights]]


def target_layers(model: nn.Module) -> dict[str, TargetLayer]:
    """The model's linear layers that adapters may target (not the LM head), by module name."""
    targets = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and not any(part in name for part in REFUSED_MODULES):
            input_size = module.input_size * (module.group.size if module.splits_input else 1)
            # A row-parallel (or replicated) layer's outputs are whole on every rank.
            whole_output = isinstance(module, (RowParallelLinear, ReplicatedLinear))
            sizes = (module.output_size,) if whole_output else tuple(module.checkpoint_shard_sizes())
            targets[name] = TargetLayer(name, tuple(module.shard_ids), sizes, input_size)
    return targets


def load_adapter(request: LoRARequest, targets: dict[str, TargetLayer], max_lora_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Reads and checks `request`'s directory; raises LoRALoadError naming what does not fit."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    config = _read_config(request.lora_path, where)
    scaling_of = _scaling(config, where)
    tensors = _read_tensors(request.lora_path, where)
    pairs = _pair_tensors(tensors, where)
    layers: dict[str, list[LoRAWeights]] = {}
    for module, (a, b) in sorted(pairs.items()):
        layer_name, shard = _fused_target(module)
        target = targets.get(layer_name)
        if target is None:
            raise LoRALoadError(f"{where}: target module {module!r} does not exist in this model; adapters may "
                                f"target q/k/v/o_proj and gate/up/down_proj of its layers "
                                f"(e.g. {next(iter(targets), '?')}).")
        rank = a.shape[0]
        if rank > max_lora_rank:
            raise LoRALoadError(f"{where}: {module} has rank {rank}, more than max_lora_rank={max_lora_rank}; "
                                f"start the engine with max_lora_rank >= {rank}.")
        _check_shapes(where, module, a, b, target, shard)
        scaled_b = b.to(torch.float32) * scaling_of(rank)
        layers.setdefault(layer_name, []).append(LoRAWeights(shard, a.to(dtype).contiguous(),
                                                             scaled_b.to(dtype).contiguous()))
    if not layers:
        raise LoRALoadError(f"{where}: the adapter holds no lora_A/lora_B weights.")
    return LoRAAdapter(request, layers)


def _read_config(path: str, where: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoRALoadError(f"{where}: no such directory; lora_path must be a PEFT adapter directory.")
    try:
        with open(config_path) as file:
            config = json.load(file)
    except FileNotFoundError:
        raise LoRALoadError(f"{where}: {CONFIG_FILE} is missing; a PEFT adapter directory holds it.") from None
    except (OSError, ValueError) as exc:
        raise LoRALoadError(f"{where}: {CONFIG_FILE} is malformed: {exc}") from None
    if not isinstance(config, dict):
        raise LoRALoadError(f"{where}: {CONFIG_FILE} is malformed: not a JSON object.")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRALoadError(f"{where}: peft_type={peft_type!r}; pagellm runs LORA adapters only.")
    refusals = {
        "use_dora": (bool(config.get("use_dora")), "DoRA adapters are not supported"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "transposed (Conv1D) weights are not supported"),
        "bias": (config.get("bias", "none") not in ("none", None), "adapters that train biases are not supported"),
        "modules_to_save": (bool(config.get("modules_to_save")),
                            "fully trained modules beside the adapter are not supported"),
        "rank_pattern": (bool(config.get("rank_pattern")), "per-module ranks are not supported"),
        "alpha_pattern": (bool(config.get("alpha_pattern")), "per-module alphas are not supported"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise LoRALoadError(f"{where}: {key}={config.get(key)!r}: {why}.")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        refused = [t for t in targets if any(part in str(t) for part in REFUSED_MODULES)]
        if refused:
            raise LoRALoadError(f"{where}: target_modules has {refused}: embedding and LM-head adapters are not "
                                "supported; adapt the linear projections only.")
    return config


def _scaling(config: dict, where: str):
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise LoRALoadError(f"{where}: lora_alpha={alpha!r} in {CONFIG_FILE} must be a number > 0.")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRALoadError(f"{where}: use_rslora={rslora!r} in {CONFIG_FILE} must be true or false.")
    # PEFT's scaling: alpha / r, or alpha / sqrt(r) for rank-stabilized LoRA.
    return (lambda rank: alpha / math.sqrt(rank)) if rslora else (lambda rank: alpha / rank)


def _read_tensors(path: str, where: str) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        file_path = os.path.join(path, file_name)
        if not os.path.isfile(file_path):
            continue
        try:
            if file_name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(file_path)
            loaded = torch.load(file_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to parse is this file's fault
            raise LoRALoadError(f"{where}: {file_name} is malformed: {exc}") from None
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise LoRALoadError(f"{where}: {file_name} is malformed: not a dict of tensors.")
        return loaded
    raise LoRALoadError(f"{where}: no weights file; a PEFT adapter directory holds {' or '.join(WEIGHT_FILES)}.")


def _pair_tensors(tensors: dict[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name (model.layers.0.self_attn.q_proj) -> (lora_A, lora_B)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if any(part in key for part in REFUSED_MODULES) or "lora_embedding" in key:
            raise LoRALoadError(f"{where}: tensor {key!r} adapts an embedding or the LM head, which pagellm does "
                                "not support; adapt the linear projections only.")
        name = key.removeprefix(_PEFT_PREFIX)
        for half in ("lora_A", "lora_B"):
            marker = f".{half}."
            if marker in name and name.endswith(".weight"):
                module = name.split(marker)[0]
                halves.setdefault(module, {})[half] = tensor
                break
        else:
            raise LoRALoadError(f"{where}: tensor {key!r} is neither a lora_A nor a lora_B weight; pagellm runs "
                                "plain LoRA adapters.")
    pairs = {}
    for module, found in halves.items():
        if set(found) != {"lora_A", "lora_B"}:
            missing = "lora_B" if "lora_A" in found else "lora_A"
            raise LoRALoadError(f"{where}: {module} has no {missing} weight.")
        a, b = found["lora_A"], found["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or not a.is_floating_point():
            raise LoRALoadError(f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                                "expected float matrices [rank, in] and [out, rank].")
        pairs[module] = (a, b)
    return pairs


def _fused_target(module: str) -> tuple[str, object]:
    """model.layers.0.self_attn.q_proj -> (model.layers.0.self_attn.qkv_proj, "q"), as the loader fuses them."""
    for fused, shard_name, shard in STACKED_PARAMS:
        if module.endswith(f".{shard_name}"):
            return module.removesuffix(shard_name) + fused, shard
    return module, None


def _check_shapes(where: str, module: str, a: torch.Tensor, b: torch.Tensor, target: TargetLayer,
                  shard: object) -> None:
    if shard is None:
        out = sum(target.shard_sizes)
    else:
        out = target.shard_sizes[target.shard_ids.index(shard)]
    if a.shape[1] != target.input_size or b.shape[0] != out:
        raise LoRALoadError(f"{where}: {module} maps {a.shape[1]} -> {b.shape[0]} features, but this model's "
                            f"layer maps {target.input_size} -> {out}: the adapter was trained for another base "
                            "model.")
