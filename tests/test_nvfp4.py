"""NVFP4 checkpoints (compressed-tensors' NVFP4A16 / NVFP4, ModelOpt's NVFP4 / W4A16_NVFP4) kept in 4 bits as the GGUF
kernels' NVFP4_F16 blocks (pagellm/layers/quantization/nvfp4.py).

The checkpoints are written by compressed-tensors' own NVFP4 code (tests/nvfp4_checkpoints.py), which is also the
reference: its packing for the codes, its dequantization (in float32) for the weights, its ModelOpt converter for
ModelOpt's names. The engine's greedy output equals transformers' on a float checkpoint of those dequantized weights
where the kernels multiply on their dequantized tiles (the blocks' one rounding, each scale's to f16, is far below
what flips a token of these models); their int8 products are checked against the dense layers and, through the
engine, as vLLM's check_logprobs_close compares."""

from __future__ import annotations

import logging

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.layers.fused_moe import FusedMoE
from pagellm.layers.linear import LinearBase
from pagellm.layers.quantization import quantization_config_for
from pagellm.layers.quantization.compressed_tensors import CompressedTensorsConfig
from pagellm.layers.quantization.gguf import GGUFWeight
from pagellm.layers.quantization.modelopt import ModelOptNvFp4Config
from pagellm.layers.quantization.nvfp4 import (COMPRESSED_TENSORS, E2M1_VALUES, MODELOPT, NVFP4LinearMethod,
                                               e2m1_values, kept_blocks, read_weight)
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.models import gguf_quants, loader
from pagellm.ops import gguf_kernels as gk
from tests.helpers import (PROMPTS, check_logprobs_close, decoder_linear_bytes, hf_greedy,
                           hf_greedy_with_top_logprobs)
from tests.nvfp4_checkpoints import (INPUT_GLOBAL_SCALE, as_modelopt, compress, compressed_checkpoint,
                                     compressed_tensors_config, decompress, modelopt_config, write_checkpoint,
                                     write_float)

LOGGER = "pagellm.layers.quantization.nvfp4"
CT_NAMES = {"packed": "weight_packed", "scales": "weight_scale", "global": "weight_global_scale"}
MAX_TOKENS = 8
CASE_PROMPTS = PROMPTS[:6]
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=16 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
# name -> (flavour, variant, config nested in hf_quant_config.json)
FLAVOURS = {
    "ct-nvfp4a16": ("compressed-tensors", "NVFP4A16", False),
    "ct-nvfp4-w4a4": ("compressed-tensors", "NVFP4", False),
    "modelopt-nvfp4-nested": ("modelopt", "NVFP4", True),
    "modelopt-w4a16-flat": ("modelopt", "W4A16_NVFP4", False),
}


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A random weight with an all-zero group and a row of a wider range than the rest."""
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    weight[0, :16] = 0
    weight[1] *= 40
    return weight


def _ct_parts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {piece: tensors[name] for piece, name in CT_NAMES.items()}


# ---- the format, against compressed-tensors' own code ---------------------------------------------------------


def test_codes_are_read_as_compressed_tensors_packs_them():
    """Every e2m1 value through the package's packer: element 2i in byte i's low nibble, the sign in bit 3."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    values = torch.cat([E2M1_VALUES, E2M1_VALUES.flip(0)]).view(1, 32)
    packed = pack_fp4_to_uint8(values)
    codes = torch.cat([torch.arange(16), torch.arange(15, -1, -1)]).to(torch.uint8)
    assert torch.equal(packed[0], codes[0::2] | (codes[1::2] << 4))
    assert torch.equal(e2m1_values(packed), values) and torch.equal(e2m1_values(packed).signbit(), values.signbit())


@pytest.mark.parametrize("shape", [(48, 128), (8, 512)])
def test_kept_blocks_hold_compressed_tensors_weights_within_the_f16_scale_rounding(shape):
    tensors = compress(_weight(*shape))
    expected = decompress(tensors)
    weight = read_weight("m.weight", _ct_parts(tensors), COMPRESSED_TENSORS)
    assert torch.equal(weight.dequantize(), expected)  # the dense fallback: the package's arithmetic
    kept = kept_blocks("m.weight", weight)
    assert kept.type_name == "NVFP4_F16" and kept.data.shape == (shape[0], shape[1] // 32 * 20)
    ours = torch.from_numpy(gguf_quants.dequantize(kept.data.numpy(), 1003, shape))
    # each 16 weights' scale (fp8 scale / global scale) rounded once to f16: 2^-11 of it, below f16's normals its
    # steps of 2^-24 (times the largest code, 6, and the grid's factor 2)
    assert torch.all((ours - expected).abs() <= 2.0 ** -11 * expected.abs() + 12 * 2.0 ** -24)
    assert (ours != expected).any()  # the bound is what is tested, not an exact copy


def test_modelopt_names_are_compressed_tensors_converters_mapping():
    """ModelOpt's tensors of the same weight (weight_scale_2 = 1 / weight_global_scale): the package's converter
    takes them back to its own names and values, and pagellm reads them as the package dequantizes."""
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

    tensors = compress(_weight(32, 64))
    stored = as_modelopt(tensors, w4a4=True)
    back = ModelOptNvfp4Converter(targets=["re:.*"]).process({f"m.{k}": v for k, v in stored.items()})
    assert torch.equal(back["m.weight_packed"], tensors["weight_packed"])
    assert torch.allclose(back["m.weight_global_scale"], tensors["weight_global_scale"].reshape(()), rtol=1e-6)
    assert back["m.input_global_scale"].item() == pytest.approx(INPUT_GLOBAL_SCALE, rel=1e-6)
    parts = {"packed": stored["weight"], "scales": stored["weight_scale"], "global": stored["weight_scale_2"]}
    ours = read_weight("m.weight", parts, MODELOPT).dequantize()
    assert torch.allclose(ours, decompress(tensors), rtol=2.0 ** -22, atol=0)


# ---- loading: the grouping of a weight's tensors ---------------------------------------------------------------


def _stream(module: str, tensors: dict[str, torch.Tensor]):
    return iter([(f"{module}.{key}", value) for key, value in sorted(tensors.items())])


def test_a_weight_of_inputs_no_multiple_of_32_runs_dense_said_in_the_log(caplog):
    config = CompressedTensorsConfig.from_config(compressed_tensors_config("NVFP4A16"))
    assert isinstance(config.linear_method("model.layers.0.mlp.down_proj"), NVFP4LinearMethod)
    assert isinstance(config.linear_method("model.layers.0.mlp.gate_up_proj"), NVFP4LinearMethod)
    odd, whole = compress(_weight(8, 48)), compress(_weight(8, 64))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ((name, dense),) = config.checkpoint_tensors(_stream("model.layers.0.mlp.down_proj", odd))
        ((_, kept),) = config.checkpoint_tensors(_stream("model.layers.0.mlp.up_proj", whole))
    assert name == "model.layers.0.mlp.down_proj.weight" and torch.equal(dense, decompress(odd))
    assert "model.layers.0.mlp.down_proj.weight runs dequantized" in caplog.text and "48 input features" in caplog.text
    assert isinstance(kept, GGUFWeight) and kept.type_name == "NVFP4_F16" and kept.data.shape == (8, 40)


def test_modules_the_format_does_not_take_and_input_scales(caplog):
    """A quantized module of a layer built otherwise (a router made unquantized) arrives dequantized; a W4A4
    checkpoint's input scale is passed over whichever side of the weight it comes; float tensors pass as they are."""
    config = quantization_config_for({"quantization_config": modelopt_config("NVFP4", nested=False)[0]})
    assert isinstance(config, ModelOptNvFp4Config)
    config.linear_method("model.layers.0.self_attn.o_proj")
    tensors = compress(_weight(16, 64))
    router = [("model.layers.0.mlp.gate.input_scale", torch.tensor(0.5))]
    router += [(f"model.layers.0.mlp.gate.{k}", v) for k, v in as_modelopt(tensors, w4a4=False).items()]
    served = [(f"model.layers.0.self_attn.o_proj.{k}", v) for k, v in as_modelopt(tensors, w4a4=True).items()]
    norm = ("model.norm.weight", torch.ones(64))
    got = dict(config.checkpoint_tensors(iter([*router, *served, norm])))
    assert sorted(got) == ["model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.o_proj.weight",
                           "model.norm.weight"]
    assert torch.allclose(got["model.layers.0.mlp.gate.weight"], decompress(tensors), rtol=2.0 ** -22, atol=0)
    assert isinstance(got["model.layers.0.self_attn.o_proj.weight"], GGUFWeight)
    assert got["model.norm.weight"] is norm[1]


def test_an_incomplete_or_misshapen_weight_is_refused_naming_it():
    config = CompressedTensorsConfig.from_config(compressed_tensors_config("NVFP4A16"))
    tensors = compress(_weight(8, 64))
    del tensors["weight_global_scale"]
    with pytest.raises(ValueError, match=r"NVFP4 weight model\.layers\.0\.mlp\.up_proj is incomplete"):
        list(config.checkpoint_tensors(_stream("model.layers.0.mlp.up_proj", tensors)))
    parts = _ct_parts(compress(_weight(8, 64)))
    with pytest.raises(ValueError, match=r"m\.weight: .*weight_scale is torch\.float32"):
        read_weight("m.weight", {**parts, "scales": parts["scales"].float()}, COMPRESSED_TENSORS)
    with pytest.raises(ValueError, match=r"m\.weight: .*\(8, 32\) and weight_scale \(8, 2\)"):
        read_weight("m.weight", {**parts, "scales": parts["scales"][:, :2]}, COMPRESSED_TENSORS)


# ---- the configs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["NVFP4A16", "NVFP4"])
def test_compressed_tensors_schemes_are_read(variant, caplog):
    config = quantization_config_for({"quantization_config": compressed_tensors_config(variant)})
    assert isinstance(config, CompressedTensorsConfig)
    assert isinstance(config.linear_method("model.layers.0.self_attn.qkv_proj"), NVFP4LinearMethod)
    assert isinstance(config.linear_method("lm_head"), UnquantizedLinearMethod)
    assert isinstance(config.linear_method("model.embed_tokens"), UnquantizedLinearMethod)
    assert "nvfp4 weights (e2m1 in groups of 16" in config.describe()
    w4a4 = variant == "NVFP4"
    assert ("4-bit float activations (run unquantized" in config.describe()) == w4a4
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert list(config.checkpoint_tensors(iter([]))) == []  # said as the checkpoint is read
    assert "compressed-tensors NVFP4: weights kept in 4 bits" in caplog.text
    assert "activations in the model's dtype" in caplog.text
    assert ("activation quantization (input scales) is not applied" in caplog.text) == w4a4


@pytest.mark.parametrize("algo, nested", [("NVFP4", True), ("W4A16_NVFP4", False)])
def test_modelopt_algorithms_are_read_flat_or_nested(algo, nested, caplog):
    flat, hf_quant = modelopt_config(algo, nested)
    config = quantization_config_for({"quantization_config": flat or {"quant_method": "modelopt", **hf_quant}})
    assert isinstance(config, ModelOptNvFp4Config)
    assert isinstance(config.linear_method("model.layers.0.mlp.gate_up_proj"), NVFP4LinearMethod)
    assert isinstance(config.linear_method("lm_head"), UnquantizedLinearMethod)
    assert f"modelopt {algo} (e2m1 weights in groups of 16" in config.describe()
    assert ("input scales not applied" in config.describe()) == (algo == "NVFP4")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        list(config.checkpoint_tensors(iter([])))
    assert "modelopt NVFP4: weights kept in 4 bits" in caplog.text
    assert ("activation quantization (input scales) is not applied" in caplog.text) == (algo == "NVFP4")


def _ct_group(**weights) -> dict:
    config = compressed_tensors_config("NVFP4A16")
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


@pytest.mark.parametrize("config, words", [
    (_ct_group(group_size=32), "group_size=32"),
    (_ct_group(strategy="group"), "strategy 'group'"),
    (_ct_group(num_bits=8), "8-bit float weights in the nvfp4-pack-quantized format"),
    ({**compressed_tensors_config("NVFP4A16"), "format": "mxfp4-pack-quantized"}, "format 'mxfp4-pack-quantized'"),
])
def test_compressed_tensors_nvfp4_variants_pagellm_does_not_read_are_refused_naming_them(config, words):
    with pytest.raises(ValueError) as refusal:
        quantization_config_for({"quantization_config": config})
    assert words in str(refusal.value) and "NVFP4A16 and NVFP4" in str(refusal.value)


def test_compressed_tensors_nvfp4_with_other_activations_is_refused_naming_them():
    config = compressed_tensors_config("NVFP4")
    config["config_groups"]["group_0"]["input_activations"].update(num_bits=8, strategy="token")
    with pytest.raises(ValueError, match="NVFP4 weights with 8-bit float activations"):
        quantization_config_for({"quantization_config": config})


def test_modelopt_other_group_sizes_and_algorithms_are_refused_naming_them():
    flat, _ = modelopt_config("NVFP4", nested=False, group_size=32)
    with pytest.raises(ValueError, match="modelopt NVFP4 with group_size=32: NVFP4 scales groups of 16"):
        quantization_config_for({"quantization_config": flat})
    _, nested = modelopt_config("W4A16_NVFP4", nested=True, group_size=8)
    with pytest.raises(ValueError, match="modelopt W4A16_NVFP4 with group_size=8"):
        quantization_config_for({"quantization_config": {"quant_method": "modelopt", **nested}})
    with pytest.raises(ValueError, match="quant_algo 'MXFP8' is not supported.*NVFP4, W4A16_NVFP4"):
        quantization_config_for({"quantization_config": {"quant_method": "modelopt", "quant_algo": "MXFP8"}})


def test_vllms_modelopt_fp4_name_takes_nvfp4_checkpoints_only():
    flat, _ = modelopt_config("NVFP4", nested=False)
    assert isinstance(quantization_config_for({"quantization_config": flat}, "modelopt_fp4"), ModelOptNvFp4Config)
    fp8 = {"quant_method": "modelopt", "quant_algo": "FP8"}
    with pytest.raises(ValueError, match="'modelopt_fp4' is vLLM's name for ModelOpt's NVFP4 checkpoints; this one "
                                         "is FP8"):
        quantization_config_for({"quantization_config": fp8}, "modelopt_fp4")
    with pytest.raises(ValueError, match="'modelopt_fp4' is vLLM's name for kernels of modelopt checkpoints; this "
                                         "checkpoint is not quantized"):
        quantization_config_for({}, "modelopt_fp4")


# ---- checkpoints in the engine -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tiny_llama_dir, module_tmp_path_factory) -> dict[str, str]:
    """flavour -> its checkpoint of the tiny Llama, and "float" -> the checkpoint of the dequantized weights."""
    modules, dequantized = compressed_checkpoint(tiny_llama_dir)
    root = module_tmp_path_factory.mktemp("nvfp4")
    dirs = {"float": write_float(tiny_llama_dir, root / "float", dequantized)}
    for name, (flavour, variant, nested) in FLAVOURS.items():
        dirs[name] = write_checkpoint(tiny_llama_dir, root / name, modules, flavour, variant, nested)
    return dirs


@pytest.fixture(scope="module")
def reference(checkpoints, default_tokenizer) -> list[tuple[list[int], list[dict]]]:
    """transformers' greedy continuations and top-5 logprobs on the dequantized weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints["float"], dtype=torch.float32).eval()
    return [hf_greedy_with_top_logprobs(model, default_tokenizer.encode(p), MAX_TOKENS, 5) for p in CASE_PROMPTS]


def _outputs(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[dict]]]:
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _assert_kept_in_nvfp4_blocks(layers: list[LinearBase]) -> None:
    """Every layer on the NVFP4 method, its shards NVFP4_F16 blocks on the kernels: 20 bytes per 32 weights."""
    for layer in layers:
        assert isinstance(layer.quant_method, NVFP4LinearMethod), layer.prefix
        assert isinstance(layer.quant_method.ops, gk.GGUFKernels), "the C kernels were not built"
        assert [part.type_name for part in layer.quantized_parts] == ["NVFP4_F16"], layer.prefix
        assert layer.weight.dtype == torch.uint8
        assert layer.weight.numel() == layer.output_size * layer.input_size // 32 * 20, layer.prefix


def _decoder_linears(llm: LLM) -> list[LinearBase]:
    model = llm.llm_engine.core.runner.model
    return [m for name, m in model.named_modules() if isinstance(m, LinearBase) and ".layers." in name]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_greedy_output_equals_transformers_on_the_dequantized_weights(flavour, checkpoints, reference,
                                                                      dequantized_tiles):
    llm = LLM(checkpoints[flavour], **ENGINE)
    layers = _decoder_linears(llm)
    _assert_kept_in_nvfp4_blocks(layers)
    model = llm.llm_engine.core.runner.model
    assert isinstance(model.lm_head.quant_method, UnquantizedLinearMethod)  # the checkpoint's ignored head
    assert decoder_linear_bytes(llm) == sum(layer.output_size * layer.input_size * 20 // 32 for layer in layers)
    ours = _outputs(llm, CASE_PROMPTS)
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in reference]


def test_the_int8_products_stay_close_to_the_dequantized_weights(checkpoints, reference):
    """The kernels' default products quantize activations per 32 (as llama.cpp's): each layer within 2% of the
    dense one (~0.5%; a wrong nibble or scale would be tens of percent), and the engine's continuations close to
    transformers' (a near-tie may flip, these random models have some)."""
    def load(path: str) -> torch.nn.Module:
        source = loader.resolve_model(path)
        config, _ = loader.load_hf_config(source)
        return loader.load_model(source, config, None, torch.float32, torch.device("cpu"), 64)

    quantized, dense = load(checkpoints["ct-nvfp4a16"]), dict(load(checkpoints["float"]).named_modules())
    generator = torch.Generator().manual_seed(0)
    for name, layer in quantized.named_modules():
        if isinstance(layer, LinearBase) and ".layers." in name:
            for rows in (1, 7, 80):  # the row kernel, and from 64 rows the 512-bit tiles where the build has them
                x = torch.randn(rows, layer.input_size, generator=generator)
                expected = dense[name](x)
                assert (layer(x) - expected).norm() <= 0.02 * expected.norm(), (name, rows)
    ours = _outputs(LLM(checkpoints["ct-nvfp4a16"], **ENGINE), CASE_PROMPTS)
    for mine, theirs in zip(ours, reference):
        check_logprobs_close(mine, theirs)


def test_mixture_of_experts_experts_stay_in_nvfp4(module_tmp_path_factory, default_tokenizer, dequantized_tiles):
    """A Qwen3-MoE's experts are the format's linear layers (ExpertLinearsMoEMethod), in NVFP4_F16 blocks too; its
    routers ignored, as llm-compressor's recipes leave them."""
    from transformers import AutoModelForCausalLM

    from tests.models.test_moe_quantized import _qwen3_moe
    from tests.models.tiny_checkpoints import save_tiny_checkpoint

    root = module_tmp_path_factory.mktemp("nvfp4-moe")
    source = save_tiny_checkpoint(_qwen3_moe, default_tokenizer, root / "source")
    modules, dequantized = compressed_checkpoint(source)
    quantized = write_checkpoint(source, root / "quantized", modules, "compressed-tensors", "NVFP4A16",
                                 ignore=("lm_head", "re:.*mlp.gate$"))
    hf = AutoModelForCausalLM.from_pretrained(write_float(source, root / "float", dequantized), dtype=torch.float32)
    llm = LLM(quantized, **ENGINE)
    experts = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(len(layer.expert_gate_up) == 8 for layer in experts)
    _assert_kept_in_nvfp4_blocks([linear for layer in experts for linear in (*layer.expert_gate_up,
                                                                             *layer.expert_down)])
    prompts = CASE_PROMPTS[:3]
    ours = _outputs(llm, prompts)
    for (tokens, _), prompt in zip(ours, prompts):
        assert tokens == hf_greedy(hf.eval(), default_tokenizer, default_tokenizer.encode(prompt), MAX_TOKENS,
                                   ignore_eos=True), prompt
