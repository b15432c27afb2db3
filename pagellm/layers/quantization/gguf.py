"""GGUF weights kept in their quantized blocks (issue 22): linear layers multiply on the blocks with
ops/gguf_kernels.py, the embedding dequantizes only the rows it gathers, and a tied LM head is the embedding's
blocks. A GGUF may quantize the shards of one fused layer differently (Q4_K_M stores attn_v and ffn_down in
Q6_K beside Q4_K q/k and gate/up): each shard then keeps its own type and is multiplied on its own. Float
tensors (F32/F16/BF16), and a layer whose type the kernels cannot take, are dense in the model's dtype."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig
from pagellm.layers.weights import set_weight_attrs
from pagellm.ops.dense_linear import DenseKernel, UpcastScratch, choose_dense_kernel
from pagellm.ops.gguf_kernels import PreparedProduct, gguf_ops, row_bytes
from pagellm.worker.huge_pages import NUMPY_HUGE_PAGE_MIN_BYTES, weight_zeros

if TYPE_CHECKING:
    from pagellm.layers.quantization.gguf_moe import GGUFFusedMoEMethod

logger = logging.getLogger(__name__)

FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass
class GGUFWeight:
    """One tensor as a GGUF stores it: uint8 blocks [rows, bytes per row] of GGML type `type_name`, holding
    rows x cols weights (HF layout: a row is one output feature)."""

    data: torch.Tensor
    type_name: str
    rows: int
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        ops = gguf_ops()
        return ops.dequantize_rows(self.data, self.type_name, torch.arange(self.rows), self.cols, dtype)


def _rows(tensor: GGUFWeight | torch.Tensor, start: int, size: int) -> GGUFWeight | torch.Tensor:
    if isinstance(tensor, GGUFWeight):
        return GGUFWeight(tensor.data.narrow(0, start, size), tensor.type_name, size, tensor.cols)
    return tensor.narrow(0, start, size)


@dataclass
class _Part:
    """This rank's piece of one checkpoint shard: quantized blocks, or a dense tensor."""

    weight: GGUFWeight | torch.Tensor

    @property
    def rows(self) -> int:
        return self.weight.rows if isinstance(self.weight, GGUFWeight) else self.weight.shape[0]


@dataclass
class _QuantizedPart:
    data: torch.Tensor
    type_name: str
    rows: int


class GGUFLinearMethod(LinearMethod):
    def __init__(self, ops=None) -> None:
        # The kernels for the device the model is built on (C on the CPU, Triton on CUDA), chosen when the first
        # layer is made; `ops` fixes them (tests run the Triton kernels on the CPU under TRITON_INTERPRET=1).
        self.ops = ops
        self.scratch = UpcastScratch()
        self._reported: set[str] = set()

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        # Filled at load with the blocks (or a dense tensor) of whatever type the file stores.
        weight = nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
        if self.ops is None:
            self.ops = gguf_ops(device=weight.device)
        set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=lambda p, t, s=None: self.load(layer, t, s))
        layer.register_parameter("weight", weight)
        layer.gguf_parts = {}
        layer.params_dtype = params_dtype

    def load(self, layer: nn.Module, tensor: GGUFWeight | torch.Tensor, shard) -> None:
        """This rank's rows of shard `shard` (and its columns, in a row-parallel layer)."""
        name = f"{layer.prefix} (shard {shard})" if shard is not None else layer.prefix
        if shard is None and layer.shard_ids != (None,):
            # A fused checkpoint tensor (a bitsandbytes Phi-3's qkv_proj; a GGUF stores none): each shard's rows.
            start = 0
            for shard_id, size in zip(layer.shard_ids, layer.checkpoint_shard_sizes()):
                self.load(layer, _rows(tensor, start, size), shard_id)
                start += size
            return
        if shard not in layer.shard_ids:
            raise ValueError(f"{name}: this layer's shards are {layer.shard_ids}")
        (piece,) = layer.pieces(shard)
        full_cols = tensor.cols if isinstance(tensor, GGUFWeight) else tensor.shape[1]
        start_col, cols = (layer.group.rank * layer.input_size, layer.input_size) if layer.splits_input else (0, full_cols)
        if cols != layer.input_size:
            raise ValueError(f"{name} has {full_cols} input features in the file, expected {layer.input_size}")
        if isinstance(tensor, GGUFWeight):
            data = tensor.data.narrow(0, piece.source_start, piece.size)
            if layer.splits_input:
                width = row_bytes(tensor.type_name, cols)
                data = data.narrow(1, layer.group.rank * width, width)
            whole = data.data_ptr() == tensor.data.data_ptr() and data.shape == tensor.data.shape
            # A part of the file's tensor is copied so as not to keep the rest alive, into numpy's memory as the
            # loader reads into (huge pages: _pack_runs); the whole one is taken as read, since a second copy of
            # a large embedding was the load's peak (README, "Memory").
            if not (whole and data.is_contiguous()):
                data = torch.from_numpy(np.array(data.numpy(), order="C"))
            part = GGUFWeight(data, tensor.type_name, piece.size, cols)
        else:
            part = tensor.narrow(0, piece.source_start, piece.size).narrow(1, start_col, cols).to(layer.params_dtype)
        layer.gguf_parts[shard] = _Part(part)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = [layer.gguf_parts.pop(shard) for shard in layer.shard_ids]
        del layer.gguf_parts
        padding = layer.output_size - sum(part.rows for part in parts)  # a vocab-split head's tail rows
        quantized = [p.weight for p in parts if isinstance(p.weight, GGUFWeight)]
        if len(quantized) == len(parts) and all(self.ops.supports(w.type_name) for w in quantized):
            layer.weight.data, layer.quantized_parts = _pack_runs(quantized, padding, layer.weight.device)
            layer.dense_kernel = None
            prepare = getattr(self.ops, "prepare", None)  # the C kernels check each weight once, here
            layer.gguf_products = None if prepare is None else tuple(
                prepare(part.data, part.type_name, part.rows, layer.input_size) for part in layer.quantized_parts)
            return
        for weight in quantized:
            self._report(weight.type_name, layer.prefix)
        dense = [p.weight.dequantize(layer.params_dtype) if isinstance(p.weight, GGUFWeight) else p.weight
                 for p in parts]
        if padding:
            dense.append(dense[0].new_zeros(padding, layer.input_size))
        layer.weight.data = torch.cat(dense).to(layer.weight.device).contiguous()
        layer.quantized_parts = None
        layer.gguf_products = None
        if not getattr(layer, "serves_matmul", True):  # an embedding table only looked up
            layer.dense_kernel = DenseKernel(layer.weight.data)
            return
        kernel, free_plain = choose_dense_kernel(layer.weight.data, getattr(layer, "shares_weight", False),
                                                 self.scratch)
        layer.dense_kernel = kernel
        if free_plain:
            layer.weight.data = layer.weight.data.new_empty(0)

    def _report(self, type_name: str, prefix: str) -> None:
        if type_name not in FLOAT_TYPES and type_name not in self._reported:
            self._reported.add(type_name)
            logger.info("GGUF %s weights (first: %s) have no kernel here; they run dequantized to the model's dtype.",
                        type_name, prefix)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel: DenseKernel | None = layer.dense_kernel
        if kernel is not None:
            return kernel(x, bias)
        products = layer.gguf_products
        if products is not None and products[0].kernels is self.ops:  # (ops swapped after loading: the else)
            out = products[0](x) if len(products) == 1 else torch.cat([product(x) for product in products], dim=-1)
            return out if bias is None else out + bias
        parts = layer.quantized_parts
        outputs = [self.ops.matmul(x, part.data, part.type_name, part.rows, layer.input_size) for part in parts]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return out if bias is None else out + bias

    def prepared_product(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        kernel: DenseKernel | None = getattr(layer, "dense_kernel", None)
        if kernel is not None:
            return functools.partial(kernel, bias=None)
        products = getattr(layer, "gguf_products", None)
        if products is not None and len(products) == 1 and products[0].kernels is self.ops:
            return products[0]
        return None

    def loaded_kernel(self, layer: nn.Module) -> object | None:
        """The layer's one prepared int8 product (PreparedProduct), for the experts' one call; None otherwise."""
        product = self.prepared_product(layer)
        return product if isinstance(product, PreparedProduct) else None

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        if layer.quantized_parts is None:
            return torch.nn.functional.embedding(input_ids, layer.weight)
        (part,) = layer.quantized_parts
        rows = self.ops.dequantize_rows(part.data, part.type_name, input_ids, layer.input_size, layer.params_dtype)
        return rows.view(*input_ids.shape, layer.input_size)

    def kernel_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        kernel = getattr(layer, "dense_kernel", None)
        return kernel.tensors() if kernel is not None else []


class GGUFConfig(QuantizationConfig):
    """A GGUF file's weights: each tensor's own GGML type (read at load), every layer on GGUFLinearMethod."""

    name = "gguf"

    def __init__(self, type_counts: dict[str, int] | None = None, ops=None) -> None:
        self.method = GGUFLinearMethod(ops)
        self.type_counts = dict(type_counts or {})
        self.moe_method: GGUFFusedMoEMethod | None = None  # made at the first mixture-of-experts layer

    def linear_method(self, prefix: str) -> LinearMethod:
        return self.method

    def fused_moe_method(self, prefix: str) -> GGUFFusedMoEMethod:
        """Every mixture-of-experts layer's method: experts kept in their blocks (layers/quantization/gguf_moe.py)."""
        from pagellm.layers.quantization.gguf_moe import GGUFFusedMoEMethod

        if self.moe_method is None:
            self.moe_method = GGUFFusedMoEMethod(self.method.ops)
        return self.moe_method

    def describe(self) -> str:
        counts = ", ".join(f"{count} {name}" for name, count in sorted(self.type_counts.items(), key=lambda i: -i[1]))
        kernels = self.method.ops.isa if self.method.ops is not None else "none built"
        return f"gguf ({counts}; kernels: {kernels})" if counts else "gguf"


def _pack_runs(weights: list[GGUFWeight], padding: int,
               device: torch.device) -> tuple[torch.Tensor, list[_QuantizedPart]]:
    """All shards' blocks in one buffer on `device`, as one part per run of equally typed shards (q/k in Q4_K
    then v in Q6_K: two products), each a view of the buffer; `padding` zero rows after the last (zero blocks
    are zero weights in every format: their scales are 0)."""
    runs: list[list[GGUFWeight]] = []
    for weight in weights:
        if runs and runs[-1][0].type_name == weight.type_name:
            runs[-1].append(weight)
        else:
            runs.append([weight])
    sizes = [sum(w.data.numel() for w in run) for run in runs]
    sizes[-1] += padding * runs[-1][0].data.shape[1]
    only = weights[0].data
    if len(weights) == 1 and not padding and device.type == "cpu" and only.is_contiguous() \
            and only.untyped_storage().nbytes() == only.numel() >= NUMPY_HUGE_PAGE_MIN_BYTES:
        # One large tensor, as the loader read it into a numpy array of its own (on huge pages at this size): kept
        # as it is, not copied while the copy and the original are both alive.
        return only.view(-1), [_QuantizedPart(only, weights[0].type_name, weights[0].rows)]
    # Huge pages, from numpy for large buffers and from the load's arena for the rest (torch's allocator gives
    # neither): a decode step streams each weight once, and on 4 KiB pages the hardware prefetcher stops at every
    # page boundary (Gemma 3's 178 MB Q8_0 head: 9.3 ms a token on 4 KiB pages, 5.9 ms on huge pages, on a
    # 2-core Intel Xeon). A smaller single tensor is copied too, one layer at a time. For another device the host
    # buffer is only a staging copy: numpy's, freed after the copy (an arena's chunk would live to the load's end).
    host = weight_zeros(sum(sizes)) if device.type == "cpu" else np.zeros(sum(sizes), dtype=np.uint8)
    buffer = torch.from_numpy(host)
    offset = 0
    for run, size in zip(runs, sizes):
        view = buffer[offset : offset + size].view(-1, run[0].data.shape[1])
        torch.cat([w.data for w in run], out=view[: sum(w.rows for w in run)])
        offset += size
    buffer = buffer.to(device)  # assembled on the host, where the file's blocks are, then copied once
    parts, offset = [], 0
    for run, size in zip(runs, sizes):
        view = buffer[offset : offset + size].view(-1, run[0].data.shape[1])
        parts.append(_QuantizedPart(view, run[0].type_name, view.shape[0]))
        offset += size
    return buffer, parts


def kernel_switch_rows(model: nn.Module, dtype: torch.dtype) -> int | None:
    """The fewest rows of x in `dtype` at which one of the model's GGUF products leaves its int8 row kernel (for
    dequantized tiles or the 512-bit tiles), or None where none ever does. Below it, every row of a step is
    computed to the bit as in any smaller step; at it, a row's last bits change."""
    limits = []
    for module in model.modules():
        for product in getattr(module, "gguf_products", None) or ():
            most = product.int8_max_rows(dtype)
            if most is not None:
                limits.append(most + 1)
            tiles = product.kernels.tile_threshold(product.type_name, dtype)
            if tiles is not None:
                limits.append(tiles)
    return min(limits, default=None)

