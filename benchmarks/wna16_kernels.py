"""AWQ/GPTQ CPU kernels (pagellm/ops/wna16.py, csrc/wna16.c) per row count, against pagellm's float32 layer.

On one layer shape (default 2048 x 2048), 4- and 8-bit weights with groups of 128 (in input order, or act-order
with --act-order), times y = x W^T through both paths of the kernels:
- `packed`: straight from the packed weights (what `matmul` runs below `dense_min_rows` rows);
- `dense`:  tiles dequantized to float32 and torch's GEMM on them (what it runs from there);
and pagellm's float32 dense layer on the dequantized weight, set up as the loader sets it up
(pagellm.ops.dense_linear.choose_dense_kernel: oneDNN on a packed copy, MKL from 512 rows on AVX2).
With --bf16, bfloat16 rows, a third path and the bfloat16 layer instead:
- `tiles`:  the weight dequantized into linear_bf16's packed layout, tile by tile, and linear_bf16 on it (what
            `product` runs from `bf16_tile_min_rows` rows where the CPU has avx512_bf16); the packed path and
            the tiles then write bfloat16 outputs, as a bfloat16 model's layers have them written;
and the row count from which the tiles were faster than the packed path.

Weights come from memory as in a decode step: each option cycles through enough layers of distinct weights to
hold --min-mib of them. Options are timed interleaved, best of --repeats. Prints GFLOP/s and weight bytes read per
second, and the row count from which the dense path was faster.

    PYTHONPATH=$PWD python benchmarks/wna16_kernels.py
    PYTHONPATH=$PWD python benchmarks/wna16_kernels.py --rows 1 2 4 8 16 32 64 128 --threads 1 --cpu-time
    PYTHONPATH=$PWD python benchmarks/wna16_kernels.py --bf16 --rows 16 32 64 --in-features 1024 --out-features 768
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from pagellm.cpu_features import cpu_description
from pagellm.ops import wna16
from pagellm.ops.dense_linear import UpcastScratch, choose_dense_kernel

DEFAULT_ROWS = (1, 8, 64)


def random_weight(bits: int, in_features: int, out_features: int, group_size: int, act_order: bool,
                  generator: torch.Generator) -> wna16.GroupQuantWeight:
    q = torch.randint(0, 2**bits, (in_features, out_features), generator=generator, dtype=torch.int32)
    groups = in_features // group_size
    g_idx = torch.arange(in_features) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, generator=generator)]
    scales = (torch.rand(groups, out_features, generator=generator) * 0.01).half().float()
    zeros = torch.randint(0, 2**bits, (groups, out_features), generator=generator).float()
    return wna16.GroupQuantWeight(bits, wna16.pack_rows(q, bits), scales, -scales * zeros, g_idx.to(torch.int32))


def time_interleaved(options: dict[str, Callable[[], None]], repeats: int, cpu_time: bool) -> dict[str, float]:
    """Best seconds per call of each option (each call one pass over its layers), round robin."""
    clock = time.thread_time if cpu_time else time.perf_counter
    for fn in options.values():
        fn()
    best = {name: float("inf") for name in options}
    for _ in range(repeats):
        for name, fn in options.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--out-features", type=int, default=2048)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--act-order", action="store_true", help="groups scattered over the inputs (desc_act)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-mib", type=float, default=96, help="weights cycled per option, beyond the caches")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the calling thread's CPU time (use with --threads 1 on a shared machine)")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 rows, with the linear_bf16 tiles path")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = wna16.wna16_kernels()
    if kernels is None:
        raise SystemExit("the C kernels cannot be built here (no compiler, or PAGELLM_NATIVE_KERNELS=0)")
    k, n = args.in_features, args.out_features
    print(f"CPU: {cpu_description()}; kernels built for {kernels.isa}; {torch.get_num_threads()} threads; "
          f"layer {k} x {n}, groups of {args.group_size}{', act-order' if args.act_order else ''}; "
          f"{'CPU' if args.cpu_time else 'wall'} time, best of {args.repeats}")
    generator = torch.Generator().manual_seed(0)
    for bits in args.bits:
        layer_bytes = k * n * bits // 8
        count = max(1, min(64, math.ceil(args.min_mib * 2**20 / layer_bytes)))
        layouts = [wna16.cpu_layout(random_weight(bits, k, n, args.group_size, args.act_order, generator))
                   for _ in range(count)]
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        element = torch.finfo(dtype).bits // 8
        float_count = max(1, min(64, math.ceil(args.min_mib * 2**20 / (element * k * n))))
        scratch = UpcastScratch()
        dense_layers = [choose_dense_kernel(kernels.dequantize(layouts[i % count]).to(dtype), False, scratch)[0]
                        for i in range(float_count)]
        tiles = args.bf16 and kernels._tiles_take(layouts[0])
        print(f"\n{bits}-bit ({count} layers of {layer_bytes / 2**20:.1f} MiB; {dtype} layer: "
              f"{dense_layers[0].name}, {float_count} layers)")
        print(f"{'rows':>6} {'packed GFLOP/s':>15} {'GB/s':>6} {'dense GFLOP/s':>14}"
              + (f" {'tiles GFLOP/s':>14}" if tiles else "") + f" {str(dtype)[6:] + ' GFLOP/s':>17} {'GB/s':>6}")
        dense_from = tiles_from = None
        for rows in args.rows:
            x = torch.randn(rows, k).to(dtype)
            # bfloat16 rows: the packed path and the tiles write bfloat16, as a bfloat16 model's layers call them.
            y = torch.empty(rows, n, dtype=torch.bfloat16)
            options = {
                "packed": (lambda: [kernels._packed_into(x, layout, y, None) for layout in layouts]) if args.bf16
                else (lambda: [kernels.matmul_packed(x, layout) for layout in layouts]),
                "dense": lambda: [kernels.matmul_dense(x, layout) for layout in layouts],
                "layer": lambda: [layer(x, None) for layer in dense_layers],
            }
            if tiles:
                options["tiles"] = lambda: [kernels._tiles_into(x, layout, y) for layout in layouts]
            best = time_interleaved(options, args.repeats, args.cpu_time)
            flops = 2 * rows * k * n
            speed = {name: flops * (float_count if name == "layer" else count) / seconds / 1e9
                     for name, seconds in best.items()}
            print(f"{rows:>6} {speed['packed']:>15.1f} {layer_bytes * count / best['packed'] / 1e9:>6.1f} "
                  f"{speed['dense']:>14.1f}" + (f" {speed['tiles']:>14.1f}" if tiles else "")
                  + f" {speed['layer']:>17.1f} {element * k * n * float_count / best['layer'] / 1e9:>6.1f}")
            if dense_from is None and speed["dense"] > speed["packed"]:
                dense_from = rows
            if tiles and tiles_from is None and speed["tiles"] > speed["packed"]:
                tiles_from = rows
        print(f"dense path faster from {dense_from} rows" if dense_from
              else "packed path faster than dense at every row count")
        if tiles:
            print(f"tiles faster from {tiles_from} rows" if tiles_from
                  else "packed path faster than the tiles at every row count")


if __name__ == "__main__":
    main()
