"""Linear layers split for tensor parallelism (Megatron's column and row split, as vLLM names them), each with
a weight method chosen from the checkpoint's quantization config when it is built.

A layer registers whatever parameters its method creates; each carries `output_dim` / `input_dim` attributes,
and the layer's weight loader puts a checkpoint tensor (a whole weight, or one of the fused q/k/v or gate/up
shards) where this rank's part of it goes, whatever the format. Fused layers never un-fuse to load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.distributed.parallel_state import TensorParallelGroup, current_group
from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig
from pagellm.layers.quantization.unquantized import Unquantized
from pagellm.layers.weights import copy_checked, scaled_range, set_weight_attrs

ShardId = int | str | None


@dataclass(frozen=True)
class OutputPiece:
    """Where this rank's part of one checkpoint shard lies: output features [source_start, + size) of the
    checkpoint tensor go to [dest_start, + size) of the fused parameter."""

    source_start: int
    size: int
    dest_start: int


class LinearBase(nn.Module):
    """x @ W^T + b over this rank's partition. Subclasses say how the features are split (`pieces`)."""

    # Checkpoint shards this layer fuses, in their order along the output (None: one unfused weight).
    shard_ids: tuple[ShardId, ...] = (None,)
    # LoRA adapter slots (pagellm/lora/layers.py) whose delta is added to the output; None without LoRA.
    lora = None

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, quant_config: QuantizationConfig | None,
                 prefix: str, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.group = group or current_group()
        self.prefix = prefix
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.quant_method: LinearMethod = (quant_config or Unquantized()).linear_method(prefix)
        self.quant_method.create_weights(self, input_size, self.output_sizes, torch.get_default_dtype())
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size), requires_grad=False)
            set_weight_attrs(self.bias, output_dim=0)
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            # A method may give a parameter a loader of its own (GPTQ's g_idx, one row per fused shard).
            loader = getattr(param, "weight_loader", None) or self.weight_loader
            set_weight_attrs(param, weight_loader=loader, shard_ids=self.shard_ids)

    def pieces(self, shard: ShardId) -> list[OutputPiece]:
        """This rank's output features of checkpoint shard `shard`."""
        return [OutputPiece(0, self.output_size, 0)]

    # Whether this rank holds a slice of the input features (row-parallel under tensor parallelism).
    splits_input = False

    def checkpoint_shard_sizes(self) -> list[int]:
        """Output features of each shard in a checkpoint (all ranks), in the order they are fused."""
        return [self.output_size * self.group.size]

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard: ShardId = None) -> None:
        name = f"{self.prefix}.{_param_name(self, param)}" + (f" (shard {shard})" if shard is not None else "")
        output_dim = getattr(param, "output_dim", None)
        if shard is None and self.shard_ids != (None,) and output_dim is not None:
            # The checkpoint stores the fused tensor (Phi-3's qkv_proj): load each shard of it in turn.
            sizes = [scaled_range(param, output_dim, 0, size)[1] for size in self.checkpoint_shard_sizes()]
            if tensor.shape[output_dim] != sum(sizes):
                raise ValueError(f"{name}: the fused tensor has {tensor.shape[output_dim]} outputs, expected {sum(sizes)}")
            for shard_id, piece in zip(self.shard_ids, tensor.split(sizes, dim=output_dim)):
                self.weight_loader(param, piece, shard_id)
            return
        if shard not in self.shard_ids and not (shard is None and output_dim is None):
            raise ValueError(f"{name}: {type(self).__name__} has no shard {shard!r}; its shards are {self.shard_ids}")
        input_dim = getattr(param, "input_dim", None)
        if input_dim is not None and self.splits_input:
            # In the parameter's own units (packed values, quantization groups): rank r holds the r-th slice.
            size = param.shape[input_dim]
            tensor = tensor.narrow(input_dim, self.group.rank * size, size)
        if output_dim is None:
            copy_checked(param.data, tensor, name)
            return
        for piece in self.pieces(shard):
            source_start, size = scaled_range(param, output_dim, piece.source_start, piece.size)
            dest_start, _ = scaled_range(param, output_dim, piece.dest_start, piece.size)
            copy_checked(param.data.narrow(output_dim, dest_start, size), tensor.narrow(output_dim, source_start, size),
                         name)

    # Set once the method has prepared the weights: a parent that needs this layer's product while preparing its
    # own (MLA's kv_b_proj) prepares it first, and the loader's walk then passes over it.
    weights_processed = False

    def process_weights_after_loading(self) -> None:
        if self.weights_processed:
            return
        self.quant_method.process_weights_after_loading(self)
        self.weights_processed = True

    def matmul(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """x @ W^T + b on this rank's partition (no collective), plus the LoRA delta of adapted tokens."""
        out = self.quant_method.apply(self, x, self.bias if add_bias else None)
        return out if self.lora is None else self.lora.add_delta(x, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def direct_product(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """x -> forward(x) as one callable prepared at load, where forward adds nothing to the method's product
        (no bias, one rank, no LoRA slots); None otherwise. A caller that skips the module call checks its
        hooks itself, at every call (models/llama.py's direct layers do)."""
        if self.bias is not None or self.group.size != 1 or self.lora is not None:
            return None
        return self.quant_method.prepared_product(self)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, method={type(self.quant_method).__name__}"


def _param_name(module: nn.Module, param: nn.Parameter) -> str:
    for name, candidate in module.named_parameters(recurse=False):
        if candidate is param:
            return name
    return "?"


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def __init__(self, input_size: int, output_size: int, bias: bool, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__(input_size, [output_size], bias, quant_config, prefix)

    def checkpoint_shard_sizes(self) -> list[int]:
        return [self.output_size]


class ColumnParallelLinear(LinearBase):
    """Output features split evenly over the ranks; each rank's output is its slice (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        group = current_group()
        super().__init__(input_size, [output_size // group.size], bias, quant_config, prefix, group)

    def pieces(self, shard: ShardId) -> list[OutputPiece]:
        return [OutputPiece(self.group.rank * self.output_size, self.output_size, 0)]


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel weights fused into one product (gate and up): shard i is output_sizes[i]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        group = current_group()
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(input_size, [size // group.size for size in output_sizes], bias, quant_config, prefix, group)

    def pieces(self, shard: ShardId) -> list[OutputPiece]:
        size = self.output_sizes[shard]
        return [OutputPiece(self.group.rank * size, size, sum(self.output_sizes[:shard]))]

    def checkpoint_shard_sizes(self) -> list[int]:
        return [size * self.group.size for size in self.output_sizes]


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one tensor-parallel rank holds: query heads [q_start, q_start + num_q) and
    KV heads [kv_start, kv_start + num_kv). With more ranks than KV heads, each KV head is held by
    size // num_key_value_heads ranks (replicated, as vLLM does), each rank holding one."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    num_q = num_heads // size
    if num_kv_heads >= size:
        num_kv = num_kv_heads // size
        return HeadShard(rank * num_q, num_q, rank * num_kv, num_kv)
    return HeadShard(rank * num_q, num_q, rank // (size // num_kv_heads), 1)


class QKVParallelLinear(LinearBase):
    """q, k and v fused, split by whole heads (KV heads replicated when there are fewer than ranks)."""

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        group = current_group()
        self.head_dim = head_dim
        self.heads = head_shard(num_heads, num_kv_heads, group.rank, group.size)
        q, kv = self.heads.num_q * head_dim, self.heads.num_kv * head_dim
        self.total_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, [q, kv, kv], bias, quant_config, prefix, group)

    def checkpoint_shard_sizes(self) -> list[int]:
        return list(self.total_sizes)

    def pieces(self, shard: ShardId) -> list[OutputPiece]:
        q_size, kv_size = self.output_sizes[0], self.output_sizes[1]
        if shard == "q":
            return [OutputPiece(self.heads.q_start * self.head_dim, q_size, 0)]
        start = self.heads.kv_start * self.head_dim
        return [OutputPiece(start, kv_size, q_size + (kv_size if shard == "v" else 0))]


class RowParallelLinear(LinearBase):
    """Input features split over the ranks: each computes a partial product over its slice and one all-reduce
    sums them. The bias is added once, by rank 0, before the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool, quant_config: QuantizationConfig | None,
                 prefix: str, reduce_results: bool = True) -> None:
        group = current_group()
        self.splits_input = group.size > 1  # set first: a weight method sizes its group tensors by it
        super().__init__(input_size // group.size, [output_size], bias, quant_config, prefix, group)
        self.reduce_results = reduce_results

    def checkpoint_shard_sizes(self) -> list[int]:
        return [self.output_size]  # the outputs are not split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, add_bias=self.group.rank == 0)
        return self.group.all_reduce(out) if self.reduce_results else out
