"""The Triton GGUF kernels (pagellm/ops/triton_gguf.py) on a CUDA device against a dense bfloat16 layer (F.linear,
cuBLAS), per block type and row count; benchmarks/gpu_check.sh runs it as its `gguf` section.

    python benchmarks/gguf_gpu.py --results r.jsonl --out gguf_gpu.md
    python benchmarks/gguf_gpu.py --results r.jsonl --types Q4_K Q8_0 --rows 1 8 --shape 4096 4096

For each type and m rows of bfloat16 x, y = x W^T on one layer (default 14336 x 4096, Llama-3-8B's MLP
up-projection, out x in): the time (triton.testing.do_bench, which clears the L2 cache before each call, so the
weight comes from memory as in a decode step), the weight's bytes read per second against a device-to-device copy
(bytes read plus written), TFLOP/s, and the speed-up over F.linear on a bfloat16 weight of the same shape. Decode
(a few rows) is bound by the bytes read: a Q4_K layer is 0.28x the bf16 one's, so the ideal speed-up is ~3.5x.
The relative error is against F.linear on the kernels' own float32 dequantization of the weight.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.ops.gguf_kernels import KERNEL_TYPES, row_bytes
from pagellm.ops.triton_gguf import GEOMETRY, TileConfig, TritonGGUFKernels, matmul_tiles


def random_weight(type_name: str, out_features: int, in_features: int, device: torch.device) -> torch.Tensor:
    """Random blocks whose every byte pair read as float16 is finite and below 2 (bit 14 of each pair cleared):
    the values do not change the time, and the products stay finite."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(out_features, row_bytes(type_name, in_features)), dtype=np.uint8)
    raw[:, 1::2] &= 0xBF
    return torch.from_numpy(raw).to(device)


def record(path: str, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def describe_tiles(tiles: TileConfig) -> str:
    kind = "dot" if tiles.use_dot else "broadcast, summed after the loop" if tiles.late_sum else "broadcast"
    return (f"{tiles.block_m}x{tiles.block_n}, {tiles.block_b} blocks, {tiles.num_warps} warps, "
            f"{tiles.num_stages} stages, {kind}")


def copy_bandwidth(device: torch.device) -> float:
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def bench(args) -> list[dict]:
    import triton.testing

    device = torch.device("cuda")
    out_features, in_features = args.shape
    ops = TritonGGUFKernels()
    copy = copy_bandwidth(device)
    record(args.results, dict(section="gguf", name="device copy (read + write)", bytes_per_s=copy))
    dense_bf16 = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16)
    bf16_ms = {}
    for rows in args.rows:
        x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16)
        bf16_ms[rows] = triton.testing.do_bench(lambda: F.linear(x, dense_bf16))
    del dense_bf16
    results = []
    for type_name in args.types:
        weight = random_weight(type_name, out_features, in_features, device)
        reference = ops.dequantize_rows(weight, type_name, torch.arange(out_features, device=device), in_features)
        for rows in args.rows:
            x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16)
            y = ops.matmul(x, weight, type_name, out_features, in_features)
            expected = F.linear(x.float(), reference)
            error = ((y.float() - expected).norm() / expected.norm()).item()
            ms = triton.testing.do_bench(lambda: ops.matmul(x, weight, type_name, out_features, in_features))
            tiles = matmul_tiles(rows, GEOMETRY[type_name])
            row = dict(section="gguf", name=f"{type_name}, {rows} rows", type=type_name, rows=rows,
                       shape=f"{out_features} x {in_features}", ms=ms, weight_bytes=weight.numel(),
                       bytes_per_s=weight.numel() / (ms / 1e3), fraction_of_copy=weight.numel() / (ms / 1e3) / copy,
                       tflops=2 * rows * out_features * in_features / (ms / 1e3) / 1e12, bf16_ms=bf16_ms[rows],
                       speedup=bf16_ms[rows] / ms, rel_error=error,
                       tiles=describe_tiles(tiles))
            record(args.results, row)
            results.append(row)
        del weight, reference
    return results


def table(rows: list[dict], shape: str) -> str:
    lines = [f"GGUF Triton kernels, {shape} (out x in), bfloat16 x, against F.linear on a bfloat16 weight",
             "", "| type | rows | ms | weight GB/s (of copy) | TFLOP/s | bf16 ms | speed-up | rel. error | tiles |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['type']} | {r['rows']} | {r['ms']:.4f} | {r['bytes_per_s'] / 1e9:.0f} "
                     f"({100 * r['fraction_of_copy']:.0f}%) | {r['tflops']:.1f} | {r['bf16_ms']:.4f} | "
                     f"{r['speedup']:.2f}x | {r['rel_error']:.1e} | {r['tiles']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, help="JSON-lines file the rows are appended to")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    parser.add_argument("--types", nargs="+", default=list(KERNEL_TYPES), choices=KERNEL_TYPES)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 64, 512])
    parser.add_argument("--shape", nargs=2, type=int, default=[14336, 4096], metavar=("OUT", "IN"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: the Triton GGUF kernels are timed on one (tests/test_triton_gguf.py checks them "
                 "on CPU under TRITON_INTERPRET=1)")
    text = table(bench(args), f"{args.shape[0]} x {args.shape[1]}")
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
