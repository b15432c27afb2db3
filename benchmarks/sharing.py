"""KV blocks and throughput with shared blocks (forks + copy-on-write) versus the same work as
independent requests: parallel sampling (n = 1, 2, 4, 8) and beam search (widths 2, 4, 8).

- Parallel sampling, shared: one request with SamplingParams(n=k). Independent: k requests with the
  per-sample seeds the shared run uses (seed + i), so both generate the very same tokens.
- Beam search, shared: LLM.beam_search, whose candidates are forks of one another. Independent: the
  same search run the way an engine without forks must run it (vLLM's LLM.beam_search), every
  candidate a separate request that recomputes its whole sequence for each next token.

Prefix caching is off in every run, so only forks share blocks. Peak blocks in use are read from
the engine after every step.

    .venv/bin/python benchmarks/sharing.py                    # default model, a few minutes on 2 cores
    .venv/bin/python benchmarks/sharing.py --model DIR --quick
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

from pagellm import SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.beam_search import beam_search
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import BeamSearchParams


@dataclass
class Run:
    kind: str  # "sampling" or "beam"
    width: int  # n, or beam width
    shared: bool
    peak_blocks: int
    seconds: float
    generated_tokens: int
    cow_copies: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


class PeakTracker:
    """Remembers the most blocks an engine ever had in use: read right after each step's allocation,
    before the step's finished requests give theirs back."""

    def __init__(self, engine: LLMEngine) -> None:
        self.peak = 0
        scheduler = engine.core.scheduler
        schedule = scheduler.schedule

        def tracked_schedule():
            output = schedule()
            self.peak = max(self.peak, scheduler.kv.pool.num_used_blocks)
            return output

        scheduler.schedule = tracked_schedule


def new_engine(model: str | None) -> tuple[LLMEngine, PeakTracker]:
    engine = LLMEngine(EngineArgs(model=model, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30,
                                  max_model_len=512))
    return engine, PeakTracker(engine)


def run_until_done(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def sampling(model, prompt: list[int], n: int, max_tokens: int, shared: bool) -> Run:
    engine, tracker = new_engine(model)
    start = time.perf_counter()
    if shared:
        engine.add_request("g", {"prompt_token_ids": prompt},
                           SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True))
    else:
        for i in range(n):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                               SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True))
    run_until_done(engine)
    seconds = time.perf_counter() - start
    stats = engine.get_stats().kv_cache
    return Run("sampling", n, shared, tracker.peak, seconds, n * max_tokens, stats.num_cow_copies)


def beams_shared(model, prompt: list[int], width: int, max_tokens: int) -> tuple[Run, list[list[int]]]:
    engine, tracker = new_engine(model)
    start = time.perf_counter()
    (result,) = beam_search(engine, [prompt], BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                               ignore_eos=True))
    seconds = time.perf_counter() - start
    stats = engine.get_stats().kv_cache
    run = Run("beam", width, True, tracker.peak, seconds, width * max_tokens, stats.num_cow_copies)
    return run, [s.tokens for s in result.sequences]


def beams_independent(model, prompt: list[int], width: int, max_tokens: int) -> tuple[Run, list[list[int]]]:
    """Every candidate is its own request, recomputing its sequence to score the next token."""
    engine, tracker = new_engine(model)
    start = time.perf_counter()
    beams: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    ids = 0
    for _ in range(max_tokens):
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=2 * width)
        request_ids = []
        for tokens, _ in beams:
            engine.add_request(f"b{ids}", {"prompt_token_ids": tokens}, params)
            request_ids.append(f"b{ids}")
            ids += 1
        finished = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        candidates = []
        for (tokens, score), request_id in zip(beams, request_ids):
            (position,) = finished[request_id].outputs[0].logprobs
            candidates += [(tokens + [t], score + lp.logprob) for t, lp in position.items()]
        candidates.sort(key=lambda c: -c[1])
        unique = {}
        for tokens, score in candidates:
            unique.setdefault(tuple(tokens), score)
        beams = [(list(t), s) for t, s in list(unique.items())[:width]]
    seconds = time.perf_counter() - start
    run = Run("beam", width, False, tracker.peak, seconds, width * max_tokens, 0)
    return run, [tokens for tokens, _ in beams]


def plot(runs: list[Run], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, kind, label in ((axes[0], "sampling", "parallel samples n"), (axes[1], "beam", "beam width")):
        for shared, style in ((True, "o-"), (False, "s--")):
            points = sorted((r.width, r.peak_blocks) for r in runs if r.kind == kind and r.shared == shared)
            if points:
                xs, ys = zip(*points)
                axis.plot(xs, ys, style, label="shared blocks (fork + COW)" if shared else "independent requests")
        axis.set_xlabel(label)
        axis.set_ylabel("peak KV blocks in use")
        axis.set_xscale("log", base=2)
        axis.legend()
    fig.suptitle("KV memory: sharing the prompt's blocks vs independent requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local model path; default: the embedded SmolLM2")
    parser.add_argument("--prompt-len", type=int, default=200, help="prompt tokens (from a fixed text)")
    parser.add_argument("--sample-tokens", type=int, default=64, help="tokens each parallel sample generates")
    parser.add_argument("--beam-tokens", type=int, default=16, help="tokens each beam search generates")
    parser.add_argument("--plot", default="benchmarks/sharing.png")
    parser.add_argument("--quick", action="store_true", help="n and widths up to 4, shorter runs")
    args = parser.parse_args()
    widths = (1, 2, 4) if args.quick else (1, 2, 4, 8)
    beam_widths = (2, 4) if args.quick else (2, 4, 8)

    engine, _ = new_engine(args.model)
    text = "Paged attention keeps the key and value cache in blocks, like pages of virtual memory. " * 40
    prompt = engine.get_tokenizer().encode(text)[: args.prompt_len]
    del engine

    runs: list[Run] = []
    for n in widths:
        runs += [sampling(args.model, prompt, n, args.sample_tokens, shared) for shared in (True, False)]
    for width in beam_widths:
        shared_run, shared_best = beams_shared(args.model, prompt, width, args.beam_tokens)
        independent_run, independent_best = beams_independent(args.model, prompt, width, args.beam_tokens)
        runs += [shared_run, independent_run]
        if shared_best[0] != independent_best[0]:
            print(f"note: width {width}: best beams differ (ties or fp rounding between the two searches)")

    print(f"\nprompt {len(prompt)} tokens; samples {args.sample_tokens} tokens; beams {args.beam_tokens} tokens; "
          "block size 16; prefix caching off")
    print(f"{'workload':<12}{'width':>6}{'shared peak':>13}{'indep. peak':>13}{'saving':>9}"
          f"{'shared tok/s':>14}{'indep. tok/s':>14}{'COW copies':>12}")
    for kind in ("sampling", "beam"):
        for width in sorted({r.width for r in runs if r.kind == kind}):
            shared = next(r for r in runs if r.kind == kind and r.width == width and r.shared)
            independent = next(r for r in runs if r.kind == kind and r.width == width and not r.shared)
            saving = 1 - shared.peak_blocks / independent.peak_blocks
            print(f"{kind:<12}{width:>6}{shared.peak_blocks:>13}{independent.peak_blocks:>13}{saving:>9.1%}"
                  f"{shared.tokens_per_s:>14.1f}{independent.tokens_per_s:>14.1f}{shared.cow_copies:>12}")
    plot(runs, args.plot)
    print(f"plot: {args.plot}")
    print(json.dumps([asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in runs]))


if __name__ == "__main__":
    main()
