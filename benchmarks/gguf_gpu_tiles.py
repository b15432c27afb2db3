"""A sweep of the Triton GGUF matmul's tiles (pagellm/ops/triton_gguf.py's TileConfig) on a CUDA device: for each
block type and row count, every candidate's time against the current choice (matmul_tiles) and a dense bfloat16
layer, so that matmul_tiles can be set from timings rather than from registers alone.

    python benchmarks/gguf_gpu_tiles.py --results sweep.jsonl --out sweep.md
    python benchmarks/gguf_gpu_tiles.py --results sweep.jsonl --types Q4_K --rows 1 64 --jobs 8

Compiling ~100 candidates per type would take minutes on one process: worker processes compile them first (and
check each candidate's output against the dequantized weight), then this process times them one at a time
(triton.testing.do_bench, L2 cleared before each call), reading the compiled kernels from Triton's cache.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
import triton

from benchmarks.gguf_gpu import describe_tiles, random_weight, record
from pagellm.ops.triton_gguf import GEOMETRY, TileConfig, TritonGGUFKernels, matmul_tiles

DEFAULT_TYPES = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
# The broadcast product's [BLOCK_M, BLOCK_N, weights per step] float32 tile, at most this many elements.
MAX_BROADCAST = 8192


def candidates(rows: int, lanes: int) -> list[TileConfig]:
    """The grid around the first sweep's winners (H200, 2026-12-04: decode 1x4 tiles under one warp, dot tiles of
    64 outputs with 2 stages, dot from 8 rows): broadcast tiles up to 4 rows, dot tiles from 2."""
    found = []
    if rows <= 4:
        block_m = triton.next_power_of_2(rows)
        for block_n in (1, 2, 4, 8):
            for per_step in (128, 256, 512):
                if block_m * block_n * per_step > MAX_BROADCAST:
                    continue
                for warps in (1, 2):
                    for late_sum in (False, True):
                        found.append(TileConfig(block_m, block_n, per_step // lanes, False, warps,
                                                late_sum=late_sum))
    if rows >= 2:
        block_ms = (16,) if rows <= 16 else (32, 64) if rows <= 64 else (64, 128)
        for block_m in block_ms:
            for block_n in (32, 64):
                for per_step in (64, 128, 256):
                    for warps in (4, 8):
                        for stages in (1, 2):
                            found.append(TileConfig(block_m, block_n, per_step // lanes, True, warps, stages))
    return found


def _inputs(type_name: str, rows: int, shape: tuple[int, int]):
    device = torch.device("cuda")
    out_features, in_features = shape
    weight = random_weight(type_name, out_features, in_features, device)
    generator = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16, generator=generator)
    return weight, x


def compile_and_check(type_name: str, rows: int, shape: tuple[int, int], configs: list[dict]) -> list[float | str]:
    """In a worker: run each candidate once (compiling it into Triton's cache); its relative error, or the error
    message where it does not compile or run."""
    ops = TritonGGUFKernels()
    out_features, in_features = shape
    weight, x = _inputs(type_name, rows, shape)
    reference = ops.dequantize_rows(weight, type_name, torch.arange(out_features, device=weight.device), in_features)
    expected = F.linear(x.float(), reference)
    results: list[float | str] = []
    for config in configs:
        try:
            y = ops.matmul(x, weight, type_name, out_features, in_features, tiles=TileConfig(**config))
            torch.cuda.synchronize()
            results.append(((y.float() - expected).norm() / expected.norm()).item())
        except Exception as error:  # noqa: BLE001 - a candidate that does not compile is a result of the sweep
            results.append(f"{type(error).__name__}: {str(error)[:200]}")
    return results


def sweep(args) -> list[dict]:
    import triton.testing

    shape = tuple(args.shape)
    jobs = []
    for type_name in args.types:
        lanes = GEOMETRY[type_name].lanes
        for rows in args.rows:
            configs = [matmul_tiles(rows, GEOMETRY[type_name])] + candidates(rows, lanes)
            configs = list(dict.fromkeys(configs))  # the current choice first, once
            jobs.append((type_name, rows, configs))
    context = multiprocessing.get_context("spawn")
    checked: dict[tuple[str, int], list] = {}
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        futures = {}
        for type_name, rows, configs in jobs:
            for start in range(0, len(configs), 8):  # small chunks keep every worker busy
                chunk = [asdict(c) for c in configs[start: start + 8]]
                futures[pool.submit(compile_and_check, type_name, rows, shape, chunk)] = (type_name, rows, start)
        for future, (type_name, rows, start) in futures.items():
            checked.setdefault((type_name, rows), []).append((start, future.result()))
    ops = TritonGGUFKernels()
    out_features, in_features = shape
    dense = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
    results = []
    for type_name, rows, configs in jobs:
        errors = [e for _, part in sorted(checked[(type_name, rows)]) for e in part]
        weight, x = _inputs(type_name, rows, shape)
        bf16_ms = triton.testing.do_bench(lambda: F.linear(x, dense), warmup=5, rep=25)
        for index, (tiles, error) in enumerate(zip(configs, errors)):
            row = dict(section="gguf_tiles", type=type_name, rows=rows, tiles=describe_tiles(tiles),
                       config=asdict(tiles), current=index == 0, bf16_ms=bf16_ms)
            if isinstance(error, str):
                row.update(error=error)
            else:
                ms = triton.testing.do_bench(
                    lambda: ops.matmul(x, weight, type_name, out_features, in_features, tiles=tiles), warmup=5, rep=25)
                row.update(ms=ms, rel_error=error, speedup=bf16_ms / ms,
                           weight_bytes_per_s=weight.numel() / (ms / 1e3))
            results.append(row)
            with open(args.results, "a") as f:
                f.write(json.dumps(row) + "\n")
    return results


def table(results: list[dict], shape: tuple[int, int]) -> str:
    lines = [f"GGUF Triton matmul tiles, {shape[0]} x {shape[1]} (out x in), bfloat16 x: the best candidate per type "
             "and rows against the current choice", "",
             "| type | rows | current ms | best ms | best / current | bf16 ms | best vs bf16 | best rel. error | "
             "best tiles | candidates (failed) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = list(dict.fromkeys((r["type"], r["rows"]) for r in results))
    for type_name, rows in keys:
        group = [r for r in results if (r["type"], r["rows"]) == (type_name, rows)]
        timed = [r for r in group if "ms" in r and r["rel_error"] < 1e-2]
        current = next(r for r in group if r["current"])
        if not timed:
            lines.append(f"| {type_name} | {rows} | - | - | - | - | - | - | none ran | {len(group)} |")
            continue
        best = min(timed, key=lambda r: r["ms"])
        current_ms = current.get("ms", float("nan"))
        lines.append(f"| {type_name} | {rows} | {current_ms:.4f} | {best['ms']:.4f} | {best['ms'] / current_ms:.2f} | "
                     f"{best['bf16_ms']:.4f} | {best['speedup']:.2f}x | {best['rel_error']:.1e} | {best['tiles']} | "
                     f"{len(group)} ({len(group) - len([r for r in group if 'ms' in r])}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, help="JSON-lines file every candidate's row is appended to")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    parser.add_argument("--types", nargs="+", default=DEFAULT_TYPES, choices=list(GEOMETRY))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 64, 512])
    parser.add_argument("--shape", nargs=2, type=int, default=[14336, 4096], metavar=("OUT", "IN"))
    parser.add_argument("--jobs", type=int, default=12, help="processes compiling the candidates")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gguf_gpu_tiles.py times Triton kernels on a CUDA device; none is visible here")
    results = sweep(args)
    text = table(results, tuple(args.shape))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    record(args.results, dict(section="gguf_tiles", name="candidates", count=len(results)))


if __name__ == "__main__":
    main()
