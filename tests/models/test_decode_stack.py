"""The decode stack (ops/decode_stack.py: a GGUF Llama's decode step as one C call for all its layers) computes
what the direct path computes, to the bit, and leaves every step it does not serve to that path."""

from __future__ import annotations

import pytest

from benchmarks.synthetic_gguf import LlamaShape, write_synthetic_gguf
from pagellm import LLM, SamplingParams
from pagellm.ops.decode_stack import DecodeStack

# Q4_1 blocks, head_dim 64 (the native decode kernel's multiple of 32), grouped KV heads, three layers.
SHAPE = LlamaShape(hidden_size=128, intermediate_size=256, num_layers=3, num_heads=2, num_kv_heads=1)
PROMPTS = [[1, 2, 3], list(range(100, 140)), [7] * 5]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", SHAPE, seed=4)


def _llm(path, **kwargs) -> LLM:
    # Chunked prefill (16 tokens a step) puts prefill chunks beside decodes: steps the stack must leave alone.
    return LLM(str(path), kv_cache_memory_bytes=8 << 20, max_model_len=256, max_num_batched_tokens=16,
               enable_prefix_caching=False, seed=0, **kwargs)


def _generate(llm: LLM) -> list[tuple[list[int], list]]:
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


def _stack(llm: LLM) -> DecodeStack:
    model = llm.llm_engine.core.runner.model.model
    assert model.direct_layers() is not None
    assert model._decode_stack is not None  # a GGUF Llama of int8 products on the fused CPU ops has one
    return model._decode_stack


def _with_and_without(llm: LLM, monkeypatch) -> tuple[list, list, list[int]]:
    """(outputs with the stack, outputs without it, the token count of each step the stack ran)."""
    _stack(llm)
    ran: list[int] = []
    call = DecodeStack.__call__

    def counted(self, hidden, *args):
        ran.append(hidden.shape[0])
        return call(self, hidden, *args)

    with monkeypatch.context() as patch:
        patch.setattr(DecodeStack, "__call__", counted)
        stacked = _generate(llm)
    with monkeypatch.context() as patch:
        patch.setattr(DecodeStack, "serves", lambda self, *args: False)
        direct = _generate(llm)
    return stacked, direct, ran


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stack_generates_what_the_direct_path_does(gguf_path, dtype, monkeypatch):
    stacked, direct, ran = _with_and_without(_llm(gguf_path, dtype=dtype), monkeypatch)
    assert stacked == direct
    # Decode steps of three, then two (the 8-token requests end together), then one sequence ran in C.
    assert {1, 2, 3} <= set(ran) or {1, 3} <= set(ran)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8_per_token_head"])
def test_the_stack_writes_and_reads_a_quantized_cache_as_the_direct_path_does(gguf_path, kv_cache_dtype,
                                                                               monkeypatch):
    stacked, direct, ran = _with_and_without(_llm(gguf_path, kv_cache_dtype=kv_cache_dtype), monkeypatch)
    assert stacked == direct and ran


def test_steps_beyond_the_int8_products_rows_are_left_to_the_direct_path(gguf_path, monkeypatch):
    llm = _llm(gguf_path)
    stack = _stack(llm)
    limit = stack.max_tokens
    stack.max_tokens = 1  # as if the products switched to dequantized tiles from 2 rows
    try:
        stacked, direct, ran = _with_and_without(llm, monkeypatch)
    finally:
        stack.max_tokens = limit
    assert stacked == direct
    assert ran and set(ran) == {1}


def test_a_failing_kernel_raises_naming_the_layer_and_the_engine_goes_on(gguf_path):
    llm = _llm(gguf_path)
    stack = _stack(llm)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0].token_ids
    saved = stack._structs[1].down_type
    stack._structs[1].down_type = 99  # a type gguf_matmul does not know
    try:
        with pytest.raises(ValueError, match="gguf_matmul refused"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        assert stack._failed_layer.value == 1
    finally:
        stack._structs[1].down_type = saved
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == expected


def test_the_switch_turns_it_off(gguf_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_DECODE_STACK", "0")
    llm = _llm(gguf_path)
    model = llm.llm_engine.core.runner.model.model
    assert model.direct_layers() is not None and model._decode_stack is None
