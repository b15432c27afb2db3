"""One MoE layer's experts on the CPU: the native kernel (ops/cpu_moe.py, one call per layer) against the grouped
path it replaced, random weights and router scores, over step sizes from one decoding token to a long prefill.
In float32 the grouped path is torch.mm per used expert on its slice of the stacked weights; in bfloat16
(`--dtype bfloat16`) it is each expert product on the dense layers' kernel (ops/dense_linear.py's choice:
linear_bf16 where the CPU has avx512_bf16), as bfloat16 experts ran on such CPUs before the kernel took them.

Shapes are benchmarks/moe.py's scaled Qwen3-30B-A3B (128 experts of 384 features, 8 per token) and Mixtral-8x7B
(8 experts of 3584, 2 per token), hidden 1024. Each cell is the best of a few interleaved runs (wall clock), so
run it on a quiet machine; the load average is printed.

    PYTHONPATH=$PWD python benchmarks/moe_experts.py
    PYTHONPATH=$PWD python benchmarks/moe_experts.py --threads 1 --tokens 1 16 256
    PYTHONPATH=$PWD python benchmarks/moe_experts.py --dtype bfloat16
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
from pagellm.ops.dense_linear import UpcastScratch, choose_dense_kernel

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


def grouped_products(w13: torch.Tensor, w2: torch.Tensor):
    """The grouped path's gate_up and down products: torch.mm on the slices in float32, the dense layers' kernel
    per expert in half types."""
    if w13.dtype == torch.float32:
        return (lambda e, rows, out: torch.mm(rows, w13[e].t(), out=out),
                lambda e, rows, out: torch.mm(rows, w2[e].t(), out=out))
    scratch = UpcastScratch()
    gate_up = [choose_dense_kernel(w, True, scratch)[0] for w in w13]
    down = [choose_dense_kernel(w, True, scratch)[0] for w in w2]
    return (lambda e, rows, out: out.copy_(gate_up[e](rows, None)),
            lambda e, rows, out: out.copy_(down[e](rows, None)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64, 256, 1024, 2048])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_moe_kernel()
    if kernel is None:
        sys.exit("the native kernels are unavailable here (no C compiler, or PAGELLM_NATIVE_KERNELS=0)")
    flags = " ".join(sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()))
    dtype = getattr(torch, args.dtype)
    print(f"CPU flags: {flags}; {args.threads} threads; {args.dtype}; load average {os.getloadavg()[0]:.2f} at start")
    print(f"{'shape':14s} {'tokens':>6s} {'rows/expert':>11s} {'native ms':>10s} {'GFLOP/s':>8s} "
          f"{'grouped ms':>10s} {'GFLOP/s':>8s} {'grouped/native':>14s}")
    generator = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        experts, hidden, inter, top_k = SHAPES[shape]
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=generator) * 0.05).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=generator) * 0.05).to(dtype)
        activation = SiluAndMul()
        w13p, w2p = kernel.pack(w13, w2)
        products = grouped_products(w13, w2)

        def torch_path(x, weights, ids):
            return grouped_experts(x, weights, ids, experts, *products, 2 * inter, activation)

        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, generator=generator).to(dtype)
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
