"""Host time per engine step, split by stage, with the model's compute made negligible.

The real engine loop runs (scheduler, KV cache manager, the model runner's input preparation, sampler,
output processor, detokenizer) over a tiny random Llama: one layer, 64-wide, but the default model's real
49k-token tokenizer and vocabulary, so the logits, the sampler and detokenization have the real shape.
What is left of a step once the forward and the sampler are taken out is the host work that a GPU waits on.

    .venv/bin/python benchmarks/host_overhead.py                          # 64, 256 and 512 running sequences
    .venv/bin/python benchmarks/host_overhead.py --sizes 256 --steps 50 --repeats 3
    .venv/bin/python benchmarks/host_overhead.py --sizes 256 --profile /tmp/step.prof   # cProfile the timed steps

Each size: N requests of `--input-len` random prompt tokens are added and prefilled, then `--steps` decode steps
(every sequence running, one token each) are timed stage by stage:

- scheduler:        Scheduler.schedule()
- runner prep:      the model runner's input preparation: applying the scheduler's deltas, the step's input
                    and attention arrays, the sampling settings
- forward+sample:   the model's forward, the logits and the sampler (the device's share on a GPU)
- runner rest:      the rest of ModelRunner.execute(): handing the sampled ids back, freeing the step's tensors
- scheduler update: Scheduler.update_from_output() (append tokens, stop checks, prefix-cache publishing)
- output:           OutputProcessor.process() (detokenization, stop strings, RequestOutputs)
- other:            the rest of LLMEngine.step() (the engine's own glue, garbage collection)
- host total:       the whole LLMEngine.step() minus forward+sample

Figures are medians over steps, and over `--repeats` runs of the steps; the CPU and the load average are printed
beside them, since the numbers mean little without them. On a machine shared with other work, `--clock cpu` (this
thread's CPU time) leaves out the time other processes held the core, which wall time counts in whichever stage
it fell. Stage medians need not add up to the median host total.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Wall time by default; --clock cpu reads this thread's CPU time instead, which a shared, loaded machine does not
# inflate with the time other processes hold the core (the forward runs on this thread too, with --threads 1).
_now = time.perf_counter

STAGES = ("scheduler", "runner prep", "forward+sample", "runner rest", "scheduler update", "output", "other",
          "host total")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.3)


def make_model_dir(path: Path, max_len: int) -> str:
    """A 1-layer random Llama with the default model's tokenizer, saved as a HF directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, max_position_embeddings=max_len, **TINY)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class StageClock:
    """Adds up the wall time of wrapped calls per stage, for the current step."""

    def __init__(self) -> None:
        self.step: dict[str, float] = {}

    def wrap(self, obj, name: str, stage: str) -> None:
        method = getattr(obj, name)

        def timed(*args, **kwargs):
            started = _now()
            try:
                return method(*args, **kwargs)
            finally:
                self.step[stage] = self.step.get(stage, 0.0) + _now() - started

        setattr(obj, name, timed)


class _TimedCallable:
    """Stands in for a callable object (the sampler), timing each call into `stage`."""

    def __init__(self, target, clock: StageClock, stage: str) -> None:
        self.target, self.clock, self.stage = target, clock, stage

    def __call__(self, *args, **kwargs):
        started = _now()
        try:
            return self.target(*args, **kwargs)
        finally:
            self.clock.step[self.stage] = self.clock.step.get(self.stage, 0.0) + _now() - started

    def __getattr__(self, name):
        return getattr(self.target, name)


def build_engine(model_dir: str, num_seqs: int, max_model_len: int):
    from pagellm.config import EngineArgs
    from pagellm.engine.llm_engine import LLMEngine

    args = EngineArgs(model=model_dir, device="cpu", dtype="float32", max_num_seqs=num_seqs,
                      max_model_len=max_model_len, max_num_batched_tokens=max(8192, num_seqs),
                      kv_cache_memory_bytes=2 * num_seqs * max_model_len * 2 * 64 * 4 + (64 << 20), seed=0)
    return LLMEngine(args)


def run_size(model_dir: str, num_seqs: int, args) -> dict:
    import numpy as np

    from pagellm.sampling_params import RequestOutputKind, SamplingParams

    max_model_len = args.input_len + args.warmup + args.steps * args.repeats + 16
    import torch

    engine = build_engine(model_dir, num_seqs, max_model_len)
    # The engine takes every core; one thread keeps torch's idle workers from spinning on the cores the
    # host work (single-threaded Python) runs on, which on a shared machine blurs the host figures.
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=max_model_len - args.input_len - 1, ignore_eos=True,
                            output_kind=RequestOutputKind[args.output_kind.upper()])
    for i, prompt in enumerate(rng.integers(3, engine.vocab_size, (num_seqs, args.input_len)).tolist()):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    scheduler = engine.core.scheduler
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.requests.values()) or scheduler.waiting:
        engine.step()  # prefill (chunked under the step budget)
    for _ in range(args.warmup):
        engine.step()
    if len(scheduler.running) != num_seqs:
        raise RuntimeError(f"{len(scheduler.running)} sequences running, expected {num_seqs}")

    clock = StageClock()
    runner, core = engine.core.runner, engine.core
    clock.wrap(scheduler, "schedule", "scheduler")
    clock.wrap(runner, "execute", "runner")
    import pagellm.worker.model_runner as runner_module

    clock.wrap(runner, "_apply", "runner prep")
    # The runner calls it by its module's name; the wrapper comes off at the end, before the next size's engine.
    prepare_inputs = runner_module.prepare_inputs
    clock.wrap(runner_module, "prepare_inputs", "runner prep")
    clock.wrap(runner.sampling_batches, "for_step", "runner prep")
    clock.wrap(runner, "run_model", "forward+sample")
    clock.wrap(runner.model, "compute_logits", "forward+sample")
    runner.sampler = _TimedCallable(runner.sampler, clock, "forward+sample")
    clock.wrap(scheduler, "update_from_output", "scheduler update")
    clock.wrap(engine.output_processor, "process", "output")
    del core

    repeats: list[dict[str, float]] = []
    profiler = cProfile.Profile() if args.profile else None
    for _ in range(args.repeats):
        per_step: dict[str, list[float]] = {stage: [] for stage in STAGES}
        per_step["step"] = []
        for _ in range(args.steps):
            clock.step = {}
            started = _now()
            if profiler is not None:
                profiler.enable()
            engine.step()
            if profiler is not None:
                profiler.disable()
            total = _now() - started
            s = clock.step
            forward, prep = s.get("forward+sample", 0.0), s.get("runner prep", 0.0)
            values = {
                "scheduler": s.get("scheduler", 0.0),
                "runner prep": prep,
                "forward+sample": forward,
                "runner rest": s.get("runner", 0.0) - forward - prep,
                "scheduler update": s.get("scheduler update", 0.0),
                "output": s.get("output", 0.0),
                "host total": total - forward,
                "other": total - forward - prep - (s.get("runner", 0.0) - forward - prep) - s.get("scheduler", 0.0)
                - s.get("scheduler update", 0.0) - s.get("output", 0.0),
                "step": total,
            }
            for stage, value in values.items():
                per_step[stage].append(value * 1000)
        repeats.append({stage: statistics.median(v) for stage, v in per_step.items()})
    if profiler is not None:
        path = f"{args.profile}.{num_seqs}"
        profiler.dump_stats(path)
        print(f"cProfile of the timed steps at {num_seqs} sequences: {path}", file=sys.stderr)
    runner_module.prepare_inputs = prepare_inputs
    result = {stage: statistics.median(r[stage] for r in repeats) for stage in (*STAGES, "step")}
    # What one full collection (the collector's oldest generation) would pause a step for, with the engine running.
    started = time.perf_counter()
    gc.collect()
    result["full gc ms"] = round(1000 * (time.perf_counter() - started), 2)
    result["host total per repeat"] = [round(r["host total"], 2) for r in repeats]
    return result


def _malloc_without_mmap() -> None:
    """On CPU a step's logits ([sequences, 49k] float32: 50 MB at 256) are a fresh mmap each step, whose pages
    the kernel zeroes on first touch and unmaps on free. glibc's M_MMAP_MAX=0 keeps such blocks in the heap
    (and M_TRIM_THRESHOLD keeps the heap from shrinking), which shows how much of the runner's time that is."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4
    if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 1 << 30)):
        raise RuntimeError("mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 512], help="running sequences")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5, help="untimed decode steps first")
    parser.add_argument("--output-kind", choices=["cumulative", "delta", "final_only"], default="final_only",
                        help="what each step's RequestOutputs carry (LLM.generate reads final outputs only)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the forward")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall time, or this thread's CPU time (steadier on a machine shared with other work)")
    parser.add_argument("--malloc-no-mmap", action="store_true",
                        help="glibc: serve large allocations from the heap, not fresh mmaps (see _malloc_without_mmap)")
    parser.add_argument("--profile", default=None, help="cProfile the timed steps into PATH.<size>")
    args = parser.parse_args()
    if args.malloc_no_mmap:
        _malloc_without_mmap()
    if args.clock == "cpu":
        global _now
        _now = time.thread_time

    with tempfile.TemporaryDirectory() as tmp:
        max_len = args.input_len + args.warmup + args.steps * args.repeats + 16
        model_dir = make_model_dir(Path(tmp) / "tiny-1-layer", max_len)
        results = {n: run_size(model_dir, n, args) for n in args.sizes}
    from pagellm.cpu_features import cpu_description

    load = os.getloadavg()
    print(f"CPU: {cpu_description()}, {len(os.sched_getaffinity(0))} cores usable; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}; {args.clock} clock; output_kind {args.output_kind}{'; malloc without mmap' if args.malloc_no_mmap else ''}; prompts of {args.input_len} tokens; "
          f"median ms per decode step over {args.steps} steps x {args.repeats} repeats")
    header = ["sequences", *STAGES, "step"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for n, r in results.items():
        print(f"| {n} | " + " | ".join(f"{r[stage]:.2f}" for stage in (*STAGES, "step")) + " |")
    print("A full garbage collection with the engine running: "
          + ", ".join(f"{r['full gc ms']:.1f} ms at {n}" for n, r in results.items()))
    for n, r in results.items():
        print(json.dumps({"sequences": n, "clock": args.clock, "output_kind": args.output_kind, "cpu": cpu_description(),
                          "loadavg": [round(x, 2) for x in load],
                          **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}}))


if __name__ == "__main__":
    main()
