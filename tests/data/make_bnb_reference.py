"""Writes bnb_reference.safetensors: small weights quantized and dequantized by bitsandbytes' own code, the
independent implementation tests/test_bitsandbytes.py checks pagellm's reading of bitsandbytes checkpoints and its
test packer against.

bitsandbytes runs on the CPU but is not a pagellm dependency. Fetch and unpack it (no install), then run this
script from the repository root:

    pip download bitsandbytes==0.50.2 --no-deps -d SOURCES
    python -m zipfile -e SOURCES/bitsandbytes-0.50.2-*.whl SOURCES/bnb
    PYTHONPATH=SOURCES/bnb python tests/data/make_bnb_reference.py

Per 4-bit case: the float weight ("<case>.weight", [out, in]), what bitsandbytes.functional.quantize_4bit made of
it as a checkpoint stores it (QuantState.as_dict(packed=True), each key after "<case>.weight.", the codes as
"<case>.weight.codes"), and its dequantize_4bit of those ("<case>.dequantized"). Per 8-bit case: the weight,
int8_vectorwise_quant's int8 rows and row absmax ("<case>.CB", "<case>.SCB", what Int8Params saves as weight and
SCB) and int8_vectorwise_dequant's weight.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

# case -> (shape, quant_type, blocksize, double quantization). nf4_b64_dq's 288 blocks take two nested blocks of 256;
# nf4_b64_rows72 has rows of 72 and blocks across rows.
CASES_4BIT = {
    "nf4_b64_dq": ((18, 1024), "nf4", 64, True),
    "nf4_b128": ((8, 384), "nf4", 128, False),
    "fp4_b64_dq": ((16, 256), "fp4", 64, True),
    "fp4_b256": ((8, 512), "fp4", 256, False),
    "nf4_b64_rows72": ((20, 72), "nf4", 64, True),
}
CASES_8BIT = {"int8_rows": (12, 160)}


def main() -> None:
    import bitsandbytes
    import bitsandbytes.functional as F

    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for case, (shape, quant_type, blocksize, double) in CASES_4BIT.items():
        weight = torch.randn(shape, generator=generator) * 0.05
        codes, state = F.quantize_4bit(weight, blocksize=blocksize, quant_type=quant_type,
                                       compress_statistics=double)
        tensors[f"{case}.weight"] = weight
        tensors[f"{case}.weight.codes"] = codes
        for key, value in state.as_dict(packed=True).items():
            tensors[f"{case}.weight.{key}"] = value
        tensors[f"{case}.dequantized"] = F.dequantize_4bit(codes, state).float()
    for case, shape in CASES_8BIT.items():
        weight = torch.randn(shape, generator=generator) * 0.05
        rows, absmax, _ = F.int8_vectorwise_quant(weight.half())
        tensors[f"{case}.weight"] = weight
        tensors[f"{case}.CB"] = rows
        tensors[f"{case}.SCB"] = absmax
        tensors[f"{case}.dequantized"] = F.int8_vectorwise_dequant(rows, absmax).float()
    target = Path(__file__).with_name("bnb_reference.safetensors")
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(target),
              metadata={"made_by": f"tests/data/make_bnb_reference.py (bitsandbytes {bitsandbytes.__version__})"})
    print(f"wrote {target} ({target.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
