"""LoRA adapters batched together: one generate call mixing the base model and more adapters than device
slots equals transformers + peft with each adapter, greedy, in float32; bad adapters are refused at load."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.lora.request import LoRARequest
from tests.lora_adapters import ATTENTION, MLP, peft_greedy, save_adapter

PROMPTS = [[1, 450, 4996, 17354, 1701, 29916], [1, 1724, 338, 278, 7483, 310, 3444, 29973], [1, 29871, 29941, 718],
           [1, 3439, 17443, 526, 278, 1900]]
MAX_TOKENS = 8

# Different ranks and targets: attention only, MLP only, everything (rsLoRA), q/v only.
ADAPTERS = {
    "attn-r8": dict(rank=8, targets=ATTENTION, alpha=16, seed=1),
    "mlp-r4": dict(rank=4, targets=MLP, alpha=8, seed=2),
    "all-r16-rs": dict(rank=16, targets=ATTENTION + MLP, alpha=32, seed=3, rslora=True),
    "qv-r2": dict(rank=2, targets=["q_proj", "v_proj"], alpha=4, seed=4),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, module_tmp_path_factory) -> dict[str, str]:
    root = module_tmp_path_factory.mktemp("adapters")
    return {name: save_adapter(tiny_llama_dir, root / name, **spec) for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapters) -> dict[str | None, list[list[int]]]:
    refs = {name: peft_greedy(tiny_llama_dir, path, PROMPTS, MAX_TOKENS) for name, path in adapters.items()}
    refs[None] = peft_greedy(tiny_llama_dir, None, PROMPTS, MAX_TOKENS)
    return refs


def _requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, index, path) for index, (name, path) in enumerate(adapters.items(), start=1)}


def test_one_batch_mixing_base_and_more_adapters_than_slots_equals_peft(tiny_llama_dir, adapters, references):
    for name in ADAPTERS:
        assert references[name] != references[None], f"adapter {name} changes nothing: the test could not fail"
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, enable_lora=True, max_loras=2,
              max_lora_rank=16, max_cpu_loras=3)
    loras = _requests(adapters)
    # Every prompt with every adapter and with none, interleaved, in one call: 5 x 4 requests over 2 slots.
    cases = [(prompt_index, name) for prompt_index in range(len(PROMPTS)) for name in [None, *ADAPTERS]]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i, _ in cases], params, use_tqdm=False,
                           lora_request=[loras[name] if name else None for _, name in cases])
    for (prompt_index, name), output in zip(cases, outputs):
        assert output.outputs[0].token_ids == references[name][prompt_index], (prompt_index, name)


def test_prefix_cache_is_not_shared_between_adapters(tiny_llama_dir, adapters, references):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, enable_lora=True, max_loras=1,
              block_size=2)
    lora = _requests(adapters)["attn-r8"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    base = llm.generate(prompt, params, use_tqdm=False)[0]
    adapted = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
    again = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
    assert base.outputs[0].token_ids == references[None][1]
    assert adapted.num_cached_tokens == 0  # the base model's blocks hold other K/V
    assert adapted.outputs[0].token_ids == again.outputs[0].token_ids == references["attn-r8"][1]
    assert again.num_cached_tokens > 0


def test_chat_and_beam_search_take_the_adapter(tiny_llama_dir, adapters):
    from pagellm.sampling_params import BeamSearchParams

    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, enable_lora=True)
    lora = _requests(adapters)["all-r16-rs"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    messages = [{"role": "user", "content": "Hi"}]
    base, adapted = (llm.chat(messages, params, use_tqdm=False, lora_request=lora_request)[0].outputs[0].token_ids
                     for lora_request in (None, lora))
    assert base != adapted
    beam = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    (base_beams,), (lora_beams,) = (llm.beam_search([prompt], beam, lora_request=r) for r in (None, lora))
    assert base_beams.sequences[0].tokens != lora_beams.sequences[0].tokens


def _refusal(llm: LLM, path: str, name: str = "bad") -> str:
    with pytest.raises(ValueError) as info:
        llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest(name, 99, path))
    return str(info.value)


def _edit_config(src: str, dst, **changes) -> str:
    import shutil

    shutil.copytree(src, dst)
    config_path = os.path.join(dst, "adapter_config.json")
    with open(config_path) as file:
        config = json.load(file)
    config.update(changes)
    with open(config_path, "w") as file:
        json.dump(config, file)
    return str(dst)


def test_bad_adapters_are_refused_at_load_with_the_reason(tiny_llama_dir, adapters, tmp_path):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, enable_lora=True, max_lora_rank=8)
    assert "rank 16, more than max_lora_rank=8" in _refusal(llm, adapters["all-r16-rs"])
    assert "no such directory" in _refusal(llm, str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "adapter_config.json is missing" in _refusal(llm, str(empty))
    broken = _edit_config(adapters["qv-r2"], tmp_path / "broken")
    with open(os.path.join(broken, "adapter_config.json"), "w") as file:
        file.write("{not json")
    assert "adapter_config.json is malformed" in _refusal(llm, broken)
    no_weights = _edit_config(adapters["qv-r2"], tmp_path / "no-weights")
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    assert "no weights file" in _refusal(llm, no_weights)
    truncated = _edit_config(adapters["qv-r2"], tmp_path / "truncated")
    with open(os.path.join(truncated, "adapter_model.safetensors"), "r+b") as file:
        file.truncate(100)
    assert "adapter_model.safetensors is malformed" in _refusal(llm, truncated)
    assert "lm_head" in _refusal(llm, _edit_config(adapters["qv-r2"], tmp_path / "head",
                                                   target_modules=["q_proj", "lm_head"]))
    # Weights of a module the model lacks, and of a wider base model.
    from safetensors.torch import load_file, save_file

    def rewrite(name: str, change) -> str:
        path = _edit_config(adapters["qv-r2"], tmp_path / name)
        weights_path = os.path.join(path, "adapter_model.safetensors")
        save_file(change(load_file(weights_path)), weights_path)
        return path

    renamed = rewrite("renamed", lambda w: {k.replace("layers.0.self_attn.q_proj", "layers.7.self_attn.q_proj"): v
                                            for k, v in w.items()})
    assert "target module 'model.layers.7.self_attn.q_proj' does not exist" in _refusal(llm, renamed)
    wider = rewrite("wider", lambda w: {k: torch.zeros(v.shape[0], 2 * v.shape[1]) if "lora_A" in k else v
                                        for k, v in w.items()})
    assert "trained for another base model" in _refusal(llm, wider)
    embedding = rewrite("embedding", lambda w: {**w, "base_model.model.model.embed_tokens.lora_embedding_A":
                                                torch.zeros(2, 8)})
    assert "embedding or the LM head" in _refusal(llm, embedding)
    # The engine goes on serving after each refusal.
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2), use_tqdm=False,
                       lora_request=_requests(adapters)["qv-r2"])
    assert len(out[0].outputs[0].token_ids) == 2


def test_lora_request_without_enable_lora_is_refused(tiny_llama_dir, adapters):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate("hi", SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("a", 1, adapters["qv-r2"]))


def test_async_engine_generates_with_adapters_side_by_side(tiny_llama_dir, adapters, references):
    import asyncio

    from pagellm.engine.arg_utils import AsyncEngineArgs
    from pagellm.engine.async_llm_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, enable_lora=True, max_loras=2))
    loras = _requests(adapters)
    names = [None, "mlp-r4", "qv-r2", None, "all-r16-rs"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def one(index: int, name: str | None) -> list[int]:
        final = None
        async for output in engine.generate({"prompt_token_ids": PROMPTS[index % len(PROMPTS)]}, params,
                                            f"async-{index}", lora_request=loras[name] if name else None):
            final = output
        return final.outputs[0].token_ids

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(one(i, name) for i, name in enumerate(names)))

    try:
        results = asyncio.run(run())
    finally:
        engine.shutdown()
    for index, (name, tokens) in enumerate(zip(names, results)):
        assert tokens == references[name][index % len(PROMPTS)], (index, name)
