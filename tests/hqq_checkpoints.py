"""HQQ checkpoints written without hqq, in the layout transformers' save_pretrained gives an HqqConfig model
(HQQLinear.state_dict, hqq 0.2's safetensors encoding), for tests/test_hqq.py and benchmarks/quantized.py;
tests/data/hqq_reference.safetensors (hqq's own output) checks the layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagellm.layers.quantization.hqq import unpack_hqq

LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def encode(value) -> torch.Tensor:
    """hqq's encode_safetensor_type."""
    if isinstance(value, bool):
        return torch.tensor(int(value), dtype=torch.uint8)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int32)
    return torch.tensor([ord(c) for c in value], dtype=torch.uint8)


def quantize_hqq(weight: torch.Tensor, bits: int, group_size: int) -> dict[str, torch.Tensor]:
    """HQQLinear.state_dict()'s tensors for `weight`, rounded to nearest with a zero rounded to an integer (hqq's
    round_zero; its half-quadratic optimization of scale and zero left out: the layout is what is tested)."""
    groups = weight.float().reshape(-1, group_size)
    low, high = groups.min(dim=1, keepdim=True)[0], groups.max(dim=1, keepdim=True)[0]
    inverse = (2**bits - 1) / (high - low)
    zero = torch.round(-low * inverse)
    q = (groups * inverse + zero).round().clamp(0, 2**bits - 1).to(torch.uint8)
    if bits == 4:
        half = len(q) // 2
        q = (q[:half] << 4) | q[half:]
    meta = {"nbits": bits, "group_size": group_size, "axis": 1, "packing": f"{bits}bit_u8",
            "unpack_view_dtype": "torch.uint8", "view_as_float": False, "quant_scale": False, "quant_zero": False,
            "compute_dtype": "torch.float32", "offload_meta": False, "encoded_state_dict": True,
            "stores_quant_config": True, "channel_wise": True, "optimize": False, "round_zero": True}
    return {"W_q": q, "scale": 1.0 / inverse, "zero": zero, "shape": torch.tensor(list(weight.shape)),
            **{key: encode(value) for key, value in meta.items()}}


def write_hqq(float_dir: str, root: Path, bits: int, group_size: int) -> tuple[Path, Path]:
    """An HQQ checkpoint of float_dir's decoder linear layers as transformers saves it, and its dequantized twin."""
    quantized, dense = root / "quantized", root / "dense"
    shutil.copytree(float_dir, quantized)
    shutil.copytree(float_dir, dense)
    tensors = load_file(f"{float_dir}/model.safetensors")
    stored, dequantized = {}, {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or ".layers." not in name or module.rpartition(".")[2] not in LINEAR_MODULES:
            stored[name] = dequantized[name] = tensor
            continue
        parts = quantize_hqq(tensor, bits, group_size)
        q, scale, zero, size = unpack_hqq(name, parts)
        rows, cols = q.shape
        dequantized[name] = ((q.float().view(rows, -1, size) - zero[..., None]) * scale[..., None]).view(rows, cols)
        stored.update({f"{module}.{key}": value for key, value in parts.items()})
    save_file(stored, str(quantized / "model.safetensors"))
    save_file(dequantized, str(dense / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "skip_modules": ["lm_head"], "quant_config": {
        "weight_quant_params": {"nbits": bits, "channel_wise": True, "group_size": group_size, "optimize": True,
                                "round_zero": True, "axis": 1, "view_as_float": False},
        "scale_quant_params": None, "zero_quant_params": None, "offload_meta": False}}
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized, dense
