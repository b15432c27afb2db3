"""gpt-oss checkpoints with their experts in MXFP4, written from a float model (the tests' and
benchmarks/mxfp4_moe.py's):

- as the released safetensors store them (write_mxfp4): each stacked expert tensor `...experts.gate_up_proj` /
  `down_proj` ([E, in, out]) becomes `_blocks` [E, out, in / 32, 16] (two e2m1 codes a byte, value 2i in byte i's
  low nibble) and `_scales` [E, out, in / 32] (e8m0: the exponent + 127), and config.json gets the
  quantization_config transformers writes;
- as llama.cpp's converter (convert_hf_to_gguf.py's GptOssModel) writes a GGUF (write_gpt_oss_gguf): experts
  stacked per projection in ggml's MXFP4 blocks, gate and up de-interleaved, their biases beside them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import write_decoder_metadata

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


def write_mxfp4(float_dir: str | Path, out: Path, dtype: torch.dtype = torch.float32,
                dequantized_out: Path | None = None) -> dict[str, torch.Tensor]:
    """`float_dir`'s checkpoint in `out` with its experts in MXFP4; returns the expert tensors those blocks hold
    (in `dtype`, the float checkpoint's names and [E, in, out] layout), as transformers dequantizes them, and
    writes `float_dir`'s checkpoint with those values in `dequantized_out` where given."""
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
    if dequantized_out is not None:
        shutil.copytree(float_dir, dequantized_out, ignore=shutil.ignore_patterns("*.safetensors"),
                        dirs_exist_ok=True)
        floats = load_file(str(Path(float_dir) / "model.safetensors"))
        save_file({**floats, **{name: values.to(floats[name].dtype) for name, values in dequantized.items()}},
                  str(dequantized_out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(config))
    return dequantized


_ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm"}
_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
MXFP4 = gguf.GGMLQuantizationType.MXFP4


def _write_metadata(writer: gguf.GGUFWriter, config) -> None:
    """TextModel.set_gguf_parameters and GptOssModel's additions."""
    write_decoder_metadata(writer, config)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(config.rope_parameters["factor"])
    writer.add_rope_scaling_orig_ctx_len(config.rope_parameters["original_max_position_embeddings"])
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_sliding_window(config.sliding_window)
    writer.add_expert_feed_forward_length(config.intermediate_size)


def _copy_vocabulary(writer: gguf.GGUFWriter, source: Path) -> None:
    """The tokenizer.* keys of another GGUF (llama.cpp reads a model's vocabulary from its own file)."""
    for name, field in gguf.GGUFReader(source).fields.items():
        if name.startswith("tokenizer.") and name not in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)


def _mxfp4_stack(stack: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """[E, rows, cols] -> (gguf's MXFP4 blocks, the float32 values they hold)."""
    blocks = gguf.quants.quantize(stack.float().numpy(), MXFP4)
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, MXFP4)).reshape(stack.shape)


def _dense(data: torch.Tensor, float_type: gguf.GGMLQuantizationType) -> tuple[np.ndarray, dict]:
    """A 2-D weight in `float_type`, 1-D tensors (norms, biases, sinks) in F32, as the converter keeps them."""
    values = data.float().numpy()
    if data.dim() < 2 or float_type == gguf.GGMLQuantizationType.F32:
        return values, {}
    return gguf.quants.quantize(values, float_type), {"raw_dtype": float_type}


def write_gpt_oss_gguf(state: dict[str, torch.Tensor], config, path: Path,
                       float_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                       vocabulary: Path | None = None) -> dict[str, torch.Tensor]:
    """A gpt-oss model's HF `state` as llama.cpp writes its GGUF: experts in MXFP4 (gguf's quantizer), other
    weights in `float_type`, `vocabulary`'s tokenizer keys where given. Returns the expert tensors (HF names and
    layout, float32) with the values the blocks hold."""
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    _write_metadata(writer, config)
    if vocabulary is not None:
        _copy_vocabulary(writer, vocabulary)
    kept = {}
    for hf_name, tensor in state.items():
        if hf_name in _GLOBALS:
            data, dtype = _dense(tensor, float_type)
            writer.add_tensor(_GLOBALS[hf_name], data, **dtype)
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        parts = rest.split(".")
        if rest == "mlp.experts.gate_up_proj":  # [E, H, 2I], gate at even and up at odd columns
            rows = tensor.transpose(1, 2)
            gate, gate_values = _mxfp4_stack(rows[:, 0::2])
            up, up_values = _mxfp4_stack(rows[:, 1::2])
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", gate, raw_dtype=MXFP4)
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", up, raw_dtype=MXFP4)
            kept[hf_name] = torch.stack((gate_values, up_values), dim=2).flatten(1, 2).transpose(1, 2)
        elif rest == "mlp.experts.down_proj":  # [E, I, H]
            blocks, values = _mxfp4_stack(tensor.transpose(1, 2))
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", blocks, raw_dtype=MXFP4)
            kept[hf_name] = values.transpose(1, 2)
        elif rest == "mlp.experts.gate_up_proj_bias":
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.bias", tensor[:, 0::2].float().contiguous().numpy())
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.bias", tensor[:, 1::2].float().contiguous().numpy())
        elif rest == "mlp.experts.down_proj_bias":
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.bias", tensor.float().numpy())
        elif rest == "self_attn.sinks":
            writer.add_tensor(f"blk.{layer}.attn_sinks.weight", tensor.float().numpy())
        else:
            stem = (_ATTENTION[parts[1]] if parts[0] == "self_attn" else "ffn_gate_inp" if parts[0] == "mlp"
                    else _NORMS[parts[0]])
            data, dtype = _dense(tensor, float_type if stem != "ffn_gate_inp" else gguf.GGMLQuantizationType.F32)
            writer.add_tensor(f"blk.{layer}.{stem}.{parts[-1]}", data, **dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return kept
