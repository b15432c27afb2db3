"""Speculative decoding (ngram, suffix, draft_model) against none: tok/s and acceptance.

    .venv/bin/python -m benchmarks.speculative                    # all three workloads, PNG beside this file
    .venv/bin/python -m benchmarks.speculative --workloads copy --max-tokens 128
    .venv/bin/python -m benchmarks.speculative --no-draft          # ngram and suffix only

Workloads (greedy, EOS ends a request as a user would see it):
- copy: one stream rewrites a given code block (most of its output is in its prompt);
- open: one stream writes open-ended text (little to look up: speculation must switch itself off);
- batch64: 64 concurrent open-ended requests (above disable_by_batch_size: no drafts, same throughput).

ngram and suffix run on one engine of the default model (SmolLM2-135M-Instruct, Q4_1 GGUF). draft_model needs a
target larger than its draft, so it runs on the default model's float export (benchmarks/export_hf.py: the GGUF's
weights dequantized, in the engine's dtype) with the Q4_1 GGUF itself as draft: the same weights in 4 bits, a
draft that agrees with its target far more often than a smaller model of the same family would. "draft=target"
(the float export drafting for itself) is the upper bound of acceptance, paying a full-size draft; "none-float"
is the float target without speculation, the base of both speed-ups. Each draft row has its own engine (its pool
sized for target + draft layers); none-float runs on the draft_model engine with its drafter detached. Prefix
caching is off in these engines, so that no run reuses blocks whose draft K/V another configuration left.

Each method runs on the same engine in turn (its scheduler's speculator swapped between runs), each workload
`--repeats` times, alternating methods, and the best run counts: the machine's other load only slows a run down.
Suffix decoding's global trie starts empty for every run, so a repeat does not learn from the one before.
tok/s counts output tokens over the workload's wall-clock time (prefill included). Speed-up is over "none" of the
same workload. Acceptance: accepted / drafted tokens; mean acceptance length: tokens a verifying step yields.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from pagellm import LLM, SamplingParams
from pagellm.cpu_features import cpu_description
from pagellm.spec_decode.speculator import make_speculator

CODE = '''\
def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages


def normalize(values):
    """Scale values to the range 0..1."""
    low, high = min(values), max(values)
    if high == low:
        return [0.0 for _ in values]
    return [(value - low) / (high - low) for value in values]
'''
COPY_PROMPT = ("Rewrite this Python code, renaming the function moving_average to rolling_mean. Keep everything else "
               f"exactly the same.\n\n```python\n{CODE}```")
OPEN_PROMPT = "Write a story about a lighthouse keeper who finds a message in a bottle."
METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}


def _chat_prompt(llm: LLM, text: str) -> list[int]:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def draft_methods(target: str, draft: str) -> dict[str, dict | None]:
    """The draft rows and their speculative_config (none-float: the float target without speculation)."""
    return {
        "none-float": None,
        "draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": 4},
        "draft=target": {"method": "draft_model", "model": target, "num_speculative_tokens": 4},
    }


def run(llm: LLM, method: str, prompts: list[list[int]], max_tokens: int, config: dict | None = None,
        drafter=None) -> dict:
    """`config`: the method's speculative_config where it is not in METHODS; `drafter`: the draft model's
    proposer of this engine (None detaches it)."""
    scheduler = llm.llm_engine.core.scheduler
    scheduler.speculator = make_speculator(config)
    llm.llm_engine.core.runner.drafter = drafter
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = scheduler.speculator.stats if scheduler.speculator is not None else None
    return {
        "method": method, "seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
        "num_drafts": stats.num_drafts if stats else 0,
        "acceptance_rate": stats.acceptance_rate if stats else None,
        "mean_acceptance_length": stats.mean_acceptance_length if stats else None,
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["copy", "open", "batch64"])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--png", default=str(pathlib.Path(__file__).with_name("speculative.png")))
    parser.add_argument("--no-draft", action="store_true", help="skip the draft_model rows")
    parser.add_argument("--model", default=None,
                        help="the ngram/suffix rows' model (default: the default model, SmolLM2-135M Q4_1 GGUF); e.g. "
                             "the float export below")
    parser.add_argument("--dtype", default="auto", help="the ngram/suffix rows' dtype (vLLM's --dtype)")
    parser.add_argument("--float-target", default="/tmp/smollm2-hf",
                        help="the default model's HF export (written with benchmarks/export_hf.py if missing)")
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_bytes=1 << 30, max_model_len=2048)
    workloads = {
        "copy": ([_chat_prompt(llm, COPY_PROMPT)], args.max_tokens),
        "open": ([_chat_prompt(llm, OPEN_PROMPT)], args.max_tokens),
        "batch64": ([_chat_prompt(llm, f"Story number {i}: {OPEN_PROMPT}") for i in range(64)],
                    args.batch_max_tokens),
    }
    run(llm, "none", workloads["open"][0], 8)  # warm-up
    # (method, its engine, its speculative_config, its engine's drafter)
    methods: list[tuple] = [(method, llm, config, None) for method, config in METHODS.items()]
    if not args.no_draft:
        methods += _draft_engines(pathlib.Path(args.float_target), workloads["open"][0])
    results = []
    for name in args.workloads:
        prompts, max_tokens = workloads[name]
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for method, engine, config, drafter in methods:
                result = run(engine, method, prompts, max_tokens, config, drafter)
                if method not in best or result["tokens_per_s"] > best[method]["tokens_per_s"]:
                    best[method] = result
        for method in [m for m in best if m.startswith("draft") or m == "none-float"]:
            best[method]["base"] = "none-float"
        for result in best.values():
            base = best[result.get("base", "none")]
            result.update(speedup=result["tokens_per_s"] / base["tokens_per_s"],
                          same_output=result["token_ids"] == base["token_ids"])
        for result in best.values():
            result["workload"] = name
            del result["token_ids"]
            print(json.dumps(result), flush=True)  # as each workload ends: a long run shows progress
        results.extend(best.values())

    cpu = cpu_description()
    print(f"\nCPU: {cpu}")
    print(f"{'workload':<9}{'method':<14}{'tok/s':>8}{'speed-up':>10}{'drafts':>8}{'accepted':>10}{'mean len':>10}"
          f"{'same output':>13}")
    for r in results:
        rate = f"{r['acceptance_rate']:.0%}" if r["acceptance_rate"] is not None else "-"
        length = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] is not None else "-"
        print(f"{r['workload']:<9}{r['method']:<14}{r['tokens_per_s']:>8.1f}{r['speedup']:>9.2f}x{r['num_drafts']:>8}"
              f"{rate:>10}{length:>10}{str(r['same_output']):>13}")
    print(json.dumps({"cpu": cpu, "results": results}))
    target = f"ngram/suffix rows: {args.model or 'the default Q4_1 GGUF'}, dtype {args.dtype}"
    _plot(results, args.png, cpu, target)


def _draft_engines(float_target: pathlib.Path, warm_prompts: list[list[int]]) -> list[tuple]:
    """The draft_model rows' engines: the float export as target, the Q4_1 GGUF (or the export itself) as draft."""
    from benchmarks.export_hf import export
    from pagellm.models.gguf_loader import default_model_path

    if not (float_target / "config.json").is_file():
        export(default_model_path(), float_target)
    rows = []
    engine_args = dict(kv_cache_memory_bytes=1 << 30, max_model_len=2048, enable_prefix_caching=False)
    for method, config in draft_methods(str(float_target), str(default_model_path())).items():
        if config is None:
            continue
        engine = LLM(str(float_target), speculative_config=config, **engine_args)
        drafter = engine.llm_engine.core.runner.drafter
        run(engine, method, warm_prompts, 8, config, drafter)  # warm-up
        if method == "draft_model":
            rows.append(("none-float", engine, None, None))
        rows.append((method, engine, config, drafter))
    return rows


def _plot(results: list[dict], path: str, cpu: str, target: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    methods = list(dict.fromkeys(r["method"] for r in results))
    figure, axis = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(methods)
    for offset, method in enumerate(methods):
        values = [next((r["speedup"] for r in results if r["workload"] == w and r["method"] == method), 0)
                  for w in workloads]
        axis.bar([i + offset * width for i in range(len(workloads))], values, width, label=method)
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(workloads))], workloads)
    axis.set_ylabel("tok/s over no speculation (of the same target)")
    drafts = ", draft rows: Q4_1 draft, float target" if any(r["method"].startswith("draft") for r in results) else ""
    axis.set_title(f"Speculative decoding, SmolLM2-135M greedy ({target}{drafts})\n{cpu}", fontsize=8)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
