"""The GGUF kernels' dequantization into linear_bf16's packed layout (what the dense path on AMX runs per tile), this
tree's library against the one built from another revision's csrc, in one process, interleaved.

A CPU's speed drifts from minute to minute on a shared machine, so two runs compare minutes as much as code: here both
libraries are loaded side by side and timed in turn (best of --rounds), on the same weights, and their outputs are
checked bit for bit. Prints G weights/s per type for both and the ratio, with the CPU.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/gguf_dequantize_ab.py --base HEAD~1
    PYTHONPATH=$PWD .venv/bin/python benchmarks/gguf_dequantize_ab.py --base main --types Q4_K Q6_K --rows 256
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.moe import print_cpu
from pagellm.ops import cpu_build
from pagellm.ops import gguf_kernels as gk
from tests.test_gguf_kernels import random_weight

ROOT = Path(__file__).resolve().parents[1]
CSRC = "pagellm/ops/csrc"


def kernels_at(revision: str, workdir: Path) -> gk.GGUFKernels:
    """The GGUF kernels compiled from `revision`'s csrc (this tree's build flags)."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{CSRC}"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        source = subprocess.run(["git", "show", f"{revision}:{CSRC}/{name}"], cwd=ROOT, check=True,
                                capture_output=True).stdout
        (workdir / name).write_bytes(source)
    headers = [workdir / name for name in names if name.endswith(".h")]
    library = cpu_build.build_library("pagellm_gguf_base_avx512", [workdir / "gguf_quant.c"], headers,
                                      gk.build_flags("avx512"))
    return gk.GGUFKernels(ctypes.CDLL(str(library)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the git revision to compare this tree with")
    parser.add_argument("--types", nargs="+", default=["NVFP4_F16", "MXFP4_F16", "IQ4_NL", "NF4", "Q4_0"])
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--out-features", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=512, help="rows of W per call (a tile)")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    new = gk.gguf_kernels("avx512")
    if new is None or "avx512" not in cpu_build.runnable_isas():
        raise SystemExit("the packed dequantization's wide path is the AVX-512 build's; this CPU cannot run it")
    with tempfile.TemporaryDirectory() as workdir:
        base = kernels_at(args.base, Path(workdir))
    print_cpu()
    k, n, rows = args.in_features, args.out_features, args.rows
    print(f"\n{n} x {k} weights, {rows} rows per call, best of {args.rounds} interleaved rounds\n")
    print(f"| type | {args.base} G weights/s | this tree | speed-up | bits equal |")
    print("|---|---:|---:|---:|---|")
    for name in args.types:
        weight = random_weight(name, n, k, seed=1)
        outputs = {label: torch.empty(rows * k, dtype=torch.bfloat16) for label in ("base", "new")}
        best = {"base": float("inf"), "new": float("inf")}
        for _ in range(args.rounds):
            for label, ops in (("base", base), ("new", new)):
                type_id = ops._type_id(name)
                started = time.perf_counter()
                for first in range(0, n, rows):
                    ops._packed_rows(type_id, weight, first, rows, k, outputs[label])
                best[label] = min(best[label], time.perf_counter() - started)
        equal = torch.equal(outputs["base"].view(torch.int16), outputs["new"].view(torch.int16))
        print(f"| {name} | {n * k / best['base'] / 1e9:.1f} | {n * k / best['new'] / 1e9:.1f} | "
              f"{best['base'] / best['new']:.2f}x | {equal} |", flush=True)


if __name__ == "__main__":
    main()
