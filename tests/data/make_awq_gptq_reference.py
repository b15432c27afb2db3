"""Writes awq_gptq_reference.safetensors: small layers packed and dequantized by AutoAWQ's and AutoGPTQ's own code,
the independent implementations tests/test_awq_gptq.py checks pagellm's test packers and its unpacking against.

Neither package installs without CUDA, but their packing and reference dequantization are plain torch. Fetch and
unpack them (no install), then run this script from the repository root:

    pip download autoawq==0.2.9 auto-gptq==0.7.1 --no-deps -d SOURCES
    tar xzf SOURCES/autoawq-0.2.9.tar.gz -C SOURCES && unzip -q SOURCES/auto_gptq-0.7.1-*.whl -d SOURCES/gptq
    python tests/data/make_awq_gptq_reference.py SOURCES

Per case, the file holds the float weight the case starts from ("<case>.weight", [out, in]); the g_idx given to
the packer; what AutoAWQ's WQLinear_GEMM.from_linear or AutoGPTQ's QuantLinear.pack (qlinear_cuda) made of the
weight our quantizer (tests/quant_checkpoints.py) rounds it to: qweight, qzeros, scales; and what their own
dequantization gives for those tensors ("<case>.dequantized", [in, out] float32): AutoAWQ's dequantize_gemm,
AutoGPTQ's QuantLinear.forward on the identity (its torch path).
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.quant_checkpoints import QuantSpec, quantize_awq, quantize_gptq  # noqa: E402

OUT_FEATURES, IN_FEATURES = 32, 64
CASES = {
    "awq_g32": QuantSpec("awq", group_size=32),
    "gptq4_sym_desc_act_g16": QuantSpec("gptq", bits=4, group_size=16, sym=True, desc_act=True),
    "gptq4_asym_desc_act_g16": QuantSpec("gptq", bits=4, group_size=16, sym=False, desc_act=True),
    "gptq8_asym_g32": QuantSpec("gptq", bits=8, group_size=32, sym=False),
}


def _package(name: str, path: Path) -> None:
    """Make `name` importable from `path` without running its __init__ (which imports the whole library)."""
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    sys.modules[name] = module


def load_references(sources: Path):
    import transformers.pytorch_utils  # noqa: F401  (AutoGPTQ's packer reads it)

    _package("awq", sources / "autoawq-0.2.9" / "awq")
    for name, sub in (("auto_gptq", ""), ("auto_gptq.nn_modules", "nn_modules"),
                      ("auto_gptq.nn_modules.qlinear", "nn_modules/qlinear")):
        _package(name, sources / "gptq" / "auto_gptq" / sub)
    gptq_linear = importlib.import_module("auto_gptq.nn_modules.qlinear.qlinear_cuda").QuantLinear
    # awq.utils.utils imports accelerate, which the packing never uses.
    sys.modules["accelerate"] = types.ModuleType("accelerate")
    try:
        awq_gemm = importlib.import_module("awq.modules.linear.gemm").WQLinear_GEMM
    finally:
        del sys.modules["accelerate"]
    dequantize_gemm = importlib.import_module("awq.utils.packing_utils").dequantize_gemm
    return awq_gemm, dequantize_gemm, gptq_linear


def main(sources: Path) -> None:
    awq_gemm, dequantize_gemm, gptq_linear = load_references(sources)
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for case, spec in CASES.items():
        weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator) * 0.3
        linear = torch.nn.Linear(IN_FEATURES, OUT_FEATURES, bias=False)
        tensors[f"{case}.weight"] = weight
        if spec.method == "awq":
            q, scales, zeros = quantize_awq(weight, spec.group_size)
            groups = torch.arange(IN_FEATURES) // spec.group_size
            g_idx = groups.to(torch.int32)
            # The packer divides (w + zero * scale) by the float16 scale: fed the dequantized weight it recovers q.
            linear.weight.data = ((q - zeros.t()[:, groups]) * scales.t()[:, groups].float()).float()
            packed = awq_gemm.from_linear(linear, 4, spec.group_size, scales=scales.float(), zeros=zeros)
            dequantized = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales.float(), 4, spec.group_size)
        else:
            perm = torch.randperm(IN_FEATURES, generator=generator) if spec.desc_act else None
            q, scales, zeros, g_idx = quantize_gptq(weight, spec, perm)
            groups = g_idx.long()
            linear.weight.data = ((q - zeros.t()[:, groups]) * scales.t()[:, groups].float()).float()
            packed = gptq_linear(spec.bits, spec.group_size, IN_FEATURES, OUT_FEATURES, bias=False)
            packed.pack(linear, scales.t().float(), zeros.t().clone(), g_idx)
            # Its torch path in float32 (scales kept exact), on the identity: the rows of W^T.
            packed.scales = packed.scales.float()
            dequantized = packed(torch.eye(IN_FEATURES))
        tensors[f"{case}.g_idx"] = g_idx.to(torch.int32)
        tensors[f"{case}.qweight"] = packed.qweight
        tensors[f"{case}.qzeros"] = packed.qzeros
        tensors[f"{case}.scales"] = packed.scales.half()
        tensors[f"{case}.dequantized"] = dequantized.float().contiguous()
    target = Path(__file__).with_name("awq_gptq_reference.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target),
              metadata={"made_by": "tests/data/make_awq_gptq_reference.py (autoawq 0.2.9, auto-gptq 0.7.1)"})
    print(f"wrote {target}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]))
