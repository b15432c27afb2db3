"""A linear layer's weight format: the method that creates its parameters, prepares them once loaded and
multiplies with them, chosen from the checkpoint's quantization config when the layer is built."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import ClassVar

import torch
from torch import nn

# pagellm's fused layers and the checkpoint modules each fuses, in order along its outputs (vLLM's
# packed_modules_mapping): a format's per-module rules name the checkpoint's modules. `w13` is a
# mixture-of-experts expert's gate (w1) and up (w3) as Mixtral's checkpoints name them (vLLM's name for the pair).
def is_lm_head(prefix: str) -> bool:
    """The LM head, or an MTP layer's own (DeepSeek's model.layers.N.shared_head.head): vLLM's ParallelLMHead,
    which a format quantizes only where it says so (GPTQ's lm_head)."""
    return prefix.split(".")[-1] == "lm_head" or prefix.endswith("shared_head.head")


FUSED_CHECKPOINT_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                            "w13": ("w1", "w3")}


class LinearMethod(ABC):
    """How one kind of weight is stored and multiplied. One instance serves every layer of a model that
    uses it; what a layer needs is kept on the layer."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register the layer's parameters for this rank's partition: `input_size` input features and one
        entry of `output_sizes` per fused shard (q/k/v, gate/up), each parameter with its weight loader's
        attributes (see layers/weights.py)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded parameters into what `apply` runs on (packed layouts, kernels)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias) for x of shape [rows, input_size]."""

    def prepared_product(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """x -> x @ W^T (no bias) as one callable made at load, equal to `apply(layer, x, None)`, for callers that
        skip the layer's module call (a decode step's host work); None where the method has none."""
        return None

    def loaded_kernel(self, layer: nn.Module) -> object | None:
        """The kernel object `apply` runs on once the layer is prepared, for callers that batch several layers'
        products into one call (the experts of a MoE layer); None where the method keeps none."""
        return None

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows `input_ids` of the weight, dequantized: for an embedding table kept in this format."""
        raise TypeError(f"{type(self).__name__} keeps no embedding tables; the embedding of {layer.prefix} needs "
                        "a method that can gather rows")

    def kernel_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        """Tensors the method keeps beside the layer's parameters (packed copies), counted as weights."""
        return []


# A calibrated KV cache's scales as checkpoints name them (compressed-tensors' kv_cache_scheme, AutoFP8's and
# ModelOpt's kv_cache_quant_algo, older exports' kv_scale and Quark's *_proj.output_scale; vLLM reads the same names).
KV_CACHE_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".q_scale", ".prob_scale", ".kv_scale", "k_proj.output_scale",
                           "v_proj.output_scale", "q_proj.output_scale", "self_attn.prob_output_scale")


class QuantizationConfig(ABC):
    """A checkpoint's weight format, read from its config (or asked for by `quantization=`)."""

    name: ClassVar[str]

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod:
        """The method of the linear layer whose parameters live under `prefix` (e.g.
        "model.layers.0.self_attn.qkv_proj"): formats that skip some layers say so per prefix."""

    def skipped_tensor(self, name: str) -> bool:
        """A checkpoint tensor the format stores that pagellm does not use (a calibrated KV cache's scales), passed
        over at load instead of refused as having no place in the model."""
        return False

    def checkpoint_tensors(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        """The checkpoint's tensors as the layers' weight loaders take them: a format that stores one weight as
        several tensors (bitsandbytes) hands it over whole."""
        return weights

    def describe(self) -> str:
        """For the start-up log: the format and its settings."""
        return self.name


class SkipsKVCacheScales:
    """For formats whose checkpoints may carry a calibrated KV cache's scales: they are passed over at load (said
    once in the log). pagellm's 8-bit KV caches scale each row as it is written (kv_cache_dtype="fp8"), and
    kv_cache_dtype="auto" keeps K/V in the model's dtype, as vLLM does with such a checkpoint."""

    name: ClassVar[str]
    _said_kv_scales = False

    def skipped_tensor(self, name: str) -> bool:
        if not name.endswith(KV_CACHE_SCALE_SUFFIXES):
            return False
        if not self._said_kv_scales:
            self._said_kv_scales = True
            logging.getLogger(type(self).__module__).info(
                "%s: the checkpoint's KV cache scales (%s, ...) are not used: pagellm's 8-bit KV caches scale each "
                "row as it is written (kv_cache_dtype='fp8')", self.name, name)
        return True


def stored_text(tensor: torch.Tensor) -> str:
    """A string a checkpoint stores as a tensor of its bytes (bitsandbytes' quant state JSON, HQQ's packing)."""
    return bytes(tensor.flatten().to(torch.uint8).tolist()).decode()


def grouped_pieces(weights: Iterator[tuple[str, torch.Tensor]],
                   piece_of: Callable[[str, torch.Tensor], tuple[str, str] | None],
                   complete: Callable[[dict[str, torch.Tensor]], bool],
                   convert: Callable[[str, dict[str, torch.Tensor]], Iterator[tuple[str, object]]],
                   what: str) -> Iterator[tuple[str, object]]:
    """For a format that stores one weight as several checkpoint tensors (bitsandbytes, HQQ): the tensors
    `piece_of(name, tensor)` places, as (key, piece), gathered per key until `complete(pieces)`, then what
    `convert(key, pieces)` makes of them; the other tensors pass as they are, and pieces of a key already converted
    (meta data after the ones it needs) are dropped. A key still incomplete at the end is refused naming it."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    for name, tensor in weights:
        found = piece_of(name, tensor)
        if found is None:
            yield name, tensor
            continue
        key, piece = found
        if key in done:
            continue
        pieces = pending.setdefault(key, {})
        pieces[piece] = tensor
        if complete(pieces):
            del pending[key]
            done.add(key)
            yield from convert(key, pieces)
    if pending:
        key, pieces = next(iter(pending.items()))
        raise ValueError(f"the checkpoint's {what} {key} is incomplete: it stores {sorted(pieces)} of it "
                         f"({len(pending)} such); the file is truncated or was not written by the format's own tool")
