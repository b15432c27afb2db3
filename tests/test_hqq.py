"""HQQ checkpoints: reading HQQLinear's state_dict against hqq's own quantization and dequantization
(tests/data/hqq_reference.safetensors), the test packer's layout, and the engine's greedy tokens against pagellm and
transformers on the dequantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.layers.quantization import quantization_config_for
from pagellm.layers.quantization.hqq import HQQLinearMethod, unpack_hqq
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from tests.helpers import PROMPTS, decoder_linear_bytes, hf_greedy

REFERENCE = Path(__file__).parent / "data" / "hqq_reference.safetensors"
CASES = ("b4_g64", "b8_g32", "b4_g64_float_view")
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=16 << 20)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(REFERENCE))


def _parts(reference: dict[str, torch.Tensor], case: str) -> dict[str, torch.Tensor]:
    return {name.removeprefix(f"{case}."): tensor for name, tensor in reference.items()
            if name.startswith(f"{case}.") and name not in (f"{case}.weight", f"{case}.dequantized")}


@pytest.mark.parametrize("case", CASES)
def test_reading_a_weight_gives_what_hqq_dequantizes(reference, case):
    q, scale, zero, group_size = unpack_hqq(case, _parts(reference, case))
    rows, cols = q.shape
    weights = (q.float().view(rows, -1, group_size) - zero[..., None]) * scale[..., None]
    assert torch.equal(weights.view(rows, cols), reference[f"{case}.dequantized"])


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


def test_the_test_packer_writes_hqqs_layout(reference):
    ours = quantize_hqq(reference["b4_g64.weight"], 4, 64)
    theirs = _parts(reference, "b4_g64")
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert value.shape == theirs[key].shape and value.dtype == theirs[key].dtype, key
    assert all(torch.equal(ours[key], theirs[key]) for key in ("shape", "nbits", "group_size", "axis", "packing"))


def _write(float_dir: str, root: Path, bits: int, group_size: int) -> tuple[Path, Path]:
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


@pytest.mark.parametrize("bits, group_size", [(4, 64), (8, 32)])
def test_greedy_output_equals_the_dequantized_model(bits, group_size, tiny_llama_dir, default_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    quantized, dense = _write(tiny_llama_dir, tmp_path, bits, group_size)
    llm = LLM(str(quantized), **ENGINE)
    assert isinstance(llm.llm_engine.core.runner.model.model.layers[0].mlp.down_proj.quant_method, HQQLinearMethod)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    dense_llm = LLM(str(dense), **ENGINE)
    assert ours == [o.outputs[0].token_ids for o in dense_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32).eval()
    for prompt, tokens in list(zip(PROMPTS, ours))[:2]:
        assert tokens == hf_greedy(hf, default_tokenizer, default_tokenizer.encode(prompt), MAX_TOKENS, True), prompt
    assert decoder_linear_bytes(llm) <= 1.1 * (bits + 64 / group_size) / 32 * decoder_linear_bytes(dense_llm)


def test_configs_and_weights_pagellm_does_not_read_are_refused(reference):
    base = {"quant_method": "hqq", "skip_modules": ["lm_head", "mlp.down_proj"], "quant_config": {
        "weight_quant_params": {"nbits": 4, "group_size": 64, "axis": 1}}}
    config = quantization_config_for({"quantization_config": base})
    assert isinstance(config.linear_method("model.layers.0.mlp.down_proj"), UnquantizedLinearMethod)
    assert isinstance(config.linear_method("model.layers.0.mlp.gate_up_proj"), HQQLinearMethod)
    for params, words in (({"nbits": 3, "group_size": 64, "axis": 1}, "4- and 8-bit"),
                          ({"nbits": 4, "group_size": 64, "axis": 0}, "axis 1")):
        with pytest.raises(ValueError, match=words):
            quantization_config_for({"quantization_config": {**base, "quant_config": {"weight_quant_params": params}}})
    with pytest.raises(ValueError, match="dynamic_config"):
        quantization_config_for({"quantization_config": {**base, "quant_config": {"self_attn.q_proj": {}}}})
    parts = _parts(reference, "b4_g64")
    stream = [(f"m.{key}", value) for key, value in parts.items() if key != "zero"]
    with pytest.raises(ValueError, match="HQQ weight m is incomplete"):
        list(config.checkpoint_tensors(iter(stream)))
    with pytest.raises(ValueError, match="8-bit weights in groups of 32, where the config says 4 bits"):
        list(config.checkpoint_tensors(iter((f"m.{k}", v) for k, v in _parts(reference, "b8_g32").items())))
