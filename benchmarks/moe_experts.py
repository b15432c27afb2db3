"""One MoE layer's experts on the CPU: the native kernel (ops/cpu_moe.py, one call per layer) against the grouped
torch path it replaced (torch.mm per used expert on its slice of the stacked weights), float32, random weights
and router scores, over step sizes from one decoding token to a long prefill.

Shapes are benchmarks/moe.py's scaled Qwen3-30B-A3B (128 experts of 384 features, 8 per token) and Mixtral-8x7B
(8 experts of 3584, 2 per token), hidden 1024. Each cell is the best of a few interleaved runs (wall clock), so
run it on a quiet machine; the load average is printed.

    PYTHONPATH=$PWD python benchmarks/moe_experts.py
    PYTHONPATH=$PWD python benchmarks/moe_experts.py --threads 1 --tokens 1 16 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from pagellm.cpu_features import cpu_flags
from pagellm.layers.activation import SiluAndMul
from pagellm.layers.fused_moe import grouped_experts
from pagellm.ops.cpu_moe import cpu_moe_kernel

# name: (experts, hidden, intermediate, top_k)
SHAPES = {"qwen3-30b-a3b": (128, 1024, 384, 8), "mixtral-8x7b": (8, 1024, 3584, 2)}


def best_of(runs: int, *calls) -> list[float]:
    """Each call's best wall time over `runs` interleaved rounds."""
    best = [float("inf")] * len(calls)
    for _ in range(runs):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64, 256, 1024, 2048])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_moe_kernel()
    if kernel is None:
        sys.exit("the native kernels are unavailable here (no C compiler, or PAGELLM_NATIVE_KERNELS=0)")
    flags = " ".join(sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()))
    print(f"CPU flags: {flags}; {args.threads} threads; load average {os.getloadavg()[0]:.2f} at start")
    print(f"{'shape':14s} {'tokens':>6s} {'rows/expert':>11s} {'native ms':>10s} {'GFLOP/s':>8s} "
          f"{'torch ms':>9s} {'GFLOP/s':>8s} {'torch/native':>12s}")
    generator = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        experts, hidden, inter, top_k = SHAPES[shape]
        w13 = torch.randn(experts, 2 * inter, hidden, generator=generator) * 0.05
        w2 = torch.randn(experts, hidden, inter, generator=generator) * 0.05
        activation = SiluAndMul()
        w13p, w2p = kernel.pack(w13, w2)

        def torch_path(x, weights, ids):
            return grouped_experts(x, weights, ids, experts,
                                   lambda e, rows, out: torch.mm(rows, w13[e].t(), out=out),
                                   lambda e, rows, out: torch.mm(rows, w2[e].t(), out=out), 2 * inter, activation)

        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, generator=generator)
            weights, ids = torch.topk(torch.randn(tokens, experts, generator=generator).softmax(-1), top_k)
            native_s, torch_s = best_of(7 if tokens <= 64 else 3, lambda: kernel(x, w13p, w2p, weights, ids),
                                        lambda: torch_path(x, weights, ids))
            flops = tokens * top_k * 3 * hidden * inter * 2
            print(f"{shape:14s} {tokens:6d} {tokens * top_k / experts:11.1f} {native_s * 1e3:10.2f} "
                  f"{flops / native_s / 1e9:8.1f} {torch_s * 1e3:9.2f} {flops / torch_s / 1e9:8.1f} "
                  f"{torch_s / native_s:11.2f}x", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
