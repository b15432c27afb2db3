"""What `kv_cache_dtype` buys and costs on the CPU: tokens per GiB of the pool, decode attention time per token,
and perplexity of the default model (SmolLM2-135M-Instruct) on a fixed text, per KV cache format.

- tokens per GiB: from the pool's KVCacheSpec on the default model's shapes (30 layers, 3 KV heads of 64,
  blocks of 16), against the bfloat16 cache;
- decode attention: the native kernel (csrc/paged_attention.c) on every instruction set this CPU runs, --seqs
  sequences of --context tokens, one cache pair per layer of a --layers pool (each call takes the next layer's,
  as a model step does, so the keys come from DRAM as in serving), blocks in shuffled order; queries in
  --dtype. Variants are interleaved (each round times every variant once, the median of --calls calls) and
  the table gives each one's best round and median round;
- perplexity: exp of the mean negative log-likelihood of TEXT's tokens after the first (prompt_logprobs),
  the model in --dtype, each format in its own engine.

    PYTHONPATH=$PWD python benchmarks/kv_cache_dtype.py
    PYTHONPATH=$PWD python benchmarks/kv_cache_dtype.py --skip-perplexity --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from pagellm.attention import native
from pagellm.attention.kv_spec import KVCacheFormat, KVCacheSpec
from pagellm.cpu_features import cpu_description
from pagellm.ops import cpu_build

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 30, 3, 9, 64, 16
FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head")


def formats_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The formats to compare under a model of `dtype`: a float32 model's cache kept in bfloat16 besides."""
    return FORMATS[:1] + ("bfloat16",) + FORMATS[1:] if dtype == torch.float32 else FORMATS
# A fixed English text (prose from pagellm's README as of this benchmark): 837 tokens in the default tokenizer.
TEXT = """\
An LLM inference engine in Python built on PagedAttention, with vLLM's API: the KV cache lives in one
pre-allocated pool of fixed-size blocks, each sequence maps its logical blocks to physical ones through a block
table, and a continuous-batching scheduler admits, runs and preempts requests every step under one token budget.

Paged KV cache: one pool of block_size-token blocks, sized once at start-up; a sequence takes a block only when a
token needs one, so the only waste is the unfilled tail of each sequence's last block. Continuous batching under
one token budget per step and a maximum number of sequences: running requests first, then waiting ones in arrival
order; when blocks run out the newest running request is preempted (its blocks freed) and recomputed later. The
oldest request is never preempted by a newer one, so nothing waits forever. Every sequence of a request counts: a
request holds seats for all of its samples (and a beam search for its width) while it runs, is admitted only with
a free block for each sample it forks, and counts its sequences against the limit on queued requests; one that
could never run (more sequences than the limit, or not room in the pool for its prompt and a block per sequence)
is refused with the numbers. With priority scheduling the queue is ordered by each request's priority (lower
first, then arrival) and the lowest-priority running request is preempted first.

Chunked prefill: a prompt longer than what is left of the step's budget is computed over several steps next to the
running decodes. Prompts up to the model's maximum length are accepted whatever the budget. Automatic prefix
caching: a full block is keyed by its tokens and the exact cached block before it, compared by value (a hash
collision can never serve wrong keys and values); freed blocks keep their contents in the free queue in least
recently used order until handed out again. The output says how many prompt tokens came from the cache.

Shared blocks with copy-on-write: sampling several completions computes the prompt once and forks sequences that
reference its blocks, the partly filled last one included; the first sequence to write into a shared block gets
its own copy first. Beam search keeps the best beams of the step, and a beam that survives shares its parent's
blocks rather than copying them. Sliding-window attention: a layer that attends to the last few thousand tokens
only reads the blocks its window touches, and a model whose every layer slides gives back the blocks that fall
out of the window, so a long conversation holds only its window.

The server speaks the OpenAI API: completions, chat completions with tools and structured outputs, embeddings of
the hidden states, streaming with usage, and the metrics vLLM exports. Requests that ask for what the engine
cannot do are refused with a clear error that names the field, the value and the fix, and the engine keeps serving
every other request. Memory is measured, not guessed: the weights, the peak of the largest prefill step and of the
worst decode step are taken at start-up, and what is left becomes the pool. On a machine shared with other
programs the pool is capped, and the engine says what decided its size.

The attention kernels for the processor are written once in C over vectors of the width the machine offers, and
compiled for each instruction set on first use: decode attention reads each sequence's blocks straight from the
pool through its block table, and prefill attention reads the chunks' keys and values where they were written,
flash-style, with an online softmax, so no copy of the cache is ever made. On a graphics card the same work runs in
Triton kernels, and decode steps are captured as graphs and replayed.
"""


def tokens_per_gib_table() -> None:
    print("\n## Pool density (default model: 30 layers, 3 KV heads of 64, blocks of 16)\n")
    print("| kv_cache_dtype | stored as | bytes per token | tokens per GiB | vs bfloat16 |")
    print("|---|---|---|---|---|")
    base = KVCacheSpec(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16).tokens_per_gib
    for name in FORMATS:
        spec = KVCacheSpec(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16, name)
        stored = spec.format.name + (" + bf16 scale per row" if spec.format.quantized else "")
        print(f"| {name} | {stored} | {spec.bytes_per_block / BLOCK:.0f} | {spec.tokens_per_gib:,.0f} | "
              f"{spec.tokens_per_gib / base:.2f}x |")


def _median_call_us(function, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def decode_table(dtype: torch.dtype, seqs: int, context: int, layers: int, rounds: int, calls: int) -> None:
    print(f"\n## Decode attention, {seqs} sequences x {context} tokens, {layers}-layer pool, queries in "
          f"{str(dtype).removeprefix('torch.')}\n")
    gen = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK)
    tables = np.random.default_rng(0).permutation(seqs * blocks).reshape(seqs, blocks).astype(np.int64)
    context_lens = np.full(seqs, context, dtype=np.int64)
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    variants = {}
    for name in formats_for(dtype):
        kv_format = KVCacheFormat.resolve(name, dtype)
        caches = []
        for _ in range(layers):  # one layer's values at a time: the float copy of a whole pool would be large
            pair = [torch.randn(seqs * blocks + 1, KV_HEADS, BLOCK, HEAD_DIM, generator=gen) for _ in range(2)]
            caches.append([kv_format.pack(x) if kv_format.quantized else x.to(kv_format.value_dtype) for x in pair])
        pool_bytes = sum(x.numel() * x.element_size() for pair in caches for x in pair)
        for isa in cpu_build.runnable_isas():
            kernel, order = native.decode_kernel(isa), itertools.cycle(range(layers))

            def call(kernel=kernel, caches=caches, order=order, kv_format=kv_format):
                k_cache, v_cache = caches[next(order)]
                kernel(q, k_cache, v_cache, tables, context_lens, 0.125, 0, kv_format)

            variants[(name, isa)] = (call, pool_bytes)
    results = {variant: [] for variant in variants}
    for call, _ in variants.values():
        call()
    for _ in range(rounds):
        for variant, (call, _) in variants.items():
            results[variant].append(_median_call_us(call, calls))
    print("| kv_cache_dtype | ISA | pool MB | us per call, best (median) | us per token and layer | vs auto |")
    print("|---|---|---|---|---|---|")
    for (name, isa), (_, pool_bytes) in variants.items():
        best, base = min(results[(name, isa)]), min(results[("auto", isa)])
        print(f"| {name} | {isa} | {pool_bytes / 1e6:.0f} | {best:.0f} ({statistics.median(results[(name, isa)]):.0f}) "
              f"| {best / seqs:.1f} | {best / base:.2f}x |", flush=True)


def perplexity_table(dtype: torch.dtype) -> None:
    from pagellm import LLM, SamplingParams

    print(f"\n## Perplexity of the default model on a fixed text, model in {str(dtype).removeprefix('torch.')}\n")
    print("| kv_cache_dtype | tokens | perplexity | vs auto |")
    print("|---|---|---|---|")
    base = None
    for name in formats_for(dtype):
        llm = LLM(dtype=str(dtype).removeprefix("torch."), kv_cache_dtype=name, kv_cache_memory_bytes=128 << 20,
                  max_model_len=2048, enable_prefix_caching=False)
        output = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        ids = output.prompt_token_ids
        logprobs = [position[token].logprob for token, position in zip(ids[1:], output.prompt_logprobs[1:])]
        perplexity = math.exp(-sum(logprobs) / len(logprobs))
        base = base or perplexity
        print(f"| {name} | {len(ids)} | {perplexity:.4f} | {(perplexity / base - 1) * 100:+.2f}% |", flush=True)
        del llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-perplexity", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}; kernels built for "
          f"{cpu_build.runnable_isas()}")
    with open("/proc/loadavg", encoding="utf-8") as loadavg:
        print(f"load average before: {loadavg.read().strip()}")
    tokens_per_gib_table()
    if not args.skip_decode:
        decode_table(dtype, args.seqs, args.context, args.layers, args.rounds, args.calls)
    if not args.skip_perplexity:
        perplexity_table(dtype)
    with open("/proc/loadavg", encoding="utf-8") as loadavg:
        print(f"\nload average after: {loadavg.read().strip()}")


if __name__ == "__main__":
    main()
