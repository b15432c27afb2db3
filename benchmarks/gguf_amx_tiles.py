"""How many bfloat16 bytes of a GGUF weight the dense path on AMX dequantizes per tile (gguf_kernels.AMX_TILE_BYTES).

On a CPU with AMX, bfloat16 rows from the dense threshold on run linear_bf16's tiles on the weight dequantized a tile
at a time into one buffer (csrc/bf16_tiles.h: each tile's dequantization, then its product, both over every
thread). A tile too large for the threads' L2 caches is written out by the dequantization and read back by the
product. This times `GGUFKernels.matmul_dense` on bfloat16 rows for each tile size, the sizes interleaved in every
round (best of --rounds), on layers from memory (weights of distinct layers cycled through, --min-mib of them), and
prints each size's time and its speed-up over the first.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/gguf_amx_tiles.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/gguf_amx_tiles.py --types Q4_0 --rows 64 --tile-kib 4096 2048
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.moe import print_cpu
from pagellm.ops import gguf_kernels as gk
from tests.test_gguf_kernels import random_weight

SHAPES = ((2048, 8192), (8192, 2048), (576, 1536))  # (in, out): a ~1B model's MLP up / down, SmolLM2's up


def time_sizes(ops: gk.GGUFKernels, type_name: str, in_features: int, out_features: int, rows: int,
               sizes: list[int], rounds: int, min_mib: int) -> dict[int, float]:
    """Best seconds per product of each tile size (bytes)."""
    count = max(1, min(8, (min_mib << 20) // gk.row_bytes(type_name, in_features) // out_features))
    weights = [random_weight(type_name, out_features, in_features, seed=i) for i in range(count)]
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    best = dict.fromkeys(sizes, float("inf"))
    saved = gk.AMX_TILE_BYTES
    try:
        for _ in range(rounds):
            for size in sizes:
                gk.AMX_TILE_BYTES = size
                started = time.perf_counter()
                for weight in weights:
                    ops.matmul_dense(x, weight, type_name, out_features, in_features)
                best[size] = min(best[size], (time.perf_counter() - started) / len(weights))
    finally:
        gk.AMX_TILE_BYTES = saved
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["NVFP4_F16", "Q4_K", "Q8_0"])
    parser.add_argument("--rows", nargs="+", type=int, default=[32, 128, 512])
    parser.add_argument("--tile-kib", nargs="+", type=int, default=[4096, 2048, 1024, 512])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-mib", type=int, default=64, help="MiB of distinct weights cycled through")
    args = parser.parse_args()
    ops = gk.gguf_kernels()
    if ops is None or ops.amx_product is None:
        raise SystemExit("the dense path runs on AMX's tiles only where the CPU has amx_bf16 (and the kernels build)")
    sizes = [kib << 10 for kib in args.tile_kib]
    print_cpu()
    print("\n| layer (in -> out) | type | rows | " + " | ".join(f"{kib} KiB ms" for kib in args.tile_kib) + " | "
          + " | ".join(f"{kib} KiB vs {args.tile_kib[0]}" for kib in args.tile_kib[1:]) + " |")
    print("|---|---|---:|" + "---:|" * (2 * len(sizes) - 1))
    for in_features, out_features in SHAPES:
        for type_name in args.types:
            if in_features % gk._format(type_name)[1].block_size:
                continue
            for rows in args.rows:
                best = time_sizes(ops, type_name, in_features, out_features, rows, sizes, args.rounds, args.min_mib)
                first = best[sizes[0]]
                print(f"| {in_features} -> {out_features} | {type_name} | {rows} | "
                      + " | ".join(f"{best[s] * 1e3:.2f}" for s in sizes) + " | "
                      + " | ".join(f"{first / best[s]:.2f}x" for s in sizes[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()
