"""Mixture-of-experts models in the quantized formats, on the CPU: the experts' memory and a step's time per
format against the same model's bfloat16 experts.

A Qwen3-30B-A3B-shaped model scaled down as benchmarks/moe.py scales it (hidden 1024, `--experts` experts of 384
features, 8 per token, 16 query / 2 KV heads of 64, `--layers` layers), with random weights written as a
bfloat16 checkpoint, then in each format by the test suite's reference quantizers (tests/quant_checkpoints.py,
tests/w8a8_checkpoints.py: the formats' documented layouts): GPTQ and AWQ 4-bit in groups of 128,
compressed-tensors int8 W8A8 per channel, fp8 with DeepSeek-V3's 128 x 128 blocks, online int8 / fp8 of the
bfloat16 checkpoint, vLLM's experts_int8 (the experts alone, int8 weights per channel, bf16 activations) and
llm-compressor's NVFP4A16 (tests/nvfp4_checkpoints.py, compressed-tensors' own NVFP4 code).
bfloat16 runs its experts on the fused native kernel (ops/cpu_moe.py); every quantized format runs each expert as
two linear layers of its format (ExpertLinearsMoEMethod): one product per used expert, or one C call for all of a
decode step's experts (wna16_matmul_experts for the group-quantized formats, w8a8_int8_linear_experts /
w8a8_fp8_linear_experts for int8 W8A8 and fp8; NVFP4's experts, on the GGUF kernels, one product per used
expert).

Every engine is loaded first, then the rounds run them interleaved (`--repeats`, best kept): one decode step of
`--batch` sequences (median of `--steps`), and the prefill step of one `--prompt-len`-token prompt; the time inside
the MoE blocks (router, grouping and experts) beside the whole step.

    PYTHONPATH=$PWD python benchmarks/moe_quantized.py
    PYTHONPATH=$PWD python benchmarks/moe_quantized.py --experts 128 --layers 2 --batch 1 8 32
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

from benchmarks.moe import SHAPES, Bench, add_step_arguments, configs, interleaved_rounds, print_cpu, workloads

# name -> how its checkpoint is made from the bfloat16 one, and what LLM() is given
FORMATS = ("bf16", "gptq-4bit-g128", "awq-4bit-g128", "int8 W8A8 (c-t)", "fp8 block 128 (DeepSeek-V3)",
           "int8 online", "fp8 online", "experts_int8", "nvfp4 (c-t)")


def float_checkpoint(root: Path, args, tokenizer) -> str:
    from transformers import Qwen3MoeForCausalLM

    config, _ = configs("qwen3-30b-a3b", args.layers, args.vocab, tokenizer)
    config.num_experts = args.experts
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    path = root / "bf16"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def format_checkpoint(fmt: str, float_dir: str, root: Path) -> tuple[str, dict]:
    """(checkpoint directory, LLM arguments) of format `fmt`."""
    from tests.quant_checkpoints import QuantSpec, write_quantized
    from tests.w8a8_checkpoints import write_quantized as write_8bit

    if fmt in ("bf16", "int8 online", "fp8 online", "experts_int8"):
        return float_dir, {} if fmt == "bf16" else {"quantization": fmt.split()[0]}
    out = root / fmt.split()[0]
    if fmt.startswith(("gptq", "awq")):
        spec = QuantSpec(fmt.split("-")[0], bits=4, group_size=128)
        write_quantized(float_dir, out / "quantized", out / "dequantized", spec)
        return str(out / "quantized"), {}
    if fmt.startswith("int8"):
        return write_8bit(float_dir, out, "int8-channel-dynamic")[0], {}
    if fmt.startswith("nvfp4"):
        from tests.nvfp4_checkpoints import compressed_checkpoint, write_checkpoint

        modules, _ = compressed_checkpoint(float_dir)
        return write_checkpoint(float_dir, out / "quantized", modules, "compressed-tensors", "NVFP4A16"), {}
    return write_8bit(float_dir, out, "fp8-block-128", fmt="fp8")[0], {}


def expert_bytes(bench: Bench) -> int:
    from pagellm.layers.fused_moe import FusedMoE
    from pagellm.layers.weights import weights_bytes

    return sum(weights_bytes(m) for m in bench.engine.core.runner.model.modules() if isinstance(m, FusedMoE))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    add_step_arguments(parser, prompt_len=256)
    args = parser.parse_args()
    args.dtype = "bfloat16"

    from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    print_cpu()
    shape = SHAPES["qwen3-30b-a3b"]
    print(f"Qwen3-MoE shape: hidden {shape['hidden_size']}, {args.experts} experts of "
          f"{shape['moe_intermediate_size']}, top {shape['num_experts_per_tok']}, {args.layers} layers")
    # The checkpoints take GBs at 128 experts: removed when the run ends.
    with tempfile.TemporaryDirectory(prefix="pagellm-moe-quant-") as scratch:
        root = Path(scratch)
        float_dir = float_checkpoint(root, args, tokenizer)
        benches = []
        for fmt in args.formats:
            path, engine_args = format_checkpoint(fmt, float_dir, root)
            benches.append(Bench(fmt, path, args, load_format="auto", **engine_args))
        results = interleaved_rounds(benches, args)
        print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; step ms (MoE blocks' ms), best of "
              f"{args.repeats} rounds")
        print("| format | experts MiB | " + " | ".join(workloads(args)) + " |")
        print("|---|---:|" + "---:|" * len(workloads(args)))
        for bench in benches:
            cells = []
            for workload in workloads(args):
                timing = results[(bench.name, workload)]
                cells.append(f"{timing.step * 1e3:.2f} ({timing.mlp * 1e3:.2f})")
            print(f"| {bench.name} | {expert_bytes(bench) / 2**20:.1f} | " + " | ".join(cells) + " |")
        for bench in benches:
            bench.engine.shutdown()


if __name__ == "__main__":
    main()
