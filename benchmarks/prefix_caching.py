"""Prefix caching and chunked prefill, measured on one engine per setting.

Part 1: requests that share a long system prompt (default 1,000 tokens) and differ in a short
question (~20 tokens), with prefix caching on and off: time to first token of each request run
alone (what a user waiting on a fresh chat sees), and throughput for a burst of them together.

Part 2: decode inter-token latency of running requests while a long prompt (default 4,000 tokens)
arrives, with chunked prefill (the prompt computed over several steps alongside the decodes) and
without (the prompt computed in one step, stalling every decode).

    .venv/bin/python benchmarks/prefix_caching.py            # default model, about 3 minutes on 2 cores
    .venv/bin/python benchmarks/prefix_caching.py --quick    # shorter prompts, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

from pagellm import SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.llm_engine import LLMEngine


@dataclass
class CachingResult:
    caching: bool
    mean_ttft_s: float
    burst_seconds: float
    burst_output_tokens: int
    hit_rate: float

    @property
    def burst_tokens_per_s(self) -> float:
        return self.burst_output_tokens / self.burst_seconds


def synthetic_tokens(engine: LLMEngine, num_tokens: int, seed: int) -> list[int]:
    """Token ids of real text (so the model sees ordinary input), cut to exactly `num_tokens`."""
    words = ("the engine keeps every key and value of a sequence in blocks of sixteen tokens and maps "
             "them through a table like pages of virtual memory ").split()
    text = " ".join(words[(i * 7 + seed) % len(words)] for i in range(num_tokens * 2))
    ids = engine.get_tokenizer().encode(text)
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def run_until_done(engine: LLMEngine, on_output=None) -> None:
    while engine.has_unfinished_requests():
        for output in engine.step():
            if on_output:
                on_output(output, time.perf_counter())


def measure_caching(model: str | None, caching: bool, prefix_len: int, num_requests: int, max_tokens: int) -> CachingResult:
    engine = LLMEngine(EngineArgs(model=model, enable_prefix_caching=caching, kv_cache_memory_bytes=1 << 30))
    system = synthetic_tokens(engine, prefix_len, seed=0)
    questions = [synthetic_tokens(engine, 20, seed=i + 1) for i in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    ttfts = []
    for i, question in enumerate(questions):
        first: dict[str, float] = {}
        start = time.perf_counter()
        engine.add_request(f"alone-{i}", {"prompt_token_ids": system + question}, params)
        run_until_done(engine, lambda o, t: first.setdefault(o.request_id, t))
        ttfts.append(first[f"alone-{i}"] - start)

    # The burst reuses the same system prompt with new questions; the cache already holds the prefix
    # (when on), as it would on a server that has seen the system prompt before.
    start = time.perf_counter()
    for i, question in enumerate(questions):
        engine.add_request(f"burst-{i}", {"prompt_token_ids": system + question[::-1]}, params)
    run_until_done(engine)
    burst = time.perf_counter() - start
    stats = engine.get_stats().kv_cache
    hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
    return CachingResult(caching, statistics.mean(ttfts[1:]), burst, num_requests * max_tokens, hit_rate)


@dataclass
class StallResult:
    chunked: bool
    budget: int
    mean_itl_ms: float
    max_itl_ms: float
    long_prompt_ttft_s: float
    itl_trace: list[tuple[float, float]]


def measure_stall(model: str | None, chunked: bool, long_len: int, budget: int, num_decoders: int) -> StallResult:
    engine = LLMEngine(EngineArgs(model=model, enable_chunked_prefill=chunked, enable_prefix_caching=False,
                                  max_num_batched_tokens=budget, kv_cache_memory_bytes=1 << 30))
    decode = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(num_decoders):
        engine.add_request(f"dec-{i}", {"prompt_token_ids": synthetic_tokens(engine, 32, seed=i)}, decode)
    last_token_at: float | None = None
    gaps: list[tuple[float, float]] = []
    long_ttft: float | None = None
    decodes_after_long = 0
    t0 = time.perf_counter()
    arrival = t0
    for step in range(10_000):
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.request_id == "dec-0":
                if last_token_at is not None:
                    gaps.append((now - t0, now - last_token_at))
                last_token_at = now
                decodes_after_long += long_ttft is not None
            elif output.request_id == "long" and long_ttft is None:
                long_ttft = now - arrival
        if step == 5:
            arrival = time.perf_counter()
            engine.add_request("long", {"prompt_token_ids": synthetic_tokens(engine, long_len, seed=99)},
                               SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        if decodes_after_long >= 5:
            break
    else:
        raise RuntimeError("the long prompt did not finish within 10,000 steps")
    engine.abort_request([f"dec-{i}" for i in range(num_decoders)])
    values = [gap for _, gap in gaps]
    return StallResult(chunked, budget, statistics.mean(values) * 1e3, max(values) * 1e3, long_ttft, gaps)


def plot(stalls: list[StallResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for result in stalls:
        xs, ys = zip(*result.itl_trace)
        label = f"chunked, budget {result.budget}" if result.chunked else f"unchunked, budget {result.budget}"
        ax.plot(xs, [y * 1e3 for y in ys], marker="o", markersize=3, label=label)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("decode inter-token latency (ms)")
    ax.set_title("A long prompt arrives while requests decode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local model path; default: the embedded SmolLM2")
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--long-len", type=int, default=4000)
    parser.add_argument("--chunk-budget", type=int, default=512)
    parser.add_argument("--num-decoders", type=int, default=4)
    parser.add_argument("--plot", default="benchmarks/prefix_caching_stall.png")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.prefix_len, args.num_requests, args.long_len, args.chunk_budget = 200, 3, 600, 128

    caching = [measure_caching(args.model, on, args.prefix_len, args.num_requests, args.max_tokens) for on in (False, True)]
    print(f"\nShared {args.prefix_len}-token system prompt + 20-token question, {args.num_requests} requests, "
          f"{args.max_tokens} output tokens each")
    print(f"{'prefix caching':<16}{'mean TTFT alone (s)':>22}{'burst (s)':>12}{'burst out tok/s':>18}{'hit rate':>10}")
    for r in caching:
        print(f"{'on' if r.caching else 'off':<16}{r.mean_ttft_s:>22.3f}{r.burst_seconds:>12.2f}"
              f"{r.burst_tokens_per_s:>18.1f}{r.hit_rate:>10.1%}")
    off, on = caching
    print(f"TTFT speed-up {off.mean_ttft_s / on.mean_ttft_s:.1f}x, burst speed-up {off.burst_seconds / on.burst_seconds:.1f}x")

    long_budget = max(args.long_len, 2048)
    stalls = [measure_stall(args.model, True, args.long_len, args.chunk_budget, args.num_decoders),
              measure_stall(args.model, False, args.long_len, long_budget, args.num_decoders)]
    print(f"\n{args.num_decoders} requests decoding while a {args.long_len}-token prompt arrives")
    print(f"{'prefill':<12}{'budget':>8}{'mean ITL (ms)':>15}{'max ITL / stall (ms)':>22}{'long prompt TTFT (s)':>22}")
    for r in stalls:
        print(f"{'chunked' if r.chunked else 'unchunked':<12}{r.budget:>8}{r.mean_itl_ms:>15.1f}{r.max_itl_ms:>22.1f}"
              f"{r.long_prompt_ttft_s:>22.2f}")
    plot(stalls, args.plot)
    print(f"plot: {args.plot}")
    print(json.dumps({"caching": [vars(r) for r in caching],
                      "stall": [{k: v for k, v in vars(r).items() if k != "itl_trace"} for r in stalls]}))


if __name__ == "__main__":
    main()
