"""Speed of several formats of benchmarks/quantized.py in one process, their runs alternating.

quantized.py runs each format in a fresh process, as its memory figures need; on a shared 2-vCPU machine whose
speed changes from one minute to the next (an AMX Xeon here ran the same tile loop 1x to 3.3x slower depending on
the minute and the vCPU), two such processes compare the minutes they ran in as much as the formats. Here every
format is loaded once and the runs go round-robin: each round times, per format, a batched prefill (--batch
prompts of quantized.py's PROMPT_TOKENS, one output token each), a batched decode (the same prompts,
--batch-tokens greedy tokens each, EOS ignored) and one stream (the first prompt, --decode-tokens greedy tokens
after its first, timed over its decode steps as quantized.py times it). Prints tok/s best and median over
--rounds and each format's ratio to the first one's, with the CPU's flags.

    .venv/bin/python benchmarks/interleaved_formats.py                       # bf16 against int8 online
    .venv/bin/python benchmarks/interleaved_formats.py --formats bf16 "int8 online" "fp8 online" --rounds 12
    .venv/bin/python benchmarks/interleaved_formats.py --formats bf16 "gguf Q8_0 (requant)" \
        "gguf Q4_K_M (requant)" --llama-python /tmp/llama-venv/bin/python   # llama.cpp requantizes the files
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.quantized import FORMATS, KV_CACHE_BYTES, MAX_MODEL_LEN, checkpoint, decode_rate, prompts_of
from benchmarks.texts import PERPLEXITY_TEXT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [f.name for f in FORMATS]
    parser.add_argument("--formats", nargs="+", default=["bf16", "int8 online"], choices=names)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="requests at once")
    parser.add_argument("--batch-tokens", type=int, default=16, help="output tokens per request in the decode run")
    parser.add_argument("--decode-tokens", type=int, default=48, help="output tokens of the single stream")
    parser.add_argument("--workdir", default=None, help="where the checkpoints are written (default: a temp dir)")
    parser.add_argument("--llama-python", default=None,
                        help="a Python with llama-cpp-python, for the formats that llama.cpp requantizes")
    args = parser.parse_args()

    from pagellm import LLM, SamplingParams
    from pagellm.cpu_features import cpu_description

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pagellm-interleaved-"))
    formats = [next(f for f in FORMATS if f.name == name) for name in args.formats]
    engines = {}
    for fmt in formats:
        engines[fmt.name] = LLM(model=checkpoint(fmt, workdir, args.llama_python), dtype=fmt.dtype,
                                quantization=fmt.quantization, kv_cache_dtype=fmt.kv_cache_dtype,
                                kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN,
                                enable_prefix_caching=False)
    ids = next(iter(engines.values())).get_tokenizer()(PERPLEXITY_TEXT)["input_ids"]
    prompts = [{"prompt_token_ids": p} for p in prompts_of(ids, args.batch)]
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    one_token = SamplingParams(temperature=0, max_tokens=1)
    decode = SamplingParams(temperature=0, max_tokens=args.batch_tokens, ignore_eos=True)
    stream = SamplingParams(temperature=0, max_tokens=args.decode_tokens + 1, ignore_eos=True)
    kinds = ("prefill", "decode", "single")
    rates: dict[str, dict[str, list[float]]] = {name: {kind: [] for kind in kinds} for name in engines}
    for round_index in range(args.rounds + 1):  # round 0 warms every engine up and is not counted
        for name, llm in engines.items():
            started = time.perf_counter()
            llm.generate(prompts, one_token, use_tqdm=False)
            prefill_s = time.perf_counter() - started
            started = time.perf_counter()
            llm.generate(prompts, decode, use_tqdm=False)
            decode_s = time.perf_counter() - started
            single = decode_rate(llm, prompts[0], stream)
            if round_index:
                rates[name]["prefill"].append(prompt_tokens / prefill_s)
                rates[name]["decode"].append(args.batch * args.batch_tokens / decode_s)
                rates[name]["single"].append(single)

    load = os.getloadavg()[0]
    print(f"\n{cpu_description()}; {os.cpu_count()} CPUs; load average {load:.1f} at the end; {args.rounds} rounds")
    first = formats[0].name
    print(f"\n| format | prefill tok/s best | median | vs {first} (median) | batched output tok/s best | median | "
          f"vs {first} (median) | 1 stream tok/s best | median | vs {first} (median) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs in rates.items():
        cells = []
        for kind in kinds:
            median = statistics.median(runs[kind])
            ratio = median / statistics.median(rates[first][kind])
            cells += [f"{max(runs[kind]):.0f}", f"{median:.0f}", f"{ratio:.2f}x"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
