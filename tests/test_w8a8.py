"""8-bit checkpoints and online quantization through the engine, on the tiny random Llama.

The checkpoints are made here (tests/w8a8_checkpoints.py) in compressed-tensors' and vLLM's fp8 layouts, each
beside a float checkpoint of its dequantized weights, whose greedy continuation transformers computes (the
project's oracle; pagellm's float32 path equals it token for token, tests/test_correctness.py):
- fp8 weights are weight-only on the CPU (activations stay float32), so the tokens must be equal;
- int8 W8A8 also quantizes activations: transformers runs the dequantized weights with each linear layer's input
  replaced by its int8 quantization (the kernels' rounding, dequantized), the same arithmetic up to float32
  rounding; the continuations are compared as vLLM's check_logprobs_close does (equal up to a first difference,
  where each side's token is in the other's top 5), and most must agree throughout.
Online quantization (quantization="int8" / "fp8") is checked the same way against the weights it makes, its
linear layers' memory against bfloat16's, and its loading against holding more than a layer in float at a time.
"""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import ArgumentValueError, EngineArgs
from pagellm.layers.linear import LinearBase
from pagellm.layers.quantization import quantization_config_for
from pagellm.layers.quantization.compressed_tensors import CompressedTensorsConfig
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.quantization.w8a8 import (Fp8LinearMethod, Int8LinearMethod, OnlineQuantizedLinearMethod)
from pagellm.layers.weights import weights_bytes
from pagellm.models import loader
from pagellm.ops import w8a8_kernels as wk
from tests.helpers import PROMPTS, check_logprobs_close, hf_greedy_with_top_logprobs
from tests.w8a8_checkpoints import compressed_tensors_config, write_quantized

ENGINE = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=32, max_num_seqs=4)
TOKENS = 10
TOP = 5
CASE_PROMPTS = [PROMPTS[1], PROMPTS[3], PROMPTS[7]]


def _ours(path: str, **kwargs) -> list[tuple[list[int], list[dict]]]:
    llm = LLM(path, **{**ENGINE, **kwargs})
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate(CASE_PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outputs]


def _hf(path: str, tokenizer, input_scales: dict[str, float | None] | None = None, rotated: bool = False):
    """transformers' greedy continuations and top logprobs; with `input_scales` (module name -> static scale, or
    None for dynamic per-token scales), the inputs of those linear modules are replaced by their int8
    quantization, dequantized (quantize_rows_int8: the kernels' rounding), so that the float32 model computes
    what W8A8 computes, up to float32 rounding. `rotated`: the inputs are rotated first as quantization="int8"
    rotates them (the checkpoint at `path` holding the rotated weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if input_scales is not None and name in input_scales:
            def fake_quantize(module, inputs, scale=input_scales[name]):
                x = inputs[0]
                rotation = wk.rotation_block(x.shape[-1]) if rotated else 1
                q, step = wk.quantize_rows_int8(x, scale, rotation)
                return ((q.float() * step[:, None]).view(x.shape),)

            module.register_forward_pre_hook(fake_quantize)
    return [hf_greedy_with_top_logprobs(model, tokenizer(p).input_ids, TOKENS, TOP) for p in CASE_PROMPTS]


def _input_scales(quantized: str) -> dict[str, float | None]:
    """Per quantized module of a checkpoint: its static input scale (the largest of a fused layer's shards, as
    the layer uses), or None (dynamic)."""
    from safetensors.torch import load_file

    tensors = load_file(f"{quantized}/model.safetensors")
    modules = {name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight_scale")}
    fused = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
             "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
             "up_proj": ("gate_proj", "up_proj")}
    scales = {}
    for module in modules:
        parent, last = module.rsplit(".", 1)
        shards = [f"{parent}.{shard}.input_scale" for shard in fused.get(last, (last,))]
        scales[module] = max(float(tensors[s]) for s in shards) if shards[0] in tensors else None
    return scales


def _load(path: str, dtype=torch.float32, quantization: str | None = None):
    source = loader.resolve_model(path)
    config, _ = loader.load_hf_config(source)
    return loader.load_model(source, config, None, dtype, torch.device("cpu"), 64, quantization=quantization)


@pytest.mark.parametrize("scheme, fmt, ignore, kv_scales", [
    ("fp8-channel-dynamic", "compressed-tensors", ("lm_head", "re:.*mlp.down_proj$"), False),
    ("fp8-tensor-static", "compressed-tensors", ("lm_head",), True),  # q, k, v, gate, up: a scale each
    ("fp8-block-dynamic", "fp8", (), False),  # weight_scale_inv blocks of [32, 64]
    ("fp8-tensor-static", "fp8", (), True),  # AutoFP8's layout, KV cache scales included
    ("fp8-channel-dynamic", "fbgemm_fp8", ("lm_head", "model.layers.1.mlp.down_proj"), False),  # Meta's
    ("fp8-tensor-static", "quark", ("lm_head", "re:.*mlp.down_proj$"), True),  # AMD's FP8-KV releases
])
def test_fp8_checkpoints_give_the_dequantized_model_s_tokens(tmp_path, tiny_llama_dir, default_tokenizer, caplog,
                                                            scheme, fmt, ignore, kv_scales):
    """A calibrated KV cache's scales (llm-compressor's kv_cache_scheme, AutoFP8's) are passed over, said in the log:
    pagellm's 8-bit KV caches scale each row."""
    quantized, dequantized = write_quantized(tiny_llama_dir, tmp_path, scheme, fmt, ignore, kv_scales)
    model = _load(quantized)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.quant_method, Fp8LinearMethod)
    assert isinstance(layer.mlp.down_proj.quant_method,
                      UnquantizedLinearMethod if "re:.*mlp.down_proj$" in ignore else Fp8LinearMethod)
    assert isinstance(model.lm_head.quant_method, UnquantizedLinearMethod)
    if fmt == "fbgemm_fp8":  # modules_to_not_convert: full names
        assert isinstance(model.model.layers[1].mlp.down_proj.quant_method, UnquantizedLinearMethod)
        assert layer.self_attn.qkv_proj.quant_method.strategy == "channel"
    assert layer.self_attn.qkv_proj.weight.numel() == 0  # only the kernel's packed copy is kept
    with caplog.at_level("INFO", logger="pagellm.layers.quantization"):
        ours = _ours(quantized)
    assert ("KV cache scales" in caplog.text) == kv_scales
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in _hf(dequantized, default_tokenizer)]


@pytest.fixture(scope="module")
def tiny_llama_128_kv_dir(module_tmp_path_factory, default_tokenizer) -> str:
    """The tiny Llama with 4 KV heads: k and v 128 outputs each, whole blocks of 128 (ModelOpt's FP8_PB_WO)."""
    from tests.conftest import _save_tiny

    return _save_tiny(module_tmp_path_factory.mktemp("tiny-llama-4kv"), default_tokenizer, num_key_value_heads=4)


@pytest.mark.parametrize("algo, nested, exclude, kv_scales", [
    ("FP8", False, ("lm_head",), True),
    ("FP8_PER_CHANNEL_PER_TOKEN", True, ("model.layers.2.mlp*",), False),  # the LM head quantized too
    ("FP8_PB_WO", False, ("lm_head", "o_proj"), False),
])
def test_modelopt_fp8_checkpoints_give_the_dequantized_model_s_tokens(
        tmp_path, tiny_llama_128_kv_dir, default_tokenizer, caplog, algo, nested, exclude, kv_scales):
    """NVIDIA ModelOpt's fp8 exports (config.json's quantization_config, or hf_quant_config.json beside it):
    fp8 layers with the algorithm's scales, excluded modules dense (a name, a contained name, a wildcard), a
    calibrated KV cache's scales passed over; transformers' greedy tokens on the dequantized weights."""
    from tests.w8a8_checkpoints import write_modelopt

    quantized, dequantized = write_modelopt(tiny_llama_128_kv_dir, tmp_path, algo, exclude, nested, kv_scales)
    model = _load(quantized)
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj.quant_method, Fp8LinearMethod)
    assert isinstance(layers[0].self_attn.o_proj.quant_method,
                      UnquantizedLinearMethod if "o_proj" in exclude else Fp8LinearMethod)
    assert isinstance(layers[2].mlp.gate_up_proj.quant_method,
                      UnquantizedLinearMethod if "model.layers.2.mlp*" in exclude else Fp8LinearMethod)
    assert isinstance(model.lm_head.quant_method,
                      UnquantizedLinearMethod if "lm_head" in exclude else Fp8LinearMethod)
    with caplog.at_level("INFO", logger="pagellm.layers.quantization.modelopt"):
        ours = _ours(quantized)
    assert ("KV cache scales" in caplog.text) == kv_scales
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in _hf(dequantized, default_tokenizer)]


@pytest.mark.parametrize("change, words", [
    ({"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}},
     ["'fp4'", "fp8_e4m3 W8A8"]),
    ({"input_tensors": {"dtype": "int8", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": False}},
     ["'symmetric': False", "symmetric int8"]),
    ({"output_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_tensor"}}, ["outputs or bias"]),
])
def test_quark_schemes_pagellm_does_not_read_are_refused_naming_them(change, words):
    from tests.w8a8_checkpoints import quark_config

    config = quark_config("int8-tensor-static", ("lm_head",), False)
    config["global_quant_config"] = {**config["global_quant_config"], **change}
    with pytest.raises(ValueError) as refusal:
        quantization_config_for({"quantization_config": config}).linear_method("model.layers.0.mlp.down_proj")
    assert all(word in str(refusal.value) for word in words), str(refusal.value)
    fp8 = quark_config("fp8-tensor-static", (), False)
    fp8["layer_quant_config"] = {"*k_proj": {**fp8["global_quant_config"], "weight": {
        **fp8["global_quant_config"]["weight"], "qscheme": "per_channel", "ch_axis": 0}}}
    with pytest.raises(ValueError, match="quantizes differently"):
        quantization_config_for({"quantization_config": fp8}).linear_method("model.layers.0.self_attn.qkv_proj")


def test_fbgemm_fp8_names_a_checkpoint_format_only(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization='fbgemm_fp8' names the format.*fp8_per_channel"):
        _load(tiny_llama_dir, quantization="fbgemm_fp8")


def test_modelopt_formats_pagellm_does_not_read_are_refused_naming_them():
    # (NVFP4 and W4A16_NVFP4 are read: tests/test_nvfp4.py)
    for algo, words in (("MXFP8", "MXFP8 export is not read"), ("MIXED_PRECISION", "mixed formats"),
                        ("INT4_AWQ", "unknown")):
        with pytest.raises(ValueError, match=f"quant_algo '{algo}'.*{words}"):
            quantization_config_for({"quantization_config": {"quant_method": "modelopt", "quant_algo": algo}})
    with pytest.raises(ValueError, match="reads NVIDIA ModelOpt checkpoints"):
        quantization_config_for({}, "modelopt")
    config = quantization_config_for({"quantization_config": {
        "quant_method": "modelopt", "quantization": {"quant_algo": "fp8", "exclude_modules": ["*.k_proj"]}}})
    assert "modelopt FP8" in config.describe()
    with pytest.raises(ValueError, match="qkv_proj fuses .*excludes only some"):
        config.linear_method("model.layers.0.self_attn.qkv_proj")


@pytest.mark.parametrize("scheme, fmt", [("int8-channel-dynamic", "compressed-tensors"),
                                         ("int8-tensor-static", "compressed-tensors"),
                                         ("int8-channel-dynamic", "quark")])
def test_int8_checkpoints_stay_close_to_the_dequantized_model(tmp_path, tiny_llama_dir, default_tokenizer, scheme,
                                                              fmt):
    quantized, dequantized = write_quantized(tiny_llama_dir, tmp_path, scheme, fmt)
    model = _load(quantized)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, Int8LinearMethod)
    if scheme == "int8-tensor-static":
        # One scale per shard, each channel given its shard's (q, k and v were quantized separately).
        assert qkv.weight_scale.shape == (3,) and len(set(qkv.weight_scale.tolist())) == 3
        assert qkv.int8_linear.input_scale == float(qkv.input_scale.max())
    ours = _ours(quantized)
    theirs = _hf(dequantized, default_tokenizer, _input_scales(quantized))
    agreed = [check_logprobs_close(mine, hf) for mine, hf in zip(ours, theirs)]
    assert sum(agreed) >= 2 * TOKENS, f"only {agreed} leading tokens agree"


# vLLM's online fp8 shorthands: (block_n, block_k or None for the whole row, power-of-two scales).
FP8_BLOCKS = {"fp8_per_channel": (1, None, False), "fp8_per_block": (128, 128, False), "mxfp8": (1, 32, True)}


def _online_dequantized(tiny_llama_dir: str, directory, method: str, only: str = "") -> str:
    """A float checkpoint of the weights quantization=`method` makes: int8 per output channel, rotated
    (quantize_int8_rotated: the model computes W8A8's products when its inputs are rotated likewise, `_hf`'s
    `rotated`); fp8 with one scale per fused weight (q/k/v together, gate/up together), as the layers quantize
    them, or (FP8_BLOCKS) per block of the fused weight. `only`: just the modules whose names start with it
    ("self_attn"), the others kept as they are."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{tiny_llama_dir}/model.safetensors")
    for layer in range(3):
        for parts in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
                      ("self_attn.o_proj",), ("mlp.down_proj",)):
            if not parts[0].startswith(only):
                continue
            names = [f"model.layers.{layer}.{part}.weight" for part in parts]
            fused = torch.cat([tensors[name] for name in names])
            if method == "int8":
                q, scale, rotation = wk.quantize_int8_rotated(fused)
                assert rotation > 1
                dequantized = q.float() * scale[:, None]
            elif method in FP8_BLOCKS:
                block_n, block_k, power_of_two = FP8_BLOCKS[method]
                block_k = block_k or fused.shape[1]
                q, scales = wk.quantize_fp8_blocks(fused, block_n, block_k, power_of_two)
                dequantized = wk.dequantize_fp8(q, scales, block_k)
            else:
                q, scale = wk.quantize_fp8_per_tensor(fused)
                dequantized = q.float() * scale
            for name, piece in zip(names, dequantized.split([tensors[n].shape[0] for n in names])):
                tensors[name] = piece.contiguous()
    shutil.copytree(tiny_llama_dir, directory)
    save_file(tensors, f"{directory}/model.safetensors")
    return str(directory)


def test_online_int8_halves_the_weights_and_computes_w8a8(tmp_path, tiny_llama_dir, default_tokenizer):
    float_layers = weights_bytes(_load(tiny_llama_dir, torch.bfloat16).model.layers)
    model = _load(tiny_llama_dir, torch.bfloat16, "int8")
    assert weights_bytes(model.model.layers) <= 0.55 * float_layers
    assert isinstance(model.lm_head.quant_method, UnquantizedLinearMethod)
    ours = _ours(tiny_llama_dir, quantization="int8")
    dequantized = _online_dequantized(tiny_llama_dir, tmp_path / "dequantized", "int8")
    linears = {f"model.layers.{i}.{part}": None for i in range(3) for part in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}
    theirs = _hf(dequantized, default_tokenizer, linears, rotated=True)
    agreed = [check_logprobs_close(mine, hf) for mine, hf in zip(ours, theirs)]
    assert sum(agreed) >= 2 * TOKENS, f"only {agreed} leading tokens agree"


def test_online_fp8_halves_the_weights_and_equals_its_dequantized_weights(tmp_path, tiny_llama_dir,
                                                                         default_tokenizer):
    float_layers = weights_bytes(_load(tiny_llama_dir, torch.bfloat16).model.layers)
    assert weights_bytes(_load(tiny_llama_dir, torch.bfloat16, "fp8").model.layers) <= 0.55 * float_layers
    ours = _ours(tiny_llama_dir, quantization="fp8")
    theirs = _hf(_online_dequantized(tiny_llama_dir, tmp_path / "dequantized", "fp8"), default_tokenizer)
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in theirs]


@pytest.mark.parametrize("shorthand", sorted(FP8_BLOCKS))
def test_vllms_online_fp8_shorthands_halve_the_weights_and_equal_their_dequantized_weights(
        shorthand, tmp_path, tiny_llama_dir, default_tokenizer):
    float_layers = weights_bytes(_load(tiny_llama_dir, torch.bfloat16).model.layers)
    # MXFP8's scales (float32 in the kernels' layout, one per 32 weights) add 1/16 of bfloat16's bytes.
    most = 0.57 if shorthand == "mxfp8" else 0.55
    assert weights_bytes(_load(tiny_llama_dir, torch.bfloat16, shorthand).model.layers) <= most * float_layers
    ours = _ours(tiny_llama_dir, quantization=shorthand)
    theirs = _hf(_online_dequantized(tiny_llama_dir, tmp_path / "dequantized", shorthand), default_tokenizer)
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in theirs]


def test_ptpc_fp8_is_fp8_per_channel_here(tiny_llama_dir):
    """vLLM's ROCm quantization="ptpc_fp8" (per-channel weight, per-token activation scales): the same weights as
    fp8_per_channel, activations in the model's dtype."""
    from pagellm.layers.quantization.online import OnlineFp8BlocksLinearMethod

    model = _load(tiny_llama_dir, torch.bfloat16, "ptpc_fp8")
    method = model.model.layers[0].mlp.down_proj.quant_method
    assert isinstance(method, OnlineFp8BlocksLinearMethod) and (method.block_n, method.block_k) == (1, None)
    assert _ours(tiny_llama_dir, quantization="ptpc_fp8") == _ours(tiny_llama_dir, quantization="fp8_per_channel")


def test_targets_quantize_the_layers_they_match_alone(tmp_path, tiny_llama_dir, default_tokenizer):
    """quantization_config's `targets` (vLLM's): attention in fp8 per channel, the MLPs left in float; transformers'
    tokens on those weights."""
    from pagellm.layers.quantization.online import OnlineFp8BlocksLinearMethod

    config = {"targets": {"re:.*self_attn.*": "fp8_per_channel"}}
    source = loader.resolve_model(tiny_llama_dir)
    hf_config, _ = loader.load_hf_config(source)
    model = loader.load_model(source, hf_config, None, torch.float32, torch.device("cpu"), 64, online_config=config)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.quant_method, OnlineFp8BlocksLinearMethod)
    assert isinstance(layer.mlp.down_proj.quant_method, UnquantizedLinearMethod)
    ours = _ours(tiny_llama_dir, quantization_config=config)
    theirs = _hf(_online_dequantized(tiny_llama_dir, tmp_path / "dequantized", "fp8_per_channel", "self_attn"),
                 default_tokenizer)
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in theirs]


def test_online_int8_weight_only_and_ignored_layers(tmp_path, tiny_llama_dir, default_tokenizer):
    """quantization_config's int8 weights per output channel for the linear layers (experts_int8's format), the
    layers `ignore` names left in float: transformers' tokens on those weights, the ignored ones as they were."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pagellm.layers.quantization.experts_int8 import int8_channel_weight
    from pagellm.ops.wna16 import dequantize

    from pagellm.layers.quantization.experts_int8 import OnlineInt8WeightOnlyMethod

    config = {"linear": "int8_per_channel_static", "ignore": ["re:.*down_proj$", "model.layers.2.*"]}
    source = loader.resolve_model(tiny_llama_dir)
    hf_config, _ = loader.load_hf_config(source)
    model = loader.load_model(source, hf_config, None, torch.float32, torch.device("cpu"), 64, online_config=config)
    layers = model.model.layers
    assert isinstance(layers[1].self_attn.qkv_proj.quant_method, OnlineInt8WeightOnlyMethod)
    assert all(isinstance(linear.quant_method, UnquantizedLinearMethod) for linear in (
        layers[0].mlp.down_proj, layers[2].self_attn.qkv_proj, layers[2].mlp.gate_up_proj, model.lm_head))
    ours = _ours(tiny_llama_dir, quantization_config=config)
    tensors = load_file(f"{tiny_llama_dir}/model.safetensors")
    for layer in range(2):
        for parts in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
                      ("self_attn.o_proj",)):
            names = [f"model.layers.{layer}.{part}.weight" for part in parts]
            fused = torch.cat([tensors[name] for name in names])
            dequantized = dequantize(int8_channel_weight(fused))
            for name, piece in zip(names, dequantized.split([tensors[n].shape[0] for n in names])):
                tensors[name] = piece.contiguous()
    shutil.copytree(tiny_llama_dir, tmp_path / "dequantized")
    save_file(tensors, f"{tmp_path}/dequantized/model.safetensors")
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in _hf(str(tmp_path / "dequantized"),
                                                                           default_tokenizer)]


def test_online_quantization_keeps_one_layer_in_float_at_a_time(tiny_llama_dir, monkeypatch):
    """Each layer's float weight exists from its first checkpoint tensor until its last shard has loaded: the
    float copies of the whole model never exist together."""
    live: set[int] = set()
    most = []
    load, finish = OnlineQuantizedLinearMethod._load, OnlineQuantizedLinearMethod._finish

    def tracked_load(self, layer, param, tensor, shard=None):
        live.add(id(layer))
        most.append(len(live))
        load(self, layer, param, tensor, shard)

    def tracked_finish(self, layer):
        finish(self, layer)
        live.discard(id(layer))

    monkeypatch.setattr(OnlineQuantizedLinearMethod, "_load", tracked_load)
    monkeypatch.setattr(OnlineQuantizedLinearMethod, "_finish", tracked_finish)
    model = _load(tiny_llama_dir, quantization="int8")
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and
              isinstance(m.quant_method, OnlineQuantizedLinearMethod)]
    assert len(layers) == 12 and not live
    assert max(most) <= 2  # at most a fused layer waiting for its last shard while another loads
    assert all(layer.weight.numel() == 0 and layer.online_kernel is not None for layer in layers)


def test_dummy_weights_load_for_every_8_bit_format(tmp_path, tiny_llama_dir):
    quantized, _ = write_quantized(tiny_llama_dir, tmp_path, "fp8-channel-dynamic")
    source = loader.resolve_model(quantized)
    config, _ = loader.load_hf_config(source)
    model = loader.load_model(source, config, None, torch.float32, torch.device("cpu"), 64, "dummy")
    assert model.model.layers[0].mlp.down_proj.fp8_linear is not None
    source = loader.resolve_model(tiny_llama_dir)
    config, _ = loader.load_hf_config(source)
    model = loader.load_model(source, config, None, torch.float32, torch.device("cpu"), 64, "dummy",
                              quantization="int8")
    layer = model.model.layers[0].mlp.down_proj
    assert layer.online_kernel is not None and layer.weight.numel() == 0


# ---- configs: what is taken and what is refused, naming it (no engine) --------------------------------------

def _config(**group_changes) -> dict:
    config = compressed_tensors_config("int8-channel-dynamic")
    config["config_groups"]["group_0"].update(group_changes)
    return config


def test_compressed_tensors_layers_take_their_group_or_stay_dense():
    config = CompressedTensorsConfig.from_config(
        {**_config(targets=["re:.*self_attn.*"]), "ignore": ["lm_head", "model.layers.1.self_attn.o_proj"]})
    assert isinstance(config.linear_method("model.layers.0.self_attn.qkv_proj"), Int8LinearMethod)
    assert isinstance(config.linear_method("model.layers.0.mlp.gate_up_proj"), UnquantizedLinearMethod)
    assert isinstance(config.linear_method("model.layers.1.self_attn.o_proj"), UnquantizedLinearMethod)
    assert isinstance(config.linear_method("model.embed_tokens"), UnquantizedLinearMethod)
    assert "int8 channel weights, dynamic token activations" in config.describe()
    mixed = CompressedTensorsConfig.from_config({**_config(), "ignore": ["model.layers.0.self_attn.k_proj"]})
    with pytest.raises(ValueError, match="qkv_proj fuses .*quantized alike"):
        mixed.linear_method("model.layers.0.self_attn.qkv_proj")


@pytest.mark.parametrize("change, words", [
    (dict(format="mxfp4-pack-quantized"), "format 'mxfp4-pack-quantized'"),
    (dict(format="pack-quantized"), "8-bit weights with 8-bit int activations (W8A8)"),
    (dict(weights={"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}), "4-bit int weights"),
    (dict(weights={"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}), "asymmetric weights"),
    (dict(weights={"num_bits": 8, "type": "int", "strategy": "group", "group_size": 128}), "strategy 'group'"),
    (dict(input_activations=None), "without input_activations"),
    (dict(input_activations={"num_bits": 8, "type": "int", "symmetric": False, "strategy": "token",
                             "dynamic": True}), "asymmetric int8 activations"),
])
def test_unsupported_compressed_tensors_schemes_are_refused_naming_them(change, words):
    with pytest.raises(ValueError) as refusal:
        CompressedTensorsConfig.from_config(_config(**change))
    assert words in str(refusal.value) and "W8A8 int8" in str(refusal.value)


def test_kv_cache_schemes_are_described_and_misplaced_methods_refused():
    config = CompressedTensorsConfig.from_config({**_config(), "kv_cache_scheme": {"num_bits": 8, "type": "float"}})
    assert "kv_cache_scheme's scales not used" in config.describe()
    assert config.skipped_tensor("model.layers.0.self_attn.k_scale")
    assert not config.skipped_tensor("model.layers.0.self_attn.k_proj.weight_scale")
    with pytest.raises(ValueError, match="needs a checkpoint whose config.json holds a compressed-tensors"):
        quantization_config_for({}, "compressed-tensors")
    with pytest.raises(ValueError, match="quantization='int8' but the checkpoint is quantized with"):
        quantization_config_for({"quantization_config": _config()}, "int8")
    assert "online W8A8" in quantization_config_for({}, "int8").describe()
    assert "one scale per weight" in quantization_config_for({}, "fp8").describe()
    assert "block-wise scales of [128, 128]" in quantization_config_for(
        {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                 "weight_block_size": [128, 128]}}).describe()


def test_engine_args_accept_the_8_bit_methods():
    for method in ("compressed-tensors", "fp8", "int8"):
        assert EngineArgs(quantization=method).quantization == method
    with pytest.raises(ArgumentValueError, match="quantization='awq4'"):
        EngineArgs(quantization="awq4")


def test_block_scales_that_do_not_tile_a_layer_are_refused(tmp_path, tiny_llama_dir):
    quantized, _ = write_quantized(tiny_llama_dir, tmp_path, "fp8-block-dynamic", "fp8")
    import json

    config_path = f"{quantized}/config.json"
    config = json.loads(open(config_path).read())
    config["quantization_config"]["weight_block_size"] = [48, 64]
    open(config_path, "w").write(json.dumps(config))
    with pytest.raises(ValueError, match=r"block-wise scales of \[48, 64\] need each output shard"):
        _load(quantized)


def test_the_compressed_tensors_package_reads_our_layout(tmp_path, tiny_llama_dir):
    """Cross-check (where `compressed-tensors` is installed): its QuantizationConfig parses our config and its
    compressors decompress our tensors to our dequantized weights, and compress the float weights to ours."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from safetensors.torch import load_file

    for scheme in ("int8-channel-dynamic", "int8-tensor-static", "fp8-channel-dynamic", "fp8-block-dynamic"):
        quantized, dequantized = write_quantized(tiny_llama_dir, tmp_path / scheme, scheme)
        config = compressed_tensors_config(scheme)
        parsed = QuantizationConfig.model_validate(config)
        group = parsed.config_groups["group_0"]
        assert isinstance(group, QuantizationScheme)
        compressor = BaseCompressor.get_value_from_registry(config["format"])
        ours, floats = load_file(f"{quantized}/model.safetensors"), load_file(f"{dequantized}/model.safetensors")
        original = load_file(f"{tiny_llama_dir}/model.safetensors")
        module = "model.layers.1.self_attn.k_proj"
        state = {"weight": ours[f"{module}.weight"], "weight_scale": ours[f"{module}.weight_scale"]}
        decompressed = compressor.decompress(state, group)["weight"]
        assert torch.equal(decompressed.float(), floats[f"{module}.weight"]), (ct.__version__, scheme)
        compressed = compressor.compress({"weight": original[f"{module}.weight"],
                                          "weight_scale": ours[f"{module}.weight_scale"]}, group)["weight"]
        assert torch.equal(compressed.view(torch.uint8), ours[f"{module}.weight"].view(torch.uint8)), scheme


@pytest.mark.parametrize("source", ["int8", "fp8", "fp8-block-dynamic"])
def test_8_bit_layers_take_the_direct_path_and_compute_what_their_modules_do(source, tmp_path, tiny_llama_dir,
                                                                           monkeypatch):
    """The int8 and fp8 layers' prepared products make LlamaModel's direct path (decode steps without the layers'
    module calls); it generates what the modules do, bit for bit."""
    from pagellm.models.llama import LlamaDecoderLayer

    monkeypatch.setenv("PAGELLM_DECODE_STACK", "0")  # int8's decode stack would take its decode steps
    if source in ("int8", "fp8"):
        llm = LLM(tiny_llama_dir, **{**ENGINE, "dtype": "bfloat16"}, quantization=source)
    else:
        llm = LLM(write_quantized(tiny_llama_dir, tmp_path / source, source, fmt="fp8")[0],
                  **{**ENGINE, "dtype": "bfloat16"})
    model = llm.llm_engine.core.runner.model.model
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=TOP)

    def run():
        outputs = llm.generate(CASE_PROMPTS, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    assert model.direct_layers() is not None
    direct = run()
    monkeypatch.setattr(LlamaDecoderLayer, "direct", lambda self, ops: None)
    model.reset_direct_layers()
    assert model.direct_layers() is None
    assert run() == direct
