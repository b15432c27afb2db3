"""The Triton kernels of mixture-of-experts and latent attention on a CUDA device, at the real models' shapes,
against the H200's limits; benchmarks/gpu_check.sh runs it as its `kernels` section (rows in the check's table).

    python benchmarks/gpu_kernels.py moe --results r.jsonl    # fused experts: Mixtral-8x7B's and Qwen3-30B-A3B's layer
    python benchmarks/gpu_kernels.py mla --results r.jsonl    # latent decode: DeepSeek-V3's heads over 64 x 4k tokens

moe: one layer's experts (ops/triton_moe.fused_experts, bfloat16) for 1 to 4,096 tokens routed by random logits;
the limit of a call is max(bytes of the experts it touches / 4.8 TB/s, FLOPs / 989 TFLOP/s), its result checked
against the grouped torch path in float32. mla: attention/mla_triton.triton_latent_decode over a paged cache of
bfloat16 latents (kv_lora_rank 512 + rope 64 values a token) and of fp8 codes with a scale a row, as latent bytes
read per second against the same 4.8 TB/s, checked against the torch reference (attention/mla.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.gpu_bench import PEAK_BF16_FLOPS, PEAK_BYTES_PER_S, record

# (experts, hidden, intermediate per expert, top_k) of one layer.
MOE_SHAPES = {"Mixtral-8x7B": (8, 4096, 14336, 2), "Qwen3-30B-A3B": (128, 2048, 768, 8)}
MOE_TOKENS = (1, 16, 256, 4096)
# (heads, kv_lora_rank, rope dims, sequences, context, block size): DeepSeek-V3's attention, 64 x 4k decodes.
MLA_SHAPE = (128, 512, 64, 64, 4096, 16)


def _time_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def bench_moe(args) -> None:
    from pagellm.layers.activation import SiluAndMul
    from pagellm.layers.fused_moe import Routing, grouped_experts
    from pagellm.ops.triton_moe import fused_experts

    device = torch.device(args.device)
    for name, (experts, hidden, inter, top_k) in MOE_SHAPES.items():
        generator = torch.Generator(device=device).manual_seed(0)
        w13 = torch.randn(experts, 2 * inter, hidden, device=device, generator=generator).mul_(0.02).to(torch.bfloat16)
        w2 = torch.randn(experts, hidden, inter, device=device, generator=generator).mul_(0.02).to(torch.bfloat16)
        router = Routing.softmax_top_k(top_k, renormalize=True)
        for tokens in MOE_TOKENS:
            x = torch.randn(tokens, hidden, device=device, generator=generator).to(torch.bfloat16)
            weights, ids = router.select(torch.randn(tokens, experts, device=device, generator=generator))
            ms = _time_ms(lambda: fused_experts(x, w13, w2, weights, ids))
            touched = int(ids.unique().numel())
            bytes_read = touched * 3 * hidden * inter * 2
            flops = 2 * tokens * top_k * 3 * hidden * inter
            limit_ms = 1e3 * max(bytes_read / PEAK_BYTES_PER_S, flops / PEAK_BF16_FLOPS)
            checked = slice(0, min(tokens, 64))  # the float32 reference on a few tokens' pairs
            reference = grouped_experts(
                x[checked].float(), weights[checked], ids[checked], experts,
                lambda e, rows, out: out.copy_(F.linear(rows, w13[e].float())),
                lambda e, rows, out: out.copy_(F.linear(rows, w2[e].float())), 2 * inter, SiluAndMul())
            ours = fused_experts(x[checked], w13, w2, weights[checked], ids[checked]).float()
            record(args.results, dict(
                section="kernel", name=f"fused MoE, {name} layer, {tokens} tokens ({touched} experts used)", ms=ms,
                result=f"{ms:.3f} ms, {bytes_read / (ms * 1e-3) / 1e12:.2f} TB/s of experts, "
                       f"{flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s",
                against=f"limit {limit_ms:.3f} ms: {100 * limit_ms / ms:.0f}% of it",
                rel_error=((ours - reference).norm() / reference.norm()).item()))
        del w13, w2
        if device.type == "cuda":
            torch.cuda.empty_cache()


def bench_mla(args) -> None:
    from pagellm.attention.kv_spec import KVCacheFormat
    from pagellm.attention.mla import torch_latent_decode
    from pagellm.attention.mla_triton import triton_latent_decode
    from pagellm.attention.paged import DecodeMetadata

    device = torch.device(args.device)
    heads, rank, rope, seqs, context, block_size = MLA_SHAPE
    width = rank + rope
    assert context % block_size == 0, "whole blocks: every table entry is a block of the sequence"
    blocks_per_seq = context // block_size
    num_blocks = seqs * blocks_per_seq + 1
    rng = np.random.default_rng(0)
    tables = rng.permutation(num_blocks)[: seqs * blocks_per_seq].reshape(seqs, blocks_per_seq).astype(np.int64)
    decode = DecodeMetadata(tables, np.full(seqs, context, dtype=np.int64), torch.from_numpy(tables).to(device))
    generator = torch.Generator(device=device).manual_seed(0)
    latents = torch.randn(num_blocks, 1, block_size, width, device=device, generator=generator).to(torch.bfloat16)
    q = torch.randn(seqs, heads, width, device=device, generator=generator).to(torch.bfloat16)
    scale = (128 + rope) ** -0.5  # DeepSeek-V3's qk_nope_head_dim 128 + rope
    for format_name in ("bfloat16", "fp8_e4m3"):
        kv_format = None if format_name == "bfloat16" else KVCacheFormat.resolve(format_name, torch.bfloat16)
        cache = latents if kv_format is None else kv_format.pack(latents)
        row_bytes = width * 2 if kv_format is None else width + 2
        bytes_read = seqs * context * row_bytes
        ms = _time_ms(lambda: triton_latent_decode(q, cache, decode, scale, rank, kv_format=kv_format))
        ours = triton_latent_decode(q, cache, decode, scale, rank, kv_format=kv_format).float()
        reference = torch_latent_decode(q.float(), cache, decode, scale, rank, kv_format, block_size)
        record(args.results, dict(
            section="kernel", name=f"MLA latent decode, {heads} heads, {seqs} x {context} tokens, {format_name} cache",
            ms=ms, result=f"{ms:.3f} ms, {bytes_read / (ms * 1e-3) / 1e12:.2f} TB/s of latents",
            against=f"{100 * bytes_read / (ms * 1e-3) / PEAK_BYTES_PER_S:.0f}% of 4.8 TB/s",
            rel_error=((ours - reference).norm() / reference.norm()).item()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", choices=["moe", "mla"])
    parser.add_argument("--results", required=True, help="JSON-lines file the rows are appended to")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a dry run under TRITON_INTERPRET
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_kernels.py times Triton kernels on a CUDA device; none is visible here")
    {"moe": bench_moe, "mla": bench_mla}[args.kernel](args)


if __name__ == "__main__":
    main()
