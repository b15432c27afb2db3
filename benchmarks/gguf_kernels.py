"""GGUF kernels (pagellm/ops/gguf_kernels.py) against the dense GEMMs pagellm runs today, per type and row count.

For each GGUF block type and each row count m, times y = x W^T on one layer shape (default 2048 x 8192, an MLP
projection of a ~1B model) through both paths of the kernels:
- `int8`:  activations quantized per row, integer dot products on the blocks (what `matmul` runs for small m,
           and, in the AVX-512 VNNI build, on 512-bit tiles from `tile_threshold` rows on);
- `dense`: tiles of the weight dequantized to float32 (bfloat16 with --activations bfloat16 where the CPU
           multiplies it natively) and torch's GEMM on them (what it runs from `dense_threshold` rows on);
           with bfloat16 activations on a CPU with AMX, bfloat16 tiles in linear_bf16's packed layout multiplied
           on AMX's tiles by pagellm's kernel instead, beside `torch`, the same tiles on torch's GEMM (oneDNN);
           `*` marks the path `matmul` picks;
and, on the same shape, pagellm's dense linear layer (pagellm.models.llama.Linear, set up as the loader sets it up)
in float32 and bfloat16: oneDNN on a packed weight, MKL from 512 rows in float32 on AVX2, the avx512_bf16 kernel
where the CPU has it, or half weights widened to float32 per call where it has no bf16 instructions.

Weights come from memory as in a decode step: each option cycles through enough layers of distinct random weights
to hold --min-mib of them (far more than the last-level cache). Options are timed interleaved, best of --repeats.
Prints GFLOP/s, weight bytes read per second and the speed-up over pagellm's bfloat16 layer, under this CPU's
flags, with a plain read bandwidth (torch summing a large float32 tensor) to compare the bytes per second with.

    PYTHONPATH=$PWD python benchmarks/gguf_kernels.py                          # Q4_0 Q8_0 Q4_K Q5_K Q6_K
    PYTHONPATH=$PWD python benchmarks/gguf_kernels.py --types all --rows 1 8 64 512 --threads 1 --cpu-time
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from pagellm.cpu_features import cpu_description, cpu_flags
from pagellm.ops import gguf_kernels as gk

DEFAULT_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
DEFAULT_ROWS = (1, 8, 64, 512)
# The flags that decide which kernels run and how fast.
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16")


def random_weight(type_name: str, out_features: int, in_features: int, rng: np.random.Generator) -> torch.Tensor:
    """Random blocks with small finite float16 scales (their values do not change the time)."""
    _, fmt = gk._format(type_name)
    blocks = rng.integers(0, 256, size=(out_features, in_features // fmt.block_size, fmt.block_bytes), dtype=np.uint8)
    # Every byte pair read as float16 stays finite: clear the exponent's top bit of each odd byte.
    blocks[..., 1::2] &= 0xBF
    return torch.from_numpy(blocks.reshape(out_features, -1))


def pagellm_linears(dtype: torch.dtype, in_features: int, out_features: int, count: int) -> list:
    """`count` of pagellm's dense products in `dtype` (callables of x), each on the kernel the loader picks for
    its weight (ops/dense_linear.py's choose_dense_kernel: packed, the bfloat16 kernel, or widened per call
    through one shared buffer)."""
    from pagellm.ops.dense_linear import UpcastScratch, choose_dense_kernel

    scratch = UpcastScratch()
    layers = []
    for _ in range(count):
        weight = (torch.randn(out_features, in_features) * 0.05).to(dtype)
        kernel, _ = choose_dense_kernel(weight, False, scratch)
        layers.append(lambda x, k=kernel: k(x, None))
    return layers


def layer_count(layer_bytes: int, min_bytes: int) -> int:
    return max(1, min(64, math.ceil(min_bytes / layer_bytes)))


def time_interleaved(options: dict[str, Callable[[], None]], repeats: int, cpu_time: bool) -> dict[str, float]:
    """Best seconds per call of each option (each call one pass over its layers), round robin."""
    clock = time.thread_time if cpu_time else time.perf_counter
    for fn in options.values():  # warm up: oneDNN builds its primitive, the kernels their library
        fn()
    best = {name: float("inf") for name in options}
    for _ in range(repeats):
        for name, fn in options.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return best


def read_bandwidth(cpu_time: bool) -> float:
    """Bytes per second of torch summing a 256 MiB float32 tensor (with torch's threads), best of 5."""
    big = torch.ones(64 << 20)
    seconds = time_interleaved({"sum": lambda: big.sum()}, 5, cpu_time)["sum"]
    return big.numel() * 4 / seconds


def call_overhead(kernels: gk.GGUFKernels, cpu_time: bool) -> float:
    """Seconds per `matmul` call on a one-block layer: the Python and ctypes cost a decode step pays per layer."""
    weight = torch.zeros(1, 34, dtype=torch.uint8)
    x = torch.zeros(1, 32)
    calls = 2000

    def run() -> None:
        for _ in range(calls):
            kernels.matmul(x, weight, "Q8_0", 1, 32)

    return time_interleaved({"call": run}, 5, cpu_time)["call"] / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=list(DEFAULT_TYPES), help="GGUF types, or 'all'")
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--out-features", type=int, default=8192)
    parser.add_argument("--min-mib", type=int, default=128, help="MiB of distinct weights each option cycles through")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--activations", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of x for the GGUF paths (bfloat16: the dense path's tiles are bfloat16 where "
                             "the CPU multiplies it natively, and `*` marks that dtype's threshold)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the calling thread's CPU time (with --threads 1, on a machine shared with others)")
    args = parser.parse_args()
    types = list(gk.KERNEL_TYPES) if args.types == ["all"] else args.types
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    kernels = gk.gguf_kernels()
    if kernels is None:
        raise SystemExit("the GGUF kernels cannot be built here (no C compiler, or PAGELLM_NATIVE_KERNELS=0)")
    in_features, out_features = args.in_features, args.out_features
    activations = getattr(torch, args.activations)
    torch_gemm = None  # the dense path as it ran before AMX's tiles took it, to compare them
    if activations is torch.bfloat16 and kernels.amx_product is not None:
        torch_gemm = gk.GGUFKernels(gk._library(kernels.isa))
        torch_gemm.amx_product = None
    flags = " ".join(flag for flag in FLAGS if flag in cpu_flags()) or "none of " + " ".join(FLAGS)
    print(f"CPU: {cpu_description()}; flags: {flags}")
    print(f"kernels: {kernels.isa} build, integer dot products on {kernels.dot_instructions}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}; "
          f"{'CPU' if args.cpu_time else 'wall'} time")
    bandwidth = read_bandwidth(args.cpu_time)
    print(f"plain read (torch sum of 256 MiB float32): {bandwidth / 1e9:.1f} GB/s; matmul call overhead "
          f"{call_overhead(kernels, args.cpu_time) * 1e6:.1f} us")
    print(f"GGUF paths' activations: {args.activations}")
    print(f"layer {in_features} -> {out_features}; ms per layer, GFLOP/s, GB/s of weights read, x vs bf16")
    rng = np.random.default_rng(0)
    min_bytes = args.min_mib << 20
    flops = {m: 2 * m * in_features * out_features for m in args.rows}
    with torch.no_grad():
        bf16_seconds: dict[int, float] = {}
        print(f"{'weights':10} {'rows':>5} {'path':6} {'ms':>9} {'GFLOP/s':>8} {'GB/s':>7} {'x bf16':>7}")
        for dtype in (torch.bfloat16, torch.float32):
            layer_bytes = in_features * out_features * torch.finfo(dtype).bits // 8
            layers = pagellm_linears(dtype, in_features, out_features, layer_count(layer_bytes, min_bytes))
            for m in args.rows:
                x = torch.randn(m, in_features, dtype=dtype)
                seconds = time_interleaved({"run": lambda: [layer(x) for layer in layers]}, args.repeats,
                                           args.cpu_time)["run"] / len(layers)
                bf16_seconds.setdefault(m, seconds)
                print(f"{str(dtype).removeprefix('torch.'):10} {m:>5} {'torch':6} {seconds * 1e3:9.3f} "
                      f"{flops[m] / seconds / 1e9:8.1f} {layer_bytes / seconds / 1e9:7.1f} "
                      f"{bf16_seconds[m] / seconds:7.2f}", flush=True)
            del layers
        for type_name in types:
            layer_bytes = out_features * gk.row_bytes(type_name, in_features)
            weights = [random_weight(type_name, out_features, in_features, rng)
                       for _ in range(layer_count(layer_bytes, min_bytes))]
            for m in args.rows:
                x = torch.randn(m, in_features, dtype=activations)
                options = {
                    "int8": lambda: [kernels.matmul_int8(x, w, type_name, out_features, in_features) for w in weights],
                    "dense": lambda: [kernels.matmul_dense(x, w, type_name, out_features, in_features) for w in weights],
                }
                if torch_gemm is not None:
                    options["torch"] = lambda: [torch_gemm.matmul_dense(x, w, type_name, out_features, in_features)
                                                for w in weights]
                seconds = time_interleaved(options, args.repeats, args.cpu_time)
                threshold = kernels.dense_threshold(type_name, activations)
                tiles = kernels.tile_threshold(type_name, activations)
                dense = threshold is not None and m >= threshold and (tiles is None or m < tiles)
                picked = "dense" if dense else "int8"
                for path, total in seconds.items():
                    s = total / len(weights)
                    mark = "*" if path == picked else " "
                    print(f"{type_name:10} {m:>5} {path + mark:6} {s * 1e3:9.3f} {flops[m] / s / 1e9:8.1f} "
                          f"{layer_bytes / s / 1e9:7.1f} {bf16_seconds[m] / s:7.2f}", flush=True)
            del weights
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
