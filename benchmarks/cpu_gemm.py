"""Which CPU GEMM is fastest per linear-layer shape and row count, in float32 and bfloat16.

Compares, for each of the model's linear shapes (default: SmolLM2-135M's fused qkv, o, gate_up, down and
lm_head) and each row count, the options torch offers without torch.compile:

- `mkl`:    F.linear on the plain [out, in] weight (MKL for float32; oneDNN's matmul underneath for bf16);
- `packed`: the weight reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`),
            then `torch.ops.mkldnn._linear_pointwise` per call: what ops/dense_linear.py does in float32 (and in
            bfloat16 where the native kernel below is not built);
- `mm_t`:   x @ W^T with W^T stored contiguous [in, out] (a second layout MKL/oneDNN may prefer);
- `native`: bfloat16 where the CPU has avx512_bf16: pagellm's own kernel (linear_bf16.c) on its packed weight.

One shape called again and again keeps its weight in cache; `--chain 30` times passes over 30 layers of distinct
weights instead (the model's qkv, o, gate_up and down), which come from memory as in a decode step.

Every option is timed interleaved with the others (round robin, best of --repeats), so that load from other
processes hits them alike. Prints GFLOP/s and the winner per row, under the CPU it ran on.

    PYTHONPATH=$PWD python benchmarks/cpu_gemm.py                       # both dtypes, default shapes
    PYTHONPATH=$PWD python benchmarks/cpu_gemm.py --dtype bfloat16 --rows 1 16 64 512 2048
    PYTHONPATH=$PWD python benchmarks/cpu_gemm.py --dtype bfloat16 --chain 30 --rows 8 32 64 256
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagellm.cpu_features import cpu_description
from pagellm.ops.dense_linear import can_pack_for_cpu
from pagellm.ops.linear_bf16 import linear_bf16

# (name, in_features, out_features) of SmolLM2-135M (hidden 576, intermediate 1536, 9 q heads, 3 kv heads
# of 64, vocabulary 49152), with q/k/v and gate/up fused as pagellm runs them.
SMOLLM2_135M_SHAPES = (
    ("qkv", 576, 960),
    ("o", 576, 576),
    ("gate_up", 576, 3072),
    ("down", 1536, 576),
    ("lm_head", 576, 49152),
)
DEFAULT_ROWS = (1, 4, 16, 48, 128, 256, 512, 1024, 2048)


def gemm_options(weight: torch.Tensor, with_mm_t: bool = True) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The ways to compute x @ weight.T that this CPU can run: oneDNN's packed weight only where pagellm packs
    (oneDNN refuses bf16 without AVX-512 or AVX-NE-CONVERT); bf16 there runs widened to float32 ("upcast")."""
    options = {"mkl": lambda x: F.linear(x, weight)}
    if can_pack_for_cpu(weight.device, weight.dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        options["packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    elif weight.dtype != torch.float32:
        weight_f32 = weight.float()
        options["upcast"] = lambda x: F.linear(x.float(), weight_f32).to(weight.dtype)
    if with_mm_t:
        weight_t = weight.t().contiguous()
        options["mm_t"] = lambda x: torch.mm(x, weight_t)
    kernel = linear_bf16() if weight.dtype == torch.bfloat16 else None
    if kernel is not None and kernel.supports(weight.shape[1], weight.shape[0]):
        native_packed = kernel.pack(weight)
        options["native"] = lambda x: kernel(x, native_packed, None)
    return options


def time_chain(dtype: torch.dtype, rows: int, layers: int, repeats: int) -> dict[str, float]:
    """Seconds per pass over `layers` layers of distinct weights (the model's qkv, o, gate_up, down each), per
    option: unlike one shape called again and again, whose weight stays in cache, the weights come from memory,
    as in a decode step."""
    chain = [gemm_options(torch.randn(out_features, in_features, dtype=dtype) * in_features ** -0.5, False)
             for _ in range(layers) for name, in_features, out_features in SMOLLM2_135M_SHAPES if name != "lm_head"]
    inputs = [torch.randn(rows, in_features, dtype=dtype)
              for _ in range(layers) for name, in_features, _ in SMOLLM2_135M_SHAPES if name != "lm_head"]
    best = {name: float("inf") for name in chain[0]}
    for _ in range(repeats):
        for name in best:
            for _ in range(2):
                start = time.perf_counter()
                for options, x in zip(chain, inputs):
                    options[name](x)
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def time_options(options: dict[str, Callable], x: torch.Tensor, repeats: int, min_seconds: float) -> dict[str, float]:
    """Best seconds per call of each option, interleaved round robin."""
    for fn in options.values():  # warm up (oneDNN builds its primitive on the first call per shape)
        fn(x)
        fn(x)
    first = next(iter(options.values()))
    start = time.perf_counter()
    first(x)
    one = time.perf_counter() - start
    calls = max(1, int(min_seconds / max(one, 1e-7)))
    best = {name: float("inf") for name in options}
    for _ in range(repeats):
        for name, fn in options.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn(x)
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="both")
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    parser.add_argument("--shapes", nargs="+", default=[name for name, _, _ in SMOLLM2_135M_SHAPES],
                        help="subset of: " + " ".join(name for name, _, _ in SMOLLM2_135M_SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's, one per core); 1 compares fairly on a busy machine, "
                             "where spinning thread pools suffer from other processes unevenly")
    parser.add_argument("--min-seconds", type=float, default=0.02, help="time per timed batch of calls")
    parser.add_argument("--chain", type=int, default=0, metavar="LAYERS",
                        help="instead: time passes over this many layers of distinct weights (30: the model's)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtypes = ("float32", "bfloat16") if args.dtype == "both" else (args.dtype,)
    shapes = [shape for shape in SMOLLM2_135M_SHAPES if shape[0] in args.shapes]
    print(f"CPU: {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average at start {os.getloadavg()[0]:.2f}")
    if args.chain:
        print_chain(dtypes, args)
        return
    columns = ("mkl", "packed", "upcast", "mm_t", "native")
    print(f"{'dtype':9} {'shape':8} {'rows':>5} | " + " ".join(f"{n:>8}" for n in columns)
          + " | GFLOP/s   winner  (vs mkl)")
    with torch.no_grad():
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for name, in_features, out_features in shapes:
                weight = torch.randn(out_features, in_features, dtype=dtype) * in_features ** -0.5
                options = gemm_options(weight)
                for rows in args.rows:
                    x = torch.randn(rows, in_features, dtype=dtype)
                    results = {n: fn(x).float() for n, fn in options.items()}
                    scale = max(results["mkl"].abs().max().item(), 1e-6)
                    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
                    for option, result in results.items():
                        error = (result - results["mkl"]).abs().max().item() / scale
                        if error > tolerance:
                            raise AssertionError(f"{option} differs from F.linear by {error:.2e} at {name} {rows} rows")
                    seconds = time_options(options, x, args.repeats, args.min_seconds)
                    flops = 2 * rows * in_features * out_features
                    gflops = {n: flops / s / 1e9 for n, s in seconds.items()}
                    winner = max(gflops, key=gflops.get)
                    print(f"{dtype_name:9} {name:8} {rows:>5} | "
                          + " ".join(f"{gflops[n]:8.1f}" if n in gflops else f"{'-':>8}" for n in columns)
                          + f" | {winner:>8} {gflops[winner] / gflops['mkl']:5.2f}x", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


def print_chain(dtypes, args) -> None:
    layer_flops = sum(2 * i * o for name, i, o in SMOLLM2_135M_SHAPES if name != "lm_head")
    print(f"{args.chain} layers of qkv, o, gate_up, down, distinct weights; ms per pass (GFLOP/s)")
    with torch.no_grad():
        for dtype_name in dtypes:
            for rows in args.rows:
                seconds = time_chain(getattr(torch, dtype_name), rows, args.chain, args.repeats)
                flops = layer_flops * rows * args.chain
                print(f"{dtype_name:9} {rows:>5} rows | " + "  ".join(
                    f"{name} {1e3 * s:7.2f} ({flops / s / 1e9:5.0f})" for name, s in seconds.items()), flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
