"""response_format, vLLM's guided_* / structured_outputs and tool calls through a real server and the openai client;
grammars parsed off the event loop, within a time budget, once."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import pytest
import uvicorn
from pydantic import BaseModel

from pagellm import SamplingParams
from pagellm.engine.arg_utils import AsyncEngineArgs
from pagellm.engine.async_llm_engine import AsyncLLMEngine
from pagellm.entrypoints.openai.api_server import build_app
from pagellm.entrypoints.openai.serving import ServerConfig
from pagellm.structured_output import grammar as grammar_module
from tests.server.utils import free_port, metric_value, wait_until

MESSAGES = [{"role": "user", "content": "Pick a color."}]
# Finite languages: the tiny random model always ends them (EOS is the only token left once complete).
PICK_SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                   "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


class _ThreadedServer:
    """uvicorn serving an app on a free loopback port from a thread of this process (so that a test can reach
    into its engine and its grammar compiler)."""

    def __init__(self, app) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="test-uvicorn", daemon=True)

    def __enter__(self) -> _ThreadedServer:
        self._thread.start()
        wait_until(lambda: self._server.started, 120, "the server to start")
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.should_exit = True
        self._thread.join(60)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    # Compact JSON (vLLM's disable_any_whitespace): the tiny random model, free to put whitespace between JSON
    # tokens as vLLM's default allows, would rarely close an object within max_tokens.
    args = AsyncEngineArgs(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=512,
                           max_num_batched_tokens=512, seed=0,
                           structured_outputs_config={"disable_any_whitespace": True})
    engine = AsyncLLMEngine.from_engine_args(args)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine, tiny_llama_dir):
    with _ThreadedServer(build_app(engine, ServerConfig(["tiny", "tiny-alias"], tiny_llama_dir))) as threaded:
        yield threaded


def _chat(client, **kwargs):
    return client.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, "max_tokens": 40,
                                             "temperature": 1.0, "seed": 3, "n": 2, **kwargs})


def test_response_format_json_schema_and_json_object(client):
    response = _chat(client, response_format={"type": "json_schema",
                                              "json_schema": {"name": "pick", "schema": PICK_SCHEMA}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        Pick.model_validate_json(choice.message.content)
    response = _chat(client, response_format={"type": "json_object"}, max_tokens=200)
    for choice in response.choices:
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model="tiny", messages=MESSAGES, max_tokens=40, response_format=Pick)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Pick)


def test_completions_take_response_format_and_vllm_extras(client):
    prompt = "Answer:"
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, n=2, seed=1,
                                         extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                             "name": "pick", "schema": PICK_SCHEMA}}})
    for choice in response.choices:
        Pick.model_validate_json(choice.text)
    extras = {
        "guided_regex": (r"[a-z]{2,4}-[0-9]{1,2}", lambda text: re.fullmatch(r"[a-z]{2,4}-[0-9]{1,2}", text)),
        "guided_choice": (["alpha", "beta gamma"], lambda text: text in ("alpha", "beta gamma")),
        "guided_grammar": ('root ::= "x" ("y" | "zz")', lambda text: text in ("xy", "xzz")),
        "guided_json": (PICK_SCHEMA, Pick.model_validate_json),
    }
    for field, (value, is_valid) in extras.items():
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, seed=2,
                                             extra_body={field: value})
        assert is_valid(response.choices[0].text), (field, response.choices[0].text)
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, stream=True,
                                         extra_body={"structured_outputs": {"choice": ["alpha", "beta gamma"]}})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) in ("alpha", "beta gamma")


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}}},
     "response_format", "cannot be compiled"),
    ({"guided_regex": "(ab"}, "guided_regex", "guided_regex='(ab' cannot be compiled"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "pass only one"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "schema"),
    ({"tools": [WEATHER_TOOL]}, "tool_choice", "tool_choice='auto'"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope'"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools.0", "function"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "pass one of them"),
])
def test_bad_structured_requests_are_400_naming_the_part(server, body, param, fragment):
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": MESSAGES, "stream": True, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_named_tool_call_plain_and_streamed(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = _chat(client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice)
    for item in response.choices:
        assert item.finish_reason == "stop" and item.message.content is None
        (call,) = item.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert set(json.loads(call.function.arguments)) == {"city", "unit"}
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, stream=True,
                                                tools=[WEATHER_TOOL], tool_choice=choice):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta_call.index, {"name": "", "arguments": ""})
            entry["name"] += delta_call.function.name or ""
            entry["arguments"] += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"])["unit"] in ("C", "F")


def test_required_tool_choice_picks_among_the_tools(client):
    response = _chat(client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", max_tokens=120)
    for item in response.choices:
        assert item.finish_reason == "tool_calls", item
        assert item.message.tool_calls
        for call in item.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert call.function.name in ("get_weather", "get_time")
            assert set(arguments) == ({"city", "unit"} if call.function.name == "get_weather" else {"zone"})


def test_a_tool_call_cut_short_comes_back_as_text(client):
    response = _chat(client, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=3, n=1)
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("[")


# ---- grammars off the event loop, within a time budget, once -----------------------------------------------


def _nested(depth: int, leaf: dict | None = None) -> dict:
    """A schema nesting `depth` objects (2 * depth + 1 levels of JSON objects and arrays)."""
    schema = leaf or {"enum": ["x", "y"]}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    return schema


def _json_schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


class _Stream:
    """A greedy completions stream read on its own thread: the times its chunks arrived."""

    def __init__(self, url: str, max_tokens: int = 300) -> None:
        self.chunks: list[float] = []
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(time.monotonic())

    def wait_for_more(self, count: int = 3) -> None:
        seen = len(self.chunks)
        wait_until(lambda: len(self.chunks) >= seen + count, 120, f"{count} more chunks of the neighbour's stream")

    def join(self) -> None:
        self._thread.join(300)


def _timed_health(url: str) -> float:
    started = time.monotonic()
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    return time.monotonic() - started


def _health_bound(url: str) -> float:
    """How long /health may take while grammars are parsed: 1 s more than twice its slowest of five answers
    beside the same stream (on a loaded 2-core machine it takes up to ~0.7 s then); a stall is seconds more."""
    return 1.0 + 2 * max(_timed_health(url) for _ in range(5))


def _cache_metric(url: str, name: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics").text, f"pagellm:structured_output_cache_{name}",
                        {"model_name": "tiny"})


def test_health_and_a_stream_go_on_while_a_grammar_is_parsed_and_it_is_parsed_once(server, monkeypatch):
    released, entered, parsed = threading.Event(), threading.Event(), []
    parse = grammar_module.parse_grammar

    def held(kind, text, any_whitespace):
        parsed.append(text)
        if "held_marker" in text:
            entered.set()
            released.wait(120)
        return parse(kind, text, any_whitespace)

    monkeypatch.setattr(grammar_module, "parse_grammar", held)
    schema = {"type": "object", "properties": {"held_marker": {"enum": ["a", "b"]}}, "required": ["held_marker"],
              "additionalProperties": False}
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 20, **_json_schema(schema)}
    hits, misses = _cache_metric(server.url, "hits_total"), _cache_metric(server.url, "misses_total")
    neighbour = _Stream(server.url)
    neighbour.wait_for_more(1)
    bound = _health_bound(server.url)
    with ThreadPoolExecutor(1) as pool:
        constrained = pool.submit(httpx.post, f"{server.url}/v1/chat/completions", json=body, timeout=300)
        try:
            assert entered.wait(120), "the grammar was never parsed"
            health_s = _timed_health(server.url)
            neighbour.wait_for_more()
        finally:
            released.set()
        first = constrained.result()
    again = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    neighbour.join()
    assert health_s < bound, f"/health took {health_s:.2f} s while a grammar was parsed (bound {bound:.2f} s)"
    for response in (first, again):
        assert response.status_code == 200, response.text
        assert json.loads(response.json()["choices"][0]["message"]["content"])["held_marker"] in ("a", "b")
    # Parsed once: the route found it in the cache the second time, and the engine never parsed it.
    assert sum("held_marker" in text for text in parsed) == 1
    assert _cache_metric(server.url, "hits_total") == hits + 1
    assert _cache_metric(server.url, "misses_total") == misses + 1
    assert _cache_metric(server.url, "entries") >= 1 and _cache_metric(server.url, "bytes") > 0


def test_a_parse_past_the_time_budget_is_a_400_naming_the_schema_size(server, engine, monkeypatch):
    released = threading.Event()
    parse = grammar_module.parse_grammar
    monkeypatch.setattr(grammar_module, "parse_grammar",
                        lambda *args: released.wait(120) and parse(*args))
    monkeypatch.setattr(engine.engine.grammar_compiler, "timeout_s", 0.5)
    try:
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                              json={"model": "tiny", "messages": MESSAGES, **_json_schema(_nested(3))})
    finally:
        released.set()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format"
    assert error["message"].startswith("response_format: the grammar (a JSON schema nested 8 deep, 22 values, size "
                                       "105) was not parsed within structured_outputs_timeout=0.5 s"), error


def test_output_keeps_the_schema_property_order(client):
    for order in (["zeta", "alpha"], ["alpha", "zeta"]):
        schema = {"type": "object", "properties": {name: {"enum": ["x", "y"]} for name in order}, "required": order,
                  "additionalProperties": False}
        response = _chat(client, n=1, **_json_schema(schema))
        assert list(json.loads(response.choices[0].message.content)) == order


def test_a_deep_schema_is_refused_at_once_while_health_and_streams_go_on(shared_servers):
    """The issue's case on a real `pagellm serve` with its defaults (JSON whitespace allowed): a schema nested
    200 objects deep is a 400 naming its depth and the limit; the deepest and widest schemas the limits take
    are parsed and served while /health answers and a neighbour's stream goes on."""
    live = shared_servers()
    neighbour = _Stream(live.url, max_tokens=400)
    neighbour.wait_for_more(1)
    bound = _health_bound(live.url)
    chains = {"anyOf": [_items(61, {"const": i}) for i in range(2)]}  # near the depth and size limits
    bodies = {"deep": _nested(200), "chains": chains, "nested": _nested(31)}
    with ThreadPoolExecutor(len(bodies)) as pool:
        pending = {name: pool.submit(httpx.post, f"{live.url}/v1/chat/completions", timeout=300,
                                     json={"model": "tiny", "messages": MESSAGES, "max_tokens": 8,
                                           **_json_schema(schema)})
                   for name, schema in bodies.items()}
        health_s = []
        while not all(future.done() for future in pending.values()):
            health_s.append(_timed_health(live.url))
        responses = {name: future.result() for name, future in pending.items()}
    neighbour.wait_for_more()
    neighbour.join()
    assert max(health_s) < bound, f"/health took up to {max(health_s):.2f} s while the schemas were parsed " \
                                  f"(bound {bound:.2f} s)"
    deep = responses.pop("deep")
    assert deep.status_code == 400 and deep.json()["error"]["param"] == "response_format"
    assert re.search(r"nests objects and arrays 402 levels deep, more than the limit of 64", deep.text), deep.text
    for name, response in responses.items():
        assert response.status_code == 200, (name, response.text)


def _items(depth: int, leaf: dict) -> dict:
    for _ in range(depth):
        leaf = {"type": "array", "items": leaf}
    return leaf


def test_generate_route_and_async_engine_callers_parse_in_the_compile_threads(server, engine, monkeypatch):
    threads = []
    parse = grammar_module.parse_grammar
    monkeypatch.setattr(grammar_module, "parse_grammar",
                        lambda *args: threads.append(threading.current_thread().name) or parse(*args))
    response = httpx.post(f"{server.url}/generate", timeout=120,
                          json={"prompt": "Pick:", "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}})
    assert response.status_code == 200 and response.json()["text"] in ("yes", "no"), response.text
    deep = httpx.post(f"{server.url}/generate", timeout=120,
                      json={"prompt": "Pick:", "structured_outputs": {"json": _nested(40)}})
    assert deep.status_code == 400 and deep.json()["error"]["param"] == "structured_outputs", deep.text
    assert "structured_outputs.json: the JSON schema nests objects and arrays 82 levels deep" in deep.text

    async def generate(structured: dict) -> object:
        params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=structured)
        async for output in engine.generate("Pick:", params, f"direct-{len(threads)}-{structured}"):
            last = output
        return last.outputs[0]

    refused = asyncio.run(generate({"regex": "(ab"}))
    served = asyncio.run(generate({"choice": ["left", "right"]}))
    # A direct caller of the engine is not waited for: a grammar xgrammar refuses ends its request, saying why.
    assert refused.finish_reason == "stop"
    assert "structured_outputs.regex='(ab' cannot be compiled" in refused.stop_reason
    assert served.text in ("left", "right")
    assert threads and all(name.startswith("pagellm-grammar") for name in threads), threads
