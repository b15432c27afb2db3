"""CUDA graphs for decode-only steps, captured at bucketed batch sizes as vLLM captures them.

A decode step of a few dozen sequences launches hundreds of small kernels; replaying them as one graph
removes the per-launch host cost that otherwise dominates. A graph replays fixed shapes and fixed
addresses, so each bucket size gets one graph over static input buffers: a step of n decodes pads to the
smallest bucket >= n (padding rows have length 0 and slot -1: they read and write nothing), copies its
inputs into the buffers and replays. Steps with prefills, or more decodes than the largest bucket, run
eagerly. All graphs share one memory pool, captured largest first so the smaller ones reuse its blocks.
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from pagellm.attention.backend import StepAttentionInputs
from pagellm.attention.paged import to_device
from pagellm.attention.triton_backend import StaticDecodeBuffers, TritonAttentionBackend

logger = logging.getLogger(__name__)

# Beyond this many sequences a decode step's launch overhead is small next to its work (vLLM's bound too).
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (capped), and max_num_seqs itself."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in [1, 2, 4, 8, *range(16, limit + 1, 16)] if s <= limit]
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


class DecodeGraphs:
    def __init__(self, model, backend: TritonAttentionBackend, kv_caches, max_num_seqs: int, max_blocks: int,
                 max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = max_blocks
        self.max_model_len = max_model_len
        self.device = device
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.buffers = StaticDecodeBuffers.allocate(largest, max_blocks, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every bucket; returns the device memory the graphs hold (their pool and buffers)."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            # An eager run first: compiles this bucket's kernels, which must not happen during capture.
            self.forward_static(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self.forward_static(size)
            self.graphs[size] = (graph, output)
        torch.cuda.synchronize(self.device)
        return max(0, free_before - torch.cuda.mem_get_info(self.device)[0])

    def can_run(self, step: StepAttentionInputs) -> bool:
        return (step.num_decodes == step.num_tokens and 0 < step.num_decodes <= self.sizes[-1]
                and step.block_tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, step: StepAttentionInputs) -> torch.Tensor:
        size = self.fill(input_ids, positions, step)
        graph, output = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return output[: step.num_decodes]

    def fill(self, input_ids: np.ndarray, positions: np.ndarray, step: StepAttentionInputs) -> int:
        """Copy a decode step into the static buffers, padded to its bucket; returns the bucket size."""
        num = step.num_decodes
        size = self.sizes[bisect.bisect_left(self.sizes, num)]
        padded = np.zeros((2, size), dtype=np.int64)
        padded[0, :num], padded[1, :num] = input_ids, positions
        padded = to_device(padded, self.device)
        self.input_ids[:size].copy_(padded[0], non_blocking=True)
        self.positions[:size].copy_(padded[1], non_blocking=True)
        self.buffers.fill(step, size)
        return size

    def forward_static(self, size: int) -> torch.Tensor:
        """The model over the first `size` rows of the static buffers: what a graph captures."""
        meta = self.backend.static_decode_metadata(self.buffers, size, self.max_model_len)
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
