"""gpt-oss checkpoints with their experts in MXFP4, as the released ones store them, written from a float
checkpoint (the tests' and benchmarks/mxfp4_moe.py's): each stacked expert tensor `...experts.gate_up_proj` /
`down_proj` ([E, in, out]) becomes `_blocks` [E, out, in / 32, 16] (two e2m1 codes a byte, value 2i in byte i's
low nibble) and `_scales` [E, out, in / 32] (e8m0: the exponent + 127), and config.json gets the
quantization_config transformers writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# e2m1's magnitudes, codes 0-7 (codes 8-15 are their negatives).
FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
EXPERT_TENSORS = ("experts.gate_up_proj", "experts.down_proj")
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (blocks [..., K / 32, 16], scales [..., K / 32]): each group of 32 scaled by the power of
    two that brings its largest magnitude within e2m1's 6, each value to its nearest code (ties to the smaller
    magnitude)."""
    groups = weight.float().contiguous().reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    midpoints = (FP4_MAGNITUDES[1:] + FP4_MAGNITUDES[:-1]) / 2
    codes = torch.bucketize(scaled.abs(), midpoints) | ((scaled < 0).long() << 3)
    pairs = codes.reshape(*codes.shape[:-1], 16, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8), (exponent + 127).to(torch.uint8)


def write_mxfp4(float_dir: str | Path, out: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """`float_dir`'s checkpoint in `out` with its experts in MXFP4; returns the expert tensors those blocks hold
    (in `dtype`, the float checkpoint's names and [E, in, out] layout), as transformers dequantizes them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(float_dir, out, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    tensors, dequantized = {}, {}
    for name, tensor in load_file(str(Path(float_dir) / "model.safetensors")).items():
        if not name.endswith(EXPERT_TENSORS):
            tensors[name] = tensor
            continue
        stored = [quantize_mxfp4(expert.t()) for expert in tensor]  # each expert [out, in], one at a time
        blocks, scales = torch.stack([b for b, _ in stored]), torch.stack([s for _, s in stored])
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(config))
    return dequantized
