"""The sampler's cost on the CPU: its largest-logits selection (csrc/largest.c) against torch.topk and two sorts,
and whole sampling calls with either, taking turns in one process (this VM's speed moves by the minute).

- selection: each row's `count` largest of [rows, vocab] random logits, milliseconds a call;
- sampling: Sampler over --rows rows of the vocabulary's size for each setting (temperature only, top-p, top-k,
  log-probabilities), logits shaped like a language model's (a shared profile falling with the log of a token's
  rank, plus noise per row), milliseconds a call (the logits' copy included).
Each figure is the best of --repeats rounds in which the two take turns.

    .venv/bin/python benchmarks/sampler.py
    .venv/bin/python benchmarks/sampler.py --vocab 49152 --rows 64
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from pagellm.cpu_features import cpu_description
from pagellm.ops.largest import largest_by_sorting, largest_per_row
from pagellm.sample import sampler as sampler_module

SELECTIONS = {"kernel": largest_per_row, "torch.topk": largest_by_sorting}


def interleaved_best_ms(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each call's best time in milliseconds, the calls taking turns, one run each per round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return {name: min(values) * 1e3 for name, values in times.items()}


def language_model_logits(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """A shared profile falling with the log of a token's rank (shuffled over the ids), plus per-row noise."""
    profile = -2.0 * torch.log1p(torch.arange(vocab, dtype=torch.float32))
    profile = profile[torch.randperm(vocab, generator=generator)]
    return profile + torch.randn(rows, vocab, generator=generator) * 1.5


def batch_of(rows: int, temperature: float, top_p: float | None = None, top_k: int | None = None,
             logprobs: int | None = None) -> sampler_module.SamplingBatch:
    def column(value, dtype):
        return None if value is None else torch.full((rows,), value, dtype=dtype)

    return sampler_module.SamplingBatch(temperature=torch.full((rows,), temperature), top_k=column(top_k, torch.int64),
                                        top_p=column(top_p, torch.float32), min_p=None, all_greedy=False,
                                        seeded_rows=[], banned_tokens=[], num_logprobs=logprobs)


SETTINGS = {
    "temperature 1.0": dict(temperature=1.0),
    "top-p 0.95, temperature 0.8": dict(temperature=0.8, top_p=0.95),
    "top-k 40": dict(temperature=1.0, top_k=40),
    "logprobs 5, temperature 1.0": dict(temperature=1.0, logprobs=5),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=262144, help="vocabulary size (default: Gemma 3's)")
    parser.add_argument("--rows", type=int, default=64, help="rows of a sampling call")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    print(f"CPU: {cpu_description()}; {torch.get_num_threads()} threads; vocabulary {args.vocab:,}\n")

    print("| selection: rows x count | kernel ms | torch.topk + sorts ms | speed-up |")
    print("|---|---:|---:|---:|")
    for rows, count in ((2, 5), (2, 256), (2, 4096), (args.rows, 5)):
        logits = torch.randn(rows, args.vocab, generator=generator)
        times = interleaved_best_ms({name: lambda select=select: select(logits, count)
                                     for name, select in SELECTIONS.items()}, args.repeats)
        print(f"| {rows} x {count} | {times['kernel']:.2f} | {times['torch.topk']:.2f} | "
              f"{times['torch.topk'] / times['kernel']:.1f}x |")

    print(f"\n| sampling {args.rows} rows | kernel ms | torch.topk + sorts ms | speed-up |")
    print("|---|---:|---:|---:|")
    logits = language_model_logits(args.rows, args.vocab, generator)
    sampler = sampler_module.Sampler(torch.Generator().manual_seed(0))
    for name, setting in SETTINGS.items():
        batch = batch_of(args.rows, **setting)

        def sample_with(select):
            sampler_module.largest_per_row = select
            sampler(logits.clone(), batch)

        times = interleaved_best_ms({name: lambda select=select: sample_with(select)
                                     for name, select in SELECTIONS.items()}, args.repeats)
        sampler_module.largest_per_row = largest_per_row
        print(f"| {name} | {times['kernel']:.1f} | {times['torch.topk']:.1f} | "
              f"{times['torch.topk'] / times['kernel']:.2f}x |")


if __name__ == "__main__":
    main()
