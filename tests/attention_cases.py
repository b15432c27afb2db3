"""Attention test cases shared by the interpreter tests and the GPU tests: one step over a shuffled pool."""

from __future__ import annotations

import numpy as np
import torch

from pagellm.attention.backend import AttentionShape, StepAttentionInputs


def make_step(shape: AttentionShape, computed: list[int], scheduled: list[int], num_blocks: int, seed: int):
    """A step where sequence i has computed[i] tokens cached and schedules scheduled[i] (1 = decode; decodes
    first). Returns the host inputs, q/k/v for the step's tokens and a pool holding the cached tokens."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    bs = shape.block_size
    free = list(rng.permutation(num_blocks))
    seq_lens = np.array(computed) + np.array(scheduled)
    max_blocks = int(-(-seq_lens.max() // bs))
    tables = np.zeros((len(computed), max_blocks), dtype=np.int64)
    for i, length in enumerate(seq_lens):
        n = -(-int(length) // bs)
        tables[i, :n] = [free.pop() for _ in range(n)]
    cache_shape = (num_blocks, shape.num_kv_heads, bs, shape.head_dim)
    k_cache, v_cache = torch.randn(cache_shape, generator=gen), torch.randn(cache_shape, generator=gen)
    slots = []
    for i, (c, n) in enumerate(zip(computed, scheduled)):
        positions = c + np.arange(n)
        slots.append(tables[i, positions // bs] * bs + positions % bs)
    step = StepAttentionInputs(num_decodes=sum(1 for n in scheduled if n == 1), query_lens=np.array(scheduled),
                               seq_lens=seq_lens, block_tables=tables, slot_mapping=np.concatenate(slots))
    tokens = int(sum(scheduled))
    q = torch.randn(tokens, shape.num_heads, shape.head_dim, generator=gen)
    # k and v as strided views of one fused projection, as the model hands them over.
    qkv = torch.randn(tokens, 2 * shape.num_kv_heads * shape.head_dim, generator=gen)
    kv_width = shape.num_kv_heads * shape.head_dim
    k, v = (t.view(tokens, shape.num_kv_heads, shape.head_dim) for t in qkv.split(kv_width, -1))
    return step, q, k, v, k_cache, v_cache
