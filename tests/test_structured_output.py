"""Structured outputs on the tiny random model: every kind constrains sampling, through preemption and n > 1."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import pytest

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request
from pagellm.core.scheduler import Scheduler, SchedulerConfig
from pagellm.entrypoints.llm import LLM
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.structured_output.matcher import GRAMMAR_COMPLETE

# Finite languages (no free strings, no whitespace freedom), so a random model ends each one by EOS.
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                   "size": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["color", "ok", "size"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,4}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe not"]
GRAMMAR = 'root ::= ("a" | "b") ("c" | "dd") "!"'


def _is_valid(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return (set(value) == {"color", "ok", "size"} and value["color"] in ("red", "green", "blue")
                and isinstance(value["ok"], bool) and isinstance(value["size"], int) and 0 <= value["size"] <= 99)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "grammar":
        return re.fullmatch(r"[ab](c|dd)!", text) is not None
    return isinstance(json.loads(text), dict)


KINDS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
    "json_object": StructuredOutputsParams(json_object=True),
}
PROMPTS = ["The answer is", "Hello there, my friend", "1 2 3"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256)


def _generate_every_kind(llm: LLM):
    prompts, params = [], []
    for seed, (kind, structured) in enumerate(KINDS.items()):
        for prompt in PROMPTS:
            prompts.append(prompt)
            # json_object admits free strings: a random model may run on, so it gets room, and is checked on stop.
            params.append(SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=60, structured_outputs=structured))
    return [(p.structured_outputs.kind, o) for p, o in zip(params, llm.generate(prompts, params, use_tqdm=False))]


def test_every_kind_constrains_sampling_through_preemption_and_n(llm, tiny_llama_dir):
    roomy = _generate_every_kind(llm)
    # 12 blocks of 16 tokens for 30 sequences: the batch preempts and recomputes, replaying the matchers.
    tight = LLM(tiny_llama_dir, dtype="float32", num_gpu_blocks_override=12, max_model_len=192)
    preempted = _generate_every_kind(tight)
    assert tight.llm_engine.get_stats().num_preemptions > 0
    finished_by_stop = 0
    for (kind, output), (_, again) in zip(roomy, preempted):
        assert len(output.outputs) == 2
        for completion, replayed in zip(output.outputs, again.outputs):
            assert completion.token_ids == replayed.token_ids, "seeded sampling is independent of preemption"
            if kind != "json_object":
                assert completion.finish_reason == "stop", (kind, completion.text)
            if completion.finish_reason == "stop":
                finished_by_stop += 1
                assert _is_valid(kind, completion.text), (kind, completion.text)
            else:
                assert completion.text.startswith("{"), completion.text
    assert finished_by_stop >= 24
    # n=2 forks each follow their own grammar state: the two samples of a prompt differ somewhere.
    assert any(o.outputs[0].text != o.outputs[1].text for _, o in roomy)


def test_greedy_constrained_output_is_the_best_allowed_token(llm):
    choices = ["zebra crossing", "apple"]
    constrained = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10,
                                                           structured_outputs=StructuredOutputsParams(choice=choices)),
                               use_tqdm=False)[0].outputs[0]
    assert constrained.text in choices and constrained.finish_reason == "stop"


def test_grammar_complete_without_eos_stops_with_the_reason(llm):
    # ignore_eos lets the EOS the grammar ends on pass; the next step has nothing allowed and says so.
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    completion = llm.generate(["Well"], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == GRAMMAR_COMPLETE
    assert len(completion.token_ids) < 20


@pytest.mark.parametrize("structured, message", [
    (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex='(ab' cannot be compiled"),
    (StructuredOutputsParams(grammar="root ::= missing_rule"), "structured_outputs.grammar="),
    (StructuredOutputsParams(json='{"type": "object",'), "is not valid JSON"),
    (StructuredOutputsParams(json={"type": "strange"}), "structured_outputs.json="),
])
def test_a_grammar_that_cannot_compile_is_a_value_error(llm, structured, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["x"], SamplingParams(structured_outputs=structured), use_tqdm=False)
    assert llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, message", [
    ({}, "set exactly one"),
    ({"regex": "a", "choice": ["a"]}, "set exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "every choice"),
    ({"regex": ""}, "non-empty str"),
    ({"json": 3}, "JSON schema"),
])
def test_structured_outputs_params_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_each_grammar_compiles_once(llm):
    compiler = llm.llm_engine.grammar_compiler
    first = compiler.submit(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    again = compiler.submit(StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}'))
    assert first is again
    assert first.result() is again.result()


def test_a_request_waiting_for_its_grammar_does_not_hold_up_others():
    scheduler = Scheduler(SchedulerConfig(64, 4, 64), KVCacheManager(16, 4, False))
    compiling: Future = Future()
    slow = Request("slow", [1, 2, 3], SamplingParams(), 0, 4)
    slow.sampling_params.structured_grammar = compiling
    scheduler.add_request(slow)
    scheduler.add_request(Request("plain", [4, 5], SamplingParams(), 1, 4))
    assert list(scheduler.schedule().num_scheduled_tokens) == ["plain"]
    assert scheduler.grammar_futures_pending() == [compiling]
    compiling.set_result(object())
    assert "slow" in scheduler.schedule().num_scheduled_tokens


def test_a_compile_failure_in_the_pool_stops_all_n_sequences_with_the_reason(llm, monkeypatch):
    failed: Future = Future()
    failed.set_exception(RuntimeError("out of memory while compiling"))
    monkeypatch.setattr(llm.llm_engine.grammar_compiler, "submit", lambda structured: failed)
    params = SamplingParams(n=3, temperature=1.0, structured_outputs=StructuredOutputsParams(regex="a+"))
    output = llm.generate(["x"], params, use_tqdm=False)[0]
    assert [c.finish_reason for c in output.outputs] == ["stop"] * 3
    assert all("out of memory while compiling" in c.stop_reason and not c.token_ids for c in output.outputs)
    assert llm.llm_engine.get_stats().kv_cache.num_used_blocks == 0


def test_default_model_outputs_under_a_json_schema_all_validate():
    # The target on the real model, one batch (benchmarks/structured.py runs the full 100).
    from benchmarks.structured import PROMPT, constrained, person_error

    llm = LLM(seed=0, kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    outputs = llm.generate([PROMPT] * 8, [constrained(seed, 128) for seed in range(8)], use_tqdm=False)
    errors = [(o.outputs[0].text, person_error(o.outputs[0].text)) for o in outputs]
    assert [e for e in errors if e[1] is not None] == []
    assert len({text for text, _ in errors}) > 4, "temperature 1.0 samples differ"


def test_structured_outputs_may_be_given_as_a_dict():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(ValueError, match="allowed keys"):
        SamplingParams(structured_outputs={"schema": {}})


def test_params_pickle_without_the_compile_future(llm):
    # Tensor-parallel ranks receive params pickled; the Future (holding a lock) stays with rank 0.
    import pickle

    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    params.structured_grammar = llm.llm_engine.grammar_compiler.submit(params.structured_outputs)
    copy = pickle.loads(pickle.dumps(params))
    assert copy.structured_grammar is None and copy.structured_outputs == params.structured_outputs
    assert params.structured_grammar is not None
