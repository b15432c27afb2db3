"""Quantized test checkpoints made from a float HF checkpoint by a reference quantizer written here, in the
layouts the formats document, each beside a float checkpoint of its dequantized weights (the oracle).

compressed-tensors (compressed_tensors.quantization, 0.20): per quantized module `weight` (int8 or
float8_e4m3fn), `weight_scale` ([N, 1] per channel, [1] per tensor, [N / bn, K / bk] per block) and, with static
activations, `input_scale` [1]; the scale of symmetric int8 is max|w| / 127.5 (calculate_qparams: the range 255
over 2) and values are round(clamp(w / scale, -128, 127)); fp8 is clamp(w / scale, +-448) cast to e4m3 with scale
max|w| / 448. quant_method "fp8" (vLLM's Fp8Config): per-tensor `weight_scale` scalar, block-wise
`weight_scale_inv`, and `input_scale` scalars for activation_scheme "static". Static input scales come from the
largest |input| each layer sees on a few calibration prompts (the min-max observer's).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers import PROMPTS as CALIBRATION

# Mixtral's experts name gate, down and up w1, w2 and w3; the rest are multi-head latent attention's (DeepSeek).
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
                   "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
FP8_MAX = 448.0


def _args(kind: str, strategy: str, dynamic: bool = False, block=None) -> dict:
    return {"num_bits": 8, "type": kind, "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": block, "dynamic": dynamic, "actorder": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}}


# name -> (weight type, weight strategy, block [bn, bk] or None, activations: None, "dynamic" or "static")
SCHEMES = {
    "int8-channel-dynamic": ("int", "channel", None, "dynamic"),
    "int8-tensor-static": ("int", "tensor", None, "static"),
    "int8-channel-static": ("int", "channel", None, "static"),
    "fp8-channel-dynamic": ("float", "channel", None, "dynamic"),
    "fp8-tensor-static": ("float", "tensor", None, "static"),
    "fp8-block-dynamic": ("float", "block", (32, 64), "dynamic"),
    "fp8-block-128": ("float", "block", (128, 128), "dynamic"),  # DeepSeek-V3's blocks (benchmarks)
    "fp8-block-32x16": ("float", "block", (32, 16), "dynamic"),  # tiny DeepSeek-V3: some outputs end mid-block
    "fp8-tensor-w8a16": ("float", "tensor", None, None),
}


def compressed_tensors_config(scheme: str, ignore=("lm_head",)) -> dict:
    kind, strategy, block, activations = SCHEMES[scheme]
    fmt = "int-quantized" if kind == "int" else "float-quantized"
    if activations is None:
        fmt = "naive-quantized"
        input_args = None
    elif activations == "dynamic":
        input_args = _args(kind, "token" if block is None else "group", dynamic=True)
        if block is not None:
            input_args["group_size"] = block[1]
    else:
        input_args = _args(kind, "tensor")
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": _args(kind, strategy, block=list(block) if block else None),
                                      "input_activations": input_args, "output_activations": None, "format": fmt}},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
        "version": "0.20.1",
    }


def quantize_int8(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' symmetric int8: (q, scale [N, 1] or [1])."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = torch.where(amax > 0, amax / 127.5, torch.ones_like(amax))
    q = (w / (scale if strategy == "channel" else scale[0])).clamp(-128, 127).round().to(torch.int8)
    return q, scale


def quantize_fp8(weight: torch.Tensor, strategy: str, block=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, scale [1], [N, 1] or [ceil(N / bn), ceil(K / bk)]: the last blocks partial, as
    DeepSeek-V3's kv_a_proj_with_mqa has 576 outputs in blocks of 128)."""
    w = weight.float()
    if strategy == "block":
        bn, bk = block
        n, k = w.shape
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.zeros(rows * bn, cols * bk)
        padded[:n, :k] = w
        tiles = padded.reshape(rows, bn, cols, bk)
        amax = tiles.abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(rows * bn, cols * bk)[:n, :k]
        return q.to(torch.float8_e4m3fn), scale
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / (scale if strategy == "channel" else scale[0])).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block=None) -> torch.Tensor:
    if block is not None:
        bn, bk = block
        n, k = q.shape
        return q.float() * scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * (scale if scale.dim() == 2 else scale[0])


def input_amax(model_dir: str) -> dict[str, float]:
    """The largest |input| of each linear module over the calibration prompts (float32 HF model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    amax: dict[str, float] = {}

    def hook(name):
        def record(module, inputs, output):
            amax[name] = max(amax.get(name, 0.0), float(inputs[0].abs().max()))
        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in model.named_modules()
               if name.split(".")[-1] in LINEAR_SUFFIXES]
    with torch.no_grad():
        for prompt in CALIBRATION:
            model(**tokenizer(prompt, return_tensors="pt"))
    for handle in handles:
        handle.remove()
    return amax


def _ignored(module: str, ignore: tuple[str, ...]) -> bool:
    return any(re.match(entry[3:], module) if entry.startswith("re:") else entry == module for entry in ignore)


def _copy_side_files(src: Path, dst: Path, config_update: dict) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json" and item.is_file():
            shutil.copy(item, dst / item.name)
    config = json.loads((src / "config.json").read_text())
    config.update(config_update)
    if not config_update:
        config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def _quark_spec(kind: str, qscheme: str, dynamic: bool, ch_axis: int | None) -> dict:
    return {"dtype": "int8" if kind == "int" else "fp8_e4m3", "is_dynamic": dynamic, "qscheme": qscheme,
            "ch_axis": ch_axis, "group_size": None, "symmetric": True, "round_method": "half_even",
            "scale_type": "float", "observer_cls": "PerChannelMinMaxObserver" if qscheme == "per_channel" else
            "PerTensorMinMaxObserver"}


def quark_config(scheme: str, ignore: tuple[str, ...], kv_scales: bool) -> dict:
    """AMD Quark's quantization_config for a W8A8 `scheme` (as quark.torch's export_safetensors writes it), its KV
    cache's per-tensor fp8 scales on k_proj / v_proj's outputs with `kv_scales`."""
    kind, strategy, block, activations = SCHEMES[scheme]
    assert block is None and activations is not None, "Quark's W8A8 schemes: per-tensor / per-channel weights"
    weight = _quark_spec(kind, f"per_{strategy}", False, 0 if strategy == "channel" else None)
    inputs = (_quark_spec(kind, "per_channel", True, 1) if activations == "dynamic"
              else _quark_spec(kind, "per_tensor", False, None))
    layer = {"weight": weight, "input_tensors": inputs, "output_tensors": None, "bias": None, "target_device": None}
    kv = {**layer, "output_tensors": _quark_spec("float", "per_tensor", False, None)}
    return {"quant_method": "quark", "quant_mode": "eager_mode", "version": "0.9",
            "export": {"kv_cache_group": ["*k_proj", "*v_proj"] if kv_scales else [], "pack_method": "reorder",
                       "weight_format": "real_quantized", "min_kv_scale": 0.0},
            "global_quant_config": layer, "layer_quant_config": {"*k_proj": kv, "*v_proj": kv} if kv_scales else {},
            "layer_type_quant_config": {}, "exclude": list(ignore), "algo_config": None}


def write_quantized(src_dir: str, dst_dir: Path, scheme: str, fmt: str = "compressed-tensors",
                    ignore: tuple[str, ...] = ("lm_head",), kv_scales: bool = False) -> tuple[str, str]:
    """(the quantized checkpoint, a float checkpoint of its dequantized weights) from the float checkpoint at
    src_dir. fmt "compressed-tensors" takes any of SCHEMES; fmt "fp8" (quant_method fp8) takes the fp8 tensor
    schemes ("fp8-tensor-static", "fp8-tensor-w8a16" as dynamic) and the block ones; fmt "fbgemm_fp8" (Meta's
    FP8 releases) takes "fp8-channel-dynamic", its [N, 1] scales as FbgemmFp8Linear saves them; fmt "quark"
    (AMD Quark) the per-tensor and per-channel W8A8 schemes, KV scales on k_proj / v_proj outputs. Modules matching
    `ignore` (names, or "re:" patterns matched from the start) stay float. `kv_scales`: a calibrated fp8 KV cache's
    per-tensor scales too, as llm-compressor's kv_cache_scheme writes them (self_attn.k_scale / v_scale) or, for
    fmt "fp8", as AutoFP8 does (k_proj.k_scale / v_proj.v_scale)."""
    src = Path(src_dir)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    kind, strategy, block, activations = SCHEMES[scheme]
    amax = input_amax(src_dir) if activations == "static" else {}
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.split(".")[-1] in LINEAR_SUFFIXES and not _ignored(module, ignore):
            if kind == "int":
                q, scale = quantize_int8(tensor, strategy)
            else:
                q, scale = quantize_fp8(tensor, strategy, block)
            quantized[name] = q
            scale_name = "weight_scale_inv" if fmt == "fp8" and block is not None else "weight_scale"
            quantized[f"{module}.{scale_name}"] = scale.reshape(()) if fmt == "fp8" and block is None else scale
            if activations == "static":
                if module not in amax and kind == "float":
                    # transformers runs stacked experts, not linear modules, so no input was seen: fp8 input
                    # scales are loaded and not applied (pagellm keeps activations in the model's dtype).
                    amax[module] = FP8_MAX
                step = amax[module] / (127.5 if kind == "int" else FP8_MAX)
                value = torch.tensor([step], dtype=torch.float32)
                quantized[f"{module}.input_scale"] = value.reshape(()) if fmt == "fp8" else value
            dequantized[name] = dequantize(q, scale, block).to(tensor.dtype)
        else:
            quantized[name] = tensor
            dequantized[name] = tensor
    if kv_scales:
        layers = sorted({name.split(".")[2] for name in tensors if name.startswith("model.layers.")})
        for layer in layers:
            prefix = f"model.layers.{layer}.self_attn"
            for kind, value in (("k", 0.03125), ("v", 0.015625)):
                name = {"compressed-tensors": f"{prefix}.{kind}_scale",
                        "quark": f"{prefix}.{kind}_proj.output_scale"}.get(fmt, f"{prefix}.{kind}_proj.{kind}_scale")
                quantized[name] = torch.tensor(value) if fmt == "fp8" else torch.tensor([value])
    dst = Path(dst_dir)
    quant_dir, float_dir = dst / "quantized", dst / "dequantized"
    if fmt == "compressed-tensors":
        quant_config = compressed_tensors_config(scheme, ignore)
        if kv_scales:
            quant_config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                                               "dynamic": False, "group_size": None}
    elif fmt == "quark":
        quant_config = quark_config(scheme, ignore, kv_scales)
    elif fmt == "fbgemm_fp8":
        assert scheme == "fp8-channel-dynamic", "fbgemm_fp8 stores a scale per output channel"
        quant_config = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                        "modules_to_not_convert": [entry for entry in ignore if not entry.startswith("re:")]}
    else:
        quant_config = {"quant_method": "fp8", "activation_scheme": "static" if activations == "static" else "dynamic",
                        "ignored_layers": [entry for entry in ignore if not entry.startswith("re:")]}
        if block is not None:
            quant_config["weight_block_size"] = list(block)
    _copy_side_files(src, quant_dir, {"quantization_config": quant_config})
    _copy_side_files(src, float_dir, {})
    save_file({k: v.contiguous() for k, v in quantized.items()}, str(quant_dir / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(float_dir / "model.safetensors"))
    return str(quant_dir), str(float_dir)


# NVIDIA ModelOpt's fp8 algorithms -> the scheme above whose tensors they store (reshaped as ModelOpt exports them).
MODELOPT_SCHEMES = {"FP8": "fp8-tensor-static", "FP8_PER_CHANNEL_PER_TOKEN": "fp8-channel-dynamic",
                    "FP8_PB_WO": "fp8-block-128"}


def _modelopt_excluded(module: str, exclude: tuple[str, ...]) -> bool:
    """ModelOpt's exclude_modules as vLLM matches them: a whole name, one contained in the module's, a wildcard."""
    from fnmatch import fnmatchcase

    return any(entry == module or entry in module or fnmatchcase(module, entry) for entry in exclude)


def write_modelopt(src_dir: str, dst_dir: Path, algo: str, exclude: tuple[str, ...] = ("lm_head",),
                   nested: bool = False, kv_scales: bool = False) -> tuple[str, str]:
    """(a ModelOpt fp8 checkpoint, a float checkpoint of its dequantized weights): write_quantized's tensors for
    the algorithm's scheme with ModelOpt's shapes (per-tensor scales as scalars, per-channel ones [N], block ones
    [N / 128, 1, K / 128, 1]), `kv_scales` adding each layer's k_proj.k_scale / v_proj.v_scale, and the config in
    config.json (flat, as newer exports write it) or, `nested`, in hf_quant_config.json."""
    tensors = {}
    for file in sorted(Path(src_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    modules = {name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight")}
    float_modules = tuple(sorted(m for m in modules if _modelopt_excluded(m, exclude)))
    scheme = MODELOPT_SCHEMES[algo]
    quant_dir, float_dir = write_quantized(src_dir, dst_dir, scheme, ignore=float_modules)
    quantized = load_file(f"{quant_dir}/model.safetensors")
    if "lm_head.weight" in tensors and "lm_head" not in float_modules:  # ModelOpt quantizes the head unless excluded
        _, strategy, block, _ = SCHEMES[scheme]
        q, scale = quantize_fp8(tensors["lm_head.weight"], strategy, block)
        quantized.update({"lm_head.weight": q, "lm_head.weight_scale": scale})
        if algo == "FP8":
            quantized["lm_head.input_scale"] = torch.tensor([1.0])
        dequantized = load_file(f"{float_dir}/model.safetensors")
        dequantized["lm_head.weight"] = dequantize(q, scale, block).to(tensors["lm_head.weight"].dtype)
        save_file({k: v.contiguous() for k, v in dequantized.items()}, f"{float_dir}/model.safetensors")
    for name in list(quantized):
        if name.endswith((".weight_scale", ".input_scale")):
            scale = quantized[name]
            if algo == "FP8" or name.endswith(".input_scale"):
                quantized[name] = scale.reshape(())
            elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
                quantized[name] = scale.reshape(-1)
            else:
                quantized[name] = scale.reshape(scale.shape[0], 1, scale.shape[1], 1)
    if kv_scales:
        layers = {name.split(".")[2] for name in quantized if name.startswith("model.layers.")}
        for layer in sorted(layers):
            quantized[f"model.layers.{layer}.self_attn.k_proj.k_scale"] = torch.tensor(0.03125)
            quantized[f"model.layers.{layer}.self_attn.v_proj.v_scale"] = torch.tensor(0.015625)
    save_file({k: v.contiguous() for k, v in quantized.items()}, f"{quant_dir}/model.safetensors")
    config_path = Path(quant_dir) / "config.json"
    config = json.loads(config_path.read_text())
    producer = {"name": "modelopt", "version": "0.29.0"}
    if nested:
        del config["quantization_config"]
        (Path(quant_dir) / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": {
            "quant_algo": algo, "kv_cache_quant_algo": "FP8" if kv_scales else None,
            "exclude_modules": list(exclude)}}, indent=2))
    else:
        config["quantization_config"] = {
            "quant_method": "modelopt", "quant_algo": algo, "ignore": list(exclude), "producer": producer,
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False} if kv_scales else None}
    config_path.write_text(json.dumps(config, indent=2))
    return quant_dir, float_dir
