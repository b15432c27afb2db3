"""gpt-oss (GptOssForCausalLM) from a tiny random HF checkpoint: greedy output equal to transformers' generate
token for token in fp32 - batched, chunked prefill with prefix caching, preempted, on the native C kernels, on
torch ops, on the Triton kernels under the interpreter, over two tensor-parallel ranks and with expert
parallelism; the experts' clamped SwiGLU and biases against transformers' GptOssExperts; an MXFP4 checkpoint
(as gpt-oss is released) against transformers on the same dequantized experts.

The checkpoint has two layers (one sliding with an 8-token window, one full), 4 biased experts, yarn rope with
an 8x factor over 64 original positions, and a low swiglu_limit so that the clamps cut; its biases and sinks,
zero or small at init, are randomised so that each one counts.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pagellm import LLM, SamplingParams
from pagellm.attention.backend import BACKEND_ENV
from pagellm.layers.fused_moe import FusedMoE
from pagellm.models.gpt_oss import GptOssAttention
from tests.conftest import TINY_CONFIG
from tests.helpers import PROMPTS
from tests.models.tiny_checkpoints import check_greedy, greedy_references, save_tiny_checkpoint

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_seqs=8, max_model_len=256)
# Prompts from 2 to ~100 tokens: most reach past the 8-token window.
GPT_OSS_PROMPTS = [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[5], PROMPTS[8]]
SHARED_PREFIX = PROMPTS[8]
SLIDING_WINDOW = 8

FAMILY_OWN_KEYS = ("rms_norm_eps", "rope_theta", "tie_word_embeddings", "intermediate_size", "num_hidden_layers")
COMMON = {key: value for key, value in TINY_CONFIG.items() if key not in FAMILY_OWN_KEYS}


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    rope = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 64, "rope_theta": 150000.0}
    config = GptOssConfig(**COMMON, num_hidden_layers=2, head_dim=32, intermediate_size=64, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=SLIDING_WINDOW,
                          layer_types=["sliding_attention", "full_attention"], rope_parameters=rope,
                          swiglu_limit=4.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return GptOssForCausalLM, config


def _randomise_biases_and_sinks(model: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if name.endswith("bias") or name.endswith("sinks"):
            param.copy_(torch.randn(param.shape, generator=generator) * (2.0 if name.endswith("sinks") else 0.5))


@pytest.fixture(scope="module")
def gpt_oss_dir(module_tmp_path_factory, default_tokenizer) -> str:
    return save_tiny_checkpoint(_gpt_oss, default_tokenizer, module_tmp_path_factory.mktemp("gpt-oss"),
                                _randomise_biases_and_sinks)


@pytest.fixture(scope="module")
def hf_reference(gpt_oss_dir, default_tokenizer):
    references = greedy_references(lambda _: gpt_oss_dir, default_tokenizer, MAX_TOKENS)
    return lambda prompts: references("gpt-oss", prompts)


def test_batched_greedy_matches_hf(gpt_oss_dir, hf_reference):
    llm = LLM(gpt_oss_dir, **ENGINE_ARGS)
    runner = llm.llm_engine.core.runner
    assert runner.attn_backend.name == "cpu-native"
    attention = [m for m in runner.model.modules() if isinstance(m, GptOssAttention)]
    assert [a.sliding_window for a in attention] == [SLIDING_WINDOW, None]
    assert all(a.sinks.abs().sum() > 0 for a in attention)
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert [(m.activation, m.w13_bias.shape, m.w2_bias.shape) for m in experts] == [
        ("swigluoai", (4, 128), (4, 128))] * 2
    check_greedy(llm, GPT_OSS_PROMPTS, hf_reference(GPT_OSS_PROMPTS), GREEDY)
    assert llm.llm_engine.get_stats().kv_cache.num_used_blocks == 0


def _chunked_prefix_cached(directory: str, hf_reference) -> None:
    llm = LLM(directory, **{**ENGINE_ARGS, "max_num_batched_tokens": 32, "block_size": 8,
                            "enable_prefix_caching": True})
    check_greedy(llm, GPT_OSS_PROMPTS, hf_reference(GPT_OSS_PROMPTS), GREEDY)
    follow_up = [SHARED_PREFIX + " And once more:"]
    [output] = check_greedy(llm, follow_up, hf_reference(follow_up), GREEDY)
    assert output.num_cached_tokens >= 16, "the shared prefix came from the cache"


def test_chunked_prefill_and_prefix_cache_match_hf_on_native_kernels(gpt_oss_dir, hf_reference):
    _chunked_prefix_cached(gpt_oss_dir, hf_reference)


def test_chunked_prefill_and_prefix_cache_match_hf_on_torch_ops(gpt_oss_dir, hf_reference, torch_ops_only):
    _chunked_prefix_cached(gpt_oss_dir, hf_reference)


def test_triton_kernels_under_the_interpreter_match_hf(gpt_oss_dir, hf_reference, monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("the interpreter run is for machines without CUDA")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    llm = LLM(gpt_oss_dir, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, kv_cache_memory_bytes=8 << 20,
              max_model_len=256)
    assert llm.llm_engine.core.runner.attn_backend.name == "triton"
    prompts = [PROMPTS[2], PROMPTS[1]]
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts, short, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [r[:6] for r in hf_reference(prompts)]


def test_preemption_keeps_outputs_exact(gpt_oss_dir, hf_reference):
    # 10 blocks of 16 tokens: less than the batch needs at once, enough for the longest request alone.
    llm = LLM(gpt_oss_dir, dtype="float32", num_gpu_blocks_override=10, max_model_len=160, max_num_seqs=8)
    check_greedy(llm, GPT_OSS_PROMPTS, hf_reference(GPT_OSS_PROMPTS), GREEDY)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache.num_used_blocks == 0


def test_two_tensor_parallel_ranks_match_hf(gpt_oss_dir, hf_reference):
    # Each rank: 2 of the 4 query heads and their sinks, 1 of the 2 KV heads, half of every expert's features
    # and gate/up biases; down's bias and o_proj's are added by one rank.
    llm = LLM(gpt_oss_dir, **ENGINE_ARGS, tensor_parallel_size=2, distributed_timeout_seconds=60)
    try:
        model = llm.llm_engine.core.runner.model
        assert [m.sinks.shape for m in model.modules() if isinstance(m, GptOssAttention)] == [(2,)] * 2
        assert [m.w13_bias.shape for m in model.modules() if isinstance(m, FusedMoE)] == [(4, 64)] * 2
        check_greedy(llm, GPT_OSS_PROMPTS, hf_reference(GPT_OSS_PROMPTS), GREEDY)
    finally:
        llm.llm_engine.shutdown()


def test_expert_parallel_ranks_match_hf(gpt_oss_dir, hf_reference):
    # enable_expert_parallel: each rank holds 2 of the 4 experts whole, with their whole biases (down's too).
    llm = LLM(gpt_oss_dir, **ENGINE_ARGS, tensor_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout_seconds=60)
    try:
        experts = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
        assert [(m.placement.start, m.local_num_experts, m.w13_bias.shape) for m in experts] == [(0, 2, (2, 128))] * 2
        assert all(m.expert_bias("down") is m.w2_bias for m in experts)
        prompts = GPT_OSS_PROMPTS[:3]
        check_greedy(llm, prompts, hf_reference(prompts), GREEDY)
    finally:
        llm.llm_engine.shutdown()


def test_experts_match_transformers_gpt_oss_experts():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    from pagellm.models.gpt_oss import GptOssMoeBlock, per_expert_tensors

    torch.manual_seed(0)
    config = GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                          swiglu_limit=1.5, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    experts, router = GptOssExperts(config), GptOssTopKRouter(config)
    with torch.no_grad():
        for param in list(experts.parameters()) + list(router.parameters()):
            param.copy_(torch.randn(param.shape))
    block = GptOssMoeBlock(config, None, "mlp")
    params = dict(block.named_parameters())
    stacked = [(f"mlp.experts.{name}", param.detach()) for name, param in experts.named_parameters()]
    stacked += [(f"mlp.router.{name}", param.detach()) for name, param in router.named_parameters()]
    for name, tensor in per_expert_tensors(stacked):
        target = FusedMoE.checkpoint_target(name)
        if target is None:
            params[name.removeprefix("mlp.")].data.copy_(tensor)
            continue
        param_name, where = target
        block.experts.weight_loader(params[param_name.removeprefix("mlp.")], tensor, where.shard_id, where.expert_id)
    hidden = torch.randn(9, 32)
    with torch.no_grad():
        _, scores, ids = router(hidden)
        expected = experts(hidden, ids, scores)
        # The config's limit (1.5) clamps gate and up: (1.5 + 1) * 1.5 * sigmoid(1.702 * 1.5).
        clamped = block.experts.act_fn(torch.full((1, 32), 10.0))
        torch.testing.assert_close(clamped, torch.full((1, 16), 2.5 * 1.5 * torch.sigmoid(torch.tensor(1.702 * 1.5))))
        torch.testing.assert_close(block(hidden), expected, rtol=1e-5, atol=1e-5)


# --- MXFP4 checkpoints ---------------------------------------------------------------------------------


def test_kept_mxfp4_blocks_hold_the_values_transformers_reads():
    """Each expert's MXFP4 blocks as the kernels' MXFP4_F16 blocks: 18 bytes per 32 weights, the same values bit
    for bit as transformers dequantizes, for every scale an f16 holds exactly; a scale beyond it is refused."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pagellm.layers.quantization.mxfp4 import mxfp4_weight
    from pagellm.models.gguf_quants import MXFP4_F16_EXPONENTS

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=generator, dtype=torch.uint8)
    low, high = MXFP4_F16_EXPONENTS
    scales = torch.randint(low, high + 1, (3, 8, 4), generator=generator, dtype=torch.uint8)
    scales[0, 0, :2] = torch.tensor([low, high], dtype=torch.uint8)
    # transformers returns the float checkpoint's layout [E, in, out], the transpose of the stored one.
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    for expert in range(3):
        kept = mxfp4_weight(blocks[expert], scales[expert])
        assert kept.type_name == "MXFP4_F16" and tuple(kept.data.shape) == (8, 4 * 18)
        assert torch.equal(kept.dequantize(torch.float32), expected[expert].t())
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        mxfp4_weight(blocks[0], scales[0, :, :3])
    with pytest.raises(ValueError, match=r"2\^17 is beyond the f16 scale"):
        mxfp4_weight(blocks[0], torch.full_like(scales[0], 144), "w")


@pytest.fixture(scope="module")
def mxfp4_checkpoint(gpt_oss_dir, module_tmp_path_factory, default_tokenizer):
    """The tiny checkpoint with its experts in MXFP4 as released gpt-oss checkpoints store them, and
    transformers' greedy continuations of the model whose experts are those MXFP4 values dequantized."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import hf_greedy
    from tests.mxfp4_checkpoints import write_mxfp4

    directory = module_tmp_path_factory.mktemp("gpt-oss-mxfp4")
    dequantized = write_mxfp4(gpt_oss_dir, directory)
    model = AutoModelForCausalLM.from_pretrained(gpt_oss_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in dequantized:
                assert not torch.equal(param, dequantized[name]), "MXFP4 rounds the tiny model's experts"
                param.copy_(dequantized[name])
    prompts = GPT_OSS_PROMPTS[:3]
    expected = [hf_greedy(model, default_tokenizer, default_tokenizer.encode(p), MAX_TOKENS, ignore_eos=True)
                for p in prompts]
    return str(directory), prompts, expected


def test_mxfp4_checkpoint_matches_hf_on_its_dequantized_experts(mxfp4_checkpoint, torch_ops_only):
    """On the products' torch path (the blocks dequantized), transformers' tokens on the same expert values."""
    directory, prompts, expected = mxfp4_checkpoint
    llm = LLM(directory, **ENGINE_ARGS)
    assert "mxfp4" in llm.llm_engine.core.runner.model.weight_format
    check_greedy(llm, prompts, expected, GREEDY)


def test_mxfp4_experts_run_on_their_blocks(mxfp4_checkpoint):
    """The native kernels: every expert at MXFP4_F16's 18 bytes per 32 weights, and each layer's experts (biases
    and the clamped SwiGLU included) within 2% of transformers' GptOssExperts on the values transformers reads from
    the same blocks (the GGUF kernels quantize activations per 32, as llama.cpp does; a wrong code, nibble order or
    scale would be tens of percent off)."""
    from transformers import AutoConfig
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from pagellm.layers.quantization.gguf_moe import GGUFFusedMoEMethod

    directory, _, _ = mxfp4_checkpoint
    model = LLM(directory, **ENGINE_ARGS).llm_engine.core.runner.model
    config = AutoConfig.from_pretrained(directory)
    stored = load_file(f"{directory}/model.safetensors")
    generator = torch.Generator().manual_seed(0)
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, FusedMoE)]
    assert len(layers) == config.num_hidden_layers
    for name, layer in layers:
        assert isinstance(layer.quant_method, GGUFFusedMoEMethod) and layer.gguf_experts is not None
        assert layer.w13_weight.dtype == torch.uint8 and layer.w2_weight.dtype == torch.uint8
        assert layer.w13_weight.numel() + layer.w2_weight.numel() == (
            config.num_local_experts * 3 * config.hidden_size * config.intermediate_size * 18 // 32)
        hf = GptOssExperts(config)
        with torch.no_grad():
            for proj in ("gate_up_proj", "down_proj"):
                blocks, scales = stored[f"{name}.{proj}_blocks"], stored[f"{name}.{proj}_scales"]
                getattr(hf, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                getattr(hf, f"{proj}_bias").copy_(stored[f"{name}.{proj}_bias"])
        x = torch.randn(5, config.hidden_size, generator=generator)
        ids = torch.randint(0, config.num_local_experts, (5, layer.top_k), generator=generator)
        weights = torch.softmax(torch.randn(5, layer.top_k, generator=generator), dim=-1)
        with torch.no_grad():
            got, expected = layer.quant_method.apply(layer, x, weights, ids), hf(x, ids, weights)
        assert (got - expected).norm() <= 0.02 * expected.norm(), name


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor-parallel", "expert-parallel"])
def test_mxfp4_experts_on_two_ranks_give_one_ranks_tokens(mxfp4_checkpoint, expert_parallel):
    """Two ranks keep the MXFP4_F16 blocks too: each rank a whole 32-weight block of every expert's down rows
    (tensor parallel) or two whole experts (expert parallel), with their biases."""
    from pagellm.layers.quantization.gguf_moe import GGUFFusedMoEMethod

    directory, prompts, _ = mxfp4_checkpoint
    single = LLM(directory, **ENGINE_ARGS)
    one = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    single.llm_engine.shutdown()
    llm = LLM(directory, **ENGINE_ARGS, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              distributed_timeout_seconds=60)
    try:
        experts = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
        assert all(isinstance(m.quant_method, GGUFFusedMoEMethod) and m.gguf_experts is not None for m in experts)
        check_greedy(llm, prompts, one, GREEDY)
    finally:
        llm.llm_engine.shutdown()


def test_mxfp4_is_not_an_online_quantization(gpt_oss_dir):
    from pagellm.layers.quantization.mxfp4 import mxfp4_config

    with pytest.raises(ValueError, match="quantization='mxfp4': MXFP4 is read from checkpoints"):
        LLM(gpt_oss_dir, dtype="float32", quantization="mxfp4")
    with pytest.raises(ValueError, match="MXFP4 is read from checkpoints"):
        mxfp4_config(None, "mxfp4")


def test_mxfp4_checkpoint_missing_scales_is_refused():
    from pagellm.models.gpt_oss import per_expert_tensors

    blocks = torch.zeros(2, 8, 4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\['model.layers.0.mlp.experts.down_proj'\] have blocks or scales"):
        list(per_expert_tensors([("model.layers.0.mlp.experts.down_proj_blocks", blocks)]))
