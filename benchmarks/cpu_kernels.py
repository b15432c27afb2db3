"""Time each native CPU kernel per instruction set (AVX-512 / AVX2 / generic) and dtype, beside the torch ops
it replaces, on the default model's shapes (SmolLM2-135M: hidden 576, intermediate 1536, 9 query and 3 kv
heads of 64).

Other processes disturb timings on a shared machine, so the variants are interleaved: each round times every
variant once (the median of `--calls` calls), and the table gives each variant's best round and the median
round; the load average is printed before and after.

    python -m benchmarks.cpu_kernels [--rounds 5] [--calls 20] [--seqs 48 --context 512 --layers 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.attention import native
from pagellm.cpu_features import cpu_description
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.rotary import RotaryEmbedding, apply_rotary
from pagellm.ops import cpu_build
from pagellm.ops.cpu_ops import cpu_ops

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 576, 1536, 9, 3, 64, 16
TORCH = "torch"


def _median_call_us(function: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _cases(dtype: torch.dtype, rows: int, seqs: int, context: int, layers: int) -> dict[str, Callable]:
    """kernel name -> (variant -> a call), each variant on the same inputs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    residual = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    norm = RMSNorm(HIDDEN, 1e-5).to(dtype)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=gen).to(dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    rotary = RotaryEmbedding(_RopeConfig(), HEAD_DIM, 4096)
    rotary.reset_cache(torch.device("cpu"))
    positions = torch.arange(rows) * 7 % 4096
    rotary.cover(positions)  # the kernel reads the tables by position
    blocks = -(-context // BLOCK)
    # One cache pair per layer, each call taking the next layer's, as a model step does: a single pair of a
    # few MB would be read from the CPU's caches, where a step reads hundreds of MB from DRAM.
    k_caches = torch.randn(layers, seqs * blocks + 1, KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    v_caches = torch.randn_like(k_caches)
    layer_order = itertools.cycle(range(layers))
    tables = np.random.default_rng(0).permutation(seqs * blocks).reshape(seqs, blocks).astype(np.int64)
    context_lens = np.full(seqs, context, dtype=np.int64)
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    tables_tensor = torch.from_numpy(tables)

    def torch_rotary():
        q_part, k_part = qkv[:, : HEADS * HEAD_DIM], qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM]
        apply_rotary(q_part.reshape(rows, HEADS, HEAD_DIM), k_part.reshape(rows, KV_HEADS, HEAD_DIM),
                     rotary.lookup(positions, dtype))

    def torch_decode():
        layer = next(layer_order)
        k = k_caches[layer][tables_tensor].transpose(1, 2).flatten(2, 3)  # [seqs, KVH, L, D]
        v = v_caches[layer][tables_tensor].transpose(1, 2).flatten(2, 3)
        F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True)

    cases = {
        f"add_rms_norm {rows}x{HIDDEN}": {TORCH: lambda: norm(x, residual.clone())},
        f"silu_and_mul {rows}x{INTERMEDIATE}": {
            TORCH: lambda: F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]},
        f"rotary {rows}x{HEADS + KV_HEADS}x{HEAD_DIM}": {TORCH: torch_rotary},
        f"decode {seqs}x{context} GQA {HEADS}/{KV_HEADS}": {TORCH: torch_decode},
    }
    def native_decode(kernel):
        layer = next(layer_order)
        kernel(q, k_caches[layer], v_caches[layer], tables, context_lens, 0.125)

    for isa in cpu_build.runnable_isas():
        ops, kernel = cpu_ops(isa), native.decode_kernel(isa)
        names = iter(cases)
        cases[next(names)][isa] = lambda ops=ops: ops.add_rms_norm(x, residual, norm.weight, 1e-5)
        cases[next(names)][isa] = lambda ops=ops: ops.silu_and_mul(gate_up)
        cases[next(names)][isa] = lambda ops=ops: ops.rotary_inplace(qkv, HEADS + KV_HEADS, HEAD_DIM, rotary.cos,
                                                                     rotary.sin, positions)
        cases[next(names)][isa] = lambda kernel=kernel: native_decode(kernel)
        if kernel.amx:  # bfloat16 decode takes the tiles: the vector loops beside them
            vector = native.decode_kernel(isa)
            vector.amx = False
            cases[list(cases)[3]][f"{isa}-vector"] = lambda kernel=vector: native_decode(kernel)
    return cases


class _RopeConfig:
    rope_theta = 10000.0
    rope_scaling = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 512], help="token rows of the fused ops")
    parser.add_argument("--seqs", type=int, default=48)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--layers", type=int, default=30,
                        help="separate KV caches the decode calls cycle through (the default model has 30 layers)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch's (and so the kernels') OpenMP threads; 1 gives steadier figures on a busy machine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isas = cpu_build.runnable_isas()
    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}; kernels built for {isas}")
    with open("/proc/loadavg", encoding="utf-8") as loadavg:
        print(f"load average before: {loadavg.read().strip()}")
    columns = [TORCH, *isas]
    decode = native.decode_kernel(isas[0])
    if decode is not None and decode.amx:
        columns.append(f"{isas[0]}-vector")  # the decode kernel's loops where bfloat16 takes AMX's tiles
    print(f"\nmicroseconds per call, best round (median round) of {args.rounds}, {args.calls} calls each")
    print(f"| kernel | dtype | {' | '.join(columns)} | best vs torch |")
    print(f"|---|---|{'---|' * len(columns)}---|")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in args.rows:
            cases = _cases(dtype, rows, args.seqs, args.context, args.layers)
            if rows != args.rows[0]:  # decode attention does not depend on the row count
                cases = {name: variants for name, variants in cases.items() if not name.startswith("decode")}
            for name, variants in cases.items():
                rounds: dict[str, list[float]] = {variant: [] for variant in variants}
                for function in variants.values():  # warm up: first-touch pages, thread pool
                    function()
                for _ in range(args.rounds):
                    for variant, function in variants.items():
                        rounds[variant].append(_median_call_us(function, args.calls))
                cells = [f"{min(rounds[c]):.1f} ({statistics.median(rounds[c]):.1f})" if c in rounds else "-"
                         for c in columns]
                best = min((c for c in columns[1:] if c in rounds), key=lambda variant: min(rounds[variant]))
                speedup = min(rounds[TORCH]) / min(rounds[best])
                print(f"| {name} | {str(dtype).removeprefix('torch.')} | {' | '.join(cells)} | {best} "
                      f"{speedup:.1f}x |", flush=True)
    with open("/proc/loadavg", encoding="utf-8") as loadavg:
        print(f"\nload average after: {loadavg.read().strip()}")


if __name__ == "__main__":
    main()
