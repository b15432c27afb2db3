"""GPU benchmarks behind benchmarks/gpu_check.sh; each section appends JSON lines to --results.

    python benchmarks/gpu_bench.py attention --results r.jsonl   # decode attention: K/V bytes read per second
    python benchmarks/gpu_bench.py pagellm --results r.jsonl     # 8B-shaped model, random bf16 weights
    python benchmarks/gpu_bench.py hf --results r.jsonl          # transformers generate, static batches
    python benchmarks/gpu_bench.py table --results r.jsonl       # one markdown table of everything above

The 8B-shaped model is Llama-3-8B's configuration with random weights (load_format="dummy"): no checkpoint
can be downloaded on the device machine. Its tokenizer is a word-level one over the model's whole
vocabulary, made here, so outputs detokenize as they would with a real one.

Limits: the throughput limit of a workload is the sum over its phases of max(FLOPs / peak FLOP/s, bytes /
peak bandwidth), with the H200's datasheet figures (989 TFLOP/s dense bf16, 4.8 TB/s); the prefill is
compute-bound, each decode step reads all weights and every sequence's K/V once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PEAK_BYTES_PER_S = 4.8e12
PEAK_BF16_FLOPS = 989e12
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, hidden_act="silu", torch_dtype="bfloat16",
)


def record(path: str, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


# ---- decode attention bandwidth --------------------------------------------------------------------


def bench_attention(args) -> None:
    import numpy as np
    import torch
    import triton.testing

    from pagellm.attention import triton_backend
    from pagellm.attention.backend import AttentionShape, StepAttentionInputs

    device = torch.device("cuda")
    gib = 1 << 30
    # The copy ceiling: a device-to-device copy, counting bytes read plus bytes written.
    src = torch.empty(2 * gib, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    copy_bw = 2 * src.numel() / (copy_ms * 1e-3)
    del src, dst
    record(args.results, dict(section="attention", name="device copy (read + write)", bytes_per_s=copy_bw,
                              ms=copy_ms))

    num_seqs, context, block_size = args.num_seqs, args.context, 16
    shape = AttentionShape(32, 8, 128, block_size)  # Llama-3-8B's attention
    blocks_per_seq = context // block_size
    num_blocks = num_seqs * blocks_per_seq + 1
    rng = np.random.default_rng(0)
    tables = rng.permutation(num_blocks)[: num_seqs * blocks_per_seq].reshape(num_seqs, blocks_per_seq)
    cache_shape = (num_blocks, shape.num_kv_heads, block_size, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=device)
    q = torch.randn(num_seqs, shape.num_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
    seq_lens = np.full(num_seqs, context)
    step = StepAttentionInputs(num_seqs, np.ones(num_seqs, np.int64), seq_lens, tables,
                               tables[:, -1] * block_size + block_size - 1)
    kv_bytes = 2 * num_seqs * context * shape.num_kv_heads * shape.head_dim * 2
    backend = triton_backend.TritonAttentionBackend(shape, device)
    meta = backend.build_metadata(step)
    out = torch.empty_like(q)

    def run(splits):
        backend.decode(out, q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, splits, 0.088)

    # The torch reference on the same step, for a correctness check at this size.
    reference = _reference_decode(q, k_cache, v_cache, tables, context, shape)
    configs = []
    for tile_n in (32, 64):
        for warps in (4, 8):
            for splits in sorted({1, meta.num_splits}):
                configs.append((tile_n, warps, splits))
    default = (triton_backend.DECODE_TILE_N, triton_backend.DECODE_NUM_WARPS, meta.num_splits)
    for tile_n, warps, splits in configs:
        triton_backend.DECODE_TILE_N, triton_backend.DECODE_NUM_WARPS = tile_n, warps
        try:
            out.fill_(float("nan"))
            run(splits)
            error = ((out.float() - reference).norm() / reference.norm()).item()
            ms = triton.testing.do_bench(lambda: run(splits), warmup=50, rep=300, return_mode="median")
        except Exception as exc:  # one config failing to compile must not hide the others
            record(args.results, dict(section="attention", name=f"tile {tile_n}, {warps} warps, {splits} splits",
                                      error=repr(exc)[:200]))
            continue
        finally:
            triton_backend.DECODE_TILE_N, triton_backend.DECODE_NUM_WARPS = default[:2]
        record(args.results, dict(
            section="attention", default=(tile_n, warps, splits) == default,
            name=f"decode {num_seqs} x {context} bf16, tile {tile_n}, {warps} warps, {splits} splits",
            ms=ms, bytes_per_s=kv_bytes / (ms * 1e-3), fraction_of_peak=kv_bytes / (ms * 1e-3) / PEAK_BYTES_PER_S,
            fraction_of_copy=kv_bytes / (ms * 1e-3) / copy_bw, rel_error=error))


def _reference_decode(q, k_cache, v_cache, tables, context, shape):
    import torch

    t = torch.as_tensor(tables, device=q.device)
    out = []
    for i in range(q.shape[0]):
        k = k_cache[t[i]].transpose(0, 1).reshape(shape.num_kv_heads, context, shape.head_dim).float()
        v = v_cache[t[i]].transpose(0, 1).reshape(shape.num_kv_heads, context, shape.head_dim).float()
        qi = q[i].float().view(shape.num_kv_heads, shape.group, shape.head_dim)
        p = torch.softmax(qi @ k.transpose(1, 2) * 0.088, dim=-1)
        out.append((p @ v).reshape(shape.num_heads, shape.head_dim))
    return torch.stack(out)


# ---- throughput on the 8B-shaped model --------------------------------------------------------------


def make_model_dir(path: Path) -> Path:
    from tests.gpu.conftest import save_word_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA3_8B))
    save_word_tokenizer(path, LLAMA3_8B["vocab_size"])
    return path


def workload(args) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(3, LLAMA3_8B["vocab_size"], (args.num_prompts, args.input_len)).tolist()


def roofline_seconds(num_prompts: int, input_len: int, output_len: int, max_num_seqs: int) -> dict:
    """The time floor of the workload on this model: prefill compute-bound; every decode step at least
    reads the weights and the batch's K/V, and does 2 FLOPs per weight per sequence."""
    c = LLAMA3_8B
    h, layers, kvh, hd = c["hidden_size"], c["num_hidden_layers"], c["num_key_value_heads"], 128
    per_layer = h * (h + 2 * kvh * hd) + h * h + 3 * h * c["intermediate_size"]
    matmul_params = layers * per_layer + h * c["vocab_size"]  # lm_head; the embedding is a lookup
    weight_bytes = 2 * (matmul_params + h * c["vocab_size"])
    kv_per_token = 2 * layers * kvh * hd * 2

    def attention_flops(queries, context):  # QK^T and PV over `context` keys per query, all heads
        return 4 * layers * c["num_attention_heads"] * hd * queries * context

    prefill_flops = 2 * matmul_params * num_prompts * input_len + attention_flops(num_prompts * input_len,
                                                                                 input_len / 2)
    seconds = prefill_flops / PEAK_BF16_FLOPS
    batches = -(-num_prompts // max_num_seqs)
    for b in range(batches):
        batch = min(max_num_seqs, num_prompts - b * max_num_seqs)
        for i in range(output_len):
            context = input_len + i
            flops = 2 * matmul_params * batch + attention_flops(batch, context)
            bytes_moved = weight_bytes + batch * context * kv_per_token
            seconds += max(flops / PEAK_BF16_FLOPS, bytes_moved / PEAK_BYTES_PER_S)
    return dict(limit_seconds=seconds, weight_bytes=weight_bytes)


def bench_pagellm(args) -> None:
    import torch

    from pagellm import LLM, SamplingParams

    model_dir = make_model_dir(Path(tempfile.mkdtemp()) / "llama3-8b-shape")
    started = time.perf_counter()
    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", load_format="dummy", max_num_seqs=args.max_num_seqs,
              max_model_len=args.input_len + args.output_len + 16, enforce_eager=args.enforce_eager)
    ready = time.perf_counter() - started
    prompts = [{"prompt_token_ids": p} for p in workload(args)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[: min(8, len(prompts))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up: kernels of every step shape compiled before the clock starts
    torch.cuda.synchronize()
    runner = llm.llm_engine.core.runner
    in_runner = _time_calls(runner, "execute")
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    limit = roofline_seconds(args.num_prompts, args.input_len, args.output_len, args.max_num_seqs)
    startup = llm.llm_engine.core.startup
    record(args.results, dict(
        section="throughput", name=f"pagellm{' (eager)' if args.enforce_eager else ''}",
        workload=f"{args.num_prompts} x ({args.input_len} in, {args.output_len} out)",
        seconds=seconds, output_tokens_per_s=generated / seconds,
        total_tokens_per_s=(generated + args.num_prompts * args.input_len) / seconds,
        limit_seconds=limit["limit_seconds"], fraction_of_limit=limit["limit_seconds"] / seconds,
        ready_seconds=ready, kv_blocks=startup.num_blocks, kv_gib=startup.kv_cache_bytes / 2**30,
        max_concurrency=startup.max_concurrency, steps=in_runner["calls"], runner_seconds=in_runner["seconds"],
        graph_replays=runner.graphs.num_replays if runner.graphs is not None else 0))


def _time_calls(obj, name: str) -> dict:
    """Wrap obj.name to add up its calls and wall time. ModelRunner.execute ends on reading the sampled ids,
    so its time is the device's time for the step plus the runner's own host work; the rest of the wall
    time is the engine's host work between steps (scheduling, output processing), when the GPU idles."""
    totals = {"calls": 0, "seconds": 0.0}
    method = getattr(obj, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            totals["calls"] += 1
            totals["seconds"] += time.perf_counter() - started

    setattr(obj, name, timed)
    return totals


def bench_hf(args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "model_type")})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    prompts = workload(args)[: args.hf_prompts]
    batch = args.hf_batch_size

    def generate(rows, new_tokens):
        ids = torch.tensor(rows, device="cuda")
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                                  pad_token_id=0)

    generate(prompts[:batch], 4)  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    generated = 0
    for i in range(0, len(prompts), batch):
        out = generate(prompts[i : i + batch], args.output_len)
        generated += out[:, args.input_len:].numel()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    record(args.results, dict(
        section="throughput", name=f"transformers generate (static batches of {batch})",
        workload=f"{len(prompts)} x ({args.input_len} in, {args.output_len} out)", seconds=seconds,
        output_tokens_per_s=generated / seconds,
        total_tokens_per_s=(generated + len(prompts) * args.input_len) / seconds))


# ---- the table -----------------------------------------------------------------------------------


def table(args) -> None:
    rows = []
    if os.path.exists(args.results):
        with open(args.results) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    lines = ["| section | what | result | against |", "| --- | --- | --- | --- |"]
    throughput = {}
    for row in rows:
        section, name = row.get("section"), row.get("name", "")
        if "error" in row:
            lines.append(f"| {section} | {name} | FAILED: {row['error']} | |")
        elif section == "tests":
            lines.append(f"| tests | {name} | {row['summary']} | |")
        elif section == "attention" and "fraction_of_peak" in row:
            mark = " (default)" if row.get("default") else ""
            lines.append(f"| attention | {name}{mark} | {row['bytes_per_s'] / 1e12:.2f} TB/s, {row['ms']:.3f} ms, "
                         f"rel. error {row['rel_error']:.1e} | {100 * row['fraction_of_peak']:.0f}% of 4.8 TB/s, "
                         f"{100 * row['fraction_of_copy']:.0f}% of copy |")
        elif section == "attention":
            lines.append(f"| attention | {name} | {row['bytes_per_s'] / 1e12:.2f} TB/s | ceiling |")
        elif section == "throughput":
            throughput[name] = row
            against = ""
            if "fraction_of_limit" in row:
                steps = max(1, row["steps"])
                against = (f"limit {row['limit_seconds']:.2f} s: {100 * row['fraction_of_limit']:.0f}% of it; "
                           f"KV {row['kv_blocks']} blocks, {row['kv_gib']:.1f} GiB, "
                           f"{row['max_concurrency']:.0f} x max_model_len; ready in {row['ready_seconds']:.0f} s; "
                           f"{row['steps']} steps ({row['graph_replays']} graph replays), "
                           f"{1000 * row['runner_seconds'] / steps:.1f} ms each in the runner, "
                           f"{1000 * (row['seconds'] - row['runner_seconds']) / steps:.1f} ms between steps")
            lines.append(f"| throughput | {name}, {row['workload']} | {row['output_tokens_per_s']:.0f} output tok/s, "
                         f"{row['total_tokens_per_s']:.0f} total tok/s ({row['seconds']:.1f} s) | {against} |")
        elif section == "kernel":
            lines.append(f"| kernel | {name} | {row['result']}, rel. error {row['rel_error']:.1e} | {row['against']} |")
        elif section == "section":
            lines.append(f"| {row['name']} | exit status | {row['status']} | {row.get('note', '')} |")
    hf = next((r for n, r in throughput.items() if n.startswith("transformers")), None)
    for name, row in throughput.items():
        if hf is not None and row is not hf:
            speedup = row["output_tokens_per_s"] / hf["output_tokens_per_s"]
            lines.append(f"| throughput | {name} / transformers | {speedup:.1f}x output tok/s | target >= 10x |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=["attention", "pagellm", "hf", "table"])
    parser.add_argument("--results", required=True, help="JSON-lines file each section appends to")
    parser.add_argument("--out", default=None, help="table: also write the markdown table here")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--hf-prompts", type=int, default=64, help="transformers runs this many of the prompts")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    args = parser.parse_args()
    {"attention": bench_attention, "pagellm": bench_pagellm, "hf": bench_hf, "table": table}[args.section](args)


if __name__ == "__main__":
    main()
