"""DeepSeek-V2/V3 with multi-head latent attention on the paged latent cache: greedy output equals
transformers' generate token for token in fp32 (batched, chunked prefill, prefix-cached, preempted, on two
tensor-parallel ranks with and without expert parallelism), on every latent decode path; and the pool holds the
latent alone (tokens per GiB against the same model with full K/V).

Each variant is a tiny random model saved with transformers' save_pretrained (the default model's tokenizer):
"v2-lite" has no q_lora_rank (DeepSeek-V2-Lite's q_proj) and plain rope; "v3" has q_lora_rank, yarn rope with
mscale/mscale_all_dim as DeepSeek-V3's config sets them (which also scale the softmax) and interleaved rope.
Layer 0 is dense and layer 1 a mixture of experts (first_k_dense_replace=1): 8 routed experts, 2 per token,
and shared experts; V2's router is softmax top-k ("greedy", or "group_limited_greedy" in "v2-grouped"), V3's
sigmoid with a (perturbed) e_score_correction_bias, grouped top-k and routed_scaling_factor.
"""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.attention.kv_spec import GiB, KVCacheSpec, kv_cache_spec_for
from tests.helpers import PROMPTS
from tests.models.tiny_checkpoints import check_greedy, checkpoint_dirs, greedy_references

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_seqs=8, max_model_len=256)
MLA_PROMPTS = [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[5], PROMPTS[8]]
SHARED_PREFIX = PROMPTS[8]

# Heads 4; latent rank 64 + rope 16 = 80 values cached per token and layer, against 4 * (32 + 16) + 4 * 24
# = 288 for the expanded K/V.
COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.3, kv_lora_rank=64,
              qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, first_k_dense_replace=1,
              n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


def _v2(grouped: bool):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    routing = dict(topk_method="group_limited_greedy", n_group=4, topk_group=2) if grouped else {}
    config = DeepseekV2Config(**COMMON, q_lora_rank=None, rope_theta=10000.0, n_shared_experts=2, **routing)
    return DeepseekV2ForCausalLM, config


def _v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**COMMON, q_lora_rank=48, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                              n_shared_experts=1, rope_parameters=YARN)
    return DeepseekV3ForCausalLM, config


VARIANTS = {"v2-lite": lambda: _v2(grouped=False), "v2-grouped": lambda: _v2(grouped=True), "v3": _v3}
# The chunked/prefix-cached test runs these; the grouped V2 router changes nothing there.
CHUNKED_VARIANTS = ["v2-lite", "v3"]


def _perturb_correction_bias(model) -> None:
    """transformers starts V3's correction bias at zero; perturbed, it changes which experts are chosen."""
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.add_(torch.randn_like(buffer) * 0.3)


@pytest.fixture(scope="module")
def mla_dirs(module_tmp_path_factory, default_tokenizer):
    return checkpoint_dirs(VARIANTS, module_tmp_path_factory, default_tokenizer, _perturb_correction_bias)


@pytest.fixture(scope="module")
def hf_references(mla_dirs, default_tokenizer):
    return greedy_references(mla_dirs, default_tokenizer, MAX_TOKENS)


def _check_greedy(llm: LLM, prompts: list[str], expected: list[list[int]]) -> list:
    return check_greedy(llm, prompts, expected, GREEDY)


@pytest.fixture
def attention_backend(monkeypatch):
    """Forces PAGELLM_ATTENTION_BACKEND for one test ("" leaves the device's choice)."""

    def force(name: str) -> None:
        if name:
            monkeypatch.setenv("PAGELLM_ATTENTION_BACKEND", name)

    return force


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_greedy_matches_hf(variant, mla_dirs, hf_references):
    llm = LLM(mla_dirs(variant), **ENGINE_ARGS)
    # Decodes on the C kernel (csrc/mla_decode.c), as users' CPUs run them.
    assert llm.llm_engine.core.runner.attn_backend.name == "mla-cpu-native"
    # The grouped V2 router differs only in the experts it picks: three prompts show it.
    prompts = MLA_PROMPTS[:3] if variant == "v2-grouped" else MLA_PROMPTS
    _check_greedy(llm, prompts, hf_references(variant, prompts))
    assert llm.llm_engine.get_stats().kv_cache.num_used_blocks == 0


@pytest.mark.parametrize("variant", CHUNKED_VARIANTS)
def test_chunked_prefill_and_prefix_cache_match_hf(variant, mla_dirs, hf_references, attention_backend):
    # A 32-token budget splits the long prompts into chunks beside other requests' decodes, which read their
    # context's latents back from the cache; then a request sharing the long prompt's prefix starts from its
    # cached blocks. On the torch reference path of the latent decode.
    attention_backend("torch")
    llm = LLM(mla_dirs(variant), **{**ENGINE_ARGS, "max_num_batched_tokens": 32, "block_size": 8,
                                    "enable_prefix_caching": True})
    assert llm.llm_engine.core.runner.attn_backend.name == "mla-torch"
    _check_greedy(llm, MLA_PROMPTS, hf_references(variant, MLA_PROMPTS))
    follow_up = [SHARED_PREFIX + " And once more:"]
    [output] = _check_greedy(llm, follow_up, hf_references(variant, follow_up))
    assert output.num_cached_tokens >= 16, "the shared prefix came from the cache"


def test_triton_latent_decode_matches_hf(mla_dirs, hf_references, attention_backend):
    # Under TRITON_INTERPRET=1 where there is no GPU (tests/conftest.py).
    pytest.importorskip("triton")
    attention_backend("triton")
    llm = LLM(mla_dirs("v3"), **ENGINE_ARGS)
    assert llm.llm_engine.core.runner.attn_backend.name == "mla-triton"
    _check_greedy(llm, MLA_PROMPTS[:3], hf_references("v3", MLA_PROMPTS[:3]))


def test_parallel_samples_and_beam_search_on_shared_latent_blocks(mla_dirs, hf_references, default_tokenizer):
    # n=2 greedy forks share the prompt's latent blocks (copy-on-write past them): both equal transformers'.
    from transformers import AutoModelForCausalLM

    from pagellm.sampling_params import BeamSearchParams

    path = mla_dirs("v3")
    llm = LLM(path, **ENGINE_ARGS)
    prompts = MLA_PROMPTS[1:3]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    for output, reference in zip(llm.generate(prompts, params, use_tqdm=False), hf_references("v3", prompts)):
        assert [sample.token_ids for sample in output.outputs] == [reference, reference]
    prompt_ids = default_tokenizer.encode(PROMPTS[2])
    (result,) = llm.beam_search([PROMPTS[2]], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        beams = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=3, num_return_sequences=3,
                               do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    assert [sequence.tokens[len(prompt_ids):] for sequence in result.sequences] == \
        beams[:, len(prompt_ids):].tolist()
    assert llm.llm_engine.get_stats().kv_cache.num_used_blocks == 0


@pytest.mark.parametrize("cache_dtype,row_bytes", [("fp8", 82), ("bfloat16", 160)])
def test_narrow_latent_cache(cache_dtype, row_bytes, mla_dirs, attention_backend):
    """kv_cache_dtype="fp8": each latent row is 80 e4m3 codes and a bfloat16 scale, which the C kernel reads as
    stored; the pool holds 4 * 80 / 82 times the tokens of the float32 latent. "bfloat16" under the float32
    model: the row rounded to bfloat16 (twice the tokens), read widened. Greedy output equals the torch reference
    path's over the same cache format."""
    prompts = MLA_PROMPTS[:3]
    llm = LLM(mla_dirs("v2-lite"), **ENGINE_ARGS, kv_cache_dtype=cache_dtype)
    assert llm.llm_engine.core.runner.attn_backend.name == "mla-cpu-native"
    spec = llm.llm_engine.core.executor.driver.kv_spec
    assert spec.tokens_per_gib == pytest.approx(GiB / (2 * row_bytes))
    native = [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY, use_tqdm=False)]
    del llm
    attention_backend("torch")
    reference = LLM(mla_dirs("v2-lite"), **ENGINE_ARGS, kv_cache_dtype=cache_dtype)
    assert reference.llm_engine.core.runner.attn_backend.name == "mla-torch"
    expected = [output.outputs[0].token_ids for output in reference.generate(prompts, GREEDY, use_tqdm=False)]
    assert native == expected
    assert all(len(tokens) == MAX_TOKENS for tokens in native)


def test_preemption_keeps_outputs_exact(mla_dirs, hf_references):
    # 9 blocks of 16 tokens: less than the batch needs at once, enough for the longest request (113 tokens) alone.
    llm = LLM(mla_dirs("v3"), dtype="float32", num_gpu_blocks_override=9, max_model_len=144, max_num_seqs=8)
    _check_greedy(llm, MLA_PROMPTS, hf_references("v3", MLA_PROMPTS))
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache.num_used_blocks == 0


def test_pool_holds_the_latent_alone(mla_dirs):
    """tokens per GiB = what the latent row allows (rank + rope values per token and layer, no V plane), and
    the start-up line says so; against the same model with its K/V expanded."""
    llm = LLM(mla_dirs("v2-lite"), **ENGINE_ARGS)
    spec = llm.llm_engine.core.executor.driver.kv_spec
    config = llm.llm_engine.core.runner.model.config
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    assert spec.latent and spec.num_kv_heads == 1 and spec.head_dim == latent
    latent_allows = GiB / (config.num_hidden_layers * latent * 4)
    assert spec.tokens_per_gib >= 0.9 * latent_allows
    assert spec.tokens_per_gib == pytest.approx(latent_allows)
    # 2 planes x 4 heads x 48 values against 80: 4.8x the tokens.
    full = _full_kv_tokens_per_gib(config, spec.block_size)
    assert spec.tokens_per_gib / full == pytest.approx(2 * 4 * 48 / latent)
    assert "MLA latent of 80 values" in spec.describe()
    pool = llm.llm_engine.core.runner.kv_pool
    assert pool.shape[:2] == (config.num_hidden_layers, 1) and pool.shape[-1] == latent


def _full_kv_tokens_per_gib(config, block_size: int) -> float:
    """The same model caching expanded K (nope + rope per head) and V (v_head_dim per head): K and V planes of
    the wider head size (a paged pool's planes share one head size)."""
    head = max(config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim)
    return KVCacheSpec(config.num_hidden_layers, config.num_attention_heads, head, block_size,
                       torch.float32).tokens_per_gib


def test_spec_of_an_ordinary_model_is_unchanged():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    spec = kv_cache_spec_for(config, 2, 32, 16, torch.float32, "auto")
    assert not spec.latent and spec.pool_shape(5) == (3, 2, 5, 2, 16, 32)


@pytest.mark.parametrize("variant, expert_parallel", [
    ("v2-lite", False), ("v3", False), ("v2-lite", True), ("v3", True)])
def test_two_tensor_parallel_ranks_match_hf(variant, expert_parallel, mla_dirs, hf_references):
    # Each rank holds 2 of the 4 heads of q and kv_b_proj and their o_proj columns, and the whole latent; the
    # routed experts are split by features, or 4 of 8 whole per rank with expert parallelism. A 32-token budget
    # mixes prefill chunks (reading their context's latents back) with other requests' decodes.
    llm = LLM(mla_dirs(variant), **{**ENGINE_ARGS, "max_num_batched_tokens": 32, "block_size": 8},
              tensor_parallel_size=2, enable_expert_parallel=expert_parallel, distributed_timeout_seconds=60)
    try:
        model = llm.llm_engine.core.runner.model
        attention = model.model.layers[0].self_attn
        assert attention.num_heads == 2 and attention.w_uk.shape == (2, 32, 64)
        assert llm.llm_engine.core.runner.kv_pool.shape[-1] == 64 + 16  # the whole latent row on each rank
        assert model.model.layers[1].mlp.experts.local_num_experts == (4 if expert_parallel else 8)
        prompts = MLA_PROMPTS[:3]
        _check_greedy(llm, prompts, hf_references(variant, prompts))
    finally:
        llm.llm_engine.shutdown()


def _planned(config, rank: int, size: int):
    from pagellm.distributed.parallel_state import TensorParallelGroup, building_with
    from pagellm.models.deepseek_v2 import DeepseekV3ForCausalLM

    with torch.device("meta"), building_with(TensorParallelGroup(rank, size)):
        return DeepseekV3ForCausalLM(config, 256)


def test_tensor_parallel_ranks_hold_their_heads_and_the_whole_latent(mla_dirs):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(mla_dirs("v3"))
    attention = _planned(config, 1, 2).model.layers[0].self_attn
    shapes = {name: tuple(param.shape) for name, param in attention.named_parameters()}
    # 2 of 4 heads: q (32 + 16 per head), kv_b (32 + 24 per head), o_proj's input (24 per head).
    assert shapes["q_b_proj.weight"] == (2 * 48, 48) and shapes["kv_b_proj.weight"] == (2 * 56, 64)
    assert shapes["o_proj.weight"] == (128, 2 * 24)
    # Replicated: the latent and the query's low-rank input.
    assert shapes["kv_a_proj_with_mqa.weight"] == (64 + 16, 128) and shapes["q_a_proj.weight"] == (48, 128)
    assert attention.num_kv_heads == 1


def test_tensor_parallel_size_not_dividing_the_heads_is_refused(mla_dirs):
    # As the worker's planning build meets it, before any weight is read (no ranks are started for this).
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(mla_dirs("v2-lite"))
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        _planned(config, 0, 3)
