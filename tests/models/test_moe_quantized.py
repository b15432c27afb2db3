"""Mixture-of-experts checkpoints in the quantized formats dense layers take (AWQ, GPTQ, compressed-tensors,
fp8, online int8 / fp8): the experts are the layer library's linear layers in the checkpoint's format
(ExpertLinearsMoEMethod).

Weight-only formats: greedy output equal to transformers' on a float checkpoint of the dequantized weights
(tests/quant_checkpoints.py and tests/w8a8_checkpoints.py write both), for Qwen3-MoE's and Mixtral's expert
names. int8 W8A8 also quantizes activations: a layer's output against a per-token reference on the dequantized
weights with each product's input rounded as the kernels round it. Tensor and expert parallelism at the layer,
the experts' bytes, and the format's per-module rules read against the experts' checkpoint names.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm import LLM, SamplingParams
from pagellm.distributed.parallel_state import TensorParallelGroup, building_with
from pagellm.layers.fused_moe import MIXTRAL_EXPERT_NAMES, ExpertLinearsMoEMethod, FusedMoE, cuda_graph_safe
from pagellm.layers.quantization import quantization_config_for
from pagellm.layers.quantization.awq import AWQLinearMethod
from pagellm.layers.quantization.compressed_tensors_wna16 import CompressedTensorsWNA16Method
from pagellm.layers.quantization.gptq import GPTQLinearMethod
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.quantization.w8a8 import Fp8LinearMethod, Int8LinearMethod, OnlineQuantizedLinearMethod
from pagellm.layers.weights import process_weights_after_loading, weights_bytes
from pagellm.models.loader import default_dtype
from pagellm.ops import w8a8_kernels as wk
from pagellm.ops.wna16 import ExpertsPackedProduct, wna16_kernels
from tests.helpers import PROMPTS
from tests.models.test_moe import COMMON, _mixtral
from tests.models.tiny_checkpoints import check_greedy, checkpoint_dirs, greedy_references, save_tiny_checkpoint
from tests.quant_checkpoints import (SAME_INPUT, QuantSpec, awq_tensors, gptq_input_order, gptq_tensors,
                                     write_quantized)
from tests.w8a8_checkpoints import SCHEMES, compressed_tensors_config, quantize_fp8, quantize_int8
from tests.w8a8_checkpoints import write_quantized as write_8bit

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_seqs=8, max_model_len=256)
CASE_PROMPTS = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]


def _qwen3_moe():
    """tests/models/test_moe.py's Qwen3-MoE with wider experts."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # Layer 1 dense. Every product's input is a multiple of 64 and its output of 32, which fp8's test blocks
    # (32 x 64) need.
    config = Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3}, head_dim=64, intermediate_size=128,
                            moe_intermediate_size=64, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                            decoder_sparse_step=1, mlp_only_layers=[1], rms_norm_eps=1e-6, rope_theta=10000.0)
    return Qwen3MoeForCausalLM, config


FAMILIES = {"qwen3-moe": _qwen3_moe, "mixtral": _mixtral}
# The group-quantized formats' writer settings (tests/quant_checkpoints.py); the 8-bit ones are
# tests/w8a8_checkpoints.py's scheme names.
GROUP_SPECS = {
    "gptq-4bit-act-order": QuantSpec("gptq", bits=4, group_size=16, desc_act=True),
    "gptq-8bit": QuantSpec("gptq", bits=8, group_size=32),
    "awq": QuantSpec("awq", group_size=16),
    "w4a16-asym": QuantSpec("compressed-tensors", bits=4, group_size=16, sym=False),
}
# "family/format" -> the method each expert's linear layers take
CASES = {
    "qwen3-moe/gptq-4bit-act-order": GPTQLinearMethod,
    "qwen3-moe/gptq-8bit": GPTQLinearMethod,
    "qwen3-moe/awq": AWQLinearMethod,
    "qwen3-moe/w4a16-asym": CompressedTensorsWNA16Method,
    "qwen3-moe/fp8-channel-dynamic": Fp8LinearMethod,
    "qwen3-moe/fp8-block": Fp8LinearMethod,
    "mixtral/awq": AWQLinearMethod,
    "mixtral/gptq-4bit-act-order": GPTQLinearMethod,
}


@pytest.fixture(scope="module")
def float_dirs(module_tmp_path_factory, default_tokenizer):
    return checkpoint_dirs(FAMILIES, module_tmp_path_factory, default_tokenizer)


@pytest.fixture(scope="module")
def case_dirs(module_tmp_path_factory, float_dirs):
    """case -> (quantized checkpoint, float checkpoint of its dequantized weights), written on first use."""
    written: dict[str, tuple[str, str]] = {}

    def get(case: str) -> tuple[str, str]:
        if case not in written:
            family, fmt = case.split("/")
            root = module_tmp_path_factory.mktemp(fmt)
            if fmt in GROUP_SPECS:
                write_quantized(float_dirs(family), root / "quantized", root / "dequantized", GROUP_SPECS[fmt])
                written[case] = (str(root / "quantized"), str(root / "dequantized"))
            elif fmt == "fp8-block":
                written[case] = write_8bit(float_dirs(family), root, "fp8-block-dynamic", fmt="fp8")
            else:
                written[case] = write_8bit(float_dirs(family), root, fmt)
        return written[case]

    return get


@pytest.fixture(scope="module")
def dequantized_references(case_dirs, default_tokenizer):
    return greedy_references(lambda case: case_dirs(case)[1], default_tokenizer, MAX_TOKENS)


def _experts(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]


def _expert_bytes(model: torch.nn.Module) -> int:
    return sum(weights_bytes(m) for m in model.modules() if isinstance(m, FusedMoE))


@pytest.mark.parametrize("case", CASES)
def test_weight_only_experts_equal_transformers_on_the_dequantized_weights(case, case_dirs, dequantized_references,
                                                                          float_dirs):
    quantized_dir, _ = case_dirs(case)
    llm = LLM(quantized_dir, **ENGINE)
    experts = _experts(llm)
    assert len(experts) == 2
    for layer in experts:
        assert isinstance(layer.quant_method, ExpertLinearsMoEMethod)
        assert len(layer.expert_gate_up) == len(layer.expert_down) == 8
        assert all(isinstance(linear.quant_method, CASES[case]) for linear in layer.expert_gate_up)
    check_greedy(llm, CASE_PROMPTS, dequantized_references(case, CASE_PROMPTS), GREEDY)
    # One product per used expert reads the step's expert counts on the host: on CUDA such a model decodes
    # eagerly (a graph could not hold that), where float experts' fused kernel can be captured.
    assert not cuda_graph_safe(llm.llm_engine.core.runner.model)
    # The experts at the format's bytes: at most 8 bits a weight and its scales, against float32's 32.
    dense = LLM(float_dirs(case.split("/")[0]), **ENGINE)
    assert cuda_graph_safe(dense.llm_engine.core.runner.model)
    assert _expert_bytes(llm.llm_engine.core.runner.model) < 0.4 * _expert_bytes(dense.llm_engine.core.runner.model)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["feature-split", "expert-parallel"])
def test_two_ranks_run_quantized_experts(expert_parallel, case_dirs, dequantized_references):
    """tensor_parallel_size=2: each rank holds half of every expert's features (GPTQ's act-order groups per
    rank), or with enable_expert_parallel 4 whole experts and nothing of the other 4 (their tensors passed
    over at load)."""
    case = "qwen3-moe/gptq-4bit-act-order"
    llm = LLM(case_dirs(case)[0], **ENGINE, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              distributed_timeout_seconds=60)
    try:
        held = [(m.placement.start, len(m.expert_gate_up)) for m in _experts(llm)]
        assert held == [(0, 4 if expert_parallel else 8)] * 2
        check_greedy(llm, CASE_PROMPTS, dequantized_references(case, CASE_PROMPTS), GREEDY)
    finally:
        llm.llm_engine.shutdown()


def test_deepseek_v3_in_its_own_fp8_block_format(tmp_path, default_tokenizer):
    """DeepSeek-V3's checkpoint format (quant_method fp8, weight_block_size, weight_scale_inv): every linear layer
    in fp8 blocks, latent attention's kv_a_proj_with_mqa ending in a partial block of outputs (576 in blocks of
    128 in the real model; here 80 in blocks of 32) and kv_b_proj dequantized for absorption, the routed and
    shared experts in fp8; greedy output equal to transformers' on the dequantized weights."""
    from tests.models.test_mla import _perturb_correction_bias, _v3

    float_dir = save_tiny_checkpoint(_v3, default_tokenizer, tmp_path / "v3", _perturb_correction_bias)
    quantized, dequantized = write_8bit(float_dir, tmp_path / "v3-fp8", "fp8-block-32x16", fmt="fp8")
    llm = LLM(quantized, **ENGINE)
    attention = llm.llm_engine.core.runner.model.model.layers[0].self_attn
    assert attention.kv_a_proj_with_mqa.weight_scale_inv.shape == (3, 8)  # 80 outputs: 2.5 blocks of 32
    for linear in (attention.kv_a_proj_with_mqa, attention.kv_b_proj, attention.q_b_proj):
        assert isinstance(linear.quant_method, Fp8LinearMethod)
    [experts] = _experts(llm)
    assert all(isinstance(linear.quant_method, Fp8LinearMethod) for linear in experts.expert_down)
    expected = greedy_references(lambda _: dequantized, default_tokenizer, MAX_TOKENS)("v3", CASE_PROMPTS)
    check_greedy(llm, CASE_PROMPTS, expected, GREEDY)


# Latent attention's projections, each a layer of its own.
MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def _online_fp8_dequantized(float_dir: str, directory, blocks: tuple[int, int, bool] | None = None) -> str:
    """A float checkpoint of the weights quantization="fp8" makes: one fp8 scale per layer weight, fused q/k/v
    and gate/up (a dense MLP's, and each expert's) together, as the layers quantize them; or with `blocks`
    (block_n, block_k, power-of-two scales) a scale per block of each such weight, as vLLM's online shorthands."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{float_dir}/model.safetensors")
    fused: dict[str, list[str]] = {}
    for name in tensors:
        module, _, kind = name.rpartition(".")
        parent, _, projection = module.rpartition(".")
        layer = SAME_INPUT.get(projection, projection if projection in MLA_PROJECTIONS else None)
        if kind == "weight" and layer is not None and ".layers." in name:
            fused.setdefault(f"{parent}:{layer}", []).append(name)
    for names in fused.values():
        weight = torch.cat([tensors[name] for name in names])
        if blocks is None:
            q, scale = wk.quantize_fp8_per_tensor(weight)
            dequantized = q.float() * scale
        else:
            q, scales = wk.quantize_fp8_blocks(weight, *blocks)
            dequantized = wk.dequantize_fp8(q, scales, blocks[1])
        pieces = dequantized.split([tensors[name].shape[0] for name in names])
        tensors.update((name, piece.contiguous()) for name, piece in zip(names, pieces))
    shutil.copytree(float_dir, directory)
    save_file(tensors, f"{directory}/model.safetensors")
    return str(directory)


def test_online_fp8_experts_equal_their_dequantized_weights(float_dirs, tmp_path, default_tokenizer):
    """quantization="fp8" on a float MoE checkpoint: each expert's products in fp8 beside the dense layers', the
    same tokens as transformers on the weights it made."""
    llm = LLM(float_dirs("qwen3-moe"), quantization="fp8", **ENGINE)
    for layer in _experts(llm):
        assert all(isinstance(linear.quant_method, OnlineQuantizedLinearMethod)
                   for linear in (*layer.expert_gate_up, *layer.expert_down))
    dense = LLM(float_dirs("qwen3-moe"), **ENGINE)
    assert _expert_bytes(llm.llm_engine.core.runner.model) < 0.3 * _expert_bytes(dense.llm_engine.core.runner.model)
    theirs = greedy_references(lambda _: _online_fp8_dequantized(float_dirs("qwen3-moe"), tmp_path / "fp8"),
                               default_tokenizer, MAX_TOKENS)
    check_greedy(llm, CASE_PROMPTS, theirs("qwen3-moe", CASE_PROMPTS), GREEDY)


def test_online_fp8_deepseek_v3_equals_its_dequantized_weights(tmp_path, default_tokenizer):
    """quantization="fp8" on a float DeepSeek-V3: latent attention's kv_b_proj quantized too, and dequantized
    for the absorbed decode from the layer itself."""
    from tests.models.test_mla import _perturb_correction_bias, _v3

    float_dir = save_tiny_checkpoint(_v3, default_tokenizer, tmp_path / "v3", _perturb_correction_bias)
    llm = LLM(float_dir, quantization="fp8", **ENGINE)
    attention = llm.llm_engine.core.runner.model.model.layers[0].self_attn
    assert isinstance(attention.kv_b_proj.quant_method, OnlineQuantizedLinearMethod)
    dequantized = _online_fp8_dequantized(float_dir, tmp_path / "v3-fp8" / "dequantized")
    check_greedy(llm, CASE_PROMPTS, greedy_references(lambda _: dequantized, default_tokenizer, MAX_TOKENS)(
        "v3", CASE_PROMPTS), GREEDY)


def _experts_int8_dequantized(float_dir: str, directory) -> str:
    """A float checkpoint of the weights quantization="experts_int8" makes: each expert projection's weight as
    int8 per output channel, dequantized as the kernels dequantize it; every other tensor as it was."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pagellm.layers.quantization.experts_int8 import int8_channel_weight
    from pagellm.ops.wna16 import dequantize

    tensors = load_file(f"{float_dir}/model.safetensors")
    for name, tensor in tensors.items():
        if ".experts." in name and name.endswith(".weight"):
            tensors[name] = dequantize(int8_channel_weight(tensor)).contiguous()
    shutil.copytree(float_dir, directory)
    save_file(tensors, f"{directory}/model.safetensors")
    return str(directory)


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_int8_quantizes_the_experts_alone(family, float_dirs, tmp_path, default_tokenizer):
    """vLLM's quantization="experts_int8": the experts' weights int8 per output channel (weight-only, on the
    group-quantized kernels' 8-bit path), attention and dense MLPs unquantized; the same tokens as transformers
    on the weights it made."""
    from pagellm.layers.quantization.experts_int8 import OnlineInt8WeightOnlyMethod

    llm = LLM(float_dirs(family), quantization="experts_int8", **ENGINE)
    model = llm.llm_engine.core.runner.model
    for layer in _experts(llm):
        assert all(isinstance(linear.quant_method, OnlineInt8WeightOnlyMethod)
                   for linear in (*layer.expert_gate_up, *layer.expert_down))
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.qkv_proj.quant_method, UnquantizedLinearMethod)
    dense = LLM(float_dirs(family), **ENGINE)
    assert _expert_bytes(model) < 0.3 * _expert_bytes(dense.llm_engine.core.runner.model)
    dequantized = _experts_int8_dequantized(float_dirs(family), tmp_path / "dequantized")
    check_greedy(llm, CASE_PROMPTS, greedy_references(lambda _: dequantized, default_tokenizer, MAX_TOKENS)(
        family, CASE_PROMPTS), GREEDY)


def test_modelopt_fp8_experts_equal_their_dequantized_weights(float_dirs, tmp_path, default_tokenizer):
    """An NVIDIA ModelOpt FP8 export of Mixtral (per-tensor scales per expert projection, static input scales, the
    router excluded as ModelOpt excludes it): the experts are fp8 linear layers; transformers' tokens on the
    dequantized weights."""
    from tests.w8a8_checkpoints import write_modelopt

    quantized, dequantized = write_modelopt(float_dirs("mixtral"), tmp_path, "FP8", ("lm_head", "*.gate"))
    llm = LLM(quantized, **ENGINE)
    for layer in _experts(llm):
        assert all(isinstance(linear.quant_method, Fp8LinearMethod)
                   for linear in (*layer.expert_gate_up, *layer.expert_down))
    check_greedy(llm, CASE_PROMPTS, greedy_references(lambda _: dequantized, default_tokenizer, MAX_TOKENS)(
        "mixtral", CASE_PROMPTS), GREEDY)


def test_vllms_online_shorthands_quantize_the_experts_as_they_say(float_dirs, tmp_path, default_tokenizer):
    """quantization="mxfp8": every linear layer and expert in fp8 with a power-of-two scale per 32 inputs;
    "int8_per_channel_weight_only": the experts alone, as experts_int8; `ignore` naming an experts layer leaves it
    in float. Greedy tokens are transformers' on the weights they made."""
    from pagellm.layers.fused_moe import UnquantizedFusedMoEMethod
    from pagellm.layers.quantization.experts_int8 import OnlineInt8WeightOnlyMethod
    from pagellm.layers.quantization.online import OnlineFp8BlocksLinearMethod

    float_dir = float_dirs("qwen3-moe")
    llm = LLM(float_dir, quantization="mxfp8", **ENGINE)
    model = llm.llm_engine.core.runner.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.quant_method, OnlineFp8BlocksLinearMethod)
    for layer in _experts(llm):
        assert all(isinstance(linear.quant_method, OnlineFp8BlocksLinearMethod)
                   for linear in (*layer.expert_gate_up, *layer.expert_down))
    dequantized = _online_fp8_dequantized(float_dir, tmp_path / "mxfp8", (1, 32, True))
    check_greedy(llm, CASE_PROMPTS, greedy_references(lambda _: dequantized, default_tokenizer, MAX_TOKENS)(
        "qwen3-moe", CASE_PROMPTS), GREEDY)

    llm = LLM(float_dir, quantization="int8_per_channel_weight_only", **ENGINE)
    assert isinstance(llm.llm_engine.core.runner.model.model.layers[0].self_attn.qkv_proj.quant_method,
                      UnquantizedLinearMethod)
    for layer in _experts(llm):
        assert all(isinstance(linear.quant_method, OnlineInt8WeightOnlyMethod)
                   for linear in (*layer.expert_gate_up, *layer.expert_down))
    dequantized = _experts_int8_dequantized(float_dir, tmp_path / "int8")
    check_greedy(llm, CASE_PROMPTS, greedy_references(lambda _: dequantized, default_tokenizer, MAX_TOKENS)(
        "qwen3-moe", CASE_PROMPTS), GREEDY)

    llm = LLM(float_dir, quantization="fp8_per_channel",
              quantization_config={"ignore": ["model.layers.0.mlp.experts"]}, **ENGINE)
    first, last = _experts(llm)
    assert isinstance(first.quant_method, UnquantizedFusedMoEMethod)
    assert isinstance(last.quant_method, ExpertLinearsMoEMethod)


@pytest.mark.parametrize("family", FAMILIES)
def test_bitsandbytes_nf4_experts_equal_transformers_on_the_weights_they_keep(family, float_dirs, tmp_path,
                                                                            default_tokenizer, torch_ops_only):
    """A bitsandbytes NF4 checkpoint (each expert's projections and the router quantized, as transformers'
    integration converts every nn.Linear): experts as linear layers of the format, the router (built unquantized)
    dequantized at load; and quantization="bitsandbytes" on the float checkpoint. On the products' torch path, the
    same tokens as transformers on the weights they keep (the kernels' products: tests/test_bitsandbytes.py)."""
    from pagellm.layers.quantization.bitsandbytes import BitsAndBytes4bitMethod, quantize_nf4
    from tests.bnb_checkpoints import kept_weights, write_bnb, write_float

    write_bnb(float_dirs(family), tmp_path / "bnb", 4, "nf4", 64)
    write_float(float_dirs(family), tmp_path / "kept", kept_weights(tmp_path / "bnb"))
    llm = LLM(str(tmp_path / "bnb"), **ENGINE)
    for layer in _experts(llm):
        assert all(isinstance(linear.quant_method, BitsAndBytes4bitMethod)
                   for linear in (*layer.expert_gate_up, *layer.expert_down))
    references = greedy_references(lambda variant: str(tmp_path / variant), default_tokenizer, MAX_TOKENS)
    check_greedy(llm, CASE_PROMPTS, references("kept", CASE_PROMPTS), GREEDY)

    from safetensors.torch import load_file

    tensors = load_file(f"{float_dirs(family)}/model.safetensors")
    write_float(float_dirs(family), tmp_path / "in-flight", {
        name: quantize_nf4(tensor).dequantize(torch.float32) for name, tensor in tensors.items()
        if ".layers." in name and name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))})
    check_greedy(LLM(float_dirs(family), quantization="bitsandbytes", **ENGINE), CASE_PROMPTS,
                 references("in-flight", CASE_PROMPTS), GREEDY)


def test_bitsandbytes_8bit_experts_equal_transformers_on_their_weights(float_dirs, tmp_path, default_tokenizer):
    """LLM.int8 experts (W8A16, exact) and router (dequantized at load): transformers' tokens on q * SCB / 127."""
    from pagellm.layers.quantization.bitsandbytes import BitsAndBytes8bitMethod
    from tests.bnb_checkpoints import write_bnb, write_float

    write_float(float_dirs("qwen3-moe"), tmp_path / "kept", write_bnb(float_dirs("qwen3-moe"), tmp_path / "bnb", 8))
    llm = LLM(str(tmp_path / "bnb"), **ENGINE)
    for layer in _experts(llm):
        assert all(isinstance(linear.quant_method, BitsAndBytes8bitMethod)
                   for linear in (*layer.expert_gate_up, *layer.expert_down))
    check_greedy(llm, CASE_PROMPTS, greedy_references(lambda _: str(tmp_path / "kept"), default_tokenizer,
                                                      MAX_TOKENS)("kept", CASE_PROMPTS), GREEDY)


def test_rtn_rounds_the_experts_as_vllm_does(float_dirs, tmp_path, default_tokenizer, monkeypatch):
    """quantization="rtn" (4-bit, groups of 32 here): experts and dense layers rounded as vLLM's rtn_quantize
    rounds them, on the group-quantized kernels; transformers' tokens on the rounded weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pagellm.layers.quantization.rtn import OnlineRTNMethod, rtn_weight
    from pagellm.ops.wna16 import dequantize

    monkeypatch.setenv("RTN_NUM_BITS", "4")
    monkeypatch.setenv("RTN_GROUP_SIZE", "32")
    float_dir = float_dirs("mixtral")
    llm = LLM(float_dir, quantization="rtn", **ENGINE)
    for layer in _experts(llm):
        assert all(isinstance(linear.quant_method, OnlineRTNMethod)
                   for linear in (*layer.expert_gate_up, *layer.expert_down))
    tensors = load_file(f"{float_dir}/model.safetensors")
    rounded = {name: dequantize(rtn_weight(tensor, 4, 32)).contiguous() for name, tensor in tensors.items()
               if ".layers." in name and name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))}
    shutil.copytree(float_dir, tmp_path / "rounded")
    save_file({**tensors, **rounded}, str(tmp_path / "rounded" / "model.safetensors"))
    check_greedy(llm, CASE_PROMPTS, greedy_references(lambda _: str(tmp_path / "rounded"), default_tokenizer,
                                                      MAX_TOKENS)("mixtral", CASE_PROMPTS), GREEDY)


def test_bitsandbytes_nf4_experts_keep_their_blocks(float_dirs, tmp_path):
    from tests.bnb_checkpoints import write_bnb

    write_bnb(float_dirs("mixtral"), tmp_path / "bnb", 4, "nf4", 64)
    ours = _expert_bytes(LLM(str(tmp_path / "bnb"), **ENGINE).llm_engine.core.runner.model)
    dense = _expert_bytes(LLM(float_dirs("mixtral"), **ENGINE).llm_engine.core.runner.model)
    assert ours <= 1.1 * 4.5 / 32 * dense


# ---- one layer ------------------------------------------------------------------------------------------------

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 64, 32, 2


def _random_experts(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"gate_proj": torch.randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN, generator=generator) * 0.1,
            "up_proj": torch.randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN, generator=generator) * 0.1,
            "down_proj": torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.1}


def _build(quant_config, group: TensorParallelGroup | None = None, prefix: str = "model.layers.0.mlp.experts",
           **kwargs) -> FusedMoE:
    with building_with(group or TensorParallelGroup(0, 1)):
        layer = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, quant_config=quant_config, prefix=prefix, **kwargs)
    layer.reduce_results = False  # no device group here: a test sums the ranks' partial outputs itself
    return layer


def _load(layer: FusedMoE, tensors_of: dict[tuple[int, str], dict[str, torch.Tensor]]) -> None:
    """Each checkpoint tensor of expert e's module `proj` (tensors_of[(e, proj)]) through the layer's names, as
    the model's loader sends it; then the layers' preparation, as after a model's load."""
    for (expert, proj), tensors in tensors_of.items():
        for kind, tensor in tensors.items():
            target = layer.expert_layer_target(expert, proj, kind)
            if target is None:
                continue  # another rank's expert
            name, shard = target
            param = layer.get_parameter(name)
            param.weight_loader(param, tensor, shard)
    layer.process_weights_after_loading()
    process_weights_after_loading(layer)  # its expert layers (the walk passes over its root)


def _fake_int8(x: torch.Tensor) -> torch.Tensor:
    q, scale = wk.quantize_rows_int8(x)
    return q.float() * scale[:, None]


def _fake_rotated_int8(x: torch.Tensor) -> torch.Tensor:
    """quantization="int8"'s inputs: rotated, then quantized per row (dequantized, in the rotated space)."""
    q, scale = wk.quantize_rows_int8(x, None, wk.rotation_block(x.shape[-1]))
    return q.float() * scale[:, None]


def _reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: dict[str, torch.Tensor],
               inputs=lambda rows: rows) -> torch.Tensor:
    """Each token's weighted sum over its experts, token by token in float64, each product's input passed
    through `inputs` first (W8A8's rounding)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token in range(x.shape[0]):
        row = inputs(x[token:token + 1]).double()
        for weight, expert in zip(weights[token].tolist(), ids[token].tolist()):
            gate = row @ experts["gate_proj"][expert].double().T
            up = row @ experts["up_proj"][expert].double().T
            hidden = inputs((F.silu(gate) * up).float()).double()
            out[token] += weight * (hidden @ experts["down_proj"][expert].double().T)[0]
    return out


def _routing(layer: FusedMoE, tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    logits = torch.randn(tokens, NUM_EXPERTS, generator=generator)
    return x, logits, *layer.routing.select(logits)


def _int8_checkpoint(experts: dict[str, torch.Tensor]):
    """compressed-tensors int8 per-channel tensors of every expert, and the dequantized weights."""
    tensors, dequantized = {}, {proj: torch.empty_like(w) for proj, w in experts.items()}
    for proj, stacked in experts.items():
        for expert in range(NUM_EXPERTS):
            q, scale = quantize_int8(stacked[expert], "channel")
            tensors[(expert, proj)] = {"weight": q, "weight_scale": scale}
            dequantized[proj][expert] = q.float() * scale
    return tensors, dequantized


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_int8_w8a8_experts_match_a_per_token_reference(tokens):
    """A compressed-tensors int8 checkpoint's experts: each product's input quantized per token (the kernels'
    rounding), times the int8 weights."""
    config = quantization_config_for({"quantization_config": compressed_tensors_config("int8-channel-dynamic")})
    layer = _build(config)
    tensors, dequantized = _int8_checkpoint(_random_experts(seed=1))
    _load(layer, tensors)
    assert all(isinstance(linear.quant_method, Int8LinearMethod) for linear in layer.expert_gate_up)
    x, logits, weights, ids = _routing(layer, tokens, seed=tokens)
    expected = _reference(x, weights, ids, dequantized, _fake_int8)
    torch.testing.assert_close(layer(x, logits).double(), expected, rtol=1e-4, atol=1e-5)


def test_online_int8_experts_quantize_each_expert_per_channel_rotated():
    layer = _build(quantization_config_for({}, "int8"))
    experts = _random_experts(seed=2)
    _load(layer, {(expert, proj): {"weight": stacked[expert]} for proj, stacked in experts.items()
                  for expert in range(NUM_EXPERTS)})
    dequantized = {}
    for proj, stacked in experts.items():
        rows = [wk.quantize_int8_rotated(weight) for weight in stacked]
        assert all(rotation > 1 for _, _, rotation in rows)
        dequantized[proj] = torch.stack([q.float() * scale[:, None] for q, scale, _ in rows])
    x, logits, weights, ids = _routing(layer, 7, seed=3)
    expected = _reference(x, weights, ids, dequantized, _fake_rotated_int8)
    torch.testing.assert_close(layer(x, logits).double(), expected, rtol=1e-4, atol=1e-5)


def _awq_checkpoint(experts: dict[str, torch.Tensor], spec: QuantSpec):
    tensors, dequantized = {}, {proj: torch.empty_like(w) for proj, w in experts.items()}
    for proj, stacked in experts.items():
        for expert in range(NUM_EXPERTS):
            tensors[(expert, proj)], dequantized[proj][expert] = awq_tensors(stacked[expert], spec)
    return tensors, dequantized


AWQ = QuantSpec("awq", group_size=16)


def _awq_config(**overrides):
    return quantization_config_for({"quantization_config": {**AWQ.quantization_config(), **overrides}})


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["feature-split", "expert-parallel"])
def test_parallel_ranks_hold_their_part_of_each_quantized_expert(expert_parallel):
    """Two ranks: each expert's features split (AWQ's groups per rank), or whole experts per rank, whose
    partial outputs add up to the whole layer's."""
    tensors, dequantized = _awq_checkpoint(_random_experts(seed=4), AWQ)
    whole = _build(_awq_config())
    _load(whole, tensors)
    x, logits, weights, ids = _routing(whole, 9, seed=5)
    expected = _reference(x, weights, ids, dequantized)
    torch.testing.assert_close(whole(x, logits).double(), expected, rtol=1e-4, atol=1e-5)
    partial = torch.zeros(9, HIDDEN)
    for rank in range(2):
        shard = _build(_awq_config(), TensorParallelGroup(rank, 2, expert_parallel=expert_parallel))
        _load(shard, tensors)
        if expert_parallel:
            assert len(shard.expert_gate_up) == 4 and shard.expert_gate_up[0].group.size == 1
            assert shard.expert_layer_target(4 * (1 - rank), "gate_proj", "qweight") is None
        else:
            assert len(shard.expert_gate_up) == 8 and shard.expert_down[0].input_size == INTERMEDIATE // 2
        partial += shard(x, logits)
    torch.testing.assert_close(partial.double(), expected, rtol=1e-4, atol=1e-5)


def test_the_formats_module_rules_read_the_experts_checkpoint_names():
    # AutoAWQ's Mixtral config leaves "gate" (the router) unconverted: Mixtral's experts are w1/w3/w2, which it
    # does not name, so they stay AWQ.
    mixtral = _build(_awq_config(modules_to_not_convert=["gate"]), prefix="model.layers.0.mlp.experts",
                     checkpoint_names=MIXTRAL_EXPERT_NAMES)
    assert all(isinstance(linear.quant_method, AWQLinearMethod)
               for linear in (*mixtral.expert_gate_up, *mixtral.expert_down))
    assert mixtral.expert_gate_up[3].prefix == "model.layers.0.block_sparse_moe.experts.3.w13"
    # A compressed-tensors ignore pattern naming one expert's modules leaves that expert's layers float.
    config = compressed_tensors_config("int8-channel-dynamic", ignore=("lm_head", "re:.*experts\\.5\\..*"))
    layer = _build(quantization_config_for({"quantization_config": config}))
    methods = [type(linear.quant_method) for linear in layer.expert_down]
    assert methods == [Int8LinearMethod] * 5 + [UnquantizedLinearMethod] + [Int8LinearMethod] * 2


def test_a_checkpoint_tensor_of_an_expert_the_layer_lacks_is_refused():
    layer = _build(_awq_config())
    with pytest.raises(ValueError, match="expert 8 is out of range; this layer has 8"):
        layer.expert_layer_target(8, "up_proj", "qweight")


def _gptq_checkpoint(experts: dict[str, torch.Tensor], spec: QuantSpec, seed: int):
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for proj, stacked in experts.items():
        for expert in range(NUM_EXPERTS):
            order = gptq_input_order(stacked.shape[2], generator) if spec.desc_act else None
            tensors[(expert, proj)] = gptq_tensors(stacked[expert], spec, order)[0]
    return tensors


def _8bit_checkpoint(experts: dict[str, torch.Tensor], scheme: str):
    """compressed-tensors int8 or fp8 tensors of every expert in `scheme` (tests/w8a8_checkpoints.py's), a static
    input scale of its own per expert."""
    kind, strategy, block, activations = SCHEMES[scheme]
    tensors = {}
    for proj, stacked in experts.items():
        for expert in range(NUM_EXPERTS):
            q, scale = (quantize_int8(stacked[expert], strategy) if kind == "int"
                        else quantize_fp8(stacked[expert], strategy, block))
            tensors[(expert, proj)] = {"weight": q, "weight_scale": scale}
            if activations == "static":
                tensors[(expert, proj)]["input_scale"] = torch.tensor([0.02 + 0.005 * expert])
    return tensors


def _one_call_case(fmt: str, dtype: torch.dtype):
    """(layer, the class of its experts' one call) for `fmt` with random experts loaded."""
    if fmt.startswith("gptq"):
        spec = (QuantSpec("gptq", bits=4, group_size=16, desc_act=True) if fmt == "gptq-4-act-order"
                else QuantSpec("gptq", bits=8, group_size=32))
        config, tensors = spec.quantization_config(), _gptq_checkpoint(_random_experts(seed=6), spec, seed=7)
        together = ExpertsPackedProduct
    else:
        config, tensors = compressed_tensors_config(fmt), _8bit_checkpoint(_random_experts(seed=6), fmt)
        together = wk.ExpertsInt8Product if fmt.startswith("int8") else wk.ExpertsFp8Product
    with default_dtype(dtype):
        layer = _build(quantization_config_for({"quantization_config": config}))
    _load(layer, tensors)
    return layer, together


@pytest.mark.skipif(wna16_kernels() is None or wk.w8a8_kernels() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["gptq-4-act-order", "gptq-8", "int8-channel-dynamic", "int8-tensor-static",
                                 "fp8-channel-dynamic", "fp8-block-32x16"])
def test_a_steps_experts_run_in_one_call_as_they_do_one_by_one(fmt, dtype, monkeypatch):
    """Where every expert of a step has few enough rows, one C call runs them all (wna16_matmul_experts for the
    group-quantized formats, w8a8_int8_linear_experts / w8a8_fp8_linear_experts for int8 W8A8 and fp8): bit for
    bit what each expert's own call gives, for 1 to 30 tokens (1 to 9 rows an expert: row tiles of each height
    and steps left to the experts' own calls), act order's per-expert input orders and static input scales of
    each expert's own included."""
    layer, together = _one_call_case(fmt, dtype)
    calls = []
    grouped = together.__call__
    monkeypatch.setattr(together, "__call__", lambda self, *args: calls.append(args[1]) or grouped(self, *args))
    for tokens in (1, 3, 9, 30):
        x, logits, _, _ = _routing(layer, tokens, seed=tokens)
        x = x.to(dtype)
        calls.clear()
        result = layer(x, logits)
        assert calls or tokens > 3  # a step of at most 3 rows an expert takes the one call in every format
        # Each call (gate/up, then down) takes every (token, expert) pair of the step.
        assert all(sum(sizes) == tokens * layer.top_k for sizes in calls)
        with monkeypatch.context() as one_by_one:
            one_by_one.setattr(together, "takes", lambda self, sizes, dtype: False)
            assert torch.equal(layer(x, logits), result), tokens
