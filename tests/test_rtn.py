"""quantization="rtn" (vLLM's online round to nearest): the rounding against vLLM's rtn_quantize as its source
writes it, and the engine's greedy tokens against pagellm and transformers on the weights it makes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.layers.quantization import quantization_config_for
from pagellm.layers.quantization.rtn import OnlineRTNMethod, rtn_weight
from pagellm.ops.wna16 import dequantize
from tests.helpers import PROMPTS, decoder_linear_bytes, hf_greedy

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=16 << 20)


def _vllm_rtn(tensor: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """vLLM 0.10's rtn_quantize then rtn_dequantize of a 2-D weight whose rows are whole groups, written out: the
    reference."""
    q_range = 2**bits
    groups = tensor.numel() // group_size if group_size != -1 else tensor.shape[0]
    flat = tensor.reshape(groups, -1)
    scale = torch.max(flat.min(dim=1, keepdim=True)[0].abs(), flat.max(dim=1, keepdim=True)[0].abs()) * 2.0 / (
        q_range - 1)
    q = ((flat / scale).round() + q_range // 2).clamp(0, q_range - 1)
    return ((q - q_range // 2) * scale).reshape(tensor.shape)


@pytest.mark.parametrize("bits, group_size", [(8, 128), (4, 128), (4, 32), (8, -1)])
def test_rounding_is_vllms(bits, group_size):
    torch.manual_seed(0)
    weight = torch.randn(48, 256) * 0.05
    ours = dequantize(rtn_weight(weight, bits, group_size))
    assert torch.allclose(ours, _vllm_rtn(weight, bits, group_size), rtol=0, atol=1e-7)


def test_a_short_last_group_is_rounded_on_its_own():
    torch.manual_seed(0)
    weight = torch.randn(8, 96) * 0.05  # groups of 64: one whole, one of 32
    ours = dequantize(rtn_weight(weight, 4, 64))
    assert torch.allclose(ours[:, :64], _vllm_rtn(weight[:, :64].contiguous(), 4, 64), rtol=0, atol=1e-7)
    assert torch.allclose(ours[:, 64:], _vllm_rtn(weight[:, 64:].contiguous(), 4, 32), rtol=0, atol=1e-7)


def _rtn_dequantized(float_dir: str, directory: Path, bits: int, group_size: int) -> str:
    tensors = load_file(f"{float_dir}/model.safetensors")
    for name, tensor in tensors.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            tensors[name] = dequantize(rtn_weight(tensor, bits, group_size)).contiguous()
    shutil.copytree(float_dir, directory)
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


@pytest.mark.parametrize("bits, group_size", [(8, 128), (4, 32)])
def test_greedy_output_equals_transformers_on_the_rounded_weights(bits, group_size, tiny_llama_dir, tmp_path,
                                                                 default_tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("RTN_NUM_BITS", str(bits))
    monkeypatch.setenv("RTN_GROUP_SIZE", str(group_size))
    llm = LLM(tiny_llama_dir, quantization="rtn", **ENGINE)
    layer = llm.llm_engine.core.runner.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj.quant_method, OnlineRTNMethod)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    dense_dir = _rtn_dequantized(tiny_llama_dir, tmp_path / "rounded", bits, group_size)
    dense = LLM(dense_dir, **ENGINE)
    assert ours == [o.outputs[0].token_ids for o in dense.generate(PROMPTS, GREEDY, use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    for prompt, tokens in list(zip(PROMPTS, ours))[:2]:
        assert tokens == hf_greedy(hf, default_tokenizer, default_tokenizer.encode(prompt), MAX_TOKENS, True), prompt
    # bits per weight plus a scale and an offset (float32) per group, against 32
    assert decoder_linear_bytes(llm) <= 1.1 * (bits + 64 / group_size) / 32 * decoder_linear_bytes(dense)


def test_settings_are_vllms_and_bad_ones_are_refused(monkeypatch):
    monkeypatch.delenv("RTN_NUM_BITS", raising=False)
    monkeypatch.delenv("RTN_GROUP_SIZE", raising=False)
    method = quantization_config_for({}, "rtn").linear_method("model.layers.0.mlp.down_proj")
    assert (method.bits, method.group_size) == (8, 128)  # vLLM's defaults
    assert "rtn" in quantization_config_for({}, "rtn").describe()
    monkeypatch.setenv("RTN_NUM_BITS", "3")
    with pytest.raises(ValueError, match="3-bit weights .RTN_NUM_BITS"):
        quantization_config_for({}, "rtn")
    monkeypatch.setenv("RTN_NUM_BITS", "4")
    monkeypatch.setenv("RTN_GROUP_SIZE", "0")
    with pytest.raises(ValueError, match="group size 0 .RTN_GROUP_SIZE"):
        quantization_config_for({}, "rtn")
