"""vLLM's online quantization frontend: `quantization=` shorthands and `quantization_config`, resolved without
torch (pagellm/online_quantization.py), refused naming the value and what is taken, and their weight formats'
scales (w8a8_kernels.quantize_fp8_blocks). The engine runs them in tests/test_w8a8.py (dense layers) and
tests/models/test_moe_quantized.py (experts)."""

from __future__ import annotations

import pytest
import torch

from pagellm.config import ArgumentValueError, EngineArgs
from pagellm.entrypoints.cli import build_parser, engine_args_from
from pagellm.layers.quantization import quantization_config_for
from pagellm.layers.quantization.online import OnlineConfig, OnlineFp8BlocksLinearMethod
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.online_quantization import SHORTHANDS, OnlineSpec, resolve
from pagellm.ops import w8a8_kernels as wk


def test_each_shorthand_is_vllms_spec_and_the_config_overrides_its_fields():
    assert resolve("fp8_per_channel", None) == OnlineSpec("fp8_per_channel_static", "fp8_per_channel_static")
    assert resolve("int8_per_channel_weight_only", None) == OnlineSpec(None, "int8_per_channel_static")
    assert resolve(None, None) is None and resolve("fp8", None) is None and resolve("awq", None) is None
    assert resolve("fp8_per_block", {"moe": "mxfp8", "ignore": ["lm_head"]}) == OnlineSpec(
        "fp8_per_block_static", "mxfp8", ("lm_head",))
    # A config alone means online; a spec may be a shorthand (its field), a format's name or {"weight": name}.
    assert resolve(None, {"linear": "fp8_per_tensor", "moe": {"weight": "int8_per_channel_static"}}) == OnlineSpec(
        "fp8_per_tensor_static", "int8_per_channel_static")
    assert resolve("online", {"linear": {"weight": "mxfp8", "activation": None}}) == OnlineSpec("mxfp8", None)


@pytest.mark.parametrize("quantization, config, words", [
    ("online", None, ['"online" needs quantization_config']),
    ("nvfp4_per_token", None, ["'nvfp4_per_token' is not supported", "Blackwell", "fp8_per_channel"]),
    ("gptq", {"linear": "mxfp8"}, ["quantization='gptq'", "only with online quantization"]),
    (None, {"linear": "fp8_per_token"}, ["linear='fp8_per_token'", "an activation format", "fp8_per_channel_static"]),
    (None, {"linear": "fp8_e4m3"}, ["linear='fp8_e4m3' is not a weight format", "mxfp8"]),
    (None, {"moe": "mxfp4"}, ["moe='mxfp4'", "gpt-oss"]),
    (None, {"linear": "int8_per_channel_weight_only"}, ["defines no linear format"]),
    (None, {"linear": {"weight": "mxfp8", "activation": "mxfp8"}}, ["activation overrides are not supported"]),
    (None, {"linear": {"weights": "mxfp8"}}, ["has 'weights'"]),
    (None, {"targets": {"re:.*": "mxfp8"}, "moe": "mxfp8"}, ["targets says each matched layer's format", "`moe`"]),
    (None, {"targets": {"re:.*": "nvfp4_per_token"}}, ["targets['re:.*']='nvfp4_per_token'", "Blackwell"]),
    (None, {"targets": {"re:(": "mxfp8"}}, ["'re:(' is not a regular expression"]),
    (None, {"targets": ["re:.*"]}, ["targets=['re:.*'] must map module patterns to shorthands"]),
    (None, {"bits": 4}, ["'bits'", "linear, moe, ignore, targets"]),
    (None, {"ignore": ["model.layers.0.mlp"]}, ["quantizes nothing", "`linear`"]),
    (None, {"linear": "mxfp8", "ignore": "lm_head"}, ["ignore='lm_head' must be a list"]),
    (None, {"linear": "mxfp8", "ignore": ["re:("]}, ["'re:(' is not a regular expression"]),
    (None, ["mxfp8"], ["must be a dict"]),
])
def test_bad_online_settings_are_refused_naming_them(quantization, config, words):
    with pytest.raises(ValueError) as refusal:
        resolve(quantization, config)
    assert all(word in str(refusal.value) for word in words), str(refusal.value)
    with pytest.raises(ArgumentValueError) as refusal:  # the engine's arguments refuse them before any load
        EngineArgs(quantization=quantization, quantization_config=config)
    assert all(word in str(refusal.value) for word in words), str(refusal.value)


def test_mxfp4_is_gpt_oss_checkpoints_method_not_an_online_format():
    assert EngineArgs(quantization="mxfp4").quantization == "mxfp4"
    with pytest.raises(ValueError, match="does not quantize a float checkpoint"):
        quantization_config_for({}, "mxfp4")


def test_the_command_line_takes_vllms_spelling():
    args = build_parser().parse_args(["serve", "--quantization", "fp8_per_block", "--quantization-config",
                                      '{"ignore": ["re:.*down_proj$"]}'])
    engine = engine_args_from(args)
    assert engine.quantization == "fp8_per_block"
    assert engine.quantization_config == {"ignore": ["re:.*down_proj$"]}
    assert all(EngineArgs(quantization=name).quantization == name for name in SHORTHANDS)


def test_ignore_takes_names_patterns_and_regular_expressions_and_fused_shards_alike():
    config = quantization_config_for({}, "fp8_per_channel", {"ignore": [
        "model.layers.0.self_attn.o_proj", "model.layers.1.*", "re:.*\\.2\\.mlp\\.(gate|up)_proj$",
        "model.layers.3.self_attn.q_proj"]})
    assert isinstance(config, OnlineConfig)
    dense = (
        "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.down_proj",
        "model.layers.2.mlp.gate_up_proj", "model.embed_tokens", "lm_head")
    for prefix in dense:
        assert isinstance(config.linear_method(prefix), UnquantizedLinearMethod), prefix
    for prefix in ("model.layers.0.self_attn.qkv_proj", "model.layers.2.mlp.down_proj"):
        assert isinstance(config.linear_method(prefix), OnlineFp8BlocksLinearMethod), prefix
    with pytest.raises(ValueError, match="qkv_proj fuses .*ignore names only some"):
        config.linear_method("model.layers.3.self_attn.qkv_proj")


def test_targets_give_each_matched_layer_its_shorthands_format_and_leave_the_rest_dense():
    """vLLM's `targets`: {pattern: shorthand}, the shorthand's linear format for a linear layer and its moe format for
    an experts layer; layers no pattern matches stay dense; refused as vLLM refuses them otherwise."""
    config = quantization_config_for({}, None, {"targets": {"re:.*self_attn.*": "fp8_per_channel",
                                                            "re:.*mlp.down_proj$": "mxfp8",
                                                            "re:.*experts$": "int8_per_channel_weight_only"}})
    qkv = config.linear_method("model.layers.0.self_attn.qkv_proj")
    down = config.linear_method("model.layers.3.mlp.down_proj")
    assert isinstance(qkv, OnlineFp8BlocksLinearMethod) and qkv.block_k is None  # per channel
    assert isinstance(down, OnlineFp8BlocksLinearMethod) and down.block_k == 32 and down.power_of_two
    assert config.linear_method("model.layers.0.self_attn.o_proj") is qkv  # one method per format, shared
    for prefix in ("model.layers.0.mlp.gate_up_proj", "lm_head", "model.embed_tokens"):
        assert isinstance(config.linear_method(prefix), UnquantizedLinearMethod), prefix
    assert "int8_per_channel_weight_only" in config.describe()
    partial = quantization_config_for({}, None, {"targets": {"re:.*q_proj$": "mxfp8"}})
    with pytest.raises(ValueError, match="each module needs exactly one pattern, and fused shards the same one"):
        partial.linear_method("model.layers.0.self_attn.qkv_proj")
    experts_only = quantization_config_for({}, None, {"targets": {"re:.*proj$": "int8_per_channel_weight_only"}})
    with pytest.raises(ValueError, match="has no format for linear layers"):
        experts_only.linear_method("model.layers.0.self_attn.o_proj")
    both = quantization_config_for({}, None, {"targets": {"re:.*o_proj$": "mxfp8"}, "ignore": ["*.o_proj"]})
    with pytest.raises(ValueError, match="matches both quantization_config.ignore and targets"):
        both.linear_method("model.layers.0.self_attn.o_proj")


def test_an_already_quantized_checkpoint_is_refused():
    checkpoint = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64}}
    with pytest.raises(ValueError, match="quantization='mxfp8' quantizes a float checkpoint .* with 'awq'"):
        quantization_config_for(checkpoint, "mxfp8")
    with pytest.raises(ValueError, match="quantization_config quantizes a float checkpoint"):
        quantization_config_for(checkpoint, None, {"linear": "mxfp8"})


# ---- the formats' scales --------------------------------------------------------------------------------------


def _weight(rows: int, columns: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, columns, generator=generator) * torch.logspace(-3, 1, rows)[:, None]
    weight[3, 40] = 0.0
    weight[5] = 0.0  # an all-zero row keeps a unit scale
    return weight


def test_per_channel_scales_are_each_rows_max_over_448():
    weight = _weight(24, 200)
    q, scales = wk.quantize_fp8_blocks(weight, 1, 200)
    assert scales.shape == (24, 1)
    expected = weight.abs().amax(dim=1) / wk.FP8_MAX
    expected[5] = 1.0
    assert torch.equal(scales[:, 0], expected)
    assert torch.equal(q, (weight / scales).to(torch.float8_e4m3fn))  # nothing past 448 to clamp


def test_block_scales_cover_partial_blocks_at_the_edges():
    weight = _weight(200, 300)  # 2 x 3 blocks of 128, the last ones partial
    q, scales = wk.quantize_fp8_blocks(weight, 128, 128)
    assert scales.shape == (200, 3)
    for n0, k0 in [(0, 0), (128, 256), (0, 256), (128, 0)]:
        block = weight[n0:n0 + 128, k0:k0 + 128]
        assert torch.all(scales[n0:n0 + 128, k0 // 128] == block.abs().amax() / wk.FP8_MAX)
    dequantized = wk.dequantize_fp8(q, scales, 128)
    assert torch.all((dequantized - weight).abs() <= weight.abs() / 16 + scales.repeat_interleave(128, 1)[:, :300]
                     * 2.0 ** -9)  # half a unit of e4m3's 3 mantissa bits, or of its least subnormal step


def test_mx_scales_are_the_least_powers_of_two_that_keep_each_block_within_448():
    weight = _weight(16, 96)
    weight[7, 32:64] = 0.5 * wk.FP8_MAX / 1024  # a block whose largest weight is a power of two times 448
    q, scales = wk.quantize_fp8_blocks(weight, 1, 32, power_of_two=True)
    assert scales.shape == (16, 3)
    mantissa, _ = torch.frexp(scales)
    assert torch.all(mantissa == 0.5)  # powers of two
    amax = weight.abs().view(16, 3, 32).amax(dim=2)
    used = amax > 0
    assert torch.all(amax[used] / scales[used] <= wk.FP8_MAX)
    assert torch.all(amax[used] / scales[used] > wk.FP8_MAX / 2)
    assert scales[7, 1] == 2.0 ** -11 and torch.all(scales[5] == 1.0)
    assert torch.equal(q, (weight / scales.repeat_interleave(32, 1)).to(torch.float8_e4m3fn))


def test_a_gguf_file_refuses_quantization_it_would_ignore():
    from pagellm import LLM
    from pagellm.layers.quantization import check_source_quantization

    check_source_quantization(True, "gguf", None)
    check_source_quantization(True, None, None)
    with pytest.raises(ValueError, match="quantization_config does not apply to a GGUF file"):
        check_source_quantization(True, None, {"linear": "mxfp8"})
    with pytest.raises(ValueError, match="'gguf' needs a .gguf model file"):
        check_source_quantization(False, "gguf", None)
    with pytest.raises(ValueError, match="quantization='int8' does not apply to a GGUF file"):
        LLM(quantization="int8", max_model_len=128, kv_cache_memory_bytes=16 << 20)  # the default model's GGUF
