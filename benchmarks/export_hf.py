"""Write a GGUF model (the default SmolLM2 by default) as a transformers directory other engines can load.

Other engines (vLLM, transformers itself) read HF directories, not this package's GGUF file. The weights
are the dequantized float32 tensors pagellm itself runs, so every engine compared runs the same numbers.

    .venv/bin/python benchmarks/export_hf.py /tmp/smollm2-hf            # the default model
    .venv/bin/python benchmarks/export_hf.py OUT --gguf path/to/model.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def export(gguf_path: Path, out: Path, with_tokenizer: bool = True) -> None:
    import torch
    import transformers

    from pagellm.models.gguf_loader import load_gguf, load_gguf_tokenizer

    config, tensors = load_gguf(gguf_path)
    config.dtype = torch.float32
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config.to_transformers(), dtype=torch.float32)
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{gguf_path} left {len(missing)} parameters unset, e.g. {missing[:3]}")
    model.save_pretrained(out)
    if with_tokenizer:
        load_gguf_tokenizer(gguf_path).save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory to write (created)")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    from pagellm.models.gguf_loader import default_model_path

    export(args.gguf or default_model_path(), args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
