"""Intel AutoRound checkpoints: AutoGPTQ's and AutoAWQ's layouts under AutoRound's quantization_config (its
block_name_to_quantize and per-module extra_config), greedy tokens against pagellm and transformers on the
dequantized weights, and the config's translation and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.layers.quantization import check_quantization_supported, quantization_config_for
from pagellm.layers.quantization.awq import AWQLinearMethod
from pagellm.layers.quantization.gptq import GPTQLinearMethod
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from tests.helpers import PROMPTS, hf_greedy
from tests.quant_checkpoints import QuantSpec, write_quantized

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=16 << 20)
FLOAT_MODULE = "model.layers.1.mlp.down_proj"  # kept in 16 bits by the checkpoint's extra_config


def _auto_round(spec: QuantSpec, **fields) -> dict:
    """quantization_config as AutoRound 0.6's save_quantized writes it for `spec`'s layout."""
    packing = "auto_round:auto_awq" if spec.method == "awq" else "auto_round:auto_gptq"
    return {"quant_method": "auto-round", "bits": spec.bits, "group_size": spec.group_size,
            "sym": spec.sym if spec.method == "gptq" else False, "data_type": "int", "iters": 200,
            "nsamples": 128, "seqlen": 2048, "autoround_version": "0.6.0", "packing_format": packing,
            "block_name_to_quantize": "model.layers", **fields}


def _write(tiny_llama_dir: str, root: Path, spec: QuantSpec) -> tuple[Path, Path]:
    """An AutoRound checkpoint in `spec`'s layout with FLOAT_MODULE stored float, and its dequantized twin."""
    quantized, dequantized = root / "quantized", root / "dequantized"
    write_quantized(tiny_llama_dir, quantized, dequantized, spec)
    original = load_file(str(Path(tiny_llama_dir) / "model.safetensors"))[f"{FLOAT_MODULE}.weight"]
    tensors = {name: value for name, value in load_file(str(quantized / "model.safetensors")).items()
               if not name.startswith(f"{FLOAT_MODULE}.")}
    save_file({**tensors, f"{FLOAT_MODULE}.weight": original}, str(quantized / "model.safetensors"))
    dense = load_file(str(dequantized / "model.safetensors"))
    save_file({**dense, f"{FLOAT_MODULE}.weight": original}, str(dequantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = _auto_round(spec, extra_config={FLOAT_MODULE: {"bits": 16, "data_type": "float"}})
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized, dequantized


@pytest.mark.parametrize("spec", [QuantSpec("gptq", bits=4, group_size=32), QuantSpec("awq", group_size=32)],
                         ids=["auto_gptq", "auto_awq"])
def test_auto_round_checkpoints_give_the_dequantized_models_tokens(spec, tiny_llama_dir, default_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    quantized, dequantized = _write(tiny_llama_dir, tmp_path, spec)
    llm = LLM(str(quantized), **ENGINE)
    layers = llm.llm_engine.core.runner.model.model.layers
    method = GPTQLinearMethod if spec.method == "gptq" else AWQLinearMethod
    assert isinstance(layers[0].mlp.down_proj.quant_method, method)
    assert isinstance(layers[1].mlp.down_proj.quant_method, UnquantizedLinearMethod)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert ours == [o.outputs[0].token_ids for o in LLM(str(dequantized), **ENGINE).generate(PROMPTS, GREEDY,
                                                                                                 use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(str(dequantized), dtype=torch.float32).eval()
    for prompt, tokens in list(zip(PROMPTS, ours))[:2]:
        assert tokens == hf_greedy(hf, default_tokenizer, default_tokenizer.encode(prompt), MAX_TOKENS, True), prompt


def _method(config: dict, prefix: str):
    return quantization_config_for({"quantization_config": config}).linear_method(prefix)


def test_extra_config_and_blocks_choose_each_layers_method():
    spec = QuantSpec("gptq", bits=4, group_size=32)
    eight_bit = {f"model.layers.0.self_attn.{p}_proj": {"bits": 8, "group_size": 64} for p in "qkv"}
    config = _auto_round(spec, block_name_to_quantize=["model.layers"],
                         extra_config={**eight_bit, "model.layers.2.mlp.gate_proj": {"bits": 16},
                                       "model.layers.2.mlp.up_proj": {"bits": 16}})
    qkv = _method(config, "model.layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, GPTQLinearMethod) and (qkv.bits, qkv.group_size) == (8, 64)
    o = _method(config, "model.layers.0.self_attn.o_proj")
    assert (o.bits, o.group_size) == (4, 32)
    assert isinstance(_method(config, "model.layers.2.mlp.gate_up_proj"), UnquantizedLinearMethod)
    assert isinstance(_method(config, "model.mtp.0.proj"), UnquantizedLinearMethod)  # outside the blocks
    assert isinstance(_method(config, "lm_head"), UnquantizedLinearMethod)
    assert "auto-round" in quantization_config_for({"quantization_config": config}).describe()
    with pytest.raises(ValueError, match="treat them differently"):
        _method(_auto_round(spec, extra_config={"model.layers.0.self_attn.q_proj": {"bits": 8}}),
                "model.layers.0.self_attn.qkv_proj")
    awq = _auto_round(QuantSpec("awq", group_size=32), block_name_to_quantize="model.layers",
                      extra_config={"model.layers.3.mlp.down_proj": {"bits": 16}})
    assert isinstance(_method(awq, "model.layers.0.mlp.down_proj"), AWQLinearMethod)
    assert isinstance(_method(awq, "model.layers.3.mlp.down_proj"), UnquantizedLinearMethod)
    assert isinstance(_method(awq, "model.mtp.0.proj"), UnquantizedLinearMethod)
    older = {**config, "quant_method": "intel/auto-round"}
    assert check_quantization_supported({"quantization_config": older}) == "intel/auto-round"


@pytest.mark.parametrize("change, words", [
    ({"data_type": "mx_fp"}, ["data_type='mx_fp'", "'int'"]),
    ({"packing_format": "auto_round:llm_compressor"}, ["packing_format='auto_round:llm_compressor'",
                                                       "auto_round:auto_gptq"]),
    ({"packing_format": "auto_round:auto_awq", "extra_config": {"model.layers.0.mlp.down_proj": {"bits": 8}}},
     ["AWQ's layout", "model.layers.0.mlp.down_proj"]),
])
def test_auto_round_variants_pagellm_does_not_read_are_refused_naming_them(change, words):
    with pytest.raises(ValueError) as refusal:
        _method(_auto_round(QuantSpec("gptq"), **change), "model.layers.0.mlp.down_proj")
    assert all(word in str(refusal.value) for word in words), str(refusal.value)
    with pytest.raises(ValueError, match="not quantized"):
        quantization_config_for({}, "auto-round")
