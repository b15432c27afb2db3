"""The decode stack (ops/decode_stack.py: a GGUF Llama's decode step, or a bfloat16 Llama's on linear_bf16, or an
int8 W8A8, fp8 or AWQ/GPTQ Llama's, as one C call for all its layers) computes what the direct path (or, for int8,
the modules) computes, to the bit, and leaves every step it does not serve to that path."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from benchmarks.synthetic_gguf import LlamaShape, write_synthetic_gguf
from pagellm import LLM, SamplingParams
from pagellm.ops import gguf_kernels
from pagellm.ops.cpu_build import native_library
from pagellm.ops.decode_stack import DecodeStack, DenseBF16Part, Fp8Part, GroupQuantPart
from pagellm.ops.linear_bf16 import LinearBF16
from tests.quant_checkpoints import QuantSpec
from tests.quant_checkpoints import write_quantized as write_group_quantized
from tests.w8a8_checkpoints import write_quantized as write_8bit

# Q4_1 blocks, head_dim 64 (the native decode kernel's multiple of 32), grouped KV heads, three layers.
SHAPE = LlamaShape(hidden_size=128, intermediate_size=256, num_layers=3, num_heads=2, num_kv_heads=1)
PROMPTS = [[1, 2, 3], list(range(100, 140)), [7] * 5]


@pytest.fixture(scope="module")
def gguf_path(module_tmp_path_factory):
    return write_synthetic_gguf(module_tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", SHAPE, seed=4)


def _llm(path, **kwargs) -> LLM:
    # Chunked prefill (16 tokens a step) puts prefill chunks beside decodes: steps the stack must leave alone.
    return LLM(str(path), kv_cache_memory_bytes=8 << 20, max_model_len=256, max_num_batched_tokens=16,
               enable_prefix_caching=False, seed=0, **kwargs)


@pytest.fixture(scope="module")
def float_llm(gguf_path):
    """The float32 engine several tests share (each restores what it changes)."""
    return _llm(gguf_path, dtype="float32")


def _generate(llm: LLM) -> list[tuple[list[int], list]]:
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


def _stack(llm: LLM) -> DecodeStack:
    model = llm.llm_engine.core.runner.model.model
    assert model.direct_layers() is not None
    stack = model.decode_stack()
    assert stack is not None  # a GGUF Llama of int8 products on the fused CPU ops has one
    return stack


def _with_and_without(llm: LLM, monkeypatch, stack_class: type = DecodeStack,
                      generate: Callable[[LLM], list] | None = None) -> tuple[list, list, list[int]]:
    """(outputs with the stack, outputs without it, the token count of each step the stack ran)."""
    generate = generate or _generate
    ran: list[int] = []
    call = stack_class.__call__

    def counted(self, hidden, *args):
        ran.append(hidden.shape[0])
        return call(self, hidden, *args)

    with monkeypatch.context() as patch:
        patch.setattr(stack_class, "__call__", counted)
        stacked = generate(llm)
    with monkeypatch.context() as patch:
        patch.setattr(stack_class, "serves", lambda self, *args: False)
        without = generate(llm)
    return stacked, without, ran


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stack_generates_what_the_direct_path_does(gguf_path, float_llm, dtype, monkeypatch):
    llm = float_llm if dtype == "float32" else _llm(gguf_path, dtype=dtype)
    _stack(llm)
    stacked, direct, ran = _with_and_without(llm, monkeypatch)
    assert stacked == direct
    # Decode steps of three sequences and of one ran in C.
    assert {1, 3} <= set(ran)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8_per_token_head", "bfloat16"])
def test_the_stack_writes_and_reads_a_narrow_cache_as_the_direct_path_does(gguf_path, kv_cache_dtype, monkeypatch):
    """A quantized cache, or a bfloat16 one under the float32 model (C's float32 -> bfloat16 writer)."""
    llm = _llm(gguf_path, kv_cache_dtype=kv_cache_dtype)
    _stack(llm)
    stacked, direct, ran = _with_and_without(llm, monkeypatch)
    assert stacked == direct and ran


def test_steps_beyond_the_int8_products_rows_are_left_to_the_direct_path(float_llm, monkeypatch):
    llm = float_llm
    stack = _stack(llm)
    limit = stack.max_tokens
    stack.max_tokens = 1  # as if the products switched to dequantized tiles from 2 rows
    try:
        stacked, direct, ran = _with_and_without(llm, monkeypatch)
    finally:
        stack.max_tokens = limit
    assert stacked == direct
    assert ran and set(ran) == {1}


def test_a_failing_kernel_raises_naming_the_layer_and_the_engine_goes_on(float_llm):
    llm = float_llm
    stack = _stack(llm)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0].token_ids
    saved = stack._structs[1].down.types[0]
    stack._structs[1].down.types[0] = 99  # a type gguf_matmul does not know
    try:
        with pytest.raises(ValueError, match="gguf_matmul refused"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        assert stack._failed.value == 1
    finally:
        stack._structs[1].down.types[0] = saved
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == expected


def test_the_switch_turns_it_off(float_llm, monkeypatch):
    model = float_llm.llm_engine.core.runner.model.model
    monkeypatch.setenv("PAGELLM_DECODE_STACK", "0")
    model.reset_direct_layers()
    try:
        assert model.direct_layers() is not None and model.decode_stack() is None
    finally:
        monkeypatch.delenv("PAGELLM_DECODE_STACK")
        model.reset_direct_layers()
    assert model.decode_stack() is not None


_LINEAR_BF16 = native_library() is not None and LinearBF16.available(native_library())
_AMX_TILES = gguf_kernels.gguf_kernels() is not None and gguf_kernels.gguf_kernels().amx_product is not None


@pytest.mark.skipif(not _LINEAR_BF16, reason="the CPU kernels were built without avx512_bf16's dot product")
def test_a_bf16_llama_on_linear_bf16_runs_on_the_stack_as_its_direct_path_does(tiny_llama_dir, monkeypatch):
    llm = _llm(tiny_llama_dir, dtype="bfloat16")
    stack = _stack(llm)
    parts = [stack._structs[0].qkv, stack._structs[0].down]
    assert all(part.parts == 1 for part in parts) and stack.max_tokens is None  # one kernel at any row count
    stacked, direct, ran = _with_and_without(llm, monkeypatch)
    assert stacked == direct
    assert {1, 3} <= set(ran)


def test_an_int8_w8a8_llama_runs_on_the_stack_as_its_direct_path_does(tiny_llama_dir, monkeypatch):
    # The int8 layers' prepared products make the direct path, which calls the kernels the stack calls.
    llm = _llm(tiny_llama_dir, dtype="bfloat16", quantization="int8")
    model = llm.llm_engine.core.runner.model.model
    assert model.direct_layers() is not None
    stack = model.decode_stack()
    assert stack.max_tokens is None and stack._structs[0].gate_up.parts == 1
    stacked, direct, ran = _with_and_without(llm, monkeypatch)
    assert stacked == direct
    assert {1, 3} <= set(ran)


@pytest.mark.parametrize("source", ["online", "mxfp8", "compressed-tensors"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_llama_runs_on_the_stack_as_its_direct_path_does(tiny_llama_dir, tmp_path, source, dtype,
                                                                 monkeypatch):
    """fp8 weights (quantization="fp8" or "mxfp8", whose scales change every 32 inputs, or a compressed-tensors
    checkpoint's) on the fused kernel their direct path calls, for steps below the rows where the product switches
    to dequantized tiles."""
    if source in ("online", "mxfp8"):
        llm = _llm(tiny_llama_dir, dtype=dtype, quantization="fp8" if source == "online" else source)
    else:
        quantized, _ = write_8bit(tiny_llama_dir, tmp_path, "fp8-channel-dynamic")
        llm = _llm(quantized, dtype=dtype)
    _check_on_the_stack_below_its_parts_rows(llm, Fp8Part, monkeypatch)


@pytest.mark.parametrize("spec", [QuantSpec("awq", group_size=32), QuantSpec("gptq", bits=4, group_size=16,
                                                                              desc_act=True),
                                  QuantSpec("gptq", bits=8, group_size=32, sym=False)],
                         ids=["awq", "gptq-4-bit-act-order", "gptq-8-bit"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_group_quantized_llama_runs_on_the_stack_as_its_direct_path_does(tiny_llama_dir, tmp_path, spec, dtype,
                                                                           monkeypatch):
    """AWQ / GPTQ weights on the packed path their direct path calls, for steps below the rows where the product
    switches to dequantized tiles."""
    write_group_quantized(tiny_llama_dir, tmp_path / "quantized", tmp_path / "dequantized", spec)
    _check_on_the_stack_below_its_parts_rows(_llm(tmp_path / "quantized", dtype=dtype), GroupQuantPart, monkeypatch)


@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 48)])
def test_online_rtn_runs_on_the_stack_as_its_direct_path_does(tiny_llama_dir, bits, group_size, monkeypatch):
    """quantization="rtn"'s group-quantized layers (a short last group with 48) take the stack as a checkpoint's
    do."""
    monkeypatch.setenv("RTN_NUM_BITS", str(bits))
    monkeypatch.setenv("RTN_GROUP_SIZE", str(group_size))
    _check_on_the_stack_below_its_parts_rows(_llm(tiny_llama_dir, dtype="bfloat16", quantization="rtn"),
                                             GroupQuantPart, monkeypatch)


@pytest.mark.skipif(not _LINEAR_BF16, reason="the CPU kernels were built without avx512_bf16's dot product")
@pytest.mark.parametrize("spec", [QuantSpec("awq", group_size=32), QuantSpec("gptq", bits=4, group_size=16,
                                                                              desc_act=True)],
                         ids=["awq", "gptq-4-bit-act-order"])
def test_bfloat16_steps_past_the_packed_path_run_on_the_stacks_tiles(tiny_llama_dir, tmp_path, spec, monkeypatch):
    """bfloat16 steps from the rows where the product takes linear_bf16's tiles (lowered here to 2, so that steps
    of 3 tokens take them) run on the stack too, as the direct path runs them."""
    write_group_quantized(tiny_llama_dir, tmp_path / "quantized", tmp_path / "dequantized", spec)
    llm = _llm(tmp_path / "quantized", dtype="bfloat16")
    _lower_the_kernels_threshold(llm, "bf16_tile_min_rows", {4: 2, 8: 2}, monkeypatch)
    _check_the_stacks_tiles(llm, monkeypatch)


@pytest.mark.skipif(not _LINEAR_BF16, reason="the CPU kernels were built without avx512_bf16's dot product")
@pytest.mark.parametrize("source", ["online", "compressed-tensors"])
def test_bfloat16_fp8_steps_past_the_fused_kernel_run_on_the_stacks_tiles(tiny_llama_dir, tmp_path, source,
                                                                           monkeypatch):
    """As above for fp8 weights: bfloat16 steps from the rows where the product takes linear_bf16's tiles (2
    here) run on the stack as the direct path runs them."""
    if source == "online":
        llm = _llm(tiny_llama_dir, dtype="bfloat16", quantization="fp8")
    else:
        llm = _llm(write_8bit(tiny_llama_dir, tmp_path, "fp8-block-dynamic")[0], dtype="bfloat16")
    _lower_the_kernels_threshold(llm, "fp8_bf16_dense_min_rows", 2, monkeypatch)
    _check_the_stacks_tiles(llm, monkeypatch)


@pytest.mark.skipif(not _AMX_TILES, reason="the GGUF dense path runs on linear_bf16 only where AMX's tiles do")
@pytest.mark.parametrize("which", ["q4_1", "mixed"])
def test_bfloat16_gguf_steps_past_the_int8_products_run_on_the_stacks_tiles(gguf_path, mixed_llama_gguf, which,
                                                                            monkeypatch):
    """GGUF weights on AMX: bfloat16 steps from the rows where the product switches to the dense path on
    linear_bf16 (2 here) run on the stack as the direct path runs them, a layer of two types (qkv) included."""
    monkeypatch.setattr(gguf_kernels, "_AMX_BF16_DENSE_MIN_ROWS", dict.fromkeys(gguf_kernels.KERNEL_TYPES, 2))
    if which == "q4_1":
        llm = _llm(gguf_path, dtype="bfloat16")
    else:
        path, tokenizer = mixed_llama_gguf
        llm = _llm(path, tokenizer=str(tokenizer), dtype="bfloat16")
    _check_the_stacks_tiles(llm, monkeypatch)


def _lower_the_kernels_threshold(llm: LLM, attribute: str, value, monkeypatch) -> None:
    """Sets `attribute` of the kernels the model's linear layers share (for the test) and rebuilds the stack."""
    model = llm.llm_engine.core.runner.model.model
    qkv = model.layers[0].self_attn.qkv_proj
    monkeypatch.setattr(qkv.quant_method.loaded_kernel(qkv).kernels, attribute, value)
    model.reset_direct_layers()


def _check_the_stacks_tiles(llm: LLM, monkeypatch) -> None:
    """The stack, rebuilt after the tiles' threshold was lowered to 2, serves steps of any size, takes the tiles
    from 2 rows and generates what the direct path (or the modules) does (steps of 1 and 3 tokens among them)."""
    stack = llm.llm_engine.core.runner.model.model.decode_stack()
    assert stack.max_tokens is None and stack.linears[0][0][0].struct.tiles.min_rows == 2
    stacked, direct, ran = _with_and_without(llm, monkeypatch)
    assert stacked == direct
    assert {1, 3} <= set(ran)


def _check_on_the_stack_below_its_parts_rows(llm: LLM, part_class: type, monkeypatch) -> None:
    """The model's layers are `part_class` parts, the stack serves steps up to the rows their kernel takes, and
    generates what the direct path does (steps of 1 and 3 tokens among them)."""
    stack = _stack(llm)
    part = stack.linears[0][0][0]
    assert isinstance(part, part_class) and stack.max_tokens == part.int8_max_rows(stack.dtype)
    stacked, direct, ran = _with_and_without(llm, monkeypatch)
    assert stacked == direct
    assert {1, 3} <= set(ran)


@pytest.mark.skipif(not _LINEAR_BF16, reason="the CPU kernels were built without avx512_bf16's dot product")
def test_a_float32_llama_or_a_biased_layer_stays_on_the_direct_path(tiny_llama_dir, monkeypatch):
    model = _llm(tiny_llama_dir, dtype="float32").llm_engine.core.runner.model.model
    assert model.direct_layers() is not None and model.decode_stack() is None
    bf16 = _llm(tiny_llama_dir, dtype="bfloat16").llm_engine.core.runner.model.model
    o_proj = bf16.layers[1].self_attn.o_proj
    part = DenseBF16Part.of(o_proj.dense_kernel)
    assert (part.in_features, part.out_features) == (o_proj.input_size, o_proj.output_size)
    monkeypatch.setattr(o_proj, "bias", torch.nn.Parameter(o_proj.weight.new_zeros(o_proj.output_size)))
    bf16.reset_direct_layers()
    assert bf16.decode_stack() is None


def _mixed_block_type(name: str):
    """As a Q4_K_M file mixes them: v and down in Q5_0, the rest of the blocks Q8_0 (so qkv is two parts, which
    Llama's direct path does not take); norms and the embedding F32."""
    import gguf

    stem = name.rsplit(".", 1)[0]
    if not name.startswith("blk.") or "norm" in stem:
        return None
    return gguf.GGMLQuantizationType.Q5_0 if stem.endswith(("attn_v", "ffn_down")) else gguf.GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module")
def mixed_llama_gguf(module_tmp_path_factory, default_tokenizer):
    import transformers

    from tests.test_gguf_families import COMMON, tiny_hf_model, write_gguf_like_llama_cpp

    config = transformers.LlamaConfig(**COMMON, num_hidden_layers=2, head_dim=32,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = tiny_hf_model(config, default_tokenizer, seed=2)
    directory = module_tmp_path_factory.mktemp("tiny-llama-mixed")
    default_tokenizer.save_pretrained(directory)
    path = directory / "tiny-llama-mixed.gguf"
    write_gguf_like_llama_cpp(model, "llama", path, _mixed_block_type)
    return path, directory


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_llama_with_multi_part_layers_runs_on_the_stack_as_its_modules_do(mixed_llama_gguf, dtype, monkeypatch):
    path, tokenizer = mixed_llama_gguf
    llm = _llm(path, tokenizer=str(tokenizer), dtype=dtype)
    model = llm.llm_engine.core.runner.model.model
    assert model.direct_layers() is None  # a two-part qkv: no prepared product
    stack = model.decode_stack()
    assert stack is not None and stack._structs[0].qkv.parts == 2 and stack._structs[0].down.parts == 1
    stacked, modules, ran = _with_and_without(llm, monkeypatch)
    assert stacked == modules
    assert {1, 3} <= set(ran)


# ---- Gemma 3 ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_gguf(module_tmp_path_factory, default_tokenizer):
    """(GGUF path, tokenizer directory) of a tiny random Gemma 3 (6 layers: 5 sliding over 32 keys, 1 global)."""
    import transformers

    from tests.test_gguf_families import COMMON, tiny_hf_model, write_gguf_like_llama_cpp

    config = transformers.Gemma3TextConfig(**{**COMMON, "tie_word_embeddings": True}, num_hidden_layers=6,
                                           head_dim=32, query_pre_attn_scalar=32, sliding_window=32,
                                           architectures=["Gemma3ForCausalLM"])
    model = tiny_hf_model(config, default_tokenizer, seed=1)
    directory = module_tmp_path_factory.mktemp("tiny-gemma3-q")
    default_tokenizer.save_pretrained(directory)
    path = directory / "tiny-gemma3-q.gguf"
    write_gguf_like_llama_cpp(model, "gemma3", path, _mixed_block_type)
    return path, directory


GEMMA_PROMPTS = [[2, 5, 9], [2] + list(range(300, 340)), [2] + [11] * 7]


def _gemma_generate(llm: LLM) -> list[tuple[list[int], list]]:
    # 40 prompt tokens + 24 outputs pass the 32-key window: the sliding layers' window is in play.
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in GEMMA_PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]


def _gemma_llm(gemma_gguf, kv_cache_dtype: str = "auto", dtype: str = "float32") -> LLM:
    path, tokenizer = gemma_gguf
    return LLM(str(path), tokenizer=str(tokenizer), dtype=dtype, kv_cache_memory_bytes=8 << 20, max_model_len=128,
               max_num_batched_tokens=16, enable_prefix_caching=False, seed=0, kv_cache_dtype=kv_cache_dtype)


@pytest.fixture(scope="module")
def gemma_llm(gemma_gguf):
    return _gemma_llm(gemma_gguf)


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("float32", "auto"), ("float32", "fp8"),
                                                       ("bfloat16", "auto")])
def test_the_gemma_stack_generates_what_the_modules_do(gemma_gguf, gemma_llm, dtype, kv_cache_dtype, monkeypatch):
    from pagellm.ops.decode_stack import GemmaDecodeStack

    if (dtype, kv_cache_dtype) == ("float32", "auto"):
        llm = gemma_llm
    else:
        llm = _gemma_llm(gemma_gguf, kv_cache_dtype, dtype)
    model = llm.llm_engine.core.runner.model.model
    stack = model.decode_stack()
    assert stack is not None and stack.dtype is getattr(torch, dtype)
    assert stack._structs[0].qkv.parts == 2 and stack._structs[0].down.parts == 1
    stacked, modules, ran = _with_and_without(llm, monkeypatch, GemmaDecodeStack, _gemma_generate)
    assert stacked == modules  # the modules' kernel calls in their order: equal to the bit
    assert {1, 3} <= set(ran)  # one sequence and several, the multi-part qkv's rows copied out per part


def test_a_hook_on_a_gemma_layer_sends_the_step_to_the_modules(gemma_llm):
    llm = gemma_llm
    model = llm.llm_engine.core.runner.model.model
    assert model.decode_stack() is not None
    calls = []
    handle = model.layers[3].self_attn.k_norm.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        assert model.decode_stack() is None
        llm.generate([{"prompt_token_ids": GEMMA_PROMPTS[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(calls) >= 4  # the prefill and every decode step
    finally:
        handle.remove()
    assert model.decode_stack() is not None


def test_verified_drafts_attend_as_decodes_so_speculation_changes_no_bit(gguf_path, float_llm, monkeypatch):
    """Each verified token attends as its decode would (worker/step_inputs.py): log-probabilities equal to the
    bit, not merely close (a chunk's attention sums in another order, and a GGUF model's int8 activations carry
    such a rounding on to its greedy tokens); the verification steps then run on the stack like decodes."""
    from tests.test_spec_decode import _oracle

    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = float_llm.generate(prompts, params, use_tqdm=False)
    references = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in expected}
    llm = _llm(gguf_path, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                               "disable_by_batch_size": 64})
    _oracle(monkeypatch, references, error=0.3, seed=2)
    ran: list[int] = []
    call = DecodeStack.__call__

    def counted(self, hidden, *args):
        ran.append(hidden.shape[0])
        return call(self, hidden, *args)

    monkeypatch.setattr(DecodeStack, "__call__", counted)
    got = llm.generate(prompts, params, use_tqdm=False)
    for ours, theirs in zip(got, expected):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].logprobs == theirs.outputs[0].logprobs
    assert llm.llm_engine.core.scheduler.get_stats().spec_decoding.num_accepted_tokens > 0
    assert max(ran) > len(PROMPTS)  # steps of several query tokens per sequence ran on the stack


def test_verifying_steps_stay_below_the_rows_where_the_products_switch_kernels(gguf_path, monkeypatch):
    """bfloat16 rows take dequantized tiles from a measured row count (ops/gguf_kernels.py), whose sums differ in
    the last bits from the int8 row kernel's: a verifying step that crossed it would part from plain decode
    steps. The speculator keeps each step's rows (one per request plus its drafts) below it."""
    from pagellm.ops import gguf_kernels as gk
    from tests.test_spec_decode import _oracle

    # Every table a CPU's bfloat16 rows may take (the engines' kernels copy theirs from these): 3 requests then
    # leave room for 2 drafts a step.
    for table in (gk._AVX512_BF16_DENSE_MIN_ROWS, gk._AMX_BF16_DENSE_MIN_ROWS, *gk.DENSE_MIN_ROWS.values()):
        monkeypatch.setitem(table, "Q4_1", 6)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def engine(**kwargs) -> LLM:
        # The prompts in one first step in both runs: prefill chunks cut where drafts took the token budget
        # would cross the switch at other places than without speculation.
        return LLM(str(gguf_path), dtype="bfloat16", kv_cache_memory_bytes=8 << 20, max_model_len=256,
                   max_num_batched_tokens=256, enable_prefix_caching=False, seed=0, **kwargs)

    expected = engine().generate(prompts, params, use_tqdm=False)
    references = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in expected}
    llm = engine(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 64})
    assert llm.llm_engine.core.scheduler.config.kernel_switch_rows == 6
    _oracle(monkeypatch, references, error=0.3, seed=2)
    verifying_rows: list[int] = []
    scheduler = llm.llm_engine.core.scheduler
    schedule = scheduler.schedule

    def recorded():
        output = schedule()
        if any(output.spec_token_ids.values()):
            verifying_rows.append(output.total_num_scheduled_tokens)
        return output

    monkeypatch.setattr(scheduler, "schedule", recorded)
    got = llm.generate(prompts, params, use_tqdm=False)
    for ours, theirs in zip(got, expected):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].logprobs == theirs.outputs[0].logprobs
    assert verifying_rows and max(verifying_rows) < 6
