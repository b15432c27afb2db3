"""One greedy stream on the default GGUF (SmolLM2-135M-Instruct Q4_1): pagellm against llama.cpp on the same file
with the same thread count. A fixed 32-token prompt, `--tokens` greedy tokens (prefill included in the time), best
of a few rounds each; the load average is printed, as the figures swing with it.

    PYTHONPATH=$PWD python benchmarks/single_stream.py --llama-python /tmp/llama-venv/bin/python
    PYTHONPATH=$PWD python benchmarks/single_stream.py --threads 1 --llama-python /tmp/llama-venv/bin/python

llama-cpp-python built from source, in a venv of its own (~7 minutes on 2 cores):
    python3 -m venv /tmp/llama-venv && CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llama-venv/bin/pip install llama-cpp-python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagellm.cpu_features import cpu_description  # noqa: E402

PROMPT_IDS = [(i * 37) % 40000 + 100 for i in range(32)]

LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
path, threads, tokens, rounds, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
llm = Llama(path, n_ctx=512, n_threads=threads, verbose=False)
best = float("inf")
for _ in range(rounds):
    llm.reset()
    start, made = time.perf_counter(), 0
    for _token in llm.generate(prompt, temp=0.0):
        made += 1
        if made == tokens:
            break
    best = min(best, time.perf_counter() - start)
print(json.dumps({"seconds": best}))
"""


def pagellm_seconds(threads: int, tokens: int, rounds: int) -> tuple[float, str]:
    """Best seconds for one stream, and the GGUF file the default model loaded."""
    import torch

    from pagellm import LLM, SamplingParams
    from pagellm.models.loader import resolve_model

    llm = LLM()
    torch.set_num_threads(threads)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    best = float("inf")
    for _ in range(rounds + 1):  # the first round warms up
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": PROMPT_IDS}], params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return best, str(resolve_model(None).path)


def llama_cpp_seconds(python: str, path: str, threads: int, tokens: int, rounds: int) -> float:
    done = subprocess.run([python, "-c", LLAMA_CPP, path, str(threads), str(tokens), str(rounds),
                           json.dumps(PROMPT_IDS)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    ours, path = pagellm_seconds(args.threads, args.tokens, args.rounds)
    print(f"{Path(path).name}, {args.threads} threads, {args.tokens} tokens after a 32-token prompt; "
          f"{cpu_description()}; load average {load:.2f} at start")
    print(f"pagellm    {args.tokens / ours:6.1f} tok/s")
    if args.llama_python:
        theirs = llama_cpp_seconds(args.llama_python, path, args.threads, args.tokens, args.rounds)
        print(f"llama.cpp  {args.tokens / theirs:6.1f} tok/s   pagellm / llama.cpp {theirs / ours:.2f}x")
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
