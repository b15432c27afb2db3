"""A Llama-architecture GGUF of a larger shape than any file this machine has, for memory figures at scale.

The blocks are random bytes with a fixed, finite scale in every block (so every weight is a small finite number),
the norms ones; the tokenizer and its metadata are the default model's (SmolLM2's 49,152 tokens), so that LLM()
loads the file as it would a real one. The text it generates is noise: the file is for RSS and load figures, where
what counts is the bytes per tensor type, not the values.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/synthetic_gguf.py /tmp/llama-1b-q4_1.gguf
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# Llama 3.2 1B's layer shapes (with the default model's vocabulary, and its embedding tied to the LM head).
LLAMA_1B = LlamaShape(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8)
# Q4_1's block: 32 weights as an fp16 scale d, an fp16 minimum m and 16 bytes of 4-bit codes (weight = d * q + m).
BLOCK_WEIGHTS, BLOCK_BYTES = 32, 20
SCALE, MINIMUM = np.float16(0.004), np.float16(-0.03)


def random_q4_1(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] of Q4_1 blocks: random codes, every block's d and m set to finite constants."""
    blocks = rng.integers(0, 256, size=(rows * cols // BLOCK_WEIGHTS, BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(SCALE.tobytes(), dtype=np.uint8)
    blocks[:, 2:4] = np.frombuffer(MINIMUM.tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, cols // BLOCK_WEIGHTS * BLOCK_BYTES)


def _copy_tokenizer(reader, writer) -> None:
    import gguf

    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type)


def write_synthetic_gguf(path: Path, shape: LlamaShape = LLAMA_1B, seed: int = 0) -> Path:
    """Writes the file once (kept where it is on later calls); returns its path."""
    import gguf

    from pagellm.models.gguf_loader import default_model_path

    if path.is_file():
        return path
    source = gguf.GGUFReader(str(default_model_path()))
    vocab_size = len(source.fields["tokenizer.ggml.tokens"].data)
    partial = path.with_name(f".{path.name}.partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(vocab_size)
    _copy_tokenizer(source, writer)

    rng = np.random.default_rng(seed)
    hidden, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    writer.add_tensor("token_embd.weight", random_q4_1(vocab_size, hidden, rng), raw_dtype=q4_1)
    for layer in range(shape.num_layers):
        for stem, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", shape.intermediate_size, hidden),
                                 ("ffn_up", shape.intermediate_size, hidden),
                                 ("ffn_down", hidden, shape.intermediate_size)):
            writer.add_tensor(f"blk.{layer}.{stem}.weight", random_q4_1(rows, cols, rng), raw_dtype=q4_1)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    args = parser.parse_args()
    path = write_synthetic_gguf(args.path)
    print(f"{path}: {path.stat().st_size / 2**20:,.0f} MiB")


if __name__ == "__main__":
    main()
