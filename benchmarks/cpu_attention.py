"""Prefill attention on the CPU: torch's flash SDPA against pagellm's native kernel and the exact alternatives
torch offers, per chunk length.

A prefill chunk that starts its sequence attends causally over its own keys (pagellm/attention/paged.py,
`_chunk_attention`); with --context N, the chunk continues a sequence of N cached tokens (chunked prefill, a
prefix-cache hit). Timed here, interleaved (round robin, best of --repeats), on the default model's heads
(9 query heads over 3 KV heads of 64):

- `sdpa`:        the torch path: F.scaled_dot_product_attention on the [1, heads, tokens, dim] views,
                 enable_gqa; with --context, after gathering the context from the paged cache, with a
                 causal mask aligned to the lower right (`_chunk_attention`);
- `native`:      csrc/prefill_attention.c reading the keys and values from the paged cache (blocks of
                 --block-size in shuffled order) where write_kv put them (the write is not timed: both
                 paths do it);
- `sdpa_contig`: (without --context) SDPA on contiguous copies;
- `sdpa_fp32`:   the same on float32 copies (the half types' path on CPUs without half instructions);
- `blocked`:     query blocks of --block rows, the GQA group's heads folded into the rows of one bmm,
                 float32 scores and softmax, probabilities rounded to the input dtype for the bmm with V.

Each is checked against the torch path in float32 first (max abs error printed). GFLOP/s counts the keys
each query sees (the causal half of the chunk, plus the context).

    PYTHONPATH=$PWD python benchmarks/cpu_attention.py                      # bf16, 256..4096 tokens
    PYTHONPATH=$PWD python benchmarks/cpu_attention.py --dtype float32 --lengths 256 2048
    PYTHONPATH=$PWD python benchmarks/cpu_attention.py --variants sdpa native sdpa_fp32 blocked
    PYTHONPATH=$PWD python benchmarks/cpu_attention.py --context 2048 --lengths 256 512   # a continued prefill
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.attention.native import PrefillChunks, prefill_kernel
from pagellm.attention.paged import PrefillChunk, _chunk_attention
from pagellm.cpu_features import cpu_description


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [tokens, heads, dim], k/v [tokens, kv_heads, dim] -> [tokens, heads, dim], causal."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block: int) -> torch.Tensor:
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    queries = (q.float() * scale).view(tokens, kv_heads, group, dim).permute(1, 2, 0, 3)  # [KVH, G, T, D]
    keys_t = k.float().permute(1, 2, 0)  # [KVH, D, T]
    values = v.transpose(0, 1)  # [KVH, T, D]
    out = torch.empty(kv_heads, group, tokens, dim, dtype=q.dtype)
    upper = torch.full((block, block), float("-inf")).triu(1)
    for start in range(0, tokens, block):
        end = min(tokens, start + block)
        rows = end - start
        scores = torch.bmm(queries[:, :, start:end].reshape(kv_heads, group * rows, dim), keys_t[:, :, :end])
        scores = scores.view(kv_heads, group, rows, end)
        scores[..., start:end] += upper[:rows, :rows]
        probs = torch.softmax(scores, -1).to(q.dtype).view(kv_heads, group * rows, end)
        out[:, :, start:end] = torch.bmm(probs, values[:, :end]).view(kv_heads, group, rows, dim)
    return out.permute(2, 0, 1, 3).reshape(tokens, heads, dim)


class PagedCase:
    """A chunk of `tokens` queries after `context` cached tokens, its keys and values already in a paged cache
    (blocks in shuffled order), as after write_kv."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, context: int, tokens: int, block_size: int) -> None:
        total, kv_heads, dim = k.shape
        num_blocks = -(-total // block_size)
        self.table = np.random.default_rng(0).permutation(num_blocks).astype(np.int64)
        self.caches = []
        for source in (k, v):
            cache = torch.zeros(num_blocks, kv_heads, block_size, dim, dtype=k.dtype)
            padded = torch.zeros(num_blocks * block_size, kv_heads, dim, dtype=k.dtype)
            padded[:total] = source
            cache[torch.from_numpy(self.table)] = padded.view(num_blocks, block_size, kv_heads, dim).transpose(1, 2)
            self.caches.append(cache)
        self.chunks = PrefillChunks.build(self.table[None], [0], [tokens], [total])
        self.chunk = PrefillChunk(0, tokens, torch.from_numpy(self.table), total) if context else None

    def native(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        kernel = prefill_kernel()
        if kernel is None:
            sys.exit("the native kernels are unavailable (no C compiler, or PAGELLM_NATIVE_KERNELS=0)")
        return kernel(q, *self.caches, self.chunks, scale)

    def torch_path(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """_chunk_attention with context (k, v: the chunk's own, unused there); else SDPA on the views."""
        if self.chunk is None:
            return sdpa(q, k, v, scale)
        caches = [cache.to(q.dtype) for cache in self.caches]
        return _chunk_attention(q, k, v, *caches, self.chunk, scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 1500, 2048, 4096])
    parser.add_argument("--variants", nargs="+", default=["sdpa", "native"],
                        choices=["sdpa", "native", "sdpa_contig", "sdpa_fp32", "blocked"])
    parser.add_argument("--block-size", type=int, default=16, help="the native kernel's cache blocks")
    parser.add_argument("--context", type=int, default=0, help="cached tokens before each chunk")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    scale = args.head_dim ** -0.5
    print(f"CPU: {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.dtype}; "
          f"{args.heads} heads over {args.kv_heads} KV heads of {args.head_dim}; load average {os.getloadavg()[0]:.2f}")
    if args.context and set(args.variants) - {"sdpa", "native"}:
        sys.exit("--context compares the torch path (sdpa) and native only")
    all_options = {
        "sdpa_contig": lambda q, k, v: sdpa(q.contiguous(), k.contiguous(), v.contiguous(), scale),
        "sdpa_fp32": lambda q, k, v: sdpa(q.float(), k.float(), v.float(), scale).to(dtype),
        "blocked": lambda q, k, v: blocked(q, k, v, scale, args.block),
    }
    print(f"{'tokens':>6} | " + " | ".join(f"{name:>18}" for name in args.variants) + "   (ms, GFLOP/s; max abs error)")
    with torch.no_grad():
        for tokens in args.lengths:
            # Views of one [tokens, q+2kv heads, dim] projection, as the model hands them over; the context's
            # keys and values before the chunk's.
            total = args.context + tokens
            qkv = torch.randn(total, args.heads + 2 * args.kv_heads, args.head_dim, dtype=dtype) * 2
            q, k, v = qkv.split([args.heads, args.kv_heads, args.kv_heads], dim=1)
            case = PagedCase(k, v, args.context, tokens, args.block_size)
            q, k, v = q[args.context:], k[args.context:], v[args.context:]
            all_options["sdpa"] = lambda q, k, v: case.torch_path(q, k, v, scale)
            all_options["native"] = lambda q, k, v: case.native(q, scale)
            options = {name: all_options[name] for name in args.variants}
            reference = case.torch_path(q.float(), k.float(), v.float(), scale)
            errors = {name: (fn(q, k, v).float() - reference).abs().max().item() for name, fn in options.items()}
            best = {name: float("inf") for name in options}
            for _ in range(args.repeats):
                for name, fn in options.items():
                    start = time.perf_counter()
                    fn(q, k, v)
                    best[name] = min(best[name], time.perf_counter() - start)
            # QK^T and PV (2 flops per multiply-add each) over the keys each query sees
            flops = 4 * tokens * (args.context + (tokens + 1) / 2) * args.head_dim * args.heads
            print(f"{tokens:>6} | " + " | ".join(
                f"{best[n] * 1e3:6.1f} {flops / best[n] / 1e9:5.0f} {errors[n]:.3f}" for n in options), flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
