"""NVFP4 test checkpoints made from a float HF checkpoint by compressed-tensors' own code (0.20, a test dependency):
its NVFP4 observer arithmetic (generate_gparam for the global scale, calculate_qparams for the fp8 group scales) and
its NVFP4PackedCompressor for the packed codes, written as llm-compressor writes NVFP4A16 / NVFP4 checkpoints, and
the same codes and scales renamed as NVIDIA ModelOpt exports them (weight, weight_scale, weight_scale_2 = 1 /
weight_global_scale: compressed-tensors' ModelOptNvfp4Converter is that mapping's other direction). Beside them, a
float checkpoint of compressed-tensors' own dequantization of the codes (in float32), the reference transformers
runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# The tiny models' linear modules llm-compressor's "Linear" target quantizes (the LM head ignored, as its recipes
# do); Qwen3-MoE's experts and attention share the names.
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_GLOBAL_SCALE = 1234.5  # a W4A4 checkpoint's calibrated activation scale: stored, never applied


def scheme(preset: str):
    """compressed-tensors' preset scheme "NVFP4A16" (weights only) or "NVFP4" (W4A4) on every Linear."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(preset, ["Linear"])


def compress(weight: torch.Tensor, preset: str = "NVFP4A16") -> dict[str, torch.Tensor]:
    """One float weight [N, K] as compressed-tensors writes it: weight_packed, weight_scale, weight_global_scale."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    chosen = scheme(preset)
    weight = weight.float()
    global_scale = generate_gparam(weight.min(), weight.max())
    groups = weight.view(weight.shape[0], -1, 16)
    scales, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), chosen.weights, global_scale=global_scale)
    compressor = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    state = {"weight": weight, "weight_scale": scales, "weight_global_scale": global_scale}
    return dict(compressor.compress(state, chosen))


def decompress(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own dequantization of compress's tensors, in float32: its decompress unpacks into
    bfloat16, which would round the weights the test compares."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed = tensors["weight_packed"]
    rows, half = packed.shape
    codes = unpack_fp4_from_uint8(packed, rows, 2 * half, dtype=torch.float32)
    return dequantize(codes, scale=tensors["weight_scale"].float(), args=scheme("NVFP4A16").weights,
                      global_scale=tensors["weight_global_scale"], dtype=torch.float32)


def as_modelopt(tensors: dict[str, torch.Tensor], w4a4: bool) -> dict[str, torch.Tensor]:
    """compress's tensors under ModelOpt's names: the global scale as its reciprocal factor, scalars as scalars."""
    out = {"weight": tensors["weight_packed"], "weight_scale": tensors["weight_scale"],
           "weight_scale_2": (1 / tensors["weight_global_scale"]).reshape(())}
    if w4a4:
        out["input_scale"] = torch.tensor(1 / INPUT_GLOBAL_SCALE)
    return out


def _quantized_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(name.removesuffix(".weight") for name in tensors
                  if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_SUFFIXES)


def compressed_checkpoint(src_dir: str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(module -> compress's tensors, the float checkpoint's tensors with those modules dequantized)."""
    tensors = {}
    for file in sorted(Path(src_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    modules = {module: compress(tensors[f"{module}.weight"]) for module in _quantized_modules(tensors)}
    dequantized = dict(tensors)
    for module, packed in modules.items():
        dequantized[f"{module}.weight"] = decompress(packed)
    return modules, dequantized


def compressed_tensors_config(preset: str, ignore: tuple[str, ...] = ("lm_head",)) -> dict:
    """The quantization_config llm-compressor saves (compressed-tensors' QuantizationConfig serialized)."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": scheme(preset)}, format="nvfp4-pack-quantized",
                                ignore=list(ignore), quantization_status="compressed")
    return config.model_dump(mode="json")


def modelopt_config(algo: str, nested: bool, group_size: int = 16) -> tuple[dict | None, dict | None]:
    """(config.json's quantization_config, hf_quant_config.json's contents) as ModelOpt writes them: flat in the
    former (newer exports) or nested in the latter (older ones)."""
    producer = {"name": "modelopt", "version": "0.29.0"}
    if nested:
        return None, {"producer": producer, "quantization": {
            "quant_algo": algo, "kv_cache_quant_algo": None, "group_size": group_size, "exclude_modules": ["lm_head"]}}
    return {"quant_method": "modelopt", "quant_algo": algo, "group_size": group_size, "ignore": ["lm_head"],
            "kv_cache_scheme": None, "producer": producer}, None


def _copy_beside(src_dir: str, dst_dir: Path, quantization_config: dict | None) -> None:
    dst_dir.mkdir(parents=True, exist_ok=True)
    for file in Path(src_dir).iterdir():
        if file.suffix != ".safetensors" and file.is_file():
            shutil.copy(file, dst_dir / file.name)
    if quantization_config is not None:
        config = json.loads((dst_dir / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (dst_dir / "config.json").write_text(json.dumps(config, indent=2))


def write_checkpoint(src_dir: str, dst_dir: Path, modules: dict[str, dict[str, torch.Tensor]], flavour: str,
                     variant: str, nested: bool = False, ignore: tuple[str, ...] = ("lm_head",)) -> str:
    """The float checkpoint at `src_dir` with `modules` (compressed_checkpoint's) quantized: flavour
    "compressed-tensors" (variant "NVFP4A16" or "NVFP4", `ignore` its config's) or "modelopt" (variant "NVFP4" or
    "W4A16_NVFP4", its config `nested` in hf_quant_config.json or flat)."""
    tensors = {}
    for file in sorted(Path(src_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    w4a4 = variant == "NVFP4"
    for module, packed in modules.items():
        del tensors[f"{module}.weight"]
        if flavour == "modelopt":
            stored = as_modelopt(packed, w4a4)
        else:
            stored = dict(packed)
            if w4a4:
                stored["input_global_scale"] = torch.tensor([INPUT_GLOBAL_SCALE])
        tensors.update({f"{module}.{key}": value for key, value in stored.items()})
    if flavour == "modelopt":
        flat, hf_quant = modelopt_config(variant, nested)
        _copy_beside(src_dir, dst_dir, flat)
        if hf_quant is not None:
            (dst_dir / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
    else:
        _copy_beside(src_dir, dst_dir, compressed_tensors_config(variant, ignore))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst_dir / "model.safetensors"))
    return str(dst_dir)


def write_float(src_dir: str, dst_dir: Path, tensors: dict[str, torch.Tensor]) -> str:
    _copy_beside(src_dir, dst_dir, None)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst_dir / "model.safetensors"))
    return str(dst_dir)
