"""Writes hqq_reference.safetensors: small weights quantized by HQQ's own HQQLinear (hqq 0.2.8), the independent
implementation tests/test_hqq.py checks pagellm's reading of HQQ checkpoints and its test packer against.

hqq's quantizer is plain torch on the CPU, but hqq is not a pagellm dependency. Fetch and unpack it (no install),
then run this script from the repository root:

    pip download hqq==0.2.8.post1 termcolor --no-deps -d SOURCES
    tar xzf SOURCES/hqq-0.2.8.post1.tar.gz -C SOURCES && python -m zipfile -e SOURCES/termcolor-*.whl SOURCES/site
    PYTHONPATH=SOURCES/hqq-0.2.8.post1:SOURCES/site python tests/data/make_hqq_reference.py

Per case: the float weight ("<case>.weight" [out, in]), HQQLinear.state_dict() as transformers saves it (each key
after "<case>."), and HQQ's own dequantization of it ("<case>.dequantized").
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

# case -> (shape, nbits, group_size, view_as_float)
CASES = {"b4_g64": ((48, 256), 4, 64, False), "b8_g32": ((16, 128), 8, 32, False),
         "b4_g64_float_view": ((32, 128), 4, 64, True)}


def main() -> None:
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear, Quantizer

    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for case, ((rows, cols), bits, group_size, view_as_float) in CASES.items():
        linear = torch.nn.Linear(cols, rows, bias=False)
        linear.weight.data = torch.randn(rows, cols, generator=generator) * 0.05
        tensors[f"{case}.weight"] = linear.weight.data.clone()
        config = BaseQuantizeConfig(nbits=bits, group_size=group_size, axis=1, view_as_float=view_as_float)
        layer = HQQLinear(linear, config, compute_dtype=torch.float32, device="cpu", initialize=True)
        for key, value in layer.state_dict().items():
            tensors[f"{case}.{key}"] = value
        tensors[f"{case}.dequantized"] = Quantizer.dequantize(layer.W_q, layer.meta).float()
    import hqq

    target = Path(__file__).with_name("hqq_reference.safetensors")
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(target),
              metadata={"made_by": f"tests/data/make_hqq_reference.py (hqq {getattr(hqq, '__version__', '0.2.8')})"})
    print(f"wrote {target} ({target.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
