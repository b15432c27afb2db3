"""bitsandbytes checkpoints written without bitsandbytes, in the layout transformers' save_pretrained gives a
load_in_4bit / load_in_8bit model (bitsandbytes 0.50's QuantState.as_dict(packed=True) and Int8Params), for
tests/test_bitsandbytes.py. The packer follows bitsandbytes' default (torch) backend; tests/data/bnb_reference.
safetensors (bitsandbytes' own output, see tests/data/make_bnb_reference.py) checks it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagellm.layers.quantization.bitsandbytes import BitsAndBytesConfig
from pagellm.layers.quantization.gguf import GGUFWeight
from pagellm.models.gguf_quants import BNB_FP4_CODES, NF4_CODES

CODE_BOOKS = {"nf4": torch.from_numpy(NF4_CODES), "fp4": torch.from_numpy(BNB_FP4_CODES)}
# The nn.Linear modules transformers' bitsandbytes integration converts in the tiny models: attention, MLPs, each
# expert's projections (Qwen3-MoE's *_proj, Mixtral's w1 / w2 / w3) and the routers ("gate").
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
                  "gate")
NESTED_BLOCKSIZE = 256


def _blockwise(values: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' blockwise quantization: each block scaled by its max |v| into [-1, 1], each value the code
    entry nearest it (midpoints of the sorted code); (codes uint8, absmax float32)."""
    flat = values.reshape(-1).float()
    blocks = -(-flat.numel() // blocksize)
    padded = torch.nn.functional.pad(flat, (0, blocks * blocksize - flat.numel())).view(blocks, blocksize)
    absmax = padded.abs().amax(dim=1)
    scaled = torch.clamp(padded * (1.0 / absmax.clamp(min=1e-38))[:, None], -1, 1).reshape(-1)[: flat.numel()]
    order = torch.argsort(code)
    midpoints = (code[order[:-1]] + code[order[1:]]) / 2
    codes = order[torch.bucketize(scaled, midpoints)].to(torch.uint8)
    return codes, absmax


def quantize_4bit(weight: torch.Tensor, quant_type: str = "nf4", blocksize: int = 64,
                  nested_quant_map: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A weight's tensors as a 4-bit checkpoint stores them, keyed by what follows "<module>." ("weight",
    "weight.absmax", ...); double quantization where `nested_quant_map` (bitsandbytes' 256-entry dynamic map) is
    given."""
    code = CODE_BOOKS[quant_type]
    codes, absmax = _blockwise(weight, code, blocksize)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    packed = ((codes[::2] << 4) | codes[1::2]).unsqueeze(1)
    state = {"quant_type": quant_type, "blocksize": blocksize, "dtype": "float32", "shape": list(weight.shape)}
    tensors = {"weight": packed, "weight.quant_map": code.clone()}
    if nested_quant_map is None:
        tensors["weight.absmax"] = absmax
    else:
        offset = absmax.mean()
        nested_codes, nested_absmax = _blockwise(absmax - offset, nested_quant_map, NESTED_BLOCKSIZE)
        tensors.update({"weight.absmax": nested_codes, "weight.nested_absmax": nested_absmax,
                        "weight.nested_quant_map": nested_quant_map.clone()})
        state.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype="float32", nested_offset=offset.item())
    tensors[f"weight.quant_state.bitsandbytes__{quant_type}"] = torch.tensor(list(json.dumps(state).encode()),
                                                                              dtype=torch.uint8)
    return tensors


def dequantize_4bit(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """bitsandbytes' dequantize_4bit of quantize_4bit's tensors (float32, the weight's shape)."""
    (state_key,) = [key for key in tensors if ".quant_state." in key]
    state = json.loads(bytes(tensors[state_key].tolist()))
    absmax = tensors["weight.absmax"]
    if "nested_blocksize" in state:
        blocks = torch.arange(absmax.numel()) // state["nested_blocksize"]
        absmax = tensors["weight.nested_quant_map"][absmax.long()] * tensors["weight.nested_absmax"][blocks]
        absmax = absmax + state["nested_offset"]
    packed = tensors["weight"].flatten()
    n = torch.Size(state["shape"]).numel()
    codes = torch.stack([packed >> 4, packed & 15], dim=1).flatten()[:n].long()
    scales = absmax.float().repeat_interleave(state["blocksize"])[:n]
    return (tensors["weight.quant_map"][codes] * scales).view(state["shape"])


def quantize_8bit(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """LLM.int8's row-wise int8 (bitsandbytes' int8_vectorwise_quant: q = round(w * 127 / max|row|)) as a checkpoint
    stores it."""
    absmax = weight.float().abs().amax(dim=1)
    q = torch.round(weight.float() * (127 / absmax)[:, None]).to(torch.int8)
    return {"weight": q, "SCB": absmax, "weight_format": torch.tensor(0, dtype=torch.uint8)}


def write_bnb(float_dir: str | Path, out_dir: str | Path, bits: int, quant_type: str = "nf4", blocksize: int = 64,
              nested_quant_map: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """float_dir's checkpoint with its decoder layers' linear weights as bitsandbytes stores them (embedding and
    LM head float, as transformers leaves them), config.json's quantization_config as transformers writes it.
    Returns the dequantized weights of the quantized modules, by checkpoint name."""
    out_dir = Path(out_dir)
    shutil.copytree(float_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    stored, dequantized = {}, {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or ".layers." not in module or module.rpartition(".")[2] not in LINEAR_MODULES:
            stored[name] = tensor
            continue
        if bits == 4:
            parts = quantize_4bit(tensor, quant_type, blocksize, nested_quant_map)
            dequantized[name] = dequantize_4bit(parts)
        else:
            parts = quantize_8bit(tensor)
            dequantized[name] = parts["weight"].float() * (parts["SCB"] / 127)[:, None]
        stored.update({f"{module}.{key}": value for key, value in parts.items()})
    save_file(stored, str(out_dir / "model.safetensors"))
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes", "load_in_4bit": bits == 4, "load_in_8bit": bits == 8,
        "_load_in_4bit": bits == 4, "_load_in_8bit": bits == 8, "bnb_4bit_quant_type": quant_type,
        "bnb_4bit_use_double_quant": nested_quant_map is not None, "bnb_4bit_compute_dtype": "float32",
        "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": None, "llm_int8_threshold": 6.0,
        "llm_int8_has_fp16_weight": False, "llm_int8_enable_fp32_cpu_offload": False}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized


def write_float(float_dir: str | Path, out_dir: str | Path, weights: dict[str, torch.Tensor]) -> None:
    """float_dir's checkpoint with `weights` (by checkpoint name) in place of its own."""
    out_dir = Path(out_dir)
    shutil.copytree(float_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    save_file({**tensors, **weights}, str(out_dir / "model.safetensors"))


def kept_weights(quantized_dir: Path) -> dict[str, torch.Tensor]:
    """The float weights of a 4-bit checkpoint's quantized modules as the model holds them: the kernels' blocks,
    and a router (built unquantized) as bitsandbytes dequantizes it."""
    config = BitsAndBytesConfig(4)
    tensors = load_file(str(quantized_dir / "model.safetensors"))
    config.served.update(name.removesuffix(".weight") for name in tensors
                         if name.endswith(".weight") and not name.endswith(".gate.weight"))
    return {name: value.dequantize(torch.float32) if isinstance(value, GGUFWeight) else value
            for name, value in config.checkpoint_tensors(iter(tensors.items())) if name in _quantized(tensors)}


def _quantized(tensors: dict[str, torch.Tensor]) -> set[str]:
    return {name.partition(".quant_state.")[0] for name in tensors if ".quant_state." in name}
