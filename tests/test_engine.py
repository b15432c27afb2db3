"""Engine behaviour on the tiny model: stopping, seeds, validation, block accounting, detokenization."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from pagellm import LLM, EngineArgs, SamplingParams
from tests.helpers import PROMPTS


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256)


def _greedy(llm, prompt, **kwargs):
    params = SamplingParams(temperature=0, **{"max_tokens": 16, "ignore_eos": True, **kwargs})
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def _assert_no_blocks_used(llm):
    stats = llm.llm_engine.get_stats()
    assert stats.kv_cache.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0


# ---- stopping --------------------------------------------------------------------------------------


def test_stop_string_is_cut_from_text(llm):
    full = _greedy(llm, PROMPTS[1])
    stop = full.text[5:9]
    assert stop.strip(), full.text
    out = _greedy(llm, PROMPTS[1], stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    kept = _greedy(llm, PROMPTS[1], stop=stop, include_stop_str_in_output=True)
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]
    _assert_no_blocks_used(llm)


def test_stop_token_ids_and_min_tokens(llm):
    full = _greedy(llm, PROMPTS[2])
    stop_token = full.token_ids[3]
    out = _greedy(llm, PROMPTS[2], stop_token_ids=[stop_token])
    first = full.token_ids.index(stop_token)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    # Until min_tokens are out, the stop token is masked, so it cannot end the sequence early.
    held = _greedy(llm, PROMPTS[2], stop_token_ids=[stop_token], min_tokens=first + 3)
    assert stop_token not in held.token_ids[: first + 3]
    assert len(held.token_ids) >= first + 3


def test_the_stop_token_is_in_the_token_ids_but_not_the_text(llm, default_tokenizer):
    # As in vLLM: the token that ended the sequence stays out of the text, even where special tokens are kept
    # (a tool-call parser whose marker is one would otherwise see the EOS text), unless asked for.
    full = _greedy(llm, PROMPTS[2])
    stop_token = full.token_ids[3]
    first = full.token_ids.index(stop_token)
    for skip_special_tokens in (True, False):
        out = _greedy(llm, PROMPTS[2], stop_token_ids=[stop_token], skip_special_tokens=skip_special_tokens)
        assert out.token_ids[-1] == stop_token
        assert out.text == default_tokenizer.decode(out.token_ids[:-1], skip_special_tokens=skip_special_tokens)
    kept = _greedy(llm, PROMPTS[2], stop_token_ids=[stop_token], include_stop_str_in_output=True)
    assert kept.text == default_tokenizer.decode(full.token_ids[: first + 1], skip_special_tokens=True)


def test_eos_from_generation_config_stops_unless_ignored(tiny_llama_dir, tmp_path, llm):
    full = _greedy(llm, PROMPTS[0])
    eos = full.token_ids[2]
    model_dir = tmp_path / "eos-model"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    eos_llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    stopped = _greedy(eos_llm, PROMPTS[0], ignore_eos=False)
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(eos) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert _greedy(eos_llm, PROMPTS[0], ignore_eos=True).token_ids == full.token_ids


def test_max_tokens_none_runs_to_max_model_len(tiny_llama_dir):
    small = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=40)
    prompt = {"prompt_token_ids": list(range(100, 110))}
    out = small.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 30 and out[0].outputs[0].finish_reason == "length"
    # max_tokens past max_model_len is cut at max_model_len too, and says so.
    out = small.generate([prompt], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 30 and out[0].outputs[0].finish_reason == "length"


# ---- sampling --------------------------------------------------------------------------------------


def test_seeded_sampling_is_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=16 + i, ignore_eos=True) for i in range(5)]
    batch = llm.generate(PROMPTS[:5] + [PROMPTS[3]], others + [seeded], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate([PROMPTS[3]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_1_is_greedy_and_sampling_varies(llm):
    greedy = _greedy(llm, PROMPTS[4]).token_ids
    top1 = llm.generate([PROMPTS[4]], SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    assert top1[0].outputs[0].token_ids == greedy
    hot = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    samples = {tuple(o.outputs[0].token_ids) for o in llm.generate([PROMPTS[4]] * 4, hot, use_tqdm=False)}
    assert len(samples) > 1


def test_engine_seed_makes_unseeded_sampling_reproducible(tiny_llama_dir):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256, seed=7)
        runs.append([o.outputs[0].token_ids for o in engine.generate(PROMPTS[:3], params, use_tqdm=False)])
    assert runs[0] == runs[1]


# ---- text ------------------------------------------------------------------------------------------


def test_incremental_text_equals_full_decode(llm):
    prompts = ["리눅스 커널의 mmap() 동작 원리를 설명해줘.", "JVM의 G1GC에 대해 알려줘.", "Emoji: 🙂🚀", PROMPTS[6]]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    tokenizer = llm.get_tokenizer()
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
    assert out[0].prompt_token_ids == list(expected)
    two = llm.chat([messages, messages], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out[0].outputs[0].token_ids


def test_prompt_forms_and_output_order(llm):
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    outs = llm.generate([PROMPTS[2], {"prompt_token_ids": ids}, {"prompt": PROMPTS[2]}],
                        SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[1].prompt is None and outs[1].prompt_token_ids == ids
    assert int(outs[0].request_id) < int(outs[1].request_id) < int(outs[2].request_id)


# ---- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, 10**9]}, "outside the vocabulary"),
        ({"prompt_token_ids": list(range(256))}, "max_model_len=256"),
        (12, "not a prompt"),
    ],
)
def test_bad_prompts_are_refused_and_the_engine_goes_on(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0], prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_no_blocks_used(llm)
    assert len(_greedy(llm, PROMPTS[0], max_tokens=2).token_ids) == 2


def test_too_long_prompt_message_names_both_lengths(llm):
    with pytest.raises(ValueError) as info:
        llm.generate({"prompt_token_ids": [5] * 300}, use_tqdm=False)
    assert "300 tokens" in str(info.value) and "max_model_len=256" in str(info.value)


def test_prompt_over_budget_is_refused_without_chunked_prefill(tiny_llama_dir):
    engine = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256,
                 max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens=32"):
        engine.generate({"prompt_token_ids": [5] * 40}, use_tqdm=False)
    assert len(engine.generate({"prompt_token_ids": [5] * 30}, use_tqdm=False)[0].outputs[0].token_ids) > 0


def test_sampling_params_count_must_match(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS[:3], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_unknown_model_name_fails_at_once_and_says_what_to_pass():
    with pytest.raises(ValueError, match="not in the local Hugging Face cache") as info:
        LLM("meta-llama/Llama-3-8B", download_dir="/nonexistent/hub")
    assert "SmolLM2-135M-Instruct" in str(info.value) and "local" in str(info.value)


def test_pool_that_cannot_hold_one_request_fails_at_start(tiny_llama_dir):
    with pytest.raises(ValueError) as info:
        LLM(tiny_llama_dir, num_gpu_blocks_override=4, max_model_len=256)
    message = str(info.value)
    assert "4 blocks" in message and "max_model_len=256" in message and "16 blocks" in message


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization=0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5"),
        ({"block_size": 3}, "block_size=3"),
        ({"max_num_seqs": 0}, "max_num_seqs=0"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens=-1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size=0"),
        ({"dtype": "int8"}, "dtype='int8'"),
    ],
)
def test_engine_args_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EngineArgs(**kwargs)


def test_unknown_engine_argument_is_a_type_error():
    with pytest.raises(TypeError, match="gpu_memory_utilisation"):
        LLM(gpu_memory_utilisation=0.5)


def test_max_model_len_over_the_models_limit(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds"):
        LLM(tiny_llama_dir, max_model_len=4096)


# ---- block accounting ------------------------------------------------------------------------------


def test_kv_waste_is_only_the_tail_of_each_last_block(llm):
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    prompts = [" ".join(["word"] * (3 + 7 * i % 90)) for i in range(64)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"waste-{i}", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    kv = engine.core.scheduler.kv
    block_size = kv.block_size
    peak_used = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.get_stats()
        running = engine.core.scheduler.running
        # Slots filled per distinct physical block: a prefix block shared by several requests counts once.
        filled: dict[int, int] = {}
        for request in running:
            for index, block_id in enumerate(kv.block_ids(request.request_id)):
                filled[block_id] = min(block_size, request.num_computed_tokens - index * block_size)
        stored, blocks = sum(filled.values()), len(filled)
        assert stats.kv_cache.num_stored_tokens == stored
        assert stats.kv_cache.num_used_blocks == blocks
        if blocks:
            assert math.isclose(stats.kv_cache.waste, 1 - stored / (blocks * block_size))
            # Never more than one partly filled block per sequence.
            assert blocks * block_size - stored < len(running) * block_size
        peak_used = max(peak_used, blocks)
    assert peak_used > 0
    _assert_no_blocks_used(llm)
    assert tokenizer is engine.get_tokenizer()


def test_abort_frees_blocks_at_once(llm):
    engine = llm.llm_engine
    engine.add_request("to-abort", PROMPTS[5], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.get_stats().kv_cache.num_used_blocks > 0
    (aborted,) = engine.abort_request("to-abort")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    _assert_no_blocks_used(llm)
    assert not engine.has_unfinished_requests()


# ---- output kinds ----------------------------------------------------------------------------------


def _stream(engine, request_id, prompt, params):
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.request_id == request_id)
    return outputs


def test_delta_outputs_add_up_to_the_cumulative_result(llm):
    from pagellm.sampling_params import RequestOutputKind

    full = _greedy(llm, PROMPTS[6], max_tokens=20)
    stop = full.text[12:16]
    base = dict(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    engine = llm.llm_engine
    cumulative = _stream(engine, "cum", PROMPTS[6], SamplingParams(**base))
    deltas = _stream(engine, "delta", PROMPTS[6], SamplingParams(**base, output_kind=RequestOutputKind.DELTA))
    final = _stream(engine, "final", PROMPTS[6], SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY))
    expected = full.text[: full.text.index(stop)]
    assert cumulative[-1].outputs[0].text == expected
    assert "".join(o.outputs[0].text for o in deltas) == expected
    assert sum((o.outputs[0].token_ids for o in deltas), []) == cumulative[-1].outputs[0].token_ids
    # Held-back text never leaks the start of the stop string before it is known to be one.
    assert all(stop not in "".join(o.outputs[0].text for o in deltas[: i + 1]) for i in range(len(deltas)))
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].text == expected
    assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        ({"stop_token_ids": [10**7], "min_tokens": 2}, "stop_token_ids"),
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
        ({"logit_bias": {10**7: 1.0}}, "logit_bias"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_at_add(llm, kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    _assert_no_blocks_used(llm)


def test_huge_top_k_is_the_whole_vocabulary(llm):
    huge = SamplingParams(temperature=1.0, top_k=2**62, seed=3, max_tokens=4, ignore_eos=True)
    plain = SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], huge, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate([PROMPTS[0]], plain, use_tqdm=False)[0].outputs[0].token_ids
