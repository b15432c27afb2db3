"""AWQ, GPTQ and compressed-tensors W4A16/W8A16 test checkpoints made from a float HF checkpoint: every linear
weight of the decoder layers is quantized by round-to-nearest (no calibration: the layout is what is tested, not
the quantizer's quality) and packed into the format's exact tensors, written as safetensors with a config.json
quantization_config as AutoAWQ / AutoGPTQ / llm-compressor write it. Beside it, the same model with the dequantized
weights in float32, the reference pagellm and transformers run.

The checkpoint packers are independent of pagellm's own unpacking (pagellm/ops/wna16.py,
layers/quantization/awq.py, gptq.py, compressed_tensors_wna16.py): they follow the producers' code, and
tests/data/awq_gptq_reference.safetensors (made by AutoAWQ's and AutoGPTQ's own packing code, see
tests/data/make_awq_gptq_reference.py) checks them byte for byte; the compressed-tensors packer is checked against
that package's own compressor (tests/test_awq_gptq.py).
`random_group_quant_weight` makes kernel test weights directly in pagellm's representation.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagellm.ops.wna16 import GroupQuantWeight, pack_rows

# Mixtral's experts name gate, down and up w1, w2 and w3.
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
# Nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8 (AutoAWQ, awq/modules/linear/gemm.py `from_linear`).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Projections that read the same input, and so share one act order in a real GPTQ run.
SAME_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
              "up_proj": "gate_up", "down_proj": "down", "w1": "gate_up", "w3": "gate_up", "w2": "down"}


@dataclass(frozen=True)
class QuantSpec:
    """One checkpoint format: "awq" (4-bit, zero point), "gptq" (bits, sym, desc_act, checkpoint_format) or
    "compressed-tensors" (pack-quantized W4A16/W8A16: bits, sym, group_size -1 for per channel, desc_act for
    the "group" act order that stores weight_g_idx)."""

    method: str
    bits: int = 4
    group_size: int = 32
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"

    def quantization_config(self) -> dict:
        if self.method == "awq":
            # AutoAWQ's AwqConfig.to_transformers_dict (what `save_quantized` puts in config.json).
            return {"quant_method": "awq", "zero_point": True, "group_size": self.group_size, "bits": self.bits,
                    "version": "gemm", "modules_to_not_convert": None}
        if self.method == "compressed-tensors":
            return compressed_tensors_wna16_config(self)
        # AutoGPTQ's BaseQuantizeConfig.to_dict, with the quant_method transformers adds.
        return {"bits": self.bits, "group_size": self.group_size, "damp_percent": 0.01, "desc_act": self.desc_act,
                "static_groups": False, "sym": self.sym, "true_sequential": True, "model_name_or_path": None,
                "model_file_base_name": "model", "quant_method": "gptq", "checkpoint_format": self.checkpoint_format}


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 with the same bits (as numpy's astype(np.int32) does)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# ---- AWQ ------------------------------------------------------------------------------------------------------


def quantize_awq(weight: torch.Tensor, group_size: int):
    """AutoAWQ's pseudo_quantize_tensor (awq/quantize/quantizer.py) with zero_point, per output row and group:
    scale = (max - min) / 15, zero = clamp(-round(min / scale), 0, 15), q = clamp(round(w / scale) + zero, 0, 15).
    The scale is rounded to float16 (the checkpoint's dtype) before q is computed. Returns q [out, in] int64,
    scales [groups, out] float16, zeros [groups, out] int64."""
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 else group_size
    w = weight.double().reshape(out_features, in_features // size, size)
    maximum, minimum = w.amax(dim=2), w.amin(dim=2)
    scales = ((maximum - minimum).clamp(min=1e-5) / 15).to(torch.float16)
    zeros = (-torch.round(minimum / scales.double())).clamp(0, 15)
    q = (torch.round(w / scales.double().unsqueeze(2)) + zeros.unsqueeze(2)).clamp(0, 15)
    return q.reshape(out_features, in_features).long(), scales.t().contiguous(), zeros.t().long().contiguous()


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """values [rows, columns] in 0..15 -> int32 [rows, columns / 8]: word [r, c] |= values[r, 8c + AWQ_ORDER[i]]
    << 4i, AutoAWQ's loop in WQLinear_GEMM.from_linear (used for qweight, whose rows are input features, and for
    qzeros, whose rows are groups)."""
    rows, columns = values.shape
    words = torch.zeros(rows, columns // 8, dtype=torch.int64)
    for column in range(columns // 8):
        for i in range(8):
            words[:, column] |= values[:, column * 8 + AWQ_ORDER[i]] << (i * 4)
    return _to_int32(words)


def awq_tensors(weight: torch.Tensor, spec: QuantSpec) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The checkpoint tensors of one linear layer (suffix -> tensor) and its dequantized weight [out, in]."""
    q, scales, zeros = quantize_awq(weight, spec.group_size)
    size = weight.shape[1] if spec.group_size == -1 else spec.group_size
    groups = torch.arange(weight.shape[1]) // size
    dequantized = ((q - zeros.t()[:, groups]).double() * scales.t()[:, groups].double()).float()
    tensors = {"qweight": pack_awq(q.t().contiguous()), "qzeros": pack_awq(zeros), "scales": scales}
    return tensors, dequantized


# ---- GPTQ -----------------------------------------------------------------------------------------------------


def gptq_group_params(w: torch.Tensor, bits: int, sym: bool):
    """AutoGPTQ's Quantizer.find_params (auto_gptq/quantization/quantizer.py) for one group's columns w [out, n]:
    the range always includes 0; symmetric puts the zero point at 2^(bits-1). Scale rounded to float16."""
    maxq = 2**bits - 1
    xmin = torch.minimum(w.amin(dim=1), torch.zeros(w.shape[0], dtype=w.dtype))
    xmax = torch.maximum(w.amax(dim=1), torch.zeros(w.shape[0], dtype=w.dtype))
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both_zero = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(both_zero, -1.0, xmin), torch.where(both_zero, 1.0, xmax)
    scale = ((xmax - xmin) / maxq).to(torch.float16)
    zero = torch.full_like(xmin, (maxq + 1) / 2) if sym else torch.round(-xmin / scale.double())
    return scale, zero.long()


def gptq_input_order(in_features: int, generator: torch.Generator) -> torch.Tensor:
    """A stand-in for act-order's argsort(diag(H), descending): the order the quantizer visits the inputs."""
    return torch.randperm(in_features, generator=generator)


def input_groups(in_features: int, spec: QuantSpec, perm: torch.Tensor | None):
    """(group size, the order the quantizer walks the inputs in, group count, g_idx [in] int32): group i holds
    the inputs order[i*g : (i+1)*g], so g_idx[order[j]] = j // g (-1 group size: one group)."""
    size = in_features if spec.group_size == -1 else spec.group_size
    order = perm if perm is not None else torch.arange(in_features)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // size).to(torch.int32)
    return size, order, -(-in_features // size), g_idx


def quantize_gptq(weight: torch.Tensor, spec: QuantSpec, perm: torch.Tensor | None):
    """Round-to-nearest in GPTQ's group structure: with desc_act, group i holds the inputs perm[i*g : (i+1)*g]
    and g_idx[perm[j]] = j // g (auto_gptq/quantization/gptq.py, `fasterquant`). Returns q [out, in] int64,
    scales [groups, out] float16, zeros [groups, out] int64, g_idx [in] int32."""
    out_features, in_features = weight.shape
    size, order, groups, g_idx = input_groups(in_features, spec, perm)
    w = weight.double()
    q = torch.empty(out_features, in_features, dtype=torch.int64)
    scales = torch.empty(groups, out_features, dtype=torch.float16)
    zeros = torch.empty(groups, out_features, dtype=torch.int64)
    for group in range(groups):
        columns = order[group * size : (group + 1) * size]
        scale, zero = gptq_group_params(w[:, columns], spec.bits, spec.sym)
        scales[group], zeros[group] = scale, zero
        values = torch.round(w[:, columns] / scale.double().unsqueeze(1)) + zero.unsqueeze(1)
        q[:, columns] = values.clamp(0, 2**spec.bits - 1).long()
    return q, scales, zeros, g_idx


def pack_gptq_qweight(q_in_out: torch.Tensor, bits: int) -> torch.Tensor:
    """intweight [in, out] -> int32 [in / pack, out]: qweight[row] |= intweight[j] << (bits * (j - i)) for the
    pack rows j = i .. i + pack - 1 of each word row (AutoGPTQ's QuantLinear.pack, qlinear_cuda_old.py)."""
    pack = 32 // bits
    rows = q_in_out.shape[0] // pack
    words = torch.zeros(rows, q_in_out.shape[1], dtype=torch.int64)
    for row in range(rows):
        for j in range(pack):
            words[row] |= q_in_out[row * pack + j] << (bits * j)
    return _to_int32(words)


def pack_gptq_qzeros(zeros: torch.Tensor, bits: int, stored_offset: int) -> torch.Tensor:
    """zeros [groups, out] -> int32 [groups, out / pack], `zeros -= 1` first in the v1 format (AutoGPTQ's
    QuantLinear.pack), as they are in GPTQModel's gptq_v2; packed along the outputs from the low bits."""
    stored = zeros - stored_offset
    if (stored < 0).any():
        raise ValueError("a zero point of 0 cannot be stored in GPTQ's v1 format (it keeps zero - 1)")
    pack = 32 // bits
    columns = zeros.shape[1] // pack
    words = torch.zeros(zeros.shape[0], columns, dtype=torch.int64)
    for column in range(columns):
        for j in range(pack):
            words[:, column] |= stored[:, column * pack + j] << (bits * j)
    return _to_int32(words)


def gptq_tensors(weight: torch.Tensor, spec: QuantSpec, perm: torch.Tensor | None):
    q, scales, zeros, g_idx = quantize_gptq(weight, spec, perm)
    groups = g_idx.long()
    dequantized = ((q - zeros.t()[:, groups]).double() * scales.t()[:, groups].double()).float()
    offset = 1 if spec.checkpoint_format == "gptq" else 0
    tensors = {"qweight": pack_gptq_qweight(q.t().contiguous(), spec.bits),
               "qzeros": pack_gptq_qzeros(zeros, spec.bits, offset), "scales": scales, "g_idx": g_idx}
    return tensors, dequantized


# ---- compressed-tensors pack-quantized -----------------------------------------------------------------------


def compressed_tensors_wna16_config(spec: QuantSpec) -> dict:
    """llm-compressor's quantization_config for a W4A16 / W8A16 scheme (compressed-tensors 0.20's QuantizationConfig
    serialized, as `save_pretrained` writes it)."""
    strategy = "channel" if spec.group_size == -1 else "group"
    weights = {"num_bits": spec.bits, "type": "int", "symmetric": spec.sym,
               "group_size": None if spec.group_size == -1 else spec.group_size, "strategy": strategy,
               "block_structure": None, "dynamic": False, "actorder": "group" if spec.desc_act else None,
               "scale_dtype": None, "zp_dtype": None if spec.sym else "torch.int8", "observer": "minmax",
               "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
            "global_compression_ratio": None, "version": "0.20.0"}


def quantize_compressed_tensors(weight: torch.Tensor, spec: QuantSpec, perm: torch.Tensor | None):
    """compressed-tensors' min-max round-to-nearest (calculate_qparams, then _quantize) per output row and group:
    the range always includes 0; symmetric: scale = max|w| / ((2^bits - 1) / 2), zero point 0; asymmetric: scale =
    (max - min) / (2^bits - 1), zero point clamp(round(q_min - min / scale)). q = clamp(round(w / scale + zp),
    q_min, q_max), signed. Scales in float16. Groups as GPTQ's (`perm`: the act order). Returns q [out, in] int64,
    scales [out, groups] float16, zero points [out, groups] int64, g_idx [in] int32."""
    out_features, in_features = weight.shape
    size, order, groups, g_idx = input_groups(in_features, spec, perm)
    q_min, q_max = -(1 << (spec.bits - 1)), (1 << (spec.bits - 1)) - 1
    w = weight.float()
    q = torch.empty(out_features, in_features, dtype=torch.int64)
    scales = torch.empty(out_features, groups, dtype=torch.float16)
    zeros = torch.zeros(out_features, groups, dtype=torch.int64)
    for group in range(groups):
        columns = order[group * size : (group + 1) * size]
        low = w[:, columns].amin(dim=1).clamp(max=0)
        high = w[:, columns].amax(dim=1).clamp(min=0)
        if spec.sym:
            scale = (torch.maximum(low.abs(), high) / ((q_max - q_min) / 2)).to(torch.float16)
            zero = torch.zeros(out_features)
        else:
            scale = ((high - low) / (q_max - q_min)).to(torch.float16)
            zero = (q_min - low / scale.float()).round().clamp(q_min, q_max)
        scale = torch.where(scale == 0, torch.finfo(torch.float16).eps, scale)
        scales[:, group], zeros[:, group] = scale, zero.long()
        values = (w[:, columns] / scale.float().unsqueeze(1) + zero.unsqueeze(1)).round()
        q[:, columns] = values.clamp(q_min, q_max).long()
    return q, scales, zeros, g_idx


def pack_compressed_tensors(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed values [rows, columns] -> int32 [rows, columns / pack]: value + 2^(bits - 1) at bits j * bits of
    word [r, c] for column c * pack + j (compressed-tensors' pack_to_int32 along dim 1, for bits dividing 32)."""
    pack = 32 // bits
    unsigned = values.to(torch.int64) + (1 << (bits - 1))
    rows, columns = unsigned.shape
    words = torch.zeros(rows, columns // pack, dtype=torch.int64)
    for j in range(pack):
        words |= unsigned[:, j::pack] << (bits * j)
    return _to_int32(words)


def compressed_tensors_tensors(weight: torch.Tensor, spec: QuantSpec, perm: torch.Tensor | None):
    """One module's pack-quantized tensors (suffix -> tensor) and its dequantized weight [out, in]."""
    q, scales, zeros, g_idx = quantize_compressed_tensors(weight, spec, perm)
    groups = g_idx.long()
    dequantized = ((q - zeros[:, groups]).double() * scales[:, groups].double()).float()
    tensors = {"weight_packed": pack_compressed_tensors(q, spec.bits), "weight_scale": scales,
               "weight_shape": torch.tensor(weight.shape)}
    if not spec.sym:
        tensors["weight_zero_point"] = pack_compressed_tensors(zeros.t().contiguous(), spec.bits).t().contiguous()
    if spec.desc_act:
        tensors["weight_g_idx"] = g_idx
    return tensors, dequantized


# ---- kernel test weights ---------------------------------------------------------------------------------------


def random_group_quant_weight(bits: int, in_features: int, out_features: int, variant: str,
                              seed: int) -> GroupQuantWeight:
    """Integer weights with float16-exact scales and integer zero points (so dequantization is exact in
    float32). Variants: "plain" (groups of 32 in input order), "act_order" (groups of 32 scattered over the inputs,
    as desc_act stores them), "uneven" (groups of different sizes, not whole words: the layout pads them),
    "per_channel" (one group)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (in_features, out_features), generator=generator, dtype=torch.int32)
    if variant == "per_channel":
        g_idx = torch.zeros(in_features, dtype=torch.int64)
    elif variant == "uneven":
        g_idx = torch.randint(0, 5, (in_features,), generator=generator)
    else:
        g_idx = torch.arange(in_features) // 32
        if variant == "act_order":
            g_idx = g_idx[torch.randperm(in_features, generator=generator)]
    groups = int(g_idx.max()) + 1
    scales = (torch.rand(groups, out_features, generator=generator) * 0.05 + 0.001).half().float()
    zeros = torch.randint(0, 2**bits, (groups, out_features), generator=generator).float()
    return GroupQuantWeight(bits, pack_rows(q, bits), scales, -scales * zeros, g_idx.to(torch.int32))


# ---- whole checkpoints ----------------------------------------------------------------------------------------


def _is_quantized(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(".weight") and name.split(".")[-2] in LINEAR_MODULES


def write_quantized(float_dir: str | Path, quant_dir: str | Path, dequant_dir: str | Path, spec: QuantSpec,
                    seed: int = 0) -> None:
    """quant_dir: the checkpoint in `spec`'s format; dequant_dir: the same model with its dequantized float32
    weights (and the other tensors unchanged). Both keep float_dir's tokenizer files."""
    float_dir, quant_dir, dequant_dir = Path(float_dir), Path(quant_dir), Path(dequant_dir)
    state = {}
    for path in sorted(float_dir.glob("*.safetensors")):
        state.update(load_file(path))
    generator = torch.Generator().manual_seed(seed)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    orders: dict[str, torch.Tensor] = {}  # one act order per input (a layer's q/k/v share theirs)
    for name, tensor in state.items():
        if not _is_quantized(name):
            quantized[name] = dequantized[name] = tensor
            continue
        module = name.removesuffix(".weight")
        if spec.method == "awq":
            tensors, dense = awq_tensors(tensor, spec)
        else:
            perm = None
            if spec.desc_act:
                block, projection = module.rsplit(".", 1)  # an expert's projections: that expert's block
                key = f"{block}:{SAME_INPUT[projection]}"
                if key not in orders:
                    orders[key] = gptq_input_order(tensor.shape[1], generator)
                perm = orders[key]
            pack = compressed_tensors_tensors if spec.method == "compressed-tensors" else gptq_tensors
            tensors, dense = pack(tensor, spec, perm)
        for suffix, value in tensors.items():
            quantized[f"{module}.{suffix}"] = value
        dequantized[name] = dense
    for directory, tensors in ((quant_dir, quantized), (dequant_dir, dequantized)):
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
        for extra in float_dir.iterdir():
            if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
                shutil.copy(extra, directory / extra.name)
    config = json.loads((float_dir / "config.json").read_text())
    (dequant_dir / "config.json").write_text(json.dumps(config, indent=2))
    config["quantization_config"] = spec.quantization_config()
    (quant_dir / "config.json").write_text(json.dumps(config, indent=2))
