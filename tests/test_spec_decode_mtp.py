"""Speculative decoding with model heads over the target's hidden states, on tiny random fp32 models: method "mtp"
(DeepSeek-V3's multi-token-prediction layer, in the target's checkpoint) and "eagle" (an EAGLE-1 head in a
checkpoint of its own, over a llama target). Greedy output equals the output without speculation whatever the
head proposes (batched, chunked prefill, prefix-cache hits, preemption), seeded sampling draws the same tokens,
the drafts are counted, and the head's cache holds what a recomputation from the target's hidden states gives;
refusals name the values.

transformers' DeepSeek-V3 drops the MTP layer, so the fixture adds its tensors to the saved safetensors with
DeepSeek's names (model.layers.{num_hidden_layers}.*). The heads are random, but lean towards repeating their
input token (the target's tiny random models repeat tokens often), so that some drafts are accepted and the rest
rolled back.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import ArgumentValueError, EngineArgs
from pagellm.spec_decode.config import SpeculativeConfig
from pagellm.spec_decode.mtp import HeadError
from tests.conftest import _save_tiny
from tests.helpers import PROMPTS

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Five short prompts and a long one (1 to 73 tokens): the long one is chunked under a 32-token budget. The
# preempted engine runs the short ones twice over: ten requests of one block each at admission, two each by the
# end, in 7 blocks.
SOME_PROMPTS = [PROMPTS[i] for i in (0, 1, 3, 4, 9, 5)]
NUM_SHORT = 5
SEEDED = [SamplingParams(seed=index, temperature=0.8, top_p=0.9, presence_penalty=0.3, max_tokens=MAX_TOKENS,
                         ignore_eos=True) for index in range(2)]
CACHE = 16 << 20
# A shared opening longer than a block: the later requests hit the prefix cache.
SHARED = "Paged attention stores the KV cache in fixed-size blocks, like an operating system's pages. "
CACHED_PROMPTS = [SHARED + "First,", SHARED + "Second,", SHARED + "Third,"]
# MLA and experts as tests/models/test_mla.py's V3, one dense layer and one MoE layer; the MTP layer (index 2)
# is a MoE layer as DeepSeek-V3's.
DEEPSEEK = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.3, kv_lora_rank=64,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, first_k_dense_replace=1,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, q_lora_rank=48, n_group=4,
                topk_group=2, n_shared_experts=1, rope_theta=10000.0, tie_word_embeddings=False)
# The scale of the target's layers' outputs, the weight of the input token in its LM head (_predictable), and the
# relative noise on the head's copy of the last layer.
LAYER_SCALE = 0.05
COPY = 0.3
NOISE = 0.05
ENGINES = {
    "batched": dict(max_num_seqs=16, kv_cache_memory_bytes=CACHE),
    "chunked": dict(max_num_seqs=16, max_num_batched_tokens=32, kv_cache_memory_bytes=CACHE),
    "prefix-cached": dict(max_num_seqs=16, kv_cache_memory_bytes=CACHE, enable_prefix_caching=True),
    "preempted": dict(max_num_seqs=16, num_gpu_blocks_override=7, max_model_len=96),
}


def _config(method: str, k: int, model: str | None = None) -> dict:
    # disable_by_batch_size above the batch: every request speculates.
    config = {"method": method, "num_speculative_tokens": k, "disable_by_batch_size": 64}
    return {**config, "model": model} if model else config


def _outputs(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _stats(llm: LLM):
    return llm.llm_engine.core.scheduler.get_stats().spec_decoding


def _copying(generator: torch.Generator, rows: int, columns: int, scale: float) -> torch.Tensor:
    """Noise of `scale` over [I 0] (of `rows` x `columns`): a projection that mostly passes its first input on."""
    weight = torch.randn(rows, columns, generator=generator) * scale
    weight[:, :rows] += torch.eye(rows)
    return weight


@torch.no_grad()
def _predictable(model) -> None:
    """Makes a random target one that a head can sometimes draft for: embedding rows of unit RMS, every layer's
    output projections scaled down (the residual stream stays near the token's embedding), and an LM head that
    leans towards the input token. Greedy decoding then wanders until it meets a token that predicts itself; a
    head that copies the last layer agrees with the target there, and mostly not before."""
    embed = model.model.embed_tokens.weight
    embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt())
    for name, param in model.model.layers.named_parameters():
        if "o_proj" in name or "down_proj" in name:
            param.mul_(LAYER_SCALE)
    model.lm_head.weight.add_(embed * COPY)


def _save_deepseek(path, tokenizer, mtp: bool) -> str:
    """A tiny random DeepSeek-V3; with `mtp`, plus an MTP layer: a copy of the last layer with noise, eh_proj
    passing the (normed) embedding on, the target's final norm and LM head as its shared head."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**DEEPSEEK, num_nextn_predict_layers=1 if mtp else 0, vocab_size=len(tokenizer),
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.3)
    _predictable(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if mtp:
        generator = torch.Generator().manual_seed(1)
        file = path / "model.safetensors"
        tensors = load_file(file)
        hidden, layers = config.hidden_size, config.num_hidden_layers
        last, mtp_layer = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
        for name, tensor in list(tensors.items()):
            if name.startswith(last):
                noise = torch.randn(tensor.shape, generator=generator) * NOISE * tensor.std().nan_to_num(0)
                tensors[name.replace(last, mtp_layer)] = tensor + noise
        tensors[f"{mtp_layer}enorm.weight"] = torch.ones(hidden)
        tensors[f"{mtp_layer}hnorm.weight"] = torch.ones(hidden)
        tensors[f"{mtp_layer}eh_proj.weight"] = _copying(generator, hidden, 2 * hidden, NOISE / 10)
        tensors[f"{mtp_layer}shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        tensors[f"{mtp_layer}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        save_file(tensors, file, metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def deepseek_dir(module_tmp_path_factory, default_tokenizer) -> str:
    return _save_deepseek(module_tmp_path_factory.mktemp("tiny-deepseek-mtp"), default_tokenizer, mtp=True)


@pytest.fixture(scope="module")
def llama_dir(module_tmp_path_factory, default_tokenizer) -> str:
    """A tiny random llama made predictable as the DeepSeek target is (_predictable)."""
    from transformers import AutoModelForCausalLM

    path = module_tmp_path_factory.mktemp("tiny-llama-eagle-target")
    _save_tiny(path, default_tokenizer, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _predictable(model)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def eagle_dir(module_tmp_path_factory, llama_dir) -> str:
    """An EAGLE-1 head for llama_dir: its last layer with noise and without the input norm, fc mostly passing the
    embedding on."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(llama_dir)
    target = load_file(f"{llama_dir}/model.safetensors")
    generator = torch.Generator().manual_seed(3)
    last = f"model.layers.{config.num_hidden_layers - 1}."
    tensors = {name.replace(last, "layers.0."): tensor + torch.randn(tensor.shape, generator=generator) * NOISE
               * tensor.std().nan_to_num(0)
               for name, tensor in target.items() if name.startswith(last) and "input_layernorm" not in name}
    hidden = config.hidden_size
    tensors["fc.weight"] = _copying(generator, hidden, 2 * hidden, NOISE / 10)
    tensors["fc.bias"] = torch.randn(hidden, generator=generator) * NOISE / 10
    path = module_tmp_path_factory.mktemp("tiny-eagle")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config.to_dict(), "num_hidden_layers": 1}))
    return str(path)


@pytest.fixture(scope="module")
def plain(deepseek_dir, llama_dir):
    """Each target's outputs without speculation: greedy over PROMPTS and CACHED_PROMPTS, seeded samples."""
    results = {}
    for name, path in (("mtp", deepseek_dir), ("eagle", llama_dir)):
        llm = LLM(path, dtype="float32", **ENGINES["batched"])
        results[name] = (_outputs(llm, SOME_PROMPTS, GREEDY), _outputs(llm, CACHED_PROMPTS, GREEDY),
                         _outputs(llm, SOME_PROMPTS[:len(SEEDED)], SEEDED))
    return results


def _target_and_head(method: str, deepseek_dir: str, llama_dir: str, eagle_dir: str) -> tuple[str, str | None]:
    return (deepseek_dir, None) if method == "mtp" else (llama_dir, eagle_dir)


# (method, engine, k); chunked prefill is test_the_heads_cache_holds_a_recomputation_after_every_step's engine.
CASES = [("mtp", "batched", 3), ("mtp", "prefix-cached", 1), ("mtp", "preempted", 2),
         ("eagle", "batched", 2), ("eagle", "prefix-cached", 1), ("eagle", "preempted", 3)]


@pytest.mark.parametrize("method, engine, k", CASES)
def test_greedy_output_is_unchanged_by_a_head(method, engine, k, deepseek_dir, llama_dir, eagle_dir, plain):
    target, head = _target_and_head(method, deepseek_dir, llama_dir, eagle_dir)
    llm = LLM(target, dtype="float32", speculative_config=_config(method, k, head), **ENGINES[engine])
    expected, expected_cached, expected_seeded = plain[method]
    if engine == "prefix-cached":
        # One request first: the others reuse its blocks, the head's K/V in them included.
        assert _outputs(llm, CACHED_PROMPTS[:1], GREEDY) == expected_cached[:1]
        assert _outputs(llm, CACHED_PROMPTS, GREEDY) == expected_cached
        assert llm.llm_engine.get_stats().kv_cache.prefix_cache_hits > 0
    elif engine == "preempted":
        short = SOME_PROMPTS[:NUM_SHORT]
        assert _outputs(llm, short * 2, GREEDY) == expected[:NUM_SHORT] * 2
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
    else:
        assert _outputs(llm, SOME_PROMPTS, GREEDY) == expected
        stats = _stats(llm)
        # The heads agree with their targets where the targets repeat a token, and not elsewhere.
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
        assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
        # A seeded request draws the same noise at each output index with drafts or without.
        assert _outputs(llm, SOME_PROMPTS[:len(SEEDED)], SEEDED) == expected_seeded
    stats = _stats(llm)
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts, stats
    assert llm.llm_engine.get_stats().kv_cache.num_used_blocks == 0


def _recomputed_head_kv(runner, drafter, tokens: list[int], count: int) -> torch.Tensor:
    """The head's K/V of positions [0, count) of a sequence computed afresh, in scratch pools: the target over
    tokens[:count] in one forward, then the head over (tokens[1:count + 1], those hidden states)."""
    from pagellm.attention.backend import StepAttentionInputs
    from pagellm.worker.kv_cache import layer_views

    block_size = runner.block_size
    num_blocks = -(-count // block_size)
    attention = StepAttentionInputs(int(count == 1), np.array([count]), np.array([count]),
                                    np.arange(num_blocks)[None], np.arange(count))
    positions = torch.arange(count)
    target_pool = torch.zeros_like(runner.kv_pool[:, :, :num_blocks])
    hidden = runner.model(torch.tensor(tokens[:count]), positions, layer_views(target_pool),
                          runner.attn_backend.build_metadata(attention))
    head_runner = drafter.runner
    head_pool = torch.zeros_like(drafter.kv_pool[:, :, :num_blocks])
    head_runner.model(torch.tensor(tokens[1:count + 1]), positions, layer_views(head_pool),
                      head_runner.attn_backend.build_metadata(attention), hidden_states=hidden)
    return head_pool[:, :, positions // block_size, :, positions % block_size]


@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_the_heads_cache_holds_a_recomputation_after_every_step(method, deepseek_dir, llama_dir, eagle_dir, plain):
    """Chunked prefill, greedy requests (drafts accepted in part) and a sampled one (rejected mostly): after every
    step, each position the head counts as cached holds what the head computes there afresh from the target's
    hidden states; the greedy outputs are those without speculation."""
    target, head = _target_and_head(method, deepseek_dir, llama_dir, eagle_dir)
    llm = LLM(target, dtype="float32", speculative_config=_config(method, 3, head), **ENGINES["chunked"])
    engine = llm.llm_engine
    # Every prompt (the long one chunked), greedy but one.
    sampled = SamplingParams(temperature=1.5, seed=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    chosen = {f"r{index}": (index, sampled if index == 2 else GREEDY) for index in range(len(SOME_PROMPTS))}
    for request_id, (index, params) in chosen.items():
        engine.add_request(request_id, SOME_PROMPTS[index], params)
    runner = engine.core.runner
    batch, drafter = runner.input_batch, runner.drafter
    checked = 0
    outputs = {}
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            outputs.update((output.request_id, output.outputs[0].token_ids) for output in engine.step()
                           if output.finished)
            for request_id, row in batch.row_of.items():
                cached = drafter.computed.get(request_id, 0)
                if not cached:
                    continue
                positions = torch.arange(cached)
                blocks = torch.from_numpy(batch.block_table[row])[positions // runner.block_size]
                stored = drafter.kv_pool[:, :, blocks, :, positions % runner.block_size]
                tokens = batch.token_ids[row, : batch.num_tokens[row]].tolist()
                expected = _recomputed_head_kv(runner, drafter, tokens, cached)
                torch.testing.assert_close(stored, expected, atol=2e-4, rtol=2e-4)
                checked += cached
    for request_id, (index, params) in chosen.items():
        if params is GREEDY:
            assert list(outputs[request_id]) == plain[method][0][index], request_id
    stats = _stats(llm)
    assert checked > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_an_mtp_method_on_a_model_without_the_layer_is_refused(tmp_path, default_tokenizer, tiny_llama_dir):
    no_layer = _save_deepseek(tmp_path / "no-mtp", default_tokenizer, mtp=False)
    for model in (no_layer, tiny_llama_dir):
        with pytest.raises(HeadError, match=r"num_nextn_predict_layers=(0|None).*num_nextn_predict_layers >= 1"):
            LLM(model, dtype="float32", speculative_config=_config("mtp", 2), **ENGINES["batched"])
    # The config promises the layer, the checkpoint lacks it.
    config = json.loads((tmp_path / "no-mtp" / "config.json").read_text())
    (tmp_path / "no-mtp" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(HeadError, match=r"num_nextn_predict_layers=1 but its checkpoint holds no tensor of that "
                                        r"layer \(model\.layers\.2\.\*\)"):
        LLM(no_layer, dtype="float32", speculative_config=_config("mtp", 2), **ENGINES["batched"])


def test_an_eagle_head_of_another_width_is_refused(tmp_path, eagle_dir, deepseek_dir):
    """The EAGLE head of the llama target over the DeepSeek target: their vocabularies agree, the widths not."""
    config = json.loads((pathlib.Path(eagle_dir) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    from transformers import AutoConfig

    from pagellm.spec_decode.eagle import check_eagle_config

    with pytest.raises(HeadError, match=r"hidden_size=64, the target has hidden_size=128"):
        check_eagle_config(AutoConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(deepseek_dir), "head")


@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_a_head_runs_under_tensor_parallelism(method, deepseek_dir, llama_dir, eagle_dir, plain):
    """Each rank runs its shard of the head over its shard of the target's embedding and LM head; rank 0 picks
    the drafts and hands them on. A rank drafting other tokens would verify other tokens, and the output would
    drift from the TP=1 run's; drafts are accepted in part, so rollback crosses ranks too."""
    target, head = _target_and_head(method, deepseek_dir, llama_dir, eagle_dir)
    llm = LLM(target, dtype="float32", tensor_parallel_size=2, speculative_config=_config(method, 2, head),
              **ENGINES["batched"])
    try:
        assert _outputs(llm, SOME_PROMPTS, GREEDY) == plain[method][0]
        stats = _stats(llm)
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    finally:
        llm.llm_engine.core.shutdown()


def test_vllm_names_of_the_head_methods():
    assert SpeculativeConfig.from_dict({"method": "deepseek_mtp", "num_speculative_tokens": 1}).method == "mtp"
    eagle = SpeculativeConfig.from_dict({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 2})
    assert eagle.method == "eagle" and eagle.uses_head and eagle.uses_draft_model


def test_an_mtp_head_of_a_checkpoint_in_fp8_blocks(deepseek_dir, tmp_path):
    """DeepSeek-V3's own fp8 format, MTP layer included: the head's experts and latent attention load as the
    target's do (each expert a linear layer of the format), and greedy output is unchanged by the head."""
    from pagellm.layers.fused_moe import FusedMoE
    from tests.w8a8_checkpoints import write_quantized

    quantized = write_quantized(deepseek_dir, tmp_path / "fp8", "fp8-block-32x16", fmt="fp8")[0]
    expected = _outputs(LLM(quantized, dtype="float32", **ENGINES["batched"]), SOME_PROMPTS, GREEDY)
    llm = LLM(quantized, dtype="float32", speculative_config=_config("mtp", 2), **ENGINES["batched"])
    head = llm.llm_engine.core.runner.drafter.runner.model
    [experts] = [m for m in head.modules() if isinstance(m, FusedMoE)]
    assert experts.expert_gate_up is not None and len(experts.expert_gate_up) == 8
    assert _outputs(llm, SOME_PROMPTS, GREEDY) == expected
    stats = _stats(llm)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
