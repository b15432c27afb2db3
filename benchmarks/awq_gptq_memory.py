"""Weight memory of AWQ/GPTQ checkpoints against the same model in float32, as pagellm holds them.

Makes a random Llama (default: hidden 1024, MLP 2816, 4 layers, the default model's 49,152-token vocabulary),
writes it as a float32 checkpoint and quantized as AWQ (4-bit) and GPTQ (4-bit act-order, 8-bit) with
tests/quant_checkpoints.py, loads each with LLM() on the CPU and prints: the checkpoint's size on disk, the
engine's weight bytes (parameters and the kernels' layouts, what the start-up log reports), the part of it the
decoder layers' linear products hold, and what they would take in float32 / float16.

    PYTHONPATH=$PWD python benchmarks/awq_gptq_memory.py
    PYTHONPATH=$PWD python benchmarks/awq_gptq_memory.py --hidden 128 --intermediate 256 --layers 3   # the tests' model
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from pagellm import LLM
from pagellm.cpu_features import cpu_description
from pagellm.layers.linear import LinearBase
from tests.quant_checkpoints import QuantSpec, write_quantized

MiB = 2**20
SPECS = {
    "awq 4-bit g128": QuantSpec("awq", group_size=128),
    "gptq 4-bit g128 act-order": QuantSpec("gptq", bits=4, group_size=128, desc_act=True),
    "gptq 8-bit g128": QuantSpec("gptq", bits=8, group_size=128, sym=False),
}


def save_random_llama(path: Path, hidden: int, intermediate: int, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         tie_word_embeddings=False, max_position_embeddings=512, initializer_range=0.3)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)


def linear_bytes(llm: LLM) -> tuple[int, int]:
    """(bytes the decoder layers' linear products hold, their weights' element count)."""
    held, elements = 0, 0
    for name, module in llm.llm_engine.core.runner.model.named_modules():
        if isinstance(module, LinearBase) and ".layers." in name:
            tensors = list(module.parameters(recurse=False)) + module.quant_method.kernel_tensors(module)
            held += sum(tensor.numel() * tensor.element_size() for tensor in tensors)
            elements += module.input_size * module.output_size
    return held, elements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}; random Llama hidden {args.hidden}, MLP {args.intermediate}, {args.layers} "
          "layers, float32 activations")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        save_random_llama(root / "float", args.hidden, args.intermediate, args.layers)
        models = {"float32": root / "float"}
        for name, spec in SPECS.items():
            directory = root / name.replace(" ", "_")
            write_quantized(root / "float", directory, root / (directory.name + "_dequantized"), spec)
            models[name] = directory
        print(f"{'checkpoint':<28} {'on disk':>9} {'weights':>9} {'linear layers':>14} {'bits/weight':>12}")
        for name, directory in models.items():
            disk = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
            llm = LLM(str(directory), dtype="float32", kv_cache_memory_bytes=8 * MiB)
            held, elements = linear_bytes(llm)
            total = llm.llm_engine.core.startup.weights_bytes
            print(f"{name:<28} {disk / MiB:>8.1f}M {total / MiB:>8.1f}M {held / MiB:>13.1f}M "
                  f"{8 * held / elements:>12.2f}")
            llm.llm_engine.shutdown()
            del llm
        print(f"(float32 linear layers as plain weights: {32:.2f} bits/weight; float16: 16.00)")


if __name__ == "__main__":
    main()
