"""The adapter slots of one linear layer: A and B of up to `max_loras` adapters, stacked and padded.

A fused layer (qkv_proj, gate_up_proj) has one A/B pair per shard in an adapter; a slot packs them side by side
along the rank: rows [off, off + r) of A are shard i's A, and the same columns of B its B, placed at the shard's
outputs (zero elsewhere), so one shrink and one expand cover every shard. Under tensor parallelism the slots
are split as the layer is: B by output features of a column-parallel layer, A by input features of a
row-parallel one (whose partial deltas the layer's all-reduce sums with its output).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.layers.linear import LinearBase
from pagellm.lora.cpu_kernels import LoRAKernel
from pagellm.lora.peft import LoRAWeights
from pagellm.lora.punica import LoRAStepMapping, add_lora_torch


@dataclass(frozen=True)
class PackedSlot:
    """One adapter's weights of one layer as a slot holds them (this rank's share, in the slots' dtype): swapping
    the adapter in is then two contiguous copies per layer."""

    a: torch.Tensor  # [width, in features of this rank]
    b_t: torch.Tensor  # [width, out features of this rank]

    @property
    def width(self) -> int:
        return self.a.shape[0]

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b_t.nbytes


@dataclass
class LoRAContext:
    """Shared by every adapted layer of a model: this step's token grouping, set by the runner (None: no
    token of the step has an adapter)."""

    mapping: LoRAStepMapping | None = None


class LoRALayerSlots:
    def __init__(self, layer: LinearBase, context: LoRAContext, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, cpu_kernel: LoRAKernel | None = None) -> None:
        self.layer = layer
        self.context = context
        self.cpu_kernel = cpu_kernel
        self.capacity = len(layer.shard_ids) * max_rank
        self.a = torch.zeros(max_loras, self.capacity, layer.input_size, dtype=dtype, device=device)
        self.b_t = torch.zeros(max_loras, self.capacity, layer.output_size, dtype=dtype, device=device)
        self.widths = np.zeros(max_loras, dtype=np.int64)  # columns of each slot in use (0: layer not adapted)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b_t.nbytes

    def pack(self, weights: list[LoRAWeights]) -> PackedSlot:
        """One adapter's weights of this layer laid out as a slot holds them (on the host)."""
        layer = self.layer
        width = sum(weight.rank for weight in weights)
        a_packed = torch.zeros(width, layer.input_size, dtype=self.a.dtype)
        b_packed = torch.zeros(width, layer.output_size, dtype=self.b_t.dtype)
        offset = 0
        for weight in weights:
            rank = weight.rank
            a = weight.a
            if layer.splits_input:
                a = a.narrow(1, layer.group.rank * layer.input_size, layer.input_size)
            a_packed[offset : offset + rank].copy_(a)
            for shard, b in self._shard_parts(weight):
                for piece in layer.pieces(shard):
                    b_packed[offset : offset + rank, piece.dest_start : piece.dest_start + piece.size].copy_(
                        b[piece.source_start : piece.source_start + piece.size].t())
            offset += rank
        return PackedSlot(a_packed, b_packed)

    def set_slot(self, slot: int, packed: PackedSlot | None) -> None:
        """Copies one adapter's packed weights into `slot` (None: the adapter leaves this layer alone). Columns
        the previous adapter used beyond the new width are cleared: the Triton kernels read the whole slot."""
        width = packed.width if packed is not None else 0
        if width:
            self.a[slot, :width].copy_(packed.a, non_blocking=True)
            self.b_t[slot, :width].copy_(packed.b_t, non_blocking=True)
        previous = int(self.widths[slot])
        if previous > width:
            self.a[slot, width:previous].zero_()
            self.b_t[slot, width:previous].zero_()
        self.widths[slot] = width

    def _shard_parts(self, weight: LoRAWeights) -> list[tuple[object, torch.Tensor]]:
        """(shard, its rows of B): one shard, or each of a fused layer's shards of a B over all its outputs."""
        if weight.shard is not None or self.layer.shard_ids == (None,):
            return [(weight.shard, weight.b)]
        sizes = self.layer.checkpoint_shard_sizes()
        return list(zip(self.layer.shard_ids, weight.b.split(sizes, dim=0)))

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        mapping = self.context.mapping
        if mapping is None:
            return out
        if out.is_cuda:
            from pagellm.lora.triton_kernels import add_lora_triton  # imports triton, absent on some CPU installs

            return add_lora_triton(x, out, self.a, self.b_t, mapping)
        if self.cpu_kernel is not None and LoRAKernel.supports(x, out, self.capacity):
            return self.cpu_kernel(x, out, self.a, self.b_t, mapping.rows, mapping.segment_array, self.widths)
        return add_lora_torch(x, out, self.a, self.b_t, self.widths, mapping)
