"""bitsandbytes checkpoints and quantization="bitsandbytes": reading a checkpoint's 4-bit and 8-bit tensors against
bitsandbytes' own quantization and dequantization (tests/data/bnb_reference.safetensors), the kept NF4 / FP4
blocks within their grid's rounding, the engine's greedy output against pagellm and transformers on the weights
the kernels hold, in-flight NF4, and the refusals."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.config import ArgumentValueError, EngineArgs
from pagellm.layers.linear import LinearBase, QKVParallelLinear
from pagellm.layers.quantization import check_quantization_supported, quantization_config_for
from pagellm.layers.quantization.bitsandbytes import (
    BitsAndBytesConfig,
    Packed4bit,
    bitsandbytes_config,
    kept_4bit,
    quantize_nf4,
    unpack_4bit,
)
from pagellm.layers.quantization.gguf import GGUFWeight
from pagellm.models.gguf_quants import BNB_FP4_CODES, BNB_FP4_VALUES, GRID_SCALE, NF4_CODES, NF4_VALUES
from tests.bnb_checkpoints import dequantize_4bit, kept_weights, quantize_4bit, quantize_8bit, write_bnb, write_float
from tests.helpers import PROMPTS, decoder_linear_bytes, hf_greedy

REFERENCE = Path(__file__).parent / "data" / "bnb_reference.safetensors"
CASES_4BIT = ("nf4_b64_dq", "nf4_b128", "fp4_b64_dq", "fp4_b256", "nf4_b64_rows72")


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(REFERENCE))


def _parts(reference: dict[str, torch.Tensor], case: str) -> dict[str, torch.Tensor]:
    """A case's checkpoint tensors as unpack_4bit takes them (weight, quant_state, absmax, ...)."""
    parts = {}
    for name, tensor in reference.items():
        if name.startswith(f"{case}.weight."):
            key = name.removeprefix(f"{case}.weight.")
            parts["weight" if key == "codes" else "quant_state" if key.startswith("quant_state") else key] = tensor
    return parts


def _state(reference, case) -> dict:
    (key,) = [name for name in reference if name.startswith(f"{case}.weight.quant_state.")]
    return json.loads(bytes(reference[key].tolist()))


# ---- the format, against bitsandbytes' own code ------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES_4BIT)
def test_reading_a_4bit_weight_gives_what_bitsandbytes_dequantizes(reference, case):
    weight = unpack_4bit(case, _parts(reference, case))
    expected = reference[f"{case}.dequantized"]
    if case.startswith("nf4"):
        assert torch.equal(weight.dequantize(), expected)
    else:
        # bitsandbytes' CPU backend multiplies FP4 by its code book rounded to 4 decimals (0.6667 for 2/3, its
        # backends/utils.py); the checkpoint's quant_map, which pagellm reads, holds the exact values.
        scales = weight.absmax.repeat_interleave(weight.blocksize)[: expected.numel()].view(expected.shape)
        assert torch.all((weight.dequantize() - expected).abs() <= 5e-5 * scales)


@pytest.mark.parametrize("case", CASES_4BIT)
def test_the_test_packer_writes_the_codes_bitsandbytes_writes(reference, case):
    state = _state(reference, case)
    nested = reference.get(f"{case}.weight.nested_quant_map")
    ours = quantize_4bit(reference[f"{case}.weight"], state["quant_type"], state["blocksize"], nested)
    assert torch.equal(ours["weight"], reference[f"{case}.weight.codes"])
    assert torch.equal(ours["weight.quant_map"], reference[f"{case}.weight.quant_map"])
    if nested is None:
        assert torch.equal(ours["weight.absmax"], reference[f"{case}.weight.absmax"])
    else:
        # The nested codes of the scales: bitsandbytes' C quantizer and its torch one (which ours follows) may round
        # a scale lying on a midpoint apart; the scales they stand for agree within one step of the code.
        assert torch.equal(ours["weight.nested_absmax"], reference[f"{case}.weight.nested_absmax"])
        assert (ours["weight.absmax"] != reference[f"{case}.weight.absmax"]).float().mean() < 0.02
    assert torch.allclose(dequantize_4bit(ours), reference[f"{case}.dequantized"], rtol=0.05, atol=1e-6)


def test_the_8bit_packer_and_reading_are_bitsandbytes_llm_int8(reference):
    ours = quantize_8bit(reference["int8_rows.weight"].half())
    assert torch.equal(ours["weight"], reference["int8_rows.CB"])
    assert torch.equal(ours["SCB"], reference["int8_rows.SCB"])
    config = BitsAndBytesConfig(8)
    config.served.add("m")
    got = dict(config.checkpoint_tensors(iter([("m.SCB", ours["SCB"]), ("m.weight", ours["weight"]),
                                               ("m.weight_format", ours["weight_format"])])))
    assert sorted(got) == ["m.weight_packed", "m.weight_scale", "m.weight_shape"]
    unsigned = got["m.weight_packed"].view(torch.uint8).view(12, 160).to(torch.int16)
    assert torch.equal(unsigned - 128, ours["weight"].to(torch.int16))
    assert torch.allclose((unsigned - 128) * got["m.weight_scale"], reference["int8_rows.dequantized"], rtol=1e-6)
    assert got["m.weight_shape"].tolist() == [12, 160]


# ---- the blocks the kernels keep -----------------------------------------------------------------------------------


def test_the_grids_are_the_code_books_times_127_rounded():
    for codes, values in ((NF4_CODES, NF4_VALUES), (BNB_FP4_CODES, BNB_FP4_VALUES)):
        assert (abs(values / GRID_SCALE - codes) <= 0.5 / GRID_SCALE).all()
    assert list(NF4_VALUES) == sorted(NF4_VALUES)  # quantize_nf4's bucketize needs it ascending


@pytest.mark.parametrize("case", CASES_4BIT)
def test_kept_blocks_hold_the_weight_within_the_grids_rounding(reference, case, caplog):
    weight = unpack_4bit(case, _parts(reference, case))
    with caplog.at_level(logging.INFO, logger="pagellm.layers.quantization.bitsandbytes"):
        kept = kept_4bit(case, weight)
    if case.endswith("rows72"):  # rows of 72 are no whole blocks of 32: dense, said in the log
        assert kept is None and "72 input features" in caplog.text
        return
    assert kept.type_name == {"nf4": "NF4", "fp4": "BNB_FP4"}[weight.quant_type]
    assert kept.data.shape == (weight.shape[0], weight.shape[1] // 32 * 18)
    rows, cols = weight.shape
    scales = weight.absmax.repeat_interleave(weight.blocksize)[: rows * cols].view(rows, cols)
    error = (kept.dequantize(torch.float32) - weight.dequantize()).abs()
    # the grid's rounding (0.5 / 127 of the absmax) and the scale's to f16 (2^-11 of it)
    assert torch.all(error <= (0.5 / GRID_SCALE + 2.0 ** -10) * scales)


def test_codes_stored_in_another_dtype_read_as_their_bytes(reference):
    """bnb_4bit_quant_storage="bfloat16" (for FSDP) keeps the same bytes in a bfloat16 tensor."""
    parts = _parts(reference, "nf4_b128")
    stored = {**parts, "weight": parts["weight"].flatten().view(torch.bfloat16).unsqueeze(1)}
    assert torch.equal(unpack_4bit("w", stored).dequantize(), unpack_4bit("w", parts).dequantize())
    config = BitsAndBytesConfig(4)
    config.served.add("m")
    stream = [(f"m.weight.{key}" if key != "weight" else "m.weight", value) for key, value in stored.items()
              if key != "quant_state"]
    stream.append(("m.weight.quant_state.bitsandbytes__nf4", parts["quant_state"]))
    ((name, kept),) = list(config.checkpoint_tensors(iter(stream)))
    assert name == "m.weight" and kept.type_name == "NF4" and kept.shape == (8, 384)


def test_a_foreign_code_book_runs_dense(caplog):
    codes = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    weight = Packed4bit(codes, torch.ones(4), torch.linspace(-1, 1, 16), "nf4", 64)
    with caplog.at_level(logging.INFO, logger="pagellm.layers.quantization.bitsandbytes"):
        assert kept_4bit("m.weight", weight) is None
    assert "code book" in caplog.text


def test_in_flight_nf4_picks_the_nearest_grid_value():
    torch.manual_seed(0)
    weight = torch.randn(16, 128) * 0.05
    kept = quantize_nf4(weight)
    values = kept.dequantize(torch.float32).view(16, 4, 32)
    blocks = weight.view(16, 4, 32)
    scale = (blocks.abs().amax(-1) / GRID_SCALE).half().float()
    grid = torch.from_numpy(NF4_VALUES).float()
    candidates = grid[None, None, None, :] * scale[..., None, None]  # every grid value at each block's scale
    best = (candidates - blocks[..., None]).abs().amin(-1)
    assert torch.allclose((values - blocks).abs(), best, atol=1e-7)


# ---- checkpoints in the engine ---------------------------------------------------------------------------------

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=16 << 20)


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoints(tiny_llama_dir, reference, module_tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """variant -> (the bitsandbytes checkpoint, the float one of the weights the kernels hold)."""
    dirs = {}
    for variant in ("nf4_double_quant", "fp4", "int8"):
        root = module_tmp_path_factory.mktemp(variant)
        quantized_dir, dense_dir = root / "quantized", root / "dense"
        if variant == "int8":
            dequantized = write_bnb(tiny_llama_dir, quantized_dir, 8)
        else:
            nested = reference["nf4_b64_dq.weight.nested_quant_map"] if variant == "nf4_double_quant" else None
            write_bnb(tiny_llama_dir, quantized_dir, 4, variant[:3], 64, nested)
            dequantized = kept_weights(quantized_dir)
        write_float(tiny_llama_dir, dense_dir, dequantized)
        dirs[variant] = (quantized_dir, dense_dir)
    return dirs


@pytest.mark.parametrize("variant", ["nf4_double_quant", "fp4", "int8"])
def test_greedy_output_equals_the_kept_weights_in_pagellm_and_transformers(variant, checkpoints, default_tokenizer,
                                                                        torch_ops_only):
    """Token for token on the products' torch path (each layer the kept weights, dequantized once): what the
    loader makes of the checkpoint. The kernels' products are the next test's."""
    from transformers import AutoModelForCausalLM

    quantized_dir, dense_dir = checkpoints[variant]
    ours = _greedy(LLM(str(quantized_dir), **ENGINE))
    assert ours == _greedy(LLM(str(dense_dir), **ENGINE))
    hf = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32).eval()
    for prompt, tokens in list(zip(PROMPTS, ours))[:4]:
        assert tokens == hf_greedy(hf, default_tokenizer, default_tokenizer.encode(prompt), MAX_TOKENS, True), prompt


@pytest.mark.parametrize("variant", ["nf4_double_quant", "fp4", "int8"])
def test_the_kernels_keep_the_checkpoints_bytes_and_multiply_as_its_weights(variant, checkpoints):
    """The native kernels: each layer at its format's bytes, its product within 2% of the kept weights' (the 4-bit
    layers' GGUF kernels quantize activations per 32 at these sizes, as llama.cpp does: ~0.5%; a wrong code or
    nibble would be tens of percent), and decode steps on the direct path."""
    quantized_dir, dense_dir = checkpoints[variant]
    quantized, dense = LLM(str(quantized_dir), **ENGINE), LLM(str(dense_dir), **ENGINE)
    bits = 8 if variant == "int8" else 4.5  # 4-bit: a 2-byte scale per 32 weights
    assert decoder_linear_bytes(quantized) <= 1.1 * bits / 32 * decoder_linear_bytes(dense)
    model = quantized.llm_engine.core.runner.model
    assert model.model.direct_layers() is not None
    dense_layers = dict(dense.llm_engine.core.runner.model.named_modules())
    generator = torch.Generator().manual_seed(0)
    for name, layer in model.named_modules():
        if isinstance(layer, LinearBase) and ".layers." in name:
            x = torch.randn(3, layer.input_size, generator=generator)
            expected = dense_layers[name](x)
            assert (layer(x) - expected).norm() <= 0.02 * expected.norm(), name


def test_in_flight_bitsandbytes_quantizes_the_linear_layers_to_nf4(tiny_llama_dir, tmp_path, torch_ops_only):
    tensors = load_file(str(Path(tiny_llama_dir) / "model.safetensors"))
    expected = {name: quantize_nf4(tensor).dequantize(torch.float32) for name, tensor in tensors.items()
                if name.endswith("_proj.weight")}
    write_float(tiny_llama_dir, tmp_path / "dense", expected)
    in_flight = LLM(tiny_llama_dir, quantization="bitsandbytes", **ENGINE)
    assert _greedy(in_flight) == _greedy(LLM(str(tmp_path / "dense"), **ENGINE))


def test_in_flight_nf4_runs_on_the_blocks(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO):
        in_flight = LLM(tiny_llama_dir, quantization="bitsandbytes", **ENGINE)
    assert "quantized to NF4 blocks of 32 as it loads" in caplog.text
    assert decoder_linear_bytes(in_flight) <= 1.1 * 4.5 / 32 * decoder_linear_bytes(LLM(tiny_llama_dir, **ENGINE))
    # vLLM's older spelling
    args = EngineArgs(model=tiny_llama_dir, load_format="bitsandbytes")
    assert (args.quantization, args.load_format) == ("bitsandbytes", "auto")


# ---- loading: fused checkpoints, modules the format does not build, refusals ---------------------------------------


def test_a_fused_checkpoint_tensor_loads_as_its_shards():
    torch.manual_seed(0)
    weights = {name: torch.randn(size, 64) * 0.05 for name, size in (("q", 64), ("k", 32), ("v", 32))}

    def layer(tensors: dict) -> QKVParallelLinear:
        linear = QKVParallelLinear(64, 16, 4, 2, False, BitsAndBytesConfig(4), "model.layers.0.self_attn.qkv_proj")
        for shard, tensor in tensors.items():
            linear.weight.weight_loader(linear.weight, tensor, shard)
        linear.process_weights_after_loading()
        return linear

    blocks = {shard: kept_4bit("w", unpack_4bit("w", _as_parts(quantize_4bit(w)))) for shard, w in weights.items()}
    fused = GGUFWeight(torch.cat([b.data for b in blocks.values()]), "NF4", 128, 64)
    x = torch.randn(3, 64)
    assert torch.equal(layer({None: fused})(x), layer(blocks)(x))


def _as_parts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"quant_state" if ".quant_state." in key else key.removeprefix("weight."): value
            for key, value in tensors.items()}


def test_a_quantized_module_of_a_layer_built_otherwise_arrives_dequantized():
    tensors = quantize_4bit(torch.randn(8, 64) * 0.05)
    stream = iter([(f"model.layers.0.mlp.gate.{key}", value) for key, value in tensors.items()])
    ((name, weight),) = list(BitsAndBytesConfig(4).checkpoint_tensors(stream))
    assert name == "model.layers.0.mlp.gate.weight" and isinstance(weight, torch.Tensor)
    assert torch.equal(weight, dequantize_4bit(tensors))


def test_an_incomplete_weight_is_refused_naming_it(tiny_llama_dir, tmp_path):
    write_bnb(tiny_llama_dir, tmp_path / "q", 4)
    path = tmp_path / "q" / "model.safetensors"
    tensors = load_file(str(path))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight.quant_map"}, str(path))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is incomplete"):
        LLM(str(tmp_path / "q"), **ENGINE)


def test_a_column_tiled_8bit_weight_is_refused():
    stream = iter([("m.weight_format", torch.tensor(1, dtype=torch.uint8))])
    with pytest.raises(ValueError, match="row format"):
        list(BitsAndBytesConfig(8).checkpoint_tensors(stream))


def test_the_config_is_read_as_transformers_writes_it():
    assert bitsandbytes_config({"quant_method": "bitsandbytes", "load_in_4bit": True}, None).bits == 4
    config = bitsandbytes_config({"quant_method": "bitsandbytes", "load_in_8bit": True,
                                  "llm_int8_skip_modules": ["mlp.gate"]}, None)
    assert config.bits == 8 and config.linear_method("model.layers.0.mlp.gate") is config.dense
    assert config.linear_method("model.layers.0.mlp.down_proj") is config.method
    assert config.linear_method("lm_head") is config.dense
    assert bitsandbytes_config(None, "bitsandbytes").in_flight
    with pytest.raises(ValueError, match="neither load_in_4bit nor load_in_8bit"):
        bitsandbytes_config({"quant_method": "bitsandbytes"}, None)
    checkpoint = {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}
    assert check_quantization_supported(checkpoint, "bitsandbytes") == "bitsandbytes"
    assert quantization_config_for({}, "bitsandbytes").in_flight
    with pytest.raises(ValueError, match="quantization='awq' but the checkpoint is quantized with 'bitsandbytes'"):
        check_quantization_supported(checkpoint, "awq")
    with pytest.raises(ArgumentValueError, match="load_format='bitsandbytes'.*quantization='awq'"):
        EngineArgs(model="m", load_format="bitsandbytes", quantization="awq")
