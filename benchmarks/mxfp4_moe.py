"""gpt-oss's MXFP4 experts kept in their 4 bits against the same experts in bfloat16, on the CPU: the experts'
memory, a decode step's and a prefill step's time.

A gpt-oss-20b-shaped model (hidden 2880, `--experts` experts of 2880 features with biases, top 4, 64 query / 8 KV
heads of 64, attention sinks, `--layers` layers, a `--vocab`-token embedding) with random weights, its experts
rounded to MXFP4 as gpt-oss's releases store them (tests/mxfp4_checkpoints.py), written twice: as the MXFP4
checkpoint, which pagellm keeps as MXFP4_F16 blocks on the GGUF experts' kernels, and as a bfloat16 checkpoint of
the same expert values, which is what pagellm ran before it kept the blocks (it dequantized them as they loaded).
Both engines are loaded first, then the rounds run them interleaved (`--repeats`, best kept): one decode step of
`--batch` sequences (median of `--steps`) and the prefill step of one `--prompt-len`-token prompt; in brackets the
time inside the MoE blocks. Greedy tokens of both on a few prompts are compared (the kernels quantize activations
per 32, llama.cpp's way; the bfloat16 experts do not).

With --llama-python (a venv with llama-cpp-python, as benchmarks/quantized.py builds it) the same weights are also
written as llama.cpp's converter writes a gpt-oss GGUF (tests/mxfp4_checkpoints.py: MXFP4 experts, bfloat16
other weights, the default model's vocabulary, whose size the embedding then takes), which pagellm runs as a third
engine and llama.cpp runs in its own process: its one-stream decode (32 tokens after a 32-token prompt, best of
`--repeats`) and eight sequences through its batching.

    PYTHONPATH=$PWD python benchmarks/mxfp4_moe.py
    PYTHONPATH=$PWD python benchmarks/mxfp4_moe.py --layers 1 --experts 8 --batch 1 8 32
    PYTHONPATH=$PWD python benchmarks/mxfp4_moe.py --llama-python /tmp/llama-venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.moe import Bench, add_step_arguments, interleaved_rounds, print_cpu, workloads

GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, num_experts_per_tok=4, sliding_window=128, swiglu_limit=7.0)


def float_checkpoint(root: Path, args, tokenizer) -> str:
    """The random bfloat16 checkpoint (tensors drawn directly: a transformers init of 1.6B parameters is slow)."""
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(**GPT_OSS_20B, num_hidden_layers=args.layers, num_local_experts=args.experts,
                          vocab_size=args.vocab, max_position_embeddings=4096,
                          layer_types=["sliding_attention", "full_attention"] * (args.layers // 2)
                          + ["sliding_attention"] * (args.layers % 2),
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          tie_word_embeddings=False, architectures=["GptOssForCausalLM"])
    with torch.device("meta"):
        shapes = {name: tensor.shape for name, tensor in GptOssForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            scale = 0.02 if "bias" not in name and "sinks" not in name else 0.1
            tensors[name] = (torch.randn(shape, generator=generator, dtype=torch.bfloat16) * scale)
    path = root / "bf16-random"
    path.mkdir()
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def checkpoints(root: Path, args, tokenizer) -> tuple[str, str]:
    """(MXFP4 checkpoint, bfloat16 checkpoint of the values its experts hold)."""
    import shutil

    from tests.mxfp4_checkpoints import write_mxfp4

    random_dir = float_checkpoint(root, args, tokenizer)
    mxfp4_dir, bf16_dir = root / "mxfp4", root / "bf16"
    write_mxfp4(random_dir, mxfp4_dir, dtype=torch.bfloat16, dequantized_out=bf16_dir)
    shutil.rmtree(random_dir)
    return str(mxfp4_dir), str(bf16_dir)


def gguf_checkpoint(root: Path, bf16_dir: str) -> str:
    """The bfloat16 checkpoint's weights as llama.cpp's gpt-oss GGUF, with the default model's vocabulary."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from pagellm.models.gguf_loader import default_model_path
    from tests.mxfp4_checkpoints import write_gpt_oss_gguf

    path = root / "gpt-oss-mxfp4.gguf"
    write_gpt_oss_gguf(load_file(f"{bf16_dir}/model.safetensors"), AutoConfig.from_pretrained(bf16_dir), path,
                       float_type=gguf_type("BF16"), vocabulary=default_model_path())
    return str(path)


def gguf_type(name: str):
    import gguf

    return gguf.GGMLQuantizationType[name]


def llama_cpp_rates(path: str, args) -> dict | None:
    """llama.cpp's one-stream decode and eight-sequence batched tok/s on the GGUF (benchmarks/quantized.py's
    worker)."""
    from benchmarks.quantized import run_llama

    settings = argparse.Namespace(llama_python=args.llama_python, decode_tokens=32, batch=8, batch_tokens=16,
                                  repeats=args.repeats, skip_speed=False, timeout=3000)
    return run_llama(path, settings)


def expert_bytes(bench: Bench) -> int:
    from pagellm.layers.fused_moe import FusedMoE
    from pagellm.layers.weights import weights_bytes

    return sum(weights_bytes(m) for m in bench.engine.core.runner.model.modules() if isinstance(m, FusedMoE))


def greedy_tokens(bench: Bench, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = bench.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python: llama.cpp's figures")
    add_step_arguments(parser, prompt_len=256)
    args = parser.parse_args()
    args.dtype = "bfloat16"

    from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    if args.llama_python:
        args.vocab = len(tokenizer)  # the GGUF carries the default model's vocabulary
    print_cpu()
    print(f"gpt-oss-20b shape: hidden {GPT_OSS_20B['hidden_size']}, {args.experts} experts of "
          f"{GPT_OSS_20B['intermediate_size']}, top {GPT_OSS_20B['num_experts_per_tok']}, {args.layers} layers")
    # The bfloat16 checkpoint takes ~1.6 GB per layer at 32 experts: removed when the run ends.
    with tempfile.TemporaryDirectory(prefix="pagellm-mxfp4-") as scratch:
        mxfp4_dir, bf16_dir = checkpoints(Path(scratch), args, tokenizer)
        sizes = {name: sum(f.stat().st_size for f in Path(d).glob("*.safetensors"))
                 for name, d in (("bf16 (the MXFP4 values)", bf16_dir), ("mxfp4 kept", mxfp4_dir))}
        benches = [Bench("bf16 (the MXFP4 values)", bf16_dir, args, load_format="auto"),
                   Bench("mxfp4 kept", mxfp4_dir, args, load_format="auto")]
        if args.llama_python:
            gguf_path = gguf_checkpoint(Path(scratch), bf16_dir)
            sizes["gguf mxfp4"] = Path(gguf_path).stat().st_size
            benches.append(Bench("gguf mxfp4", gguf_path, args, load_format="auto"))
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, args.vocab, (24,), generator=generator).tolist() for _ in range(4)]
        tokens = [greedy_tokens(bench, prompts, 16) for bench in benches]
        results = interleaved_rounds(benches, args)
        print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; step ms (MoE blocks' ms), best of "
              f"{args.repeats} rounds")
        print("| experts | checkpoint MiB | experts MiB | " + " | ".join(workloads(args)) + " |")
        print("|---|---:|---:|" + "---:|" * len(workloads(args)))
        for bench in benches:
            cells = []
            for workload in workloads(args):
                timing = results[(bench.name, workload)]
                cells.append(f"{timing.step * 1e3:.1f} ({timing.mlp * 1e3:.1f})")
            print(f"| {bench.name} | {sizes[bench.name] / 2**20:.0f} | {expert_bytes(bench) / 2**20:.0f} | "
                  + " | ".join(cells) + " |")
        same = sum(a == b for a, b in zip(tokens[0], tokens[1]))
        first = sum(a[0] == b[0] for a, b in zip(tokens[0], tokens[1]))
        print(f"greedy 16 tokens after {len(prompts)} random prompts, bf16 vs mxfp4 kept: {same} identical, first "
              f"token equal in {first}")
        if args.llama_python:
            for bench in benches:
                bench.engine.shutdown()
            benches = []
            llama = llama_cpp_rates(gguf_path, args) or {}
            gguf_step = results[("gguf mxfp4", "decode x1")].step
            print(f"one stream decode tok/s: pagellm (gguf) {1 / gguf_step:.1f} (1 / the decode x1 step), llama.cpp "
                  f"{llama.get('single_tok_s', float('nan')):.1f}; llama.cpp 8 sequences: "
                  f"{llama.get('batched_tok_s') or float('nan'):.1f} tok/s (extra buffer types: "
                  f"{llama.get('extra_buffers')})")
        for bench in benches:
            bench.engine.shutdown()


if __name__ == "__main__":
    main()
