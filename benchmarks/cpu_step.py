"""How long one engine step takes on the CPU when decodes share it with a prefill, per token budget.

Serving under Poisson arrivals, nearly every step carries a prefill chunk beside the running decodes, so
the step time, and with it every running request's time per output token, is set by the chunk: the token
budget (max_num_batched_tokens) splits a long prompt into chunks of at most budget - decodes tokens. This
measures, on the default model:

1. a step of `--decodes` decodes alone (the floor TPOT);
2. for each budget in `--budgets`, the steps that prefill one `--prompt-len`-token prompt beside those
   decodes: the longest step (what a running request's TPOT sees) and their sum (the prefill's cost in
   throughput: smaller chunks mean more steps, and each later chunk reads its context back from the cache);
3. with `--compare-prefill`, each budget twice per round, once with the native prefill-attention kernel and once
   on the torch path's per-chunk SDPA (the same engine, interleaved, so both see the same load);
4. with `--profile`, torch.profiler's top ops of a decode-only step and of one step carrying a full chunk
   beside the decodes (the fused C kernels run through ctypes: their time is the gap between the
   profiled total and the wall clock of the step).

    PYTHONPATH=$PWD python benchmarks/cpu_step.py                         # auto dtype, budgets 256..2048
    PYTHONPATH=$PWD python benchmarks/cpu_step.py --dtype bfloat16 --profile
    PYTHONPATH=$PWD python benchmarks/cpu_step.py --dtype float32 --budgets 512 2048 --prompt-len 1500
    PYTHONPATH=$PWD python benchmarks/cpu_step.py --dtype bfloat16 --compare-prefill

Budgets run interleaved (round robin, --repeats times, best kept), so that load from other processes hits
them alike; the load average is printed beside the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np


def timed_step(engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def set_budget(engine, budget: int) -> None:
    scheduler = engine.core.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=budget)


def prefill_steps(engine, params, prompt: list[int], budget: int, tag: str) -> list[float]:
    """Seconds of each step until the new prompt's prefill is done (its first token comes with the last)."""
    set_budget(engine, budget)
    engine.add_request(tag, {"prompt_token_ids": prompt}, params)
    times = []
    while True:
        times.append(timed_step(engine))
        if all(r.request_id != tag for r in engine.core.scheduler.running):
            break  # finished at its first token (max_tokens=1)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--decodes", type=int, default=16, help="running sequences decoding beside the prefill")
    parser.add_argument("--context", type=int, default=300, help="prompt length of each decoding sequence")
    parser.add_argument("--prompt-len", type=int, default=1500, help="the arriving prompt that is prefilled")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048],
                        help="max_num_batched_tokens values to compare")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of a mixed step")
    parser.add_argument("--compare-prefill", action="store_true",
                        help="also time every budget with prefill attention on the torch path (SDPA per chunk)")
    args = parser.parse_args()

    from pagellm import LLM, SamplingParams
    from pagellm.cpu_features import cpu_description

    if max(args.budgets) < args.decodes + 1:
        sys.exit(f"--budgets must leave room beside --decodes={args.decodes}; got {args.budgets}")
    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=max(max(args.budgets), args.context * args.decodes),
              max_model_len=max(args.prompt_len, args.context) + 1024, seed=0)
    engine = llm.llm_engine
    dtype = engine.core.model_info.dtype
    rng = np.random.default_rng(0)
    vocab = engine.core.model_info.hf_config.vocab_size

    def random_prompt(length: int) -> list[int]:
        return rng.integers(0, vocab, size=length).tolist()

    decoding = SamplingParams(temperature=0, ignore_eos=True)  # runs until max_model_len
    for i in range(args.decodes):
        engine.add_request(f"decode-{i}", {"prompt_token_ids": random_prompt(args.context)}, decoding)
    while engine.core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                               for r in engine.core.scheduler.running):
        engine.step()
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    print(f"CPU: {cpu_description()}; dtype {str(dtype).removeprefix('torch.')}; {args.decodes} decodes of "
          f"~{args.context} tokens of context; prefill of {args.prompt_len} tokens; load average "
          f"{os.getloadavg()[0]:.2f} at start", flush=True)

    # The first decode steps after the prompts pay one-time costs (oneDNN primitives for the new batch shape:
    # over a second each in bfloat16), which are no step's steady cost: run them before timing.
    for _ in range(8):
        engine.step()
    decode_only = min(timed_step(engine) for _ in range(5))
    backend = engine.core.runner.attn_backend
    native_prefill = getattr(backend, "native_prefill", None)
    variants = ["native", "torch"] if args.compare_prefill else ["native" if native_prefill else "torch"]
    if args.compare_prefill and native_prefill is None:
        sys.exit("--compare-prefill needs the native prefill kernel (a CPU engine with the native kernels on)")
    best: dict[tuple[int, str], list[float]] = {}
    for repeat in range(args.repeats):
        for budget in args.budgets:
            for variant in variants:
                backend.native_prefill = native_prefill if variant == "native" else None
                times = prefill_steps(engine, one_token, random_prompt(args.prompt_len), budget,
                                      f"p{repeat}-{budget}-{variant}")
                if (budget, variant) not in best or sum(times) < sum(best[budget, variant]):
                    best[budget, variant] = times
    if native_prefill is not None:
        backend.native_prefill = native_prefill
    print(f"decode-only step: {decode_only * 1e3:.1f} ms")
    print(f"{'budget':>7} {'prefill attention':>18} {'steps':>6} {'longest step ms':>16} {'sum ms':>8} "
          f"{'prefill tok/s':>14}")
    for budget in args.budgets:
        for variant in variants:
            times = best[budget, variant]
            print(f"{budget:>7} {variant:>18} {len(times):>6} {max(times) * 1e3:>16.1f} {sum(times) * 1e3:>8.1f} "
                  f"{args.prompt_len / (sum(times) - len(times) * decode_only):>14.0f}")
    print(f"load average at end {os.getloadavg()[0]:.2f}", flush=True)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        set_budget(engine, max(args.budgets))
        chunk = min(args.prompt_len, max(args.budgets) - args.decodes)
        for title, prompt in (("decode-only step", None), (f"step with a {chunk}-token chunk", random_prompt(chunk))):
            if prompt is not None:
                engine.add_request("profiled", {"prompt_token_ids": prompt}, one_token)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                wall = timed_step(engine)
            print(f"{title}: {wall * 1e3:.1f} ms wall clock")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
