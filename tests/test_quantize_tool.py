"""`pagellm quantize` (pagellm/compression): GPTQ's rounding against round-to-nearest on correlated inputs, and
its checkpoints read by compressed-tensors' own decompressors and served by pagellm as transformers runs their
dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.compression import oneshot
from pagellm.compression.gptq import FP8_MAX, WeightGrid, gptq, inverse_hessian_factor, round_to_nearest
from pagellm.entrypoints import cli
from tests.helpers import PROMPTS, hf_greedy, run_python

GRIDS = {
    "fp8 per channel": WeightGrid("float", 8, None),
    "int8 per channel": WeightGrid("int", 8, None),
    "int4 groups of 32, bfloat16 scales": WeightGrid("int", 4, 32, torch.bfloat16),
    "int4 groups of 32, zero points": WeightGrid("int", 4, 32, torch.float16, symmetric=False),
    # _weight()'s largest |w| is 3.95: a global scale of 2688 / 5 leaves its groups' fp8 scales room
    "nvfp4": WeightGrid("nvfp4", 4, 16, global_scale=2688 / 5),
}
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
CALIBRATION_TEXT = " ".join(PROMPTS) * 4


def _correlated_inputs(features: int, rows: int = 2048) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    mixing = torch.eye(features) + 0.3 * torch.randn(features, features, generator=generator)
    return torch.randn(rows, features, generator=generator) @ mixing


def _weight(rows: int = 48, columns: int = 256) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_gptq_with_an_identity_hessian_rounds_to_nearest(grid):
    weight = _weight()
    nearest, compensated = round_to_nearest(weight, grid), gptq(weight, torch.eye(256), grid, dampening_frac=0.0)
    assert torch.equal(nearest.codes, compensated.codes)
    assert torch.equal(nearest.scales, compensated.scales)


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_gptq_cuts_the_output_error_on_correlated_inputs(grid):
    weight, inputs = _weight(), _correlated_inputs(256)
    hessian = inputs.T.double() @ inputs.double() / inputs.shape[0]
    nearest, compensated = round_to_nearest(weight, grid), gptq(weight, hessian, grid)
    error = {name: (inputs @ (r.dequantize() - weight).T).norm().item()
             for name, r in (("nearest", nearest), ("gptq", compensated))}
    assert error["gptq"] < 0.85 * error["nearest"], error


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_codes_lie_on_the_grid_and_scales_are_stored_exactly(grid):
    weight, inputs = _weight(), _correlated_inputs(256)
    rounded = gptq(weight, inputs.T @ inputs, grid)
    assert rounded.scales.shape == (48, 256 // (grid.group_size or 256))
    assert torch.equal(rounded.scales.to(grid.scale_dtype).float(), rounded.scales)
    if grid.kind == "nvfp4":  # e2m1 codes; each scale an fp8 value over the global scale
        assert torch.isin(rounded.codes.abs(), E2M1).all()
        fp8 = rounded.scales * grid.global_scale
        assert torch.equal((fp8.to(torch.float8_e4m3fn).float() / torch.tensor(grid.global_scale)), rounded.scales)
    elif grid.kind == "float":
        assert torch.equal(rounded.codes.to(torch.float8_e4m3fn).float(), rounded.codes)
        assert rounded.codes.abs().max() <= FP8_MAX
    else:
        low, high = -(2 ** (grid.bits - 1)), 2 ** (grid.bits - 1) - 1
        for integers in (rounded.codes, rounded.zeros):
            assert torch.equal(integers.round(), integers)
            assert integers.min() >= low and integers.max() <= high
        assert (rounded.zeros != 0).any() != grid.symmetric


def test_an_input_never_seen_rounds_to_nearest_and_a_singular_hessian_is_dampened():
    weight, inputs = _weight(8, 64), _correlated_inputs(64, rows=16)  # rank 16 of 64: singular
    inputs[:, 5] = 0
    hessian = inputs.T @ inputs
    grid = GRIDS["int8 per channel"]
    rounded = gptq(weight, hessian, grid, dampening_frac=0.0)
    assert torch.isfinite(rounded.dequantize()).all()
    assert torch.equal(rounded.codes[:, 5], round_to_nearest(weight, grid).codes[:, 5])
    with pytest.raises(ValueError, match="not positive definite.*calibrate on more tokens"):
        inverse_hessian_factor(-torch.eye(4) - torch.ones(4, 4), 0.01)


def test_a_group_size_that_does_not_divide_the_inputs_is_refused():
    with pytest.raises(ValueError, match="group_size=48 does not divide a layer's 256 inputs"):
        gptq(_weight(), torch.eye(256), WeightGrid("int", 4, 48))


# ---- checkpoints ------------------------------------------------------------------------------------------------


def _write(tmp_path, tiny_llama_dir, scheme: str, **changes) -> str:
    text = tmp_path / "calibration.txt"
    text.write_text(CALIBRATION_TEXT)
    args = oneshot.QuantizeArgs(tiny_llama_dir, str(tmp_path / scheme), scheme, calibration_files=[str(text)],
                                num_samples=4, sample_length=64, **changes)
    return str(oneshot.quantize(args))


@pytest.mark.parametrize("scheme", oneshot.SCHEMES)
def test_compressed_tensors_decompresses_each_scheme_to_our_rounding(scheme):
    """compressed-tensors' own compressor reads the tensors a scheme writes as exactly the weights GPTQ chose."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    chosen = oneshot.SCHEMES[scheme]
    nvfp4 = chosen.kind == "nvfp4"
    grid = WeightGrid(chosen.kind, chosen.bits, 16 if nvfp4 else chosen.group_size and 32, torch.bfloat16,
                      chosen.symmetric)
    grid = grid.with_global_scale([_weight()]) if nvfp4 else grid
    inputs = _correlated_inputs(256)
    rounded = gptq(_weight(), inputs.T @ inputs, grid)
    config = oneshot.compressed_tensors_config(chosen, grid, ["lm_head"])
    parsed = QuantizationConfig.model_validate(config).config_groups["group_0"]
    state = oneshot.module_tensors(rounded, chosen)
    state["weight_scale"] = state["weight_scale"].float()  # the package multiplies in the scales' dtype
    if nvfp4:  # its decompressor rounds into bfloat16: the dequantization itself, in float32
        from tests.nvfp4_checkpoints import decompress
        decompressed = decompress(state)
    else:
        decompressed = BaseCompressor.get_value_from_registry(config["format"]).decompress(state, parsed)["weight"]
    assert torch.equal(decompressed.float(), rounded.dequantize())


def test_nvfp4_rounded_to_nearest_is_compressed_tensors_own_quantization_bit_for_bit():
    """The codes, fp8 scales and global scale compressed-tensors' NVFP4 observer and compressor write for the same
    weight (an all-zero group, a row of a wider range, ties included), byte for byte."""
    pytest.importorskip("compressed_tensors")
    from tests.nvfp4_checkpoints import compress

    weight = _weight() * 0.05
    weight[0, :16] = 0
    weight[1] *= 40
    weight[2, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25]) * weight[2].abs().max() / 6
    grid = WeightGrid("nvfp4", 4, 16).with_global_scale([weight])
    ours, theirs = oneshot.nvfp4_tensors(round_to_nearest(weight, grid)), compress(weight)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name].view(torch.uint8), tensor.reshape(ours[name].shape).view(torch.uint8)), name


def _decompressed(path: str) -> dict[str, torch.Tensor]:
    """Module name -> its weight as compressed-tensors' own compressor dequantizes our tensors."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    config = json.loads(open(f"{path}/config.json").read())["quantization_config"]
    scheme = QuantizationConfig.model_validate(config).config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(config["format"])
    tensors = load_file(f"{path}/model.safetensors")
    modules = {name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight_scale")}
    weights = {}
    for module in modules:
        state = {name.rsplit(".", 1)[1]: t for name, t in tensors.items() if name.rsplit(".", 1)[0] == module}
        state["weight_scale"] = state["weight_scale"].float()
        weights[module] = compressor.decompress(state, scheme)["weight"].float()
    return weights


def _hf_on(path: str, weights: dict[str, torch.Tensor], source: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    for name, weight in weights.items():
        modules[name].weight.data = weight
    return model


@pytest.mark.parametrize("scheme, group_size, ignore", [
    ("FP8_DYNAMIC", None, ["lm_head"]),
    ("W4A16", 32, ["lm_head"]),
    ("W4A16_ASYM", 32, ["lm_head"]),
    ("FP8_DYNAMIC", None, ["lm_head", "re:.*mlp.down_proj$"]),  # a mixed checkpoint: whole names in `ignore`
    ("NVFP4A16", None, ["lm_head"]),
])
def test_pagellm_serves_its_checkpoints_as_transformers_runs_their_weights(tmp_path, tiny_llama_dir,
                                                                           default_tokenizer, scheme, group_size,
                                                                           ignore, request):
    pytest.importorskip("compressed_tensors")
    if scheme == "NVFP4A16":  # its GGUF kernels' int8 products are checked in tests/test_nvfp4.py
        request.getfixturevalue("dequantized_tiles")
    path = _write(tmp_path, tiny_llama_dir, scheme, group_size=group_size, ignore=ignore)
    weights = _decompressed(path)
    dense = [f"model.layers.{i}.mlp.down_proj" for i in range(3)] if len(ignore) > 1 else []
    assert len(weights) == 3 * 7 - len(dense) and not any("lm_head" in name for name in weights)
    config = json.loads(open(f"{path}/config.json").read())["quantization_config"]
    assert config["ignore"] == sorted(["lm_head", *dense])
    reference = _hf_on(path, weights, tiny_llama_dir)
    llm = LLM(path, dtype="float32", max_model_len=128, num_gpu_blocks_override=32, max_num_seqs=4)
    assert "compressed-tensors" in llm.llm_engine.core.runner.model.weight_format
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[7]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = hf_greedy(reference, default_tokenizer, default_tokenizer(prompt).input_ids, 8, ignore_eos=True)
        assert output.outputs[0].token_ids == expected, prompt


def test_nvfp4_fused_shards_share_one_global_scale(tmp_path, tiny_llama_dir):
    """q/k/v and gate/up get the smallest of their global scales (llm-compressor's, so that a fused layer loads
    with one); o_proj and down_proj keep their own."""
    from safetensors.torch import load_file

    tensors = load_file(f"{_write(tmp_path, tiny_llama_dir, 'NVFP4A16', method='rtn')}/model.safetensors")
    source = load_file(f"{tiny_llama_dir}/model.safetensors")
    for layer in range(3):
        for shards in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
                       ("self_attn.o_proj",), ("mlp.down_proj",)):
            names = [f"model.layers.{layer}.{shard}" for shard in shards]
            largest = max(source[f"{name}.weight"].abs().max() for name in names)
            expected = torch.tensor([448 * 6], dtype=torch.float32) / largest
            for name in names:
                assert torch.equal(tensors[f"{name}.weight_global_scale"], expected), name


def test_the_model_writes_its_own_calibration_samples(tiny_llama_dir, default_tokenizer):
    args = oneshot.QuantizeArgs(tiny_llama_dir, "unused", num_samples=3, sample_length=12, seed=5)
    samples = oneshot.calibration_batch(args)
    assert samples.shape == (3, 12)
    assert (samples[:, 0] == default_tokenizer.bos_token_id).all()
    assert len({tuple(row.tolist()) for row in samples}) == 3


def test_the_command_line_writes_a_checkpoint_and_refuses_bad_values(tmp_path, tiny_llama_dir, capsys):
    text = tmp_path / "calibration.txt"
    text.write_text(CALIBRATION_TEXT)
    output = tmp_path / "out"
    cli.main(["quantize", tiny_llama_dir, str(output), "--scheme", "W8A16", "--calibration-file", str(text),
              "--num-samples", "2", "--sample-length", "32"])
    assert capsys.readouterr().out.strip() == str(output)
    config = json.loads((output / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["weights"]["num_bits"] == 8
    assert (output / "tokenizer.json").is_file()
    with pytest.raises(SystemExit, match="out exists and is not empty"):
        cli.main(["quantize", tiny_llama_dir, str(output), "--method", "rtn"])
    with pytest.raises(SystemExit, match=r"hold 7 tokens, fewer than sample_length=32; give more text"):
        (tmp_path / "short.txt").write_text("one two three four five six seven")
        cli.main(["quantize", tiny_llama_dir, str(tmp_path / "other"), "--calibration-file",
                  str(tmp_path / "short.txt"), "--sample-length", "32"])
    with pytest.raises(SystemExit, match="group_size=16 must be a positive number of inputs, on an int scheme"):
        cli.main(["quantize", tiny_llama_dir, str(tmp_path / "other"), "--scheme", "FP8_DYNAMIC",
                  "--group-size", "16"])
    with pytest.raises(SystemExit, match="mlp.down_proj: group_size=48 does not divide a layer's 256 inputs"):
        cli.main(["quantize", tiny_llama_dir, str(tmp_path / "other"), "--scheme", "W4A16", "--group-size", "48",
                  "--ignore", "q_proj", "--ignore", "k_proj", "--ignore", "v_proj", "--ignore", "o_proj",
                  "--ignore", "gate_proj", "--ignore", "up_proj"])
    with pytest.raises(SystemExit, match="no config.json"):
        cli.main(["quantize", str(tmp_path / "nowhere"), str(tmp_path / "other")])


def test_scales_take_the_checkpoints_dtype(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tmp_path / "bf16"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    model.save_pretrained(source)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(source)
    written = oneshot.quantize(oneshot.QuantizeArgs(str(source), str(tmp_path / "out"), "W4A16", method="rtn",
                                                    group_size=32))
    tensors = load_file(f"{written}/model.safetensors")
    scale = tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert scale.dtype == torch.bfloat16 and scale.shape == (128, 256 // 32)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_a_mixture_of_experts_is_refused_before_calibrating(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    MixtralForCausalLM(config).save_pretrained(tmp_path / "moe")
    with pytest.raises(ValueError, match=r"is a weight outside any linear layer .*dense models only"):
        oneshot.quantize(oneshot.QuantizeArgs(str(tmp_path / "moe"), str(tmp_path / "out")))


def test_the_command_line_parser_imports_no_torch():
    """`pagellm serve` shares the parser, which refuses bad flags before anything heavy loads."""
    script = ("import sys\nfrom pagellm.entrypoints.cli import build_parser\nbuild_parser()\n"
              "print('torch' in sys.modules)")
    assert run_python(script).strip() == "False"
