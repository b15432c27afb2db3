"""Write a random-weight Llama of SmolLM2-135M's size whose heads split 2 and 4 ways, for TP benchmarks.

SmolLM2-135M has 9 query and 3 KV heads, so it splits only 3 ways; this model keeps its depth (30 layers),
MLP (1536), vocabulary (49152, tied) and head size (64), with 8 query and 4 KV heads (hidden 512): the
same work per token within 10%, split evenly by 1, 2 or 4 ranks. Throughput with EOS ignored does not
depend on the weights' values.

    .venv/bin/python benchmarks/tp_model.py /tmp/tp-llama
    .venv/bin/python benchmarks/throughput.py --model /tmp/tp-llama --dtype float32 -tp 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
             tie_word_embeddings=True)


def write(out: Path, seed: int = 0) -> None:
    import torch
    import transformers

    from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, **SHAPE)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory to write (created)")
    args = parser.parse_args(argv)
    write(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
