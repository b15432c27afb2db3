"""Mixture-of-experts: the router against transformers' gates (ties included), FusedMoE against a per-token
reference, and Mixtral / Qwen3-MoE from HF checkpoint directories with greedy output equal to transformers'
generate token for token in fp32 (batched, chunked prefill, prefix-cached, two tensor-parallel ranks, and two
ranks with expert parallelism).

Each model is a tiny random one (2-3 layers, 8 experts, small dims) saved with transformers' save_pretrained,
with the default model's tokenizer.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pagellm import LLM, SamplingParams
from pagellm.distributed.parallel_state import TensorParallelGroup, building_with
from pagellm.layers import fused_moe
from pagellm.layers.fused_moe import ExpertPlacement, FusedMoE, Routing
from pagellm.models.loader import default_dtype
from pagellm.ops.cpu_moe import cpu_moe_kernel
from pagellm.ops.linear_bf16 import linear_bf16
from tests.conftest import TINY_CONFIG
from tests.helpers import PROMPTS
from tests.models.tiny_checkpoints import check_greedy, checkpoint_dirs, greedy_references

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_seqs=8, max_model_len=256)
MOE_PROMPTS = [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[5], PROMPTS[8]]
SHARED_PREFIX = PROMPTS[8]

FAMILY_OWN_KEYS = ("rms_norm_eps", "rope_theta", "tie_word_embeddings", "intermediate_size")
COMMON = {key: value for key, value in TINY_CONFIG.items() if key not in FAMILY_OWN_KEYS}


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**{**COMMON, "num_hidden_layers": 2}, intermediate_size=64, num_local_experts=8,
                           num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=None)
    return MixtralForCausalLM, config


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse; weights not renormalised (norm_topk_prob false,
    # as in Qwen3-30B-A3B's config), head_dim 64 (not hidden / heads).
    config = Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3}, head_dim=64, intermediate_size=96,
                            moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                            decoder_sparse_step=1, mlp_only_layers=[1], rms_norm_eps=1e-6, rope_theta=10000.0)
    return Qwen3MoeForCausalLM, config


def _olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    # clip_qkv low enough to clip some of the normed q/k values and about half of v (the wide init).
    config = OlmoeConfig(**{**COMMON, "num_hidden_layers": 2}, intermediate_size=64, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=2.5, rms_norm_eps=1e-5,
                         rope_theta=10000.0, pad_token_id=0)
    return OlmoeForCausalLM, config


VARIANTS = {"mixtral": _mixtral, "qwen3-moe": _qwen3_moe, "olmoe": _olmoe}


@pytest.fixture(scope="module")
def moe_dirs(module_tmp_path_factory, default_tokenizer):
    return checkpoint_dirs(VARIANTS, module_tmp_path_factory, default_tokenizer)


@pytest.fixture(scope="module")
def hf_references(moe_dirs, default_tokenizer):
    return greedy_references(moe_dirs, default_tokenizer, MAX_TOKENS)


def _check_greedy(llm: LLM, prompts: list[str], expected: list[list[int]]) -> list:
    return check_greedy(llm, prompts, expected, GREEDY)


@pytest.mark.parametrize("variant", VARIANTS)
def test_batched_greedy_matches_hf(variant, moe_dirs, hf_references):
    llm = LLM(moe_dirs(variant), **ENGINE_ARGS)
    model = llm.llm_engine.core.runner.model
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2  # Mixtral, OLMoE: both layers; Qwen3-MoE: layers 0 and 2 (layer 1 is dense)
    _check_greedy(llm, MOE_PROMPTS, hf_references(variant, MOE_PROMPTS))
    assert llm.llm_engine.get_stats().kv_cache.num_used_blocks == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_and_prefix_cache_match_hf(variant, moe_dirs, hf_references, torch_ops_only):
    llm = LLM(moe_dirs(variant), **{**ENGINE_ARGS, "max_num_batched_tokens": 32, "block_size": 8,
                                    "enable_prefix_caching": True})
    _check_greedy(llm, MOE_PROMPTS, hf_references(variant, MOE_PROMPTS))
    follow_up = [SHARED_PREFIX + " And once more:"]
    [output] = _check_greedy(llm, follow_up, hf_references(variant, follow_up))
    assert output.num_cached_tokens >= 16, "the shared prefix came from the cache"


def test_preemption_keeps_outputs_exact(moe_dirs, hf_references):
    # 10 blocks of 16 tokens: less than the batch needs at once, enough for the longest request alone.
    llm = LLM(moe_dirs("mixtral"), dtype="float32", num_gpu_blocks_override=10, max_model_len=160, max_num_seqs=8)
    _check_greedy(llm, MOE_PROMPTS, hf_references("mixtral", MOE_PROMPTS))
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache.num_used_blocks == 0


@pytest.mark.parametrize("variant", ["qwen3-moe", "olmoe"])
def test_two_tensor_parallel_ranks_match_hf(variant, moe_dirs, hf_references):
    # Each rank holds half of every expert's intermediate features (and of Qwen3-MoE's dense layer); OLMoE's
    # whole-projection q/k norms sum their mean square over the ranks.
    llm = LLM(moe_dirs(variant), **ENGINE_ARGS, tensor_parallel_size=2, distributed_timeout_seconds=60)
    try:
        _check_greedy(llm, MOE_PROMPTS, hf_references(variant, MOE_PROMPTS))
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("variant", ["mixtral", "qwen3-moe"])
def test_expert_parallel_ranks_match_hf(variant, moe_dirs, hf_references):
    # enable_expert_parallel: each rank holds 4 of the 8 experts whole (Qwen3-MoE's dense layer stays split).
    llm = LLM(moe_dirs(variant), **ENGINE_ARGS, tensor_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout_seconds=60)
    try:
        # Rank 0 (this process): experts 0-3, each with all its intermediate features.
        intermediate = {"mixtral": 64, "qwen3-moe": 48}[variant]
        experts = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
        assert [(m.placement.start, m.local_num_experts) for m in experts] == [(0, 4)] * 2
        # The experts as the CPU kernel packed them: [experts, panels, 2, hidden, 16] and [experts, panels,
        # intermediate, 16] (ops/cpu_moe.py).
        assert [(m.w13_weight.shape[0], m.w13_weight.shape[3], m.w2_weight.shape[2]) for m in experts] \
            == [(4, 128, intermediate)] * 2
        prompts = MOE_PROMPTS[:3]
        _check_greedy(llm, prompts, hf_references(variant, prompts))
    finally:
        llm.llm_engine.shutdown()


# --- the router against transformers' gates ---------------------------------------------------------------

def _tied_hidden(tokens: int, hidden: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states and a gate weight of small integers: their logits repeat, so many experts tie."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (tokens, hidden), generator=generator).float()
    weight = torch.randint(-1, 2, (num_experts, hidden), generator=generator).float()
    return x, weight


def _random_hidden(tokens: int, hidden: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=generator), torch.randn(num_experts, hidden, generator=generator)


INPUTS = {"ties": _tied_hidden, "random": _random_hidden}


def _assert_same_routing(ours: tuple[torch.Tensor, torch.Tensor], theirs_weights: torch.Tensor,
                         theirs_ids: torch.Tensor) -> None:
    weights, ids = ours
    assert weights.dtype == torch.float32 and ids.shape == theirs_ids.shape
    assert torch.equal(ids, theirs_ids)
    torch.testing.assert_close(weights, theirs_weights.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("family, norm", [("mixtral", True), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_softmax_routing_matches_transformers(family, norm, inputs):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if family == "mixtral":
        gate = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2))
    else:
        gate = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                                 norm_topk_prob=norm))
    x, weight = INPUTS[inputs](64, 16, 8, seed=3)
    gate.weight.data.copy_(weight)
    if inputs == "ties":
        edge = F.linear(x, weight).topk(gate.top_k + 1).values
        assert (edge[:, -1] == edge[:, -2]).any(), "some token's k-th and (k+1)-th experts tie"
    logits, theirs_weights, theirs_ids = gate(x)
    _assert_same_routing(Routing.softmax_top_k(gate.top_k, norm).select(F.linear(x, weight)), theirs_weights,
                         theirs_ids)


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_v3_routing_matches_transformers(inputs, norm):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=norm)
    gate = DeepseekV3TopkRouter(config)
    x, weight = INPUTS[inputs](64, 16, 16, seed=5)
    gate.weight.data.copy_(weight)
    # A bias that moves choices: with it some experts are chosen whose own score is not among the top k.
    bias = torch.linspace(-0.3, 0.3, 16) if inputs == "random" else torch.zeros(16)
    gate.e_score_correction_bias.copy_(bias)
    _, theirs_weights, theirs_ids = gate(x)
    routing = Routing.deepseek_v3(config)
    _assert_same_routing(routing.select(F.linear(x, weight), bias), theirs_weights, theirs_ids)


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing_matches_transformers(inputs, method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              topk_method=method, routed_scaling_factor=16.0)
    gate = DeepseekV2TopkRouter(config)
    x, weight = INPUTS[inputs](64, 16, 16, seed=7)
    gate.weight.data.copy_(weight)
    _, theirs_weights, theirs_ids = gate(x)
    _assert_same_routing(Routing.deepseek_v2(config).select(F.linear(x, weight)), theirs_weights, theirs_ids)


@pytest.mark.parametrize("routing, num_experts, named", [
    (Routing.softmax_top_k(9, True), 8, "num_experts_per_tok=9"),
    (Routing.softmax_top_k(0, True), 8, "num_experts_per_tok=0"),
    (Routing(4, "sigmoid", True, 3, 2, "top2_sum"), 16, "n_group=3"),
    (Routing(4, "sigmoid", True, 4, 5, "top2_sum"), 16, "topk_group=5"),
    (Routing(8, "sigmoid", True, 4, 1, "top2_sum"), 16, "topk_group=1"),
    (Routing(2, "softmax", True, 8, 2, "top2_sum"), 8, "n_group=8"),
    (Routing(2, "tanh", True), 8, "scoring_func='tanh'"),
])
def test_settings_the_kernels_cannot_take_are_refused(routing, num_experts, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        routing.check(num_experts)


# --- the experts ------------------------------------------------------------------------------------------

def _random_experts(num_experts: int, hidden: int, intermediate: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_experts, intermediate, hidden, generator=generator) * 0.1,
            torch.randn(num_experts, intermediate, hidden, generator=generator) * 0.1,
            torch.randn(num_experts, hidden, intermediate, generator=generator) * 0.1)


def _load(layer: FusedMoE, w1, w3, w2, expert_offset: int = 0) -> None:
    for expert in range(layer.num_experts):
        source = expert + expert_offset
        for shard, tensor in (("w1", w1[source]), ("w3", w3[source])):
            layer.weight_loader(layer.w13_weight, tensor, shard, expert)
        layer.weight_loader(layer.w2_weight, w2[source], "w2", expert)


def _per_token_reference(x, weights, ids, w1, w3, w2) -> torch.Tensor:
    x, out = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token].tolist(), ids[token].tolist()):
            gate, up = w1[expert].double() @ x[token], w3[expert].double() @ x[token]
            out[token] += weight * (w2[expert].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "intermediate"), [(1, 24), (7, 32), (64, 24), (64, 32)])
def test_fused_moe_matches_a_per_token_reference(tokens, intermediate, dtype, native, monkeypatch):
    if native and cpu_moe_kernel() is None:
        pytest.skip("no C compiler for the native kernels")
    if native and dtype == torch.bfloat16 and linear_bf16() is not None and intermediate % 16:
        # The bf16 dot layout wants multiples of 16; those experts take the dense bf16 kernel per product.
        native = False
    if not native:
        monkeypatch.setattr("pagellm.layers.fused_moe.cpu_moe_kernel", lambda: None)
    num_experts, hidden = 8, 32
    w1, w3, w2 = _random_experts(num_experts, hidden, intermediate, seed=1)
    with default_dtype(dtype):
        layer = FusedMoE(num_experts, 2, hidden, intermediate, prefix="layer")
    _load(layer, w1, w3, w2)
    layer.process_weights_after_loading()
    assert (layer.native_experts is not None) == native
    if not native and dtype != torch.float32:  # the dense layers' kernel per expert product
        assert layer.gate_up_kernels is not None and len(layer.down_kernels) == num_experts
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=generator)
    weights, ids = layer.routing.select(logits)
    expected = _per_token_reference(x, weights, ids, *(w.to(dtype) for w in (w1, w3, w2)))
    out = layer(x, logits)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_busy_bf16_steps_take_linear_bf16_per_expert_where_amx_would(monkeypatch):
    """On a CPU with AMX, a step whose experts average `amx_min_rows` rows runs each expert through linear_bf16
    (its tiles) on the fused kernel's packed weights. Without AMX here, the vector linear_bf16 stands in: the same
    sums in the same order, so the two paths agree to the bit and only the choice is under test."""
    linear, kernel = linear_bf16(), cpu_moe_kernel()
    if linear is None or kernel is None or not kernel.bf16_dot:
        pytest.skip("no avx512_bf16 dot product on this CPU")
    num_experts, hidden, intermediate = 8, 32, 32
    w1, w3, w2 = _random_experts(num_experts, hidden, intermediate, seed=2)
    with default_dtype(torch.bfloat16):
        layer = FusedMoE(num_experts, 2, hidden, intermediate, prefix="layer")
    _load(layer, w1, w3, w2)
    layer.process_weights_after_loading()
    assert layer.native_experts is not None and (layer.tile_experts is not None) == linear.amx
    calls = []
    original = fused_moe.linear_bf16_experts
    monkeypatch.setattr(fused_moe, "linear_bf16_experts", lambda *args: calls.append(1) or original(*args))
    generator = torch.Generator().manual_seed(3)
    for tokens in (3, 40):  # 6 pairs over 8 experts: the fused kernel; 80: ten rows an expert, the tiles
        x = torch.randn(tokens, hidden, generator=generator).bfloat16()
        logits = torch.randn(tokens, num_experts, generator=generator)
        layer.tile_experts = None
        fused = layer(x, logits)
        monkeypatch.setattr(linear, "amx_min_rows", 4)
        layer.tile_experts = linear
        calls.clear()
        assert torch.equal(layer(x, logits), fused)
        assert len(calls) == (tokens * 2 >= 4 * num_experts)


def test_correction_bias_chooses_experts_but_does_not_weigh_them():
    num_experts, hidden, intermediate = 8, 16, 8
    w1, w3, w2 = _random_experts(num_experts, hidden, intermediate, seed=4)
    routing = Routing(2, "sigmoid", True, 4, 2, "top2_sum", 2.5, sorted_choice=False)
    layer = FusedMoE(num_experts, 2, hidden, intermediate, prefix="layer", routing=routing, has_correction_bias=True)
    assert layer.e_score_correction_bias.dtype == torch.float32
    assert "e_score_correction_bias" in dict(layer.named_parameters())
    _load(layer, w1, w3, w2)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 5.0])  # experts 6 and 7 always win the choice
    layer.e_score_correction_bias.data.copy_(bias)
    x, logits = torch.randn(5, hidden), torch.randn(5, num_experts)
    weights, ids = layer.select_experts(logits)
    assert sorted(ids[0].tolist()) == [6, 7]
    scores = logits.sigmoid()[:, 6:]
    torch.testing.assert_close(weights.sort(dim=-1).values,
                               (scores / scores.sum(-1, keepdim=True) * 2.5).sort(dim=-1).values)
    expected = _per_token_reference(x, weights, ids, w1, w3, w2)
    torch.testing.assert_close(layer(x, logits).double(), expected, rtol=1e-5, atol=1e-5)


def test_inactive_experts_do_no_work():
    num_experts, hidden, intermediate = 8, 16, 8
    layer = FusedMoE(num_experts, 2, hidden, intermediate, prefix="layer")
    _load(layer, *_random_experts(num_experts, hidden, intermediate, seed=2))
    calls: list[int] = []
    product = layer.quant_method._product

    def counted(_, which):
        run = product(layer, which)
        return lambda expert, rows, out: (calls.append((which, expert, rows.shape[0])), run(expert, rows, out))

    layer.quant_method._product = counted
    logits = torch.full((5, num_experts), -10.0)
    logits[:, 3] = logits[:, 6] = 10.0  # every token routes to experts 3 and 6
    layer(torch.randn(5, hidden), logits)
    assert calls == [("gate_up", 3, 5), ("gate_up", 6, 5), ("down", 3, 5), ("down", 6, 5)], \
        "each active expert's two products ran once, over all its tokens"


def test_tensor_parallel_ranks_hold_their_slice_of_each_expert():
    num_experts, hidden, intermediate = 4, 16, 12
    w1, w3, w2 = _random_experts(num_experts, hidden, intermediate, seed=3)
    x, logits = torch.randn(6, hidden), torch.randn(6, num_experts)
    full = FusedMoE(num_experts, 2, hidden, intermediate, prefix="layer")
    _load(full, w1, w3, w2)
    partial = torch.zeros(6, hidden)
    for rank in range(2):
        with building_with(TensorParallelGroup(rank, 2)):
            shard = FusedMoE(num_experts, 2, hidden, intermediate, prefix="layer")
        _load(shard, w1, w3, w2)
        assert shard.w13_weight.shape == (num_experts, intermediate, hidden)
        # Without a device group the all-reduce cannot run: sum the ranks' partial outputs here.
        shard.reduce_results = False
        partial += shard(x, logits)
    torch.testing.assert_close(partial, full(x, logits), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_experts, size, held", [
    (8, 2, [(0, 4), (4, 4)]),
    (5, 2, [(0, 3), (3, 2)]),  # vLLM's linear placement: the first E % n ranks hold one more
    (7, 4, [(0, 2), (2, 2), (4, 2), (6, 1)]),
])
def test_expert_parallel_ranks_hold_whole_experts(num_experts, size, held):
    hidden, intermediate = 16, 12
    w1, w3, w2 = _random_experts(num_experts, hidden, intermediate, seed=5)
    generator = torch.Generator().manual_seed(6)
    x, logits = torch.randn(9, hidden, generator=generator), torch.randn(9, num_experts, generator=generator)
    full = FusedMoE(num_experts, 2, hidden, intermediate, prefix="layer")
    _load(full, w1, w3, w2)
    partial = torch.zeros(9, hidden)
    for rank in range(size):
        with building_with(TensorParallelGroup(rank, size, expert_parallel=True)):
            shard = FusedMoE(num_experts, 2, hidden, intermediate, prefix="layer")
        assert shard.placement == ExpertPlacement.for_rank(num_experts, rank, size)
        assert (shard.placement.start, shard.local_num_experts) == held[rank]
        _load(shard, w1, w3, w2)  # every checkpoint expert is offered; the rank keeps its own
        start, count = held[rank]
        assert shard.w13_weight.shape == (count, 2 * intermediate, hidden)
        torch.testing.assert_close(shard.w13_weight, full.w13_weight[start:start + count], rtol=0, atol=0)
        torch.testing.assert_close(shard.w2_weight, full.w2_weight[start:start + count], rtol=0, atol=0)
        shard.reduce_results = False
        partial += shard(x, logits)
    torch.testing.assert_close(partial, full(x, logits), rtol=1e-5, atol=1e-6)


def test_expert_parallel_rank_with_no_routed_token_adds_zeros():
    num_experts, hidden, intermediate = 4, 16, 8
    with building_with(TensorParallelGroup(1, 2, expert_parallel=True)):
        shard = FusedMoE(num_experts, 2, hidden, intermediate, prefix="layer")
    _load(shard, *_random_experts(num_experts, hidden, intermediate, seed=7))
    shard.reduce_results = False
    logits = torch.full((3, num_experts), -10.0)
    logits[:, :2] = 10.0  # experts 0 and 1, both on rank 0
    assert torch.equal(shard(torch.randn(3, hidden), logits), torch.zeros(3, hidden))


def _expert_bytes(model) -> list[int]:
    return [sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules()
            if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("variant", ["mixtral", "qwen3-moe"])
def test_expert_parallel_rank_holds_its_share_of_expert_bytes(variant):
    # The planning build (meta tensors, as the worker sizes its weights): each of 2 ranks holds 4 of 8 experts.
    model_class = _model_class(variant)
    _, config = VARIANTS[variant]()
    config.vocab_size = 64
    with torch.device("meta"):
        whole = _expert_bytes(model_class(config, 256))
        for rank in range(2):
            with building_with(TensorParallelGroup(rank, 2, expert_parallel=True)):
                share = _expert_bytes(model_class(config, 256))
            assert share == [size // 2 for size in whole]


def _model_class(variant: str):
    from pagellm.models.mixtral import MixtralForCausalLM
    from pagellm.models.qwen3_moe import Qwen3MoeForCausalLM

    return {"mixtral": MixtralForCausalLM, "qwen3-moe": Qwen3MoeForCausalLM}[variant]


def test_expert_parallel_refuses_more_ranks_than_experts():
    # As the worker's planning build meets it, before any weight is read: 4 ranks, 2 experts.
    _, config = _mixtral()
    config.vocab_size, config.num_local_experts, config.num_experts_per_tok = 64, 2, 1
    with torch.device("meta"), building_with(TensorParallelGroup(0, 4, expert_parallel=True)):
        with pytest.raises(ValueError, match=r"tensor_parallel_size=4 ranks, but this layer has 2 experts.*"
                                             r"tensor_parallel_size <= 2"):
            _model_class("mixtral")(config, 256)


def test_engine_with_expert_parallel_refuses_a_single_expert(tmp_path):
    # config.json alone, two ranks started: the engine fails to start with the layer's reason, nothing loaded.
    _, config = _mixtral()
    fields = {**config.to_dict(), "vocab_size": 64, "num_local_experts": 1, "num_experts_per_tok": 1}
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 ranks, but this layer has 1 expert, so a rank would hold none"):
        LLM(_write_config(tmp_path / "model", **fields), dtype="float32", tensor_parallel_size=2,
            enable_expert_parallel=True, distributed_timeout_seconds=60)


def test_tensor_parallel_size_must_divide_the_experts_intermediate_size():
    with building_with(TensorParallelGroup(0, 4)), pytest.raises(ValueError, match=r"tensor_parallel_size=4.*\(18\)"):
        FusedMoE(4, 2, 16, 18, prefix="model.layers.0.mlp.experts")


@pytest.mark.parametrize("name, target", [
    ("model.layers.3.block_sparse_moe.experts.5.w1.weight", ("model.layers.3.block_sparse_moe.experts.w13_weight", 5, "w1")),
    ("model.layers.3.block_sparse_moe.experts.5.w3.weight", ("model.layers.3.block_sparse_moe.experts.w13_weight", 5, "w3")),
    ("model.layers.0.mlp.experts.17.down_proj.weight", ("model.layers.0.mlp.experts.w2_weight", 17, "w2")),
    ("model.layers.0.mlp.experts.0.up_proj.weight", ("model.layers.0.mlp.experts.w13_weight", 0, "w3")),
    ("model.layers.0.mlp.shared_experts.gate_proj.weight", None),
    ("model.layers.0.mlp.gate.weight", None),
])
def test_checkpoint_names_map_to_expert_shards(name, target):
    found = FusedMoE.checkpoint_target(name)
    assert (None if found is None else (found[0], found[1].expert_id, found[1].shard_id)) == target


def _write_config(directory, **fields) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))
    return str(directory)


@pytest.mark.parametrize("overrides, named", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok=0"),
])
def test_expert_settings_are_refused_before_loading(tmp_path, overrides, named):
    # config.json alone: the refusal comes from building the model, before any weight is looked for.
    _, config = _mixtral()
    fields = {**config.to_dict(), "vocab_size": 64, **overrides}
    with pytest.raises(ValueError, match=named):
        LLM(_write_config(tmp_path / "model", **fields), dtype="float32")


def test_vllm_style_mapping_agrees_with_checkpoint_target():
    for param_prefix, name_prefix, expert, shard in FusedMoE.make_expert_params_mapping(4):
        name = f"model.layers.1.mlp.{name_prefix}weight"
        param, target = FusedMoE.checkpoint_target(name)
        assert param == f"model.layers.1.mlp.{param_prefix}"
        assert (target.expert_id, target.shard_id) == (expert, shard)
