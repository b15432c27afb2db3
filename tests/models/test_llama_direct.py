"""LlamaModel's direct path (models/llama.py's run_direct_layers: the decoder layers' kernel calls without their
module calls) computes what the layers' modules compute, and is left for the modules wherever it could differ."""

from __future__ import annotations

import pytest

from benchmarks.synthetic_gguf import LlamaShape, write_synthetic_gguf
from pagellm import LLM, SamplingParams
from pagellm.models.llama import LlamaDecoderLayer

# Q4_1 blocks, head_dim 64 (the native decode kernel's multiple of 32), grouped KV heads.
SHAPE = LlamaShape(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1)
PROMPTS = [[1, 2, 3], list(range(100, 140)), [7] * 5]


@pytest.fixture(scope="module")
def llm(module_tmp_path_factory):
    path = write_synthetic_gguf(module_tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", SHAPE, seed=3)
    # Chunked prefill (16 tokens a step) puts prefill chunks with context beside decodes in one step.
    return LLM(str(path), kv_cache_memory_bytes=8 << 20, max_model_len=256, max_num_batched_tokens=16,
               enable_prefix_caching=False, seed=0)


def _generate(llm: LLM) -> list[tuple[list[int], list]]:
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


def _model(llm: LLM):
    return llm.llm_engine.core.runner.model.model


def test_the_direct_path_generates_what_the_modules_do(llm, monkeypatch):
    model = _model(llm)
    assert model.direct_layers() is not None  # a GGUF Llama on the fused CPU ops takes it
    direct = _generate(llm)
    monkeypatch.setattr(LlamaDecoderLayer, "direct", lambda self, ops: None)
    model.reset_direct_layers()
    assert model.direct_layers() is None
    assert _generate(llm) == direct  # the same kernels in the same order: equal to the bit


def test_hooks_and_lora_slots_send_the_layers_back_to_their_modules(llm):
    model = _model(llm)
    model.reset_direct_layers()
    assert model.direct_layers() is not None
    calls = []
    handle = model.layers[1].mlp.register_forward_hook(lambda module, args, out: calls.append(1))
    try:  # registered after the direct layers were made: seen at the next forward all the same
        assert model.direct_layers() is None
        _generate(llm)
        assert calls
    finally:
        handle.remove()
    assert model.direct_layers() is not None
    # A linear layer's hook too: the direct path calls its product without the module.
    handle = model.layers[0].self_attn.qkv_proj.register_forward_pre_hook(lambda module, args: calls.append(2))
    try:
        assert model.direct_layers() is None
        _generate(llm)
        assert 2 in calls
    finally:
        handle.remove()
    assert model.direct_layers() is not None
    down = model.layers[0].mlp.down_proj
    down.lora = object()  # LoRA slots, attached as lora/manager.py does: it resets the direct layers
    try:
        model.reset_direct_layers()
        assert model.direct_layers() is None
    finally:
        del down.lora
        model.reset_direct_layers()
    assert model.direct_layers() is not None
