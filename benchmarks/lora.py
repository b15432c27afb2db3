"""LoRA throughput and swap cost on the default model (issue 25's targets).

1. Throughput: 64 requests, greedy, EOS ignored, on one engine (enable_lora, max_loras=4): the base model
   alone, then a batch mixing 4 rank-16 adapters (q/k/v/o and gate/up/down on every layer) and the base model,
   round robin. Target: mixed >= 85% of base.
2. Swap: copying an adapter from the host cache into a device slot (what a request whose adapter is not resident
   waits for), and reading it from its directory, against one decode step of the same batch. Target: swap-in
   below one decode step.

    .venv/bin/python benchmarks/lora.py                      # the issue's workload
    .venv/bin/python benchmarks/lora.py --num-requests 16 --output-len 16   # a quick look
    OMP_WAIT_POLICY=passive .venv/bin/python benchmarks/lora.py   # on cores other processes also load

The adapters are random PEFT directories of the model's shapes (written to a temporary directory), so the
benchmark needs no download. Prints a table, the CPU and its flags, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, hf_config, rank: int, seed: int) -> str:
    """A PEFT LoRA directory for every attention and MLP projection of the model's layers, small random A/B."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / math.sqrt(fan_in)
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
              "bias": "none", "use_rslora": False}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def run_batch(engine, prompts: list[list[int]], loras: list, output_len: int) -> tuple[float, list[float]]:
    """(seconds, per-step seconds) to finish every request, all added at once."""
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for index, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{time.monotonic_ns()}-{index}", {"prompt_token_ids": prompt}, params, 0, lora)
    steps = []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        step_started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - step_started)
    return time.perf_counter() - started, steps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="back-to-back base/mixed pairs")
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    args = parser.parse_args(argv)

    from pagellm import LLM
    from pagellm.cpu_features import SPEED_FLAGS, cpu_description, cpu_flags
    from pagellm.lora.request import LoRARequest

    load_at_start = os.getloadavg()[0]
    llm = LLM(args.model, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
              max_num_seqs=args.num_requests, kv_cache_memory_bytes=1 << 30)
    engine = llm.llm_engine
    hf_config = engine.core.model_info.hf_config
    manager = engine.core.runner.lora
    temporary = tempfile.TemporaryDirectory(prefix="pagellm-lora-bench-")
    loras = [LoRARequest(f"adapter{i}", i + 1, write_adapter(Path(temporary.name) / f"a{i}", hf_config, args.rank, i))
             for i in range(args.num_adapters)]
    generator = torch.Generator().manual_seed(0)
    vocab = hf_config.vocab_size
    prompts = [torch.randint(100, vocab - 100, (args.input_len,), generator=generator).tolist()
               for _ in range(args.num_requests)]
    mixed = [([None, *loras])[i % (len(loras) + 1)] for i in range(args.num_requests)]
    base = [None] * args.num_requests

    run_batch(engine, prompts[:4], [None, *loras][:4], 2)  # warm-up: kernels, adapters into their slots
    # Base and mixed runs alternate, so that both see the same machine (other processes' load drifts).
    runs: dict[str, list[tuple[float, list[float]]]] = {"base": [], "mixed": []}
    for _ in range(args.repeats):
        for name, assignment in (("base", base), ("mixed", mixed)):
            # Distinct prompts per run: the prefix cache must not serve a repeat.
            run_prompts = [[int(time.monotonic_ns() % 50) + 1, *p] for p in prompts]
            runs[name].append(run_batch(engine, run_prompts, assignment, args.output_len))
    results = {}
    for name, measured in runs.items():
        seconds = min(run[0] for run in measured)
        # The late steps of each run, when every request decodes.
        decode_steps = [step for _, steps in measured for step in steps[-max(args.output_len // 2, 1):]]
        results[name] = dict(seconds=seconds, tokens_per_s=args.num_requests * args.output_len / seconds,
                             decode_step_ms=1e3 * statistics.median(decode_steps))
    pair_ratios = [base_run[0] / mixed_run[0] for base_run, mixed_run in zip(runs["base"], runs["mixed"])]

    # Swap-in: host cache -> a device slot; cold: the directory read and checked first.
    swap = []
    for _ in range(10):
        started = time.perf_counter()
        manager.activate(0, loras[1])
        swap.append(time.perf_counter() - started)
    cold = []
    for i in range(3):
        manager.host.pop(loras[2].lora_int_id, None)
        started = time.perf_counter()
        manager.activate(1, loras[2])
        cold.append(time.perf_counter() - started)
    swap_ms, cold_ms = 1e3 * statistics.median(swap), 1e3 * statistics.median(cold)

    ratio = statistics.median(pair_ratios)
    decode_ms = results["base"]["decode_step_ms"]
    print(f"\n{args.num_requests} requests x ({args.input_len} prompt + {args.output_len} output tokens), "
          f"{args.num_adapters} adapters of rank {args.rank} on q/k/v/o/gate/up/down, "
          f"{manager.slots_bytes / 2**20:.0f} MiB of device slots")
    print(f"{'batch':<28}{'output tok/s':>14}{'decode step ms':>16}")
    print(f"{'base model alone':<28}{results['base']['tokens_per_s']:>14.1f}{decode_ms:>16.1f}")
    print(f"{'4 adapters + base, mixed':<28}{results['mixed']['tokens_per_s']:>14.1f}"
          f"{results['mixed']['decode_step_ms']:>16.1f}")
    print(f"mixed / base: {ratio:.1%} (median of {len(pair_ratios)} back-to-back pairs; target >= 85%)")
    print(f"swap-in from host memory: {swap_ms:.2f} ms; from its directory: {cold_ms:.1f} ms; "
          f"one decode step of the base batch: {decode_ms:.1f} ms (target: swap-in < one step)")
    load_at_end = os.getloadavg()[0]
    print(f"CPU: {cpu_description()}, {len(os.sched_getaffinity(0))} cores, load average {load_at_start:.1f} at "
          f"start, {load_at_end:.1f} at end")
    line = dict(base_tokens_per_s=round(results["base"]["tokens_per_s"], 2),
                mixed_tokens_per_s=round(results["mixed"]["tokens_per_s"], 2), mixed_over_base=round(ratio, 4),
                base_decode_step_ms=round(decode_ms, 2), mixed_decode_step_ms=round(results["mixed"]["decode_step_ms"], 2),
                swap_in_ms=round(swap_ms, 3), cold_load_ms=round(cold_ms, 2), rank=args.rank,
                num_adapters=args.num_adapters, num_requests=args.num_requests, cpu=cpu_description(),
                cpu_flags={flag: flag in cpu_flags() for flag in SPEED_FLAGS}, loadavg_start=load_at_start,
                loadavg_end=load_at_end)
    print(json.dumps(line))
    temporary.cleanup()
    return line


if __name__ == "__main__":
    main()
