"""What AWQ and GPTQ share: integer weights with a scale and zero point per group of input features. Each
format registers its checkpoint's tensors (awq.py, gptq.py) and turns them, once loaded, into the one
representation the kernels take (pagellm/ops/wna16.py); the checkpoint's tensors are then freed."""

from __future__ import annotations

import functools
import logging
from abc import abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from pagellm.layers.quantization.base import FUSED_CHECKPOINT_MODULES, LinearMethod
from pagellm.layers.weights import copy_checked
from pagellm.ops.wna16 import (
    GroupQuantKernel,
    GroupQuantWeight,
    Parts,
    TorchGroupQuant,
    choose_kernel,
    compact_groups,
)
from pagellm.worker.huge_pages import note_freed

logger = logging.getLogger(__name__)

# Layers that are never linear products on group-quantized weights here (the LM head may be, where the
# checkpoint says so).
EMBEDDING_SUFFIX = "embed_tokens"


def checkpoint_modules(prefix: str) -> list[str]:
    """The checkpoint module names a layer `prefix` holds (one, or each shard of a fused layer): a layer is
    quantized or skipped as its shards are, and they must agree."""
    head, _, name = prefix.rpartition(".")
    shards = FUSED_CHECKPOINT_MODULES.get(name)
    if shards is None:
        return [prefix]
    return [f"{head}.{shard}" if head else shard for shard in shards]


def all_shards_agree(prefix: str, matches, what: str) -> bool:
    """matches(module name) for each of the layer's checkpoint modules, which must all give the same answer."""
    answers = {module: bool(matches(module)) for module in checkpoint_modules(prefix)}
    if len(set(answers.values())) > 1:
        raise ValueError(f"{prefix} fuses {', '.join(answers)}, but the checkpoint's {what} covers only some of "
                         f"them ({answers}); pagellm needs a fused layer's shards stored alike")
    return next(iter(answers.values()))


def check_int(config: dict, key: str, value, allowed: tuple, method: str) -> None:
    if value not in allowed:
        raise ValueError(f"{method} checkpoint with quantization_config.{key}={value!r}: pagellm runs "
                         f"{key} in {allowed}")


class GroupQuantLinearMethod(LinearMethod):
    """A linear layer on 4- or 8-bit group-quantized weights. Subclasses register the checkpoint's tensors and
    read them back as `Parts` (pagellm/ops/wna16.py); this class builds the product for the device once they are
    loaded and frees the checkpoint's copy."""

    format_name = "group-quantized"
    # The parameters create_weights registers (freed once their contents are in the kernel's layout).
    checkpoint_params: tuple[str, ...] = ()

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self._logged: set[str] = set()

    @abstractmethod
    def parts(self, layer: nn.Module) -> Parts:
        """The loaded checkpoint tensors as the kernels' representation."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = [(first, compact_groups(part)) for first, part in self.parts(layer)]
        for first, part in parts:
            part.check(f"{layer.prefix} (columns from {first})")
        device = parts[0][1].qweight.device
        kernel = choose_kernel(parts, device)
        layer.group_quant_kernel = kernel
        for name in self.checkpoint_params:
            param = getattr(layer, name)
            note_freed(param.data.untyped_storage().nbytes())
            param.data = param.data.new_empty(0)
        if kernel.name not in self._logged:
            self._logged.add(kernel.name)
            if isinstance(kernel, TorchGroupQuant):
                logger.warning("%s layers (e.g. %s) run dequantized per call in torch on %s: no kernel for them "
                               "here", self.format_name, layer.prefix, device)
            else:
                logger.info("%s layers run on the %s kernel", self.format_name, kernel.name)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel: GroupQuantKernel | None = getattr(layer, "group_quant_kernel", None)
        if kernel is None:  # not processed yet (a model used before loading finished, e.g. in a unit test)
            kernel = TorchGroupQuant(self.parts(layer))
        return kernel(x, bias)

    def prepared_product(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        kernel: GroupQuantKernel | None = getattr(layer, "group_quant_kernel", None)
        if kernel is None:
            return None
        return kernel.prepared_product() or functools.partial(kernel, bias=None)

    def loaded_kernel(self, layer: nn.Module) -> GroupQuantKernel | None:
        return getattr(layer, "group_quant_kernel", None)

    def kernel_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        kernel = getattr(layer, "group_quant_kernel", None)
        return kernel.tensors() if kernel is not None else []


def column_ranges(output_sizes: list[int]) -> list[tuple[int, int]]:
    """(first column, width) of each fused shard along the layer's outputs."""
    ranges, first = [], 0
    for size in output_sizes:
        ranges.append((first, size))
        first += size
    return ranges


def load_shard_row(layer: nn.Module, name: str, input_sliced: bool, param: nn.Parameter, tensor: torch.Tensor,
                   shard=None) -> None:
    """A per-shard tensor (GPTQ's g_idx, compressed-tensors' weight_g_idx and weight_shape) into the parameter's
    row for that shard, a fused checkpoint tensor into every row; with `input_sliced`, this rank's input
    features of it only. Bound to a layer, a name and `input_sliced` with functools.partial, it is the
    parameter's weight loader."""
    size = param.shape[1]
    if input_sliced and layer.splits_input:
        tensor = tensor.narrow(0, layer.group.rank * size, size)
    rows = range(param.shape[0]) if shard is None else [layer.shard_ids.index(shard)]
    for row in rows:
        copy_checked(param.data[row], tensor, f"{layer.prefix}.{name}" + (f" ({shard})" if shard is not None else ""))


def parts_by_input_order(layer: nn.Module, bits: int, qweight: torch.Tensor, scales: torch.Tensor,
                         offsets: torch.Tensor, g_idx: torch.Tensor) -> Parts:
    """The layer's weight as kernel parts, from qweight [in / pack, out], scales and offsets [groups, out] and
    one g_idx row per fused shard: consecutive shards whose inputs are in the same order run as one part (a
    quantizer with act order may have visited each shard's inputs in its own order)."""
    groups = scales.shape[0]
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise ValueError(f"{layer.prefix}: g_idx holds groups outside 0 .. {groups - 1}: the checkpoint's g_idx "
                         "does not fit its scales")
    runs: list[tuple[int, int, int]] = []  # (first column, width, g_idx row)
    for row, (first, width) in enumerate(column_ranges(layer.output_sizes)):
        if runs and torch.equal(g_idx[runs[-1][2]], g_idx[row]):
            runs[-1] = (runs[-1][0], runs[-1][1] + width, runs[-1][2])
        else:
            runs.append((first, width, row))
    parts: Parts = []
    for first, width, row in runs:
        columns = slice(first, first + width)
        parts.append((first, GroupQuantWeight(bits, qweight[:, columns].contiguous(), scales[:, columns].contiguous(),
                                              offsets[:, columns].contiguous(), g_idx[row].contiguous())))
    return parts
