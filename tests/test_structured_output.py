"""Structured outputs on the tiny random model: every kind constrains sampling, through preemption and n > 1."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future

import pytest

from pagellm.config import EngineArgs
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request
from pagellm.core.scheduler import Scheduler, SchedulerConfig
from pagellm.entrypoints.llm import LLM
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.structured_output import grammar as grammar_module
from pagellm.structured_output.grammar import GrammarCompiler
from pagellm.structured_output.limits import GrammarLimits, GrammarTooLarge, RegexCost, measure_schema, regex_cost
from pagellm.structured_output.matcher import GRAMMAR_COMPLETE

# Finite languages (no free strings; JSON compact, with disable_any_whitespace), so a random model ends each
# one by EOS. With whitespace allowed (the default, as in vLLM) a random model may pad JSON until max_tokens.
COMPACT = {"structured_outputs_config": {"disable_any_whitespace": True}}
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
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, **COMPACT)


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
    tight = LLM(tiny_llama_dir, dtype="float32", num_gpu_blocks_override=12, max_model_len=192, **COMPACT)
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


def test_each_grammar_is_parsed_once_and_keeps_its_property_order(llm, monkeypatch):
    parsed = []
    parse = grammar_module.parse_grammar
    monkeypatch.setattr(grammar_module, "parse_grammar", lambda *args: parsed.append(args[:2]) or parse(*args))
    compiler = llm.llm_engine.grammar_compiler
    before = compiler.stats()
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    first = compiler.submit(StructuredOutputsParams(json=schema)).wait()
    # The same schema as JSON text, spaced otherwise: the same grammar, found in the cache, not parsed again.
    again = compiler.submit(StructuredOutputsParams(json=json.dumps(schema, indent=4))).wait()
    assert again.result() is first.result()
    # Key order is property order in the output: the other order is another grammar.
    swapped = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    assert compiler.submit(StructuredOutputsParams(json=swapped)).wait().result() is not first.result()
    assert parsed == [("json", json.dumps(schema, separators=(",", ":"))),
                      ("json", json.dumps(swapped, separators=(",", ":")))]
    stats = compiler.stats()
    assert (stats.hits - before.hits, stats.misses - before.misses) == (1, 2)


def test_output_keeps_the_schema_property_order(llm):
    enum = {"enum": ["x", "y"]}
    for order in (["zeta", "alpha"], ["alpha", "zeta"]):
        schema = {"type": "object", "properties": {name: enum for name in order}, "required": order,
                  "additionalProperties": False}
        params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema))
        completion = llm.generate(["Order:"], params, use_tqdm=False)[0].outputs[0]
        assert completion.finish_reason == "stop", completion.text
        assert list(json.loads(completion.text)) == order, completion.text


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


class _Compiler:
    """A stand-in for xgrammar's GrammarCompiler whose compile fails, or waits for `release`."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.release = threading.Event()

    def compile_grammar(self, grammar):
        if self.error is not None:
            raise self.error
        self.release.wait(60)
        raise RuntimeError("released")


def test_a_compile_failure_in_the_pool_stops_all_n_sequences_with_the_reason(llm, monkeypatch):
    compiler = llm.llm_engine.grammar_compiler
    failing = _Compiler(RuntimeError("out of memory while compiling"))
    monkeypatch.setattr(compiler, "_xgrammar_compiler", lambda: failing)
    params = SamplingParams(n=3, temperature=1.0, structured_outputs=StructuredOutputsParams(regex="oom+"))
    output = llm.generate(["x"], params, use_tqdm=False)[0]
    assert [c.finish_reason for c in output.outputs] == ["stop"] * 3
    assert all("out of memory while compiling" in c.stop_reason and not c.token_ids for c in output.outputs)
    assert llm.llm_engine.get_stats().kv_cache.num_used_blocks == 0


def test_a_grammar_that_does_not_compile_in_time_fails_its_request_alone(llm, monkeypatch):
    compiler = llm.llm_engine.grammar_compiler
    stuck = _Compiler()
    monkeypatch.setattr(compiler, "_xgrammar_compiler", lambda: stuck)
    monkeypatch.setattr(compiler, "timeout_s", 0.3)
    slow = SamplingParams(temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(regex="slow+"))
    plain = SamplingParams(temperature=0, max_tokens=5)
    try:
        outputs = llm.generate(["x", "y"], [slow, plain], use_tqdm=False)
    finally:
        stuck.release.set()
    (failed,), (served,) = outputs[0].outputs, outputs[1].outputs
    assert failed.finish_reason == "stop" and not failed.token_ids
    assert "structured_outputs.regex: the grammar (5 characters) did not compile against the vocabulary within " \
           "structured_outputs_timeout=0.3 s" in failed.stop_reason
    assert served.finish_reason == "length" and len(served.token_ids) == 5


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
    params.structured_grammar = llm.llm_engine.grammar_compiler.submit(params.structured_outputs).wait()
    copy = pickle.loads(pickle.dumps(params))
    assert copy.structured_grammar is None and copy.structured_outputs == params.structured_outputs
    assert params.structured_grammar is not None


# ---- limits, time budget and the bounded cache --------------------------------------------------------


def _nested(depth: int) -> dict:
    """A schema nesting `depth` objects (2 * depth + 1 levels of JSON objects and arrays)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.fixture(scope="module")
def compile_pool(default_tokenizer):
    """Compilers on the default model's vocabulary, shut down after the module."""
    compilers: list[GrammarCompiler] = []

    def make(**kwargs) -> GrammarCompiler:
        compilers.append(GrammarCompiler(default_tokenizer, len(default_tokenizer),
                                         frozenset({default_tokenizer.eos_token_id}), **kwargs))
        return compilers[-1]

    yield make
    for compiler in compilers:
        compiler.shutdown()


def test_a_schema_over_the_limits_is_refused_before_parsing(llm, monkeypatch):
    monkeypatch.setattr(grammar_module, "parse_grammar", lambda *args: pytest.fail("parsed a refused schema"))
    cases = [
        (_nested(200), "nests objects and arrays 401 levels deep, more than the limit of 64"),
        ('{"type":"array","items":' * 5000 + "{}" + "}" * 5000, "nests objects and arrays more than 64 levels deep"),
        ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)},
          "required": [f"p{i}" for i in range(5000)]}, "is larger than the limit of size 10000"),
        ({"type": "string", "pattern": "(a|b|c|d){1,10000}"}, "patterns that repeat up to 10000 times"),
        ({"type": "object", "patternProperties": {"^x{2000}$": {}}}, "patterns that repeat up to 2000 times"),
        ({"enum": ["x" * 300_000]}, "more than 262144 characters, the limit"),
        ({"properties": {f"p{i}": {"pattern": "^[a-z]+$"} for i in range(65)}}, "has more than 64 patterns"),
        ({"properties": {"p": {"pattern": "a?" * 49}}}, "the JSON schema's patterns has 49 optional items"),
        ({"properties": {f"p{i}": {"type": "string", "format": "email"} for i in range(17)}, "required": ["p0"]},
         "has string formats of weight 170 or more, more than the limit of 160"),
        ({"properties": {f"p{i}": {"type": "integer"} for i in range(257)}}, "has more than 256 optional properties"),
    ]
    for schema, message in cases:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate(["x"], params, use_tqdm=False)
    compiler = llm.llm_engine.grammar_compiler
    with pytest.raises(ValueError, match=r"structured_outputs.regex is 300000 characters long, more than the limit "):
        compiler.submit(StructuredOutputsParams(regex="a" * 300_000))
    with pytest.raises(ValueError, match=r"structured_outputs.regex has 300 optional items .* than the limit of 48"):
        compiler.submit(StructuredOutputsParams(regex="(a?){300}"))
    with pytest.raises(ValueError, match=r"structured_outputs.grammar has 49 optional items"):
        compiler.submit(StructuredOutputsParams(grammar="root ::= " + '"a"? ' * 49))
    # What the limits count and what they do not: "int64" on an integer is no automaton; required properties.
    many = {"type": "object", "properties": {f"p{i}": {"type": "integer", "format": "int64"} for i in range(300)},
            "required": [f"p{i}" for i in range(300)]}
    many["properties"]["when"] = {"type": "string", "format": "date-time"}
    assert measure_schema(many, GrammarLimits(), "s").values == 1207
    # The deepest schema the limit takes is served.
    params = SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(json=_nested(31)))
    monkeypatch.undo()
    assert llm.generate(["x"], params, use_tqdm=False)[0].outputs[0].text.startswith("{")


def test_schema_size_and_regex_costs_are_measured():
    size = measure_schema(_nested(31), GrammarLimits(), "s")
    assert (size.depth, size.values) == (63, 157)
    # A wide schema may be big where a deep one may not: each value counts once per level it is nested at.
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(100)}}
    assert measure_schema(wide, GrammarLimits(), "s").weighted == 1 + 2 * 2 + 100 * 3 + 100 * 4
    with pytest.raises(GrammarTooLarge, match="larger than the limit of size 700"):
        measure_schema(wide, GrammarLimits(max_json_size=700), "s")
    assert regex_cost(r"[a-z]{1,64}@[a-z]{1,64}\.[a-z]{2,10}") == RegexCost(138, 0)
    assert regex_cost(r"((a|b){1,100}){1,100}") == RegexCost(10_000, 0)
    assert regex_cost(r"\d{4}-\d{2}|x*y+z?(?:ab)") == RegexCost(6, 2)
    assert regex_cost(r"\{9999}[{?]{3}") == RegexCost(3, 0)
    assert regex_cost(r"(a?b{0,2}){10}") == RegexCost(20, 20)
    assert regex_cost('root ::= "a?b*" ("x" | [a-z*]*)? r{0,3}', ebnf=True) == RegexCost(3, 3)


def _held_parse(monkeypatch, held_kinds=("regex",)):
    """parse_grammar that waits for `release` on the kinds given, recording what it parsed."""
    release, entered, parsed = threading.Event(), threading.Semaphore(0), []
    parse = grammar_module.parse_grammar

    def held(kind, text, any_whitespace):
        parsed.append(text)
        if kind in held_kinds:
            entered.release()
            release.wait(60)
        return parse(kind, text, any_whitespace)

    monkeypatch.setattr(grammar_module, "parse_grammar", held)
    return release, entered, parsed


def test_a_parse_past_the_timeout_is_a_value_error_naming_the_size(compile_pool, monkeypatch):
    release, entered, parsed = _held_parse(monkeypatch, held_kinds=("json",))
    compiler = compile_pool(timeout_s=0.3)
    try:
        with pytest.raises(ValueError, match=re.escape(
                "structured_outputs.json: the grammar (a JSON schema nested 11 deep, 27 values, size 173) was not "
                "parsed within structured_outputs_timeout=0.3 s")):
            compiler.submit(StructuredOutputsParams(json=_nested(5))).wait()
    finally:
        release.set()


def test_a_grammar_every_request_gave_up_on_is_not_parsed(compile_pool, monkeypatch):
    release, entered, parsed = _held_parse(monkeypatch)
    compiler = compile_pool(timeout_s=0.3)
    # Both compile threads busy with held grammars: the third waits in the queue past its time budget.
    held = [compiler.submit(StructuredOutputsParams(regex=f"held{i}")) for i in range(2)]
    for _ in held:
        assert entered.acquire(timeout=60)
    queued = compiler.submit(StructuredOutputsParams(regex="queued"))
    with pytest.raises(ValueError, match="was not parsed within structured_outputs_timeout=0.3 s"):
        queued.wait()
    release.set()
    for request in held:
        assert request.entry.parsed.result(timeout=60) is None
    assert "stopped waiting" in str(queued.entry.parsed.exception(timeout=60))
    assert sorted(parsed) == ["held0", "held1"] and compiler.stats().entries == 2


def test_the_cache_is_an_lru_bounded_by_entries_and_bytes(compile_pool):
    compiler = compile_pool(max_entries=4)
    grammars = [StructuredOutputsParams(regex=f"entry{i}[0-9]+") for i in range(6)]
    compiled = [compiler.submit(g).wait().result(timeout=60) for g in grammars[:4]]
    compiler.submit(grammars[0]).wait()  # a hit: entry 0 becomes the most recently used
    compiled += [compiler.submit(g).wait().result(timeout=60) for g in grammars[4:]]
    stats = compiler.stats()
    assert (stats.entries, stats.hits, stats.misses, stats.evictions) == (4, 1, 6, 2)
    assert stats.bytes == sum(compiled[i].memory_size_bytes for i in (0, 3, 4, 5))
    # Entries 1 and 2 were the least recently used: asked again, 1 is compiled again (a miss).
    compiler.submit(grammars[1]).wait()
    assert compiler.stats().misses == 7
    # A grammar in use stays valid after its eviction: the request holds its own reference.
    assert xgrammar_matcher(compiled[2]).accept_string("entry2")

    one = compiled[0].memory_size_bytes
    by_bytes = compile_pool(max_bytes=int(2.5 * one))
    for i in range(8):
        by_bytes.submit(StructuredOutputsParams(regex=f"entry{i % 4}[0-9]+|b{i}")).wait().result(timeout=60)
        assert by_bytes.stats().bytes <= int(2.5 * one)
    assert by_bytes.stats().entries <= 3 and by_bytes.stats().evictions >= 5


def xgrammar_matcher(compiled):
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def test_json_whitespace_follows_vllm(compile_pool):
    spaced, compact = '{ "a" : 1 ,\n "b" : [ 2 ] }', '{"a":1,"b":[2]}'
    schema = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"},
                                                                            "b": {"type": "array"}}})
    for compiler, accepted in ((compile_pool(), (spaced, compact)), (compile_pool(any_whitespace=False), (compact,))):
        for kind in (schema, StructuredOutputsParams(json_object=True)):
            grammar = compiler.submit(kind).wait().result(timeout=60)
            for text in (spaced, compact):
                accepts = xgrammar_matcher(grammar).accept_string(text)
                assert accepts == (text in accepted), (kind.kind, compiler.any_whitespace, text)


def test_structured_outputs_config_and_timeout_are_validated():
    assert EngineArgs(structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True,
                                                 "reasoning_parser": ""}).structured_outputs_timeout == 10.0
    for kwargs, message in [
        ({"structured_outputs_config": {"backend": "guidance"}}, "use one of ['auto', 'xgrammar']"),
        ({"structured_outputs_config": {"disable_any_whitespace": "yes"}}, "must be true or false"),
        ({"structured_outputs_config": {"reasoning_parser": "deepseek_r1"}}, "leave it ''"),
        ({"structured_outputs_config": {"backends": "auto"}}, "has unknown fields ['backends']"),
        ({"structured_outputs_timeout": 0}, "structured_outputs_timeout=0 is out of range"),
        ({"structured_outputs_timeout": float("inf")}, "a finite number of seconds > 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            EngineArgs(**kwargs)


def test_cache_stats_are_exported_as_prometheus_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    from pagellm.metrics import StructuredOutputCacheCollector
    from pagellm.structured_output.grammar import GrammarCacheStats
    from tests.server.utils import metric_value

    registry = CollectorRegistry()
    registry.register(StructuredOutputCacheCollector("m", lambda: GrammarCacheStats(3, 4096, 7, 5, 2)))
    text = generate_latest(registry).decode()
    expected = {"entries": 3, "bytes": 4096, "hits_total": 7, "misses_total": 5, "evictions_total": 2}
    for name, value in expected.items():
        assert metric_value(text, f"pagellm:structured_output_cache_{name}", {"model_name": "m"}) == value
