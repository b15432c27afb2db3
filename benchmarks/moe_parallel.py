"""Tensor parallelism against expert parallelism for a mixture-of-experts model on the CPU: the same 2 ranks,
experts split by features (`-tp 2`) or placed whole (`-tp 2 -ep`).

Mixtral-8x7B's shape scaled down as benchmarks/moe.py scales it (hidden 1024, 8 experts of 3584 features, 2 per
token, 8 query / 2 KV heads of 128), random weights (load_format="dummy"), float32, `--layers` layers. For each
setting: the wall time of generating `--tokens` greedy tokens for a batch of 1 and of 8 sequences (decode-bound),
and of prefilling one `--prompt-len`-token prompt (1 token generated). The two engines run one after the other,
`--repeats` rounds, best kept; the load average is printed, as other processes on the machine skew both.

    PYTHONPATH=$PWD python benchmarks/moe_parallel.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.moe import configs, model_dir  # noqa: E402


def timed(llm, prompts: list[list[int]], params) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def measure(path: str, expert_parallel: bool, args) -> dict[str, float]:
    from pagellm import LLM, SamplingParams

    llm = LLM(path, load_format="dummy", dtype="float32", tensor_parallel_size=2, max_model_len=1024,
              enable_expert_parallel=expert_parallel, kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
    try:
        decode = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        timed(llm, [[1] * 16], decode)  # warm-up
        prompt = [[(i * 7) % 1000 + 1 for i in range(args.prompt_len)]]
        return {
            "decode, 1 sequence": timed(llm, [[1, 2, 3, 4]], decode) / args.tokens,
            "decode, 8 sequences": timed(llm, [[i + 1] * 4 for i in range(8)], decode) / args.tokens,
            f"prefill, {args.prompt_len} tokens": timed(llm, prompt, prefill),
        }
    finally:
        llm.llm_engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    moe, _ = configs("mixtral-8x7b", args.layers, args.vocab, tokenizer)
    with tempfile.TemporaryDirectory() as root:
        path = model_dir(Path(root), "mixtral", moe, tokenizer)
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.repeats):
            for name, expert_parallel in (("tp=2", False), ("tp=2 + ep", True)):
                for step, seconds in measure(path, expert_parallel, args).items():
                    row = best.setdefault(step, {})
                    row[name] = min(row.get(name, float("inf")), seconds)
    print(f"load average {os.getloadavg()[0]:.1f}; ms per step (decode) or per prefill, best of {args.repeats}")
    print("| step | tp=2 | tp=2 + ep | ep / tp |")
    print("|---|---:|---:|---:|")
    for step, row in best.items():
        print(f"| {step} | {row['tp=2'] * 1e3:.1f} | {row['tp=2 + ep'] * 1e3:.1f} | "
              f"{row['tp=2 + ep'] / row['tp=2']:.2f}x |")


if __name__ == "__main__":
    main()
