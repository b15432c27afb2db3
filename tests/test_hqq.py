"""HQQ checkpoints: reading HQQLinear's state_dict against hqq's own quantization and dequantization
(tests/data/hqq_reference.safetensors), the test packer's layout, and the engine's greedy tokens against pagellm and
transformers on the dequantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagellm import LLM, SamplingParams
from pagellm.layers.quantization import quantization_config_for
from pagellm.layers.quantization.hqq import HQQLinearMethod, unpack_hqq
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from tests.helpers import PROMPTS, decoder_linear_bytes, hf_greedy
from tests.hqq_checkpoints import quantize_hqq, write_hqq

REFERENCE = Path(__file__).parent / "data" / "hqq_reference.safetensors"
CASES = ("b4_g64", "b8_g32", "b4_g64_float_view")
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


def test_the_test_packer_writes_hqqs_layout(reference):
    ours = quantize_hqq(reference["b4_g64.weight"], 4, 64)
    theirs = _parts(reference, "b4_g64")
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert value.shape == theirs[key].shape and value.dtype == theirs[key].dtype, key
    assert all(torch.equal(ours[key], theirs[key]) for key in ("shape", "nbits", "group_size", "axis", "packing"))


@pytest.mark.parametrize("bits, group_size", [(4, 64), (8, 32)])
def test_greedy_output_equals_the_dequantized_model(bits, group_size, tiny_llama_dir, default_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    quantized, dense = write_hqq(tiny_llama_dir, tmp_path, bits, group_size)
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
