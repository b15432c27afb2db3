"""Start-up time, greedy decode speed at several batch sizes, and KV waste, on one engine.

    .venv/bin/python benchmarks/decode_speed.py                  # default model, batches 1 and 32
    .venv/bin/python benchmarks/decode_speed.py --batch-sizes 1 8 32 64 --max-tokens 128

Each batch decodes `--max-tokens` greedy tokens per request (EOS ignored) from short distinct prompts;
tokens/s counts generated tokens over the batch's wall-clock time (its prefill included). KV waste is
read at the step where the most blocks are in use.
"""

from __future__ import annotations

import argparse
import json
import time

from pagellm import LLM, SamplingParams


def measure_batch(llm: LLM, batch_size: int, max_tokens: int) -> dict:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i in range(batch_size):
        engine.add_request(f"b{batch_size}-{i}", f"Story number {i}: once upon a time, in a city by the sea,", params)
    peak_blocks, waste_at_peak = 0, 0.0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.get_stats().kv_cache
        if stats.num_used_blocks > peak_blocks:
            peak_blocks, waste_at_peak = stats.num_used_blocks, stats.waste
    seconds = time.perf_counter() - start
    return {"batch_size": batch_size, "seconds": seconds, "tokens_per_s": batch_size * max_tokens / seconds,
            "peak_blocks": peak_blocks, "kv_waste_at_peak": waste_at_peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local model path; default: the embedded SmolLM2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    ready = time.perf_counter() - start
    llm.generate(["warm-up"], SamplingParams(max_tokens=2), use_tqdm=False)
    results = [measure_batch(llm, b, args.max_tokens) for b in args.batch_sizes]

    print(f"\nready in {ready:.2f} s (engine start-up {llm.llm_engine.core.startup.seconds:.2f} s)")
    print(f"{'batch':>6}{'seconds':>10}{'greedy tok/s':>14}{'peak blocks':>13}{'KV waste at peak':>18}")
    for r in results:
        print(f"{r['batch_size']:>6}{r['seconds']:>10.2f}{r['tokens_per_s']:>14.1f}{r['peak_blocks']:>13}"
              f"{r['kv_waste_at_peak']:>18.2%}")
    print(json.dumps({"ready_s": ready, "results": results}))


if __name__ == "__main__":
    main()
