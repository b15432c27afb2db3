"""How checkpoint tensors land in parameters: each parameter carries a `weight_loader(param, tensor, shard)`
and the attributes it reads (vLLM's convention), so that fused shards (q/k/v, gate/up) and tensor-parallel
slices are loaded where they go, whatever format the weight is stored in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

WeightLoader = Callable[[nn.Parameter, torch.Tensor, Any], None]


def set_weight_attrs(param: torch.Tensor, **attrs: Any) -> None:
    """Attributes a weight loader reads: `output_dim` / `input_dim` (the dimension along which output or
    input features lie, None if the parameter has none), `packed_dim` and `pack_factor` (a dimension that holds
    pack_factor values per element, e.g. eight 4-bit weights in an int32), `weight_loader`."""
    for key, value in attrs.items():
        if hasattr(param, key) and key != "weight_loader":
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy (casting to the parameter's dtype) after checking the shapes agree."""
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.copy_(tensor)


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard: Any = None) -> None:
    """A whole, unsharded parameter (norms, replicated tensors)."""
    copy_checked(param.data, tensor, getattr(param, "checkpoint_name", "?"))


def scaled_range(param: torch.Tensor, dim: int, start: int, size: int) -> tuple[int, int]:
    """(start, size) in the parameter's own units along `dim`: a packed dimension holds pack_factor features
    per element."""
    if getattr(param, "packed_dim", None) == dim:
        factor = param.pack_factor
        if start % factor or size % factor:
            raise ValueError(f"a shard of {size} features at {start} does not align with {factor} packed per element")
        return start // factor, size // factor
    return start, size


def process_weights_after_loading(model: nn.Module) -> None:
    """Each layer's method turns its loaded parameters into what it multiplies with (once, after loading)."""
    for module in model.modules():
        process = getattr(module, "process_weights_after_loading", None)
        if process is not None and module is not model:
            process()


def weights_bytes(model: nn.Module) -> int:
    """Memory of the weights: every parameter and what the layers' methods keep beside them, each storage
    counted once (a tied LM head is the embedding's table)."""
    tensors = list(model.parameters())
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            tensors += method.kernel_tensors(module)
    storages: dict[int, int] = {}
    for tensor in tensors:
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # oneDNN's packed weights are opaque: no storage to share
            storages[id(tensor)] = tensor.numel() * tensor.element_size()
            continue
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
