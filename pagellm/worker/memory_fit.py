"""Whether the weights, the KV pool and the activation peak fit in the memory this process may use.

Checked twice, each time before the allocation it guards: the weights (a GGUF file's size, or the parameters
a meta-device build of the model with its quantization makes, before they are loaded), then the whole footprint (after the profiling steps
measured the activation peak, before the pool is allocated). What cannot fit is refused with a ValueError
that names every figure and what to lower; a small machine never starts to load what it cannot hold.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pagellm.config import CPU_DEFAULT_KV_CACHE_BYTES
from pagellm.distributed.parallel_state import TensorParallelGroup, building_with
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.models import registry
from pagellm.models.loader import default_dtype
from pagellm.worker.kv_cache import GiB, DeviceMemory

logger = logging.getLogger(__name__)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"


@dataclass(frozen=True)
class PlannedModel:
    num_parameters: int  # this rank's
    parameter_bytes: int  # as the layers make them: `dtype`, or a quantized layer's own dtypes
    num_kv_heads: int  # this rank's share
    described: str  # what parameter_bytes counts, for messages


def planned_model(hf_config, max_model_len: int, dtype: torch.dtype, group: TensorParallelGroup,
                  quant_config: QuantizationConfig | None) -> PlannedModel:
    """This rank's share of the model, counted on a meta-device build (which allocates nothing) with the
    quantization config loading uses: the parameters loading allocates before it copies the checkpoint in,
    the least the weights take. Packed copies for the CPU kernels may come on top; a layer quantized online
    (quantization="int8"/"fp8" on a float checkpoint) makes its weight when its tensors arrive, so it is not
    counted at all."""
    with torch.device("meta"), default_dtype(dtype), building_with(group):
        model = registry.model_class_for(hf_config)(hf_config, max_model_len, quant_config)
    parameters = list(model.parameters())
    count = sum(p.numel() for p in parameters)
    dtype_name = str(dtype).removeprefix("torch.")
    described = f"{count / 1e6:.0f}M parameters in {dtype_name}"
    if quant_config is not None:
        described = (f"{count / 1e6:.0f}M parameters: the {quant_config.name} layers' in the dtypes they load in, "
                     f"the rest in {dtype_name}")
    return PlannedModel(count, sum(p.numel() * p.element_size() for p in parameters), model.num_kv_heads_per_rank,
                        described)


def gguf_share(path: Path, group: TensorParallelGroup, growth: int = 0) -> tuple[int, str]:
    """(bytes, what they are) of a GGUF file that this rank holds at least: whatever the loader makes of the
    tensors (kept in their blocks or dequantized), the ranks together hold the file's, and `growth` more where
    known (kernel-less types kept as Q8_0 blocks: GGUFTensors.transcoding_growth)."""
    size = path.stat().st_size + growth
    what = f"the size of {path.name}" + (" with its kernel-less types as Q8_0" if growth else "")
    if group.size == 1:
        return size, what
    return size // group.size, f"{what} / {group.size} ranks"


@dataclass(frozen=True)
class LeastPool:
    """The smallest KV pool the engine could start with, where it comes from and the setting that sets it."""

    nbytes: int
    what: str
    setting: str


def check_weights_fit(weights: int, what: str, pool: LeastPool | None, memory: DeviceMemory) -> None:
    """Refuses, before loading, weights that with the least pool exceed what the process may use. `what` says
    where the weights' figure comes from."""
    need = weights + (pool.nbytes if pool is not None else 0)
    if need <= memory.free:
        return
    pool_part = f" and the KV cache at least {_gib(pool.nbytes)} ({pool.what})" if pool is not None else ""
    lower = f", lower {pool.setting}" if pool is not None and pool.nbytes else ""
    raise ValueError(
        f"the model does not fit in this machine's memory: its weights need at least {_gib(weights)} ({what})"
        f"{pool_part}, {_gib(need)} in all, but this process may use {_gib(memory.free)} ({memory.described}). "
        f"Use a smaller model or a narrower dtype{lower}, or free memory."
    )


@dataclass(frozen=True)
class Footprint:
    """What the engine holds beside the KV pool, as measured at start-up."""

    memory: DeviceMemory
    weights: int
    prefill_peak: int
    decode_peak: int
    num_decodes: int  # sequences in the profiled decode step (max_num_seqs, or less where the budget is)
    graph_reserve: int  # CUDA graphs' pool (0 on CPU and with enforce_eager)

    @property
    def activation_peak(self) -> int:
        return max(self.prefill_peak, self.decode_peak)

    @property
    def beside_pool(self) -> int:
        return self.weights + self.activation_peak + self.graph_reserve

    def describe(self) -> str:
        graphs = f" + CUDA graphs {_gib(self.graph_reserve)}" if self.graph_reserve else ""
        return (f"weights {_gib(self.weights)} + activation peak {_gib(self.activation_peak)} (prefill of "
                f"max_num_batched_tokens {_gib(self.prefill_peak)}, decode of {self.num_decodes} sequences "
                f"(max_num_seqs) with their logits and sampler {_gib(self.decode_peak)}){graphs}")


def check_pool_fits(footprint: Footprint, pool: int, name: str) -> None:
    """An explicit pool (kv_cache_memory_bytes, num_gpu_blocks_override) must fit beside the rest."""
    available = footprint.memory.free
    if footprint.beside_pool + pool <= available:
        return
    room = available - footprint.beside_pool
    lower = (f"lower {name} to at most {_gib(max(room, 0))}" if room > 0
             else "the pool has no room at all; lower max_num_seqs or max_num_batched_tokens")
    raise ValueError(
        f"{name} asks for a {_gib(pool)} KV cache, but {footprint.describe()} + that pool = "
        f"{_gib(footprint.beside_pool + pool)}, more than the {_gib(available)} this process may use "
        f"({footprint.memory.described}): {lower} (max_model_len sets the least pool one request needs), "
        "or free memory."
    )


def refuse_pool_too_small(footprint: Footprint, usable: int, utilization: float, need_bytes: int,
                          max_model_len: int) -> ValueError:
    """The default pool, sized to the memory there is, cannot hold one request of max_model_len."""
    return ValueError(
        f"the KV cache cannot hold one request of max_model_len={max_model_len} ({_gib(need_bytes)}) in this "
        f"machine's memory: {footprint.describe()} leave {_gib(max(usable - footprint.beside_pool, 0))} of the "
        f"{_gib(usable)} the engine may use (gpu_memory_utilization={utilization} x {_gib(footprint.memory.total)}, "
        f"{footprint.memory.described}). Lower max_model_len, max_num_seqs (the decode peak) or "
        "max_num_batched_tokens (the prefill peak), or free memory."
    )


def cpu_default_pool(footprint: Footprint, usable: int, utilization: float) -> tuple[int, str]:
    """The CPU pool when kv_cache_memory_bytes is not given: the CPU default, or what fits where less does."""
    room = usable - footprint.beside_pool
    if room >= CPU_DEFAULT_KV_CACHE_BYTES:
        return CPU_DEFAULT_KV_CACHE_BYTES, (f"gpu_memory_utilization={utilization}, capped at the CPU default of "
                                            f"{CPU_DEFAULT_KV_CACHE_BYTES / GiB:.0f} GiB")
    reason = (f"sized down from the CPU default of {CPU_DEFAULT_KV_CACHE_BYTES / GiB:.0f} GiB to what fits: "
              f"gpu_memory_utilization={utilization} x {_gib(footprint.memory.total)} available "
              f"({footprint.memory.described}) - {footprint.describe()}")
    logger.warning("KV cache %s", reason)
    return max(room, 0), reason
