"""What multi-head latent attention's paged latent cache buys on a DeepSeek-V2-Lite-shaped model (27 layers, 16
heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128), and what its decode costs.

- tokens per GiB of KV: the engine started on a V2-Lite-shaped config with dummy weights (its attention and
  layer count as V2-Lite's; hidden size, MLP and vocabulary shrunk to fit this machine: the pool depends on
  neither), read from the pool it allocated (bytes / tokens it holds) and from its start-up line; against what
  the latent allows (rank + rope values per token and layer) and against the same model caching full K/V
  (K: 16 heads x 192, V: 16 heads x 128 per token and layer; and as a paged pool whose K and V planes share one
  head size, 2 x 16 x 192);
- decode attention of one layer: the latent decode kernels (C on every instruction set this CPU runs, the torch
  reference) for --seqs sequences of --context tokens, best of --calls calls; W_UK/W_UV products excluded.

    PYTHONPATH=$PWD python benchmarks/mla.py
    PYTHONPATH=$PWD python benchmarks/mla.py --skip-engine --context 2048 --seqs 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from pagellm.attention.kv_spec import GiB, KVCacheSpec
from pagellm.cpu_features import cpu_description

V2_LITE = dict(num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
               qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None, max_position_embeddings=4096)
BLOCK = 16


def _v2_lite_dir(directory: Path, tokenizer_vocab: int) -> str:
    """A config.json of V2-Lite's attention shape with a small hidden size, dense MLP and vocabulary."""
    config = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=512,
                  intermediate_size=512, vocab_size=tokenizer_vocab, rms_norm_eps=1e-6, rope_theta=10000.0,
                  first_k_dense_replace=V2_LITE["num_hidden_layers"], n_routed_experts=64, num_experts_per_tok=6,
                  moe_intermediate_size=1408, torch_dtype="bfloat16", **V2_LITE)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def _tokenizer_dir(directory: Path) -> int:
    from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    tokenizer.save_pretrained(directory)
    return len(tokenizer)


def kv_table(dtype: torch.dtype, skip_engine: bool) -> list[str]:
    layers, heads = V2_LITE["num_hidden_layers"], V2_LITE["num_attention_heads"]
    latent = V2_LITE["kv_lora_rank"] + V2_LITE["qk_rope_head_dim"]
    k_head = V2_LITE["qk_nope_head_dim"] + V2_LITE["qk_rope_head_dim"]
    itemsize = dtype.itemsize
    allows = GiB / (layers * latent * itemsize)
    full_exact = GiB / (layers * heads * (k_head + V2_LITE["v_head_dim"]) * itemsize)
    full_paged = KVCacheSpec(layers, heads, k_head, BLOCK, dtype).tokens_per_gib
    rows = [f"| what | values per token and layer | tokens per GiB ({str(dtype).removeprefix('torch.')}) "
            "| vs the latent's allowance |", "|---|---:|---:|---:|",
            f"| latent allowance (rank + rope) | {latent} | {allows:,.0f} | 1.00x |"]
    if not skip_engine:
        from pagellm import LLM

        with tempfile.TemporaryDirectory() as tmp:
            vocab = _tokenizer_dir(Path(tmp))
            path = _v2_lite_dir(Path(tmp), vocab)
            llm = LLM(path, dtype=str(dtype).removeprefix("torch."), load_format="dummy", max_model_len=512,
                      max_num_seqs=4, kv_cache_memory_bytes=256 << 20, block_size=BLOCK)
            worker = llm.llm_engine.core.executor.driver
            pool = llm.llm_engine.core.runner.kv_pool
            held = GiB / (pool.numel() * pool.element_size() / (worker.num_blocks * BLOCK))
            rows.append(f"| engine: the pool it allocated | {latent} | {held:,.0f} | {held / allows:.2f}x |")
            rows.append(f"| engine: start-up line | | {worker.kv_spec.tokens_per_gib:,.0f} "
                        f"| {worker.kv_spec.tokens_per_gib / allows:.2f}x |")
            del llm
    rows.append(f"| full K/V (K 16 x 192, V 16 x 128) | {heads * (k_head + V2_LITE['v_head_dim'])} "
                f"| {full_exact:,.0f} | {full_exact / allows:.3f}x |")
    rows.append(f"| full K/V, paged planes of one head size (2 x 16 x 192) | {2 * heads * k_head} "
                f"| {full_paged:,.0f} | {full_paged / allows:.3f}x |")
    return rows


def decode_table(seqs: int, context: int, calls: int, dtype: torch.dtype) -> list[str]:
    from pagellm.attention.mla import mla_decode_kernel, torch_latent_decode
    from pagellm.attention.paged import DecodeMetadata
    from pagellm.ops import cpu_build

    heads, rank = V2_LITE["num_attention_heads"], V2_LITE["kv_lora_rank"]
    width = rank + V2_LITE["qk_rope_head_dim"]
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = seqs * blocks_per_seq
    cache = torch.randn(num_blocks, 1, BLOCK, width, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator).view(seqs, blocks_per_seq).numpy().astype(np.int64)
    decode = DecodeMetadata(tables, np.full(seqs, context, dtype=np.int64), torch.from_numpy(tables))
    q = torch.randn(seqs, heads, width, generator=generator).to(dtype)
    scale = (V2_LITE["qk_nope_head_dim"] + V2_LITE["qk_rope_head_dim"]) ** -0.5
    variants = {f"C ({isa})": (lambda kernel: lambda: kernel(q, cache, decode, scale, rank))(mla_decode_kernel(isa))
                for isa in cpu_build.runnable_isas() if mla_decode_kernel(isa) is not None}
    variants["torch reference"] = lambda: torch_latent_decode(q, cache, decode, scale, rank)
    rows = [f"| latent decode, {seqs} seqs x {context} tokens, {str(dtype).removeprefix('torch.')} "
            "| ms per call (best) | GB/s of latent rows |", "|---|---:|---:|"]
    for name, run in variants.items():
        run()
        best = float("inf")
        for _ in range(calls):
            started = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - started)
        rows.append(f"| {name} | {best * 1e3:.2f} | {cache.numel() * cache.element_size() / best / 1e9:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--skip-engine", action="store_true", help="the KV table from the spec arithmetic only")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {cpu_description()}; torch threads: {torch.get_num_threads()}")
    print("\n".join(kv_table(dtype, args.skip_engine)))
    print()
    print("\n".join(decode_table(args.seqs, args.context, args.calls, dtype)))


if __name__ == "__main__":
    main()
