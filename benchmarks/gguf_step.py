"""Where the time goes in a decode step of a GGUF model (Gemma 3 270M Q4_K_M unless --model; one stream, then
16): wall time of the GGUF linear products by layer and block type (the tied LM head among them), the decode
stack (ops/decode_stack.py: every layer of a decode step, its products inside; PAGELLM_DECODE_STACK=0 runs the
layers as modules, whose products and attention calls are then split out), the paged-attention call, the sampler,
and the rest (norms, rotary, the embedding gather, the engine's host work), summed over each step's calls, mean
of --steps steps.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/gguf_step.py
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pagellm.models.llama as llama_module  # noqa: E402
from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.cpu_features import cpu_description  # noqa: E402
from pagellm.layers.quantization.gguf import GGUFLinearMethod  # noqa: E402
from pagellm.ops.decode_stack import DecodeStack, GemmaDecodeStack  # noqa: E402
from tests.test_gguf_gemma3 import gemma3_270m_path  # noqa: E402

Seconds = collections.Counter


def timed(function: Callable, spent: Seconds, part: Callable[..., str] | str) -> Callable:
    """`function`, adding each call's wall time to spent[part] (part may be named from the call's arguments)."""

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[part(*args) if callable(part) else part] += time.perf_counter() - started

    return wrapper


def linear_part(method, layer, *_) -> str:
    kinds = "+".join(p.type_name for p in (layer.quantized_parts or [])) or "dense"
    name = layer.prefix.rsplit(".", 1)[-1]
    return f"LM head ({kinds})" if name == "embed_tokens" else f"{name} ({kinds})"


def measure(model: str, num_seqs: int, steps: int, spent: Seconds, threads: int | None = None,
            dtype: str = "float32") -> float:
    """Seconds of `steps` decode steps of `num_seqs` sequences; `spent` gets the parts'."""
    llm = LLM(model, dtype=dtype, kv_cache_memory_bytes=256 << 20, max_model_len=1024,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    if threads:  # after the engine set its own count
        torch.set_num_threads(threads)
    runner = engine.core.runner
    runner.sampler.sample_into = timed(runner.sampler.sample_into, spent, "sampler")
    params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [2] + list(range(1000 + 50 * i, 1031 + 50 * i))
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    for _ in range(6):  # the prefill and warm-up decodes
        engine.step()
    spent.clear()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seqs", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--model", default=None, help="a GGUF file (default: Gemma 3 270M Q4_K_M)")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: the engine's)")
    parser.add_argument("--dtype", default="float32", help="the activations' dtype (LLM's dtype=; auto, bfloat16, ...)")
    args = parser.parse_args()
    spent: Seconds = collections.Counter()
    GGUFLinearMethod.apply = timed(GGUFLinearMethod.apply, spent, linear_part)
    # Decode steps run the layers on the decode stack (ops/decode_stack.py): one part, its products inside.
    DecodeStack.__call__ = timed(DecodeStack.__call__, spent, "decode stack (every layer)")
    GemmaDecodeStack.__call__ = timed(GemmaDecodeStack.__call__, spent, "decode stack (every layer)")
    llama_module.paged_attention = timed(llama_module.paged_attention, spent, "paged attention")
    model = args.model or str(gemma3_270m_path())
    for num_seqs in args.seqs:
        total = measure(model, num_seqs, args.steps, spent, args.threads, args.dtype)
        print(f"\n## {num_seqs} sequence(s), dtype {args.dtype}, {cpu_description()}, {torch.get_num_threads()} "
              f"thread(s), load average "
              f"{os.getloadavg()[0]:.1f}: {1000 * total / args.steps:.2f} ms per decode step (mean of {args.steps})\n")
        print("| part | ms per step | share |\n|---|---:|---:|")
        for name, seconds in spent.most_common():
            print(f"| {name} | {1000 * seconds / args.steps:.2f} | {seconds / total:.0%} |")
        rest = total - sum(spent.values())
        print(f"| rest (norms, rotary, embedding, host) | {1000 * rest / args.steps:.2f} | {rest / total:.0%} |")


if __name__ == "__main__":
    main()
