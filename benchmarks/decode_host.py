"""CPU time per decode step of one stream on the default model (SmolLM2-135M GGUF): LlamaModel's direct layers
(models/llama.py's run_direct_layers) against the same layers run as modules, in one process.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/decode_host.py            # real products
    PYTHONPATH=$PWD .venv/bin/python benchmarks/decode_host.py --no-op-products   # host work only

One request (a 32-token prompt, greedy) decodes on one thread; blocks of `--steps` engine steps alternate between
the two ways of running the layers, `--blocks` blocks each, and each block's CPU time (this process's, which a
machine shared with other jobs inflates less than wall time) is divided by its steps. With --no-op-products every
GGUF product's C call returns at once (its Python wrapper still runs), so what is left of a step is its host work
plus the attention, norm and rotary kernels, which at these sizes take microseconds. The two ways alternate so
that a change in the machine's load falls on both; the paired ratio is the median of direct / modules over
neighbouring blocks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.cpu_features import cpu_description  # noqa: E402
from pagellm.models.llama import LlamaDecoderLayer  # noqa: E402


def _no_op(*args) -> int:
    return 0  # gguf_matmul's "done" code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="engine steps per block")
    parser.add_argument("--blocks", type=int, default=20, help="blocks per way of running the layers")
    parser.add_argument("--no-op-products", action="store_true", help="GGUF products return without computing")
    args = parser.parse_args()
    llm = LLM(kv_cache_memory_bytes=64 << 20, max_model_len=1024, enable_prefix_caching=False)
    engine = llm.llm_engine
    torch.set_num_threads(1)  # after the engine chose its own count
    model = engine.core.runner.model.model
    if model.direct_layers() is None:
        raise SystemExit("this model's layers do not run directly here (no fused CPU ops?); nothing to compare")
    if args.no_op_products:
        for module in model.modules():
            for product in getattr(module, "gguf_products", None) or ():
                product.function = _no_op
    steps_needed = 2 * args.blocks * (args.steps + 1) + 8
    if steps_needed > 1024 - 32:
        raise SystemExit(f"{steps_needed} steps do not fit max_model_len=1024; lower --blocks or --steps")
    params = SamplingParams(temperature=0, max_tokens=steps_needed, ignore_eos=True)
    engine.add_request("0", {"prompt_token_ids": list(range(1000, 1032))}, params)
    for _ in range(8):  # the prefill and warm-up decodes
        engine.step()
    direct = LlamaDecoderLayer.direct
    ms_per_step: dict[str, list[float]] = {"modules": [], "direct": []}
    try:
        for block in range(2 * args.blocks):
            way = "direct" if block % 2 else "modules"
            LlamaDecoderLayer.direct = direct if way == "direct" else (lambda layer, ops: None)
            model.reset_direct_layers()
            engine.step()  # makes (or not) the direct layers, outside the timed steps
            started = time.process_time()
            for _ in range(args.steps):
                engine.step()
            ms_per_step[way].append((time.process_time() - started) / args.steps * 1e3)
    finally:
        LlamaDecoderLayer.direct = direct
    ratios = [d / m for m, d in zip(ms_per_step["modules"], ms_per_step["direct"])]
    print(f"{cpu_description()}; load average {'%.2f %.2f %.2f' % os.getloadavg()}; "
          f"products {'no-op' if args.no_op_products else 'real'}; one thread, one stream")
    for way, values in ms_per_step.items():
        print(f"{way:8s} CPU ms per step: min {min(values):.2f}, median {statistics.median(values):.2f}")
    print(f"direct / modules, paired median: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
