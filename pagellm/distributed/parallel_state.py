"""The tensor-parallel group of this process and the few collectives the engine uses.

A process may hold several engines at once (tests compare TP=1 with TP=2 in one interpreter), so there
is no global default process group: each engine's ranks get a `TensorParallelGroup` of their own, built
directly on a rendezvous store, and each layer keeps the group that was current when it was built.
Two process groups join the same ranks: `device_group` (gloo on CPU, NCCL on CUDA) carries the
activations, `cpu_group` (always gloo) carries the driver's per-step messages, with a timeout of its
own, because a worker waits there for as long as the engine stays idle.

`expert_parallel` (vLLM's enable_expert_parallel) tells the mixture-of-experts layers built for the group to
place whole experts on its ranks instead of a slice of every expert (layers/fused_moe.py); the same ranks and
collectives serve both.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# The step message travels in one broadcast of this many bytes (its length leads); a longer one takes a second.
_MESSAGE_BYTES = 1 << 16
_HEADER_BYTES = 8


@dataclass
class TensorParallelGroup:
    rank: int
    size: int
    device_group: object | None = None
    cpu_group: object | None = None
    expert_parallel: bool = False

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place."""
        if self.size > 1:
            self.device_group.allreduce([tensor]).wait()
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's `tensor` (equal shapes) concatenated along the last dim; other ranks: None."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            self.device_group.gather([parts], [tensor], options).wait()
            return torch.cat(parts, dim=-1)
        self.device_group.gather([], [tensor], options).wait()
        return None

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0 sends `obj` (picklable); every rank returns it. Runs on the CPU group."""
        buffer = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        payload = b""
        if self.rank == 0:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            head = len(payload).to_bytes(_HEADER_BYTES, "little") + payload[: _MESSAGE_BYTES - _HEADER_BYTES]
            buffer[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self.cpu_group.broadcast(buffer, 0).wait()
        length = int.from_bytes(buffer[:_HEADER_BYTES].numpy().tobytes(), "little")
        first = buffer[_HEADER_BYTES : _HEADER_BYTES + length]
        rest_length = length - len(first)
        if rest_length <= 0:
            return obj if self.rank == 0 else pickle.loads(first.numpy().tobytes())
        rest = torch.zeros(rest_length, dtype=torch.uint8)
        if self.rank == 0:
            rest.copy_(torch.frombuffer(bytearray(payload[len(first):]), dtype=torch.uint8))
        self.cpu_group.broadcast(rest, 0).wait()
        if self.rank == 0:
            return obj
        return pickle.loads(first.numpy().tobytes() + rest.numpy().tobytes())

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` (a CPU tensor of the same shape and dtype on every rank), into every rank's, in place.
        Runs on the CPU group."""
        if self.size > 1:
            self.cpu_group.broadcast(tensor, 0).wait()
        return tensor

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (on the CPU group)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.cpu_group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def shutdown(self) -> None:
        for group in (self.device_group, self.cpu_group):
            if group is not None and hasattr(group, "shutdown"):
                try:
                    group.shutdown()
                except RuntimeError:
                    pass  # a peer is already gone: nothing left to close cleanly
        self.device_group = self.cpu_group = None


SINGLE = TensorParallelGroup(0, 1)
_current = SINGLE


def build_group(store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta,
                idle_timeout: timedelta, expert_parallel: bool = False) -> TensorParallelGroup:
    """Joins the ranks that meet on `store`; returns once all `size` have joined (or raises on timeout)."""
    cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, size, timeout)
    cpu_group.set_timeout(idle_timeout)  # after the rendezvous, which `timeout` bounds
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        device_group = dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, size, options)
    else:
        device_group = dist.ProcessGroupGloo(dist.PrefixStore("device", store), rank, size, timeout)
    return TensorParallelGroup(rank, size, device_group, cpu_group, expert_parallel)


@contextmanager
def building_with(group: TensorParallelGroup) -> Iterator[None]:
    """Makes `group` the one that layers built inside the block shard over."""
    global _current
    saved, _current = _current, group
    try:
        yield
    finally:
        _current = saved


def current_group() -> TensorParallelGroup:
    return _current


def tp_rank() -> int:
    return _current.rank


def tp_size() -> int:
    return _current.size
