"""A GGUF file's mixture-of-experts layer on the C kernels: a step's experts in one gguf_matmul_experts call per
projection against one product per used expert (what ran before), on a Qwen3-30B-A3B-shaped layer.

The layer is pagellm's FusedMoE on the GGUF experts' method (layers/quantization/gguf_moe.py), its experts random
blocks of --type (valid scales); a step routes --tokens tokens with a random router. Both ways run on the same
layer, interleaved (best of --rounds), and give the same bits (checked); prints ms per step of the experts.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/gguf_moe_experts.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/gguf_moe_experts.py --type Q8_0 --experts 64 --tokens 1 8
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.moe import print_cpu
from pagellm.distributed.parallel_state import TensorParallelGroup, building_with
from pagellm.layers.fused_moe import FusedMoE, Routing, grouped_experts
from pagellm.layers.quantization.gguf import GGUFConfig, GGUFWeight
from pagellm.models.loader import default_dtype
from pagellm.ops import gguf_kernels as gk
from tests.test_gguf_kernels import random_weight


def build_layer(ops: gk.GGUFKernels, type_name: str, experts: int, top_k: int, hidden: int,
                intermediate: int) -> FusedMoE:
    with building_with(TensorParallelGroup(0, 1)), default_dtype(torch.bfloat16):
        layer = FusedMoE(experts, top_k, hidden, intermediate, quant_config=GGUFConfig(ops=ops),
                         prefix="model.layers.0.mlp.experts", routing=Routing.softmax_top_k(top_k, True))
    for expert in range(experts):
        for index, (shard, rows, cols) in enumerate((("w1", intermediate, hidden), ("w3", intermediate, hidden),
                                                     ("w2", hidden, intermediate))):
            blocks = random_weight(type_name, rows, cols, seed=3 * expert + index)
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            param.weight_loader(param, GGUFWeight(blocks, type_name, rows, cols), (expert, shard))
    layer.process_weights_after_loading()
    return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--type", default="Q4_K")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    ops = gk.gguf_kernels()
    if ops is None:
        raise SystemExit("the GGUF C kernels cannot be built here")
    layer = build_layer(ops, args.type, args.experts, args.top_k, args.hidden, args.intermediate)
    method = layer.quant_method
    per_expert = (method._gate_up(layer.gguf_experts, args.hidden), method._down(layer.gguf_experts,
                                                                                   args.intermediate))
    print_cpu()
    print(f"\n{args.experts} experts of {args.type}, hidden {args.hidden}, {args.intermediate} features, top "
          f"{args.top_k}; bfloat16 rows; ms per step of the experts, best of {args.rounds} interleaved rounds\n")
    print("| tokens | one product per expert | one call | speed-up | same bits |")
    print("|---:|---:|---:|---:|---|")
    for tokens in args.tokens:
        generator = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, args.hidden, generator=generator).to(torch.bfloat16)
        weights, ids = layer.select_experts(torch.randn(tokens, args.experts, generator=generator))
        runs = {
            "each": lambda: grouped_experts(x, weights, ids, args.experts, *per_expert, 2 * args.intermediate,
                                            layer.act_fn),
            "one call": lambda: method.apply(layer, x, weights, ids),
        }
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.rounds):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - started)
        same = torch.equal(runs["each"](), runs["one call"]())
        print(f"| {tokens} | {best['each'] * 1e3:.2f} | {best['one call'] * 1e3:.2f} | "
              f"{best['each'] / best['one call']:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
