"""vLLM's request fields on the OpenAI routes: every one vLLM 0.32 accepts is accepted (the list recorded from its
source in tests/data/vllm_request_fields.json), unknown ones are ignored with a warning, and those that change the
output do what vLLM's do. In-process (httpx's ASGI transport) on one engine, with servers of two configurations:
one that trusts request chat templates and has a --chat-template of its own, one that does not."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path

import httpx
import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.arg_utils import AsyncEngineArgs
from pagellm.engine.async_llm_engine import AsyncLLMEngine
from pagellm.entrypoints.openai.api_server import build_app
from pagellm.entrypoints.openai.fields import refuse_unsupported
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.entrypoints.openai.serving import ServerConfig

FIELDS = json.loads((Path(__file__).parents[1] / "data" / "vllm_request_fields.json").read_text())
ENGINE_KWARGS = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256)
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "ignore_eos": True}
# The trusted server's own template: plain enough that a test can say what each prompt must be.
SERVER_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}" \
                  "{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama_dir, **ENGINE_KWARGS))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def app(engine, tiny_llama_dir):
    return build_app(engine, ServerConfig(["tiny"], tiny_llama_dir))


@pytest.fixture(scope="module")
def trusting_app(engine, tiny_llama_dir):
    config = ServerConfig(["tiny"], tiny_llama_dir, chat_template=SERVER_TEMPLATE, trust_request_chat_template=True)
    return build_app(engine, config)


def _post(app, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pagellm.test", timeout=120) as client:
            return await client.post(path, json={"model": "tiny", **body}, headers=headers)

    return asyncio.run(run())


def _ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def _events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _error(response: httpx.Response, param: str, *fragments: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error


def _token_ids(offline: LLM, text: str) -> list[int]:
    return offline.get_tokenizer().encode(text)


# ---- every field vLLM accepts, accepted ---------------------------------------------------------------------


@pytest.mark.parametrize(("model", "recorded", "openai"), [
    (CompletionRequest, "CompletionRequest", "completions"),
    (ChatCompletionRequest, "ChatCompletionRequest", "chat"),
])
def test_every_vllm_and_openai_request_field_is_a_field(model, recorded, openai):
    assert FIELDS["vllm_version"] == "0.32.0"
    names = set(model.model_fields)
    assert sorted(set(FIELDS[recorded]) - names) == []
    assert sorted(set(FIELDS["openai"][openai]) - names) == []


@pytest.mark.parametrize(("model", "recorded"), [(CompletionRequest, "CompletionRequest"),
                                                 (ChatCompletionRequest, "ChatCompletionRequest")])
def test_a_body_with_every_vllm_field_at_its_default_is_accepted(model, recorded):
    body = {"prompt": "Hi"} if model is CompletionRequest else {"messages": MESSAGES}
    defaults = {name: spec["default"] for name, spec in FIELDS[recorded].items() if "default" in spec}
    request = model.model_validate({**defaults, **body})
    refuse_unsupported(request)  # no field at its default is refused


def test_unknown_fields_are_ignored_with_a_warning_naming_them(app, caplog):
    with caplog.at_level(logging.WARNING, logger="pagellm.entrypoints.openai.protocol"):
        response = _ok(_post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "max_token": 9,
                                                       "stream_options_x": {}}))
    assert response["usage"]["completion_tokens"] <= 3
    assert "ignoring fields this server does not know: max_token, stream_options_x" in caplog.text


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/completions", {"prompt": PROMPT, "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": PROMPT, "watermarking": True}, "watermarking"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1, "logprob_token_ids": [1]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "repetition_detection": {"max_pattern_size": 4}}, "repetition_detection"),
    ("/v1/chat/completions", {"messages": MESSAGES, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": MESSAGES, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": MESSAGES, "mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"messages": MESSAGES, "thinking_token_budget": 10}, "thinking_token_budget"),
    ("/v1/completions", {"prompt": PROMPT, "seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "cache_salt": "a/b"}, None),
])
def test_what_pagellm_cannot_honour_is_a_400_naming_the_field(app, route, body, param):
    response = _post(app, route, body)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param
    else:
        assert "cache_salt" in response.json()["error"]["message"]


def test_openai_and_vllm_informational_fields_change_nothing(app):
    plain = _ok(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, **GREEDY}))
    extras = {"store": True, "metadata": {"team": "a"}, "service_tier": "default", "user": "u",
              "parallel_tool_calls": False, "modalities": ["text"], "prediction": {"type": "content", "content": "x"},
              "safety_identifier": "s", "prompt_cache_key": "k", "verbosity": "low", "session_id": "s1",
              "kv_transfer_params": {"do_remote_prefill": False}, "vllm_xargs": {"a": 1}, "stream_interval": 2,
              "include_reasoning": True, "thinking_token_budget": -1, "return_token_offsets": True}
    with_extras = _ok(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, **GREEDY, **extras}))
    assert with_extras["choices"][0]["message"] == plain["choices"][0]["message"]


# ---- log-probabilities ---------------------------------------------------------------------------------------


def test_prompt_logprobs_on_both_routes_are_the_engines(app, offline):
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    response = _ok(_post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}))
    prompt_logprobs = response["choices"][0]["prompt_logprobs"]
    ids = expected.prompt_token_ids
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for position, token_id, reference in zip(prompt_logprobs[1:], ids[1:], expected.prompt_logprobs[1:]):
        entry = position[str(token_id)]
        assert math.isclose(entry["logprob"], reference[token_id].logprob, abs_tol=1e-4)
        assert entry["rank"] == reference[token_id].rank and isinstance(entry["decoded_token"], str)
        assert len(position) <= 3  # the prompt's token and the 2 most likely

    chat = _ok(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0,
                                                   "return_token_ids": True}))
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) and chat["prompt_logprobs"][0] is None
    assert all(str(t) in p for t, p in zip(chat["prompt_token_ids"][1:], chat["prompt_logprobs"][1:]))


def test_echo_with_logprobs_scores_the_prompt_first_token_null(app, offline):
    body = {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 2, **GREEDY}
    response = _ok(_post(app, "/v1/completions", body))
    choice = response["choices"][0]
    plain = _ok(_post(app, "/v1/completions", {**body, "echo": False}))["choices"][0]
    num_prompt = len(_token_ids(offline, PROMPT))
    assert choice["text"] == PROMPT + plain["text"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == num_prompt + 4
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    assert logprobs["token_logprobs"][num_prompt:] == plain["logprobs"]["token_logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"][num_prompt] == len(PROMPT)

    streamed = _events(_post(app, "/v1/completions", {**body, "stream": True}))
    tokens = [t for event in streamed for c in event["choices"] for t in (c["logprobs"] or {}).get("tokens", [])]
    assert tokens == logprobs["tokens"]
    assert "".join(c["text"] for event in streamed for c in event["choices"]) == choice["text"]
    assert streamed[0]["choices"][0]["prompt_token_ids"] == _token_ids(offline, PROMPT)

    only_prompt = _ok(_post(app, "/v1/completions", {**body, "max_tokens": 0}))["choices"][0]
    assert only_prompt["text"] == PROMPT and len(only_prompt["logprobs"]["tokens"]) == num_prompt


def test_max_logprobs_is_the_limit_named(app):
    _error(_post(app, "/v1/completions", {"prompt": PROMPT, "logprobs": -1}), "logprobs", "max_logprobs=20")
    _error(_post(app, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}), "prompt_logprobs",
           "max_logprobs=20")
    _error(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}),
           "top_logprobs", "max_logprobs=20")
    assert _ok(_post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 20}))


def test_return_tokens_as_token_ids(app):
    response = _ok(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "logprobs": True,
                                                       "top_logprobs": 1, "return_tokens_as_token_ids": True,
                                                       "return_token_ids": True, **GREEDY}))
    choice = response["choices"][0]
    assert [entry["token"] for entry in choice["logprobs"]["content"]] == \
           [f"token_id:{t}" for t in choice["token_ids"]]


# ---- chat templates --------------------------------------------------------------------------------------------


def test_continue_final_message_continues_it_as_offline(app, offline):
    messages = MESSAGES + [{"role": "assistant", "content": "The capital of France"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 6, "return_prompt_text": True, **GREEDY}
    response = _ok(_post(app, "/v1/chat/completions", body))
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False,
                            add_generation_prompt=False, continue_final_message=True)[0]
    assert response["prompt_text"] == expected.prompt and expected.prompt.endswith("The capital of France")
    choice = response["choices"][0]
    assert choice["message"] == {**choice["message"], "role": "assistant", "content": expected.outputs[0].text}
    echoed = _ok(_post(app, "/v1/chat/completions", {**body, "echo": True}))["choices"][0]["message"]["content"]
    assert echoed == "The capital of France" + expected.outputs[0].text
    _error(_post(app, "/v1/chat/completions", {**body, "add_generation_prompt": True}), "continue_final_message",
           "add_generation_prompt=false")


def test_request_chat_templates_need_a_trusting_server(app, trusting_app):
    template = "{% for m in messages %}[{{ m['content'] }}|{{ greeting }}]{% endfor %}"
    body = {"messages": MESSAGES, "max_tokens": 1, "return_prompt_text": True, "chat_template": template,
            "chat_template_kwargs": {"greeting": "hello"}}
    _error(_post(app, "/v1/chat/completions", body), "chat_template", "--trust-request-chat-template")
    trusted = _ok(_post(trusting_app, "/v1/chat/completions", body))
    assert trusted["prompt_text"] == f"[{MESSAGES[0]['content']}|hello]"
    # Without one of its own, the request gets the server's --chat-template (and its variables).
    server_default = _ok(_post(trusting_app, "/v1/chat/completions",
                               {"messages": MESSAGES, "max_tokens": 1, "return_prompt_text": True}))
    assert server_default["prompt_text"] == f"<user>{MESSAGES[0]['content']}<assistant>"
    _error(_post(trusting_app, "/v1/chat/completions",
                 {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}),
           "chat_template_kwargs.tokenize", "tokenizing is the server's")


def test_reasoning_effort_and_documents_reach_the_template(trusting_app):
    template = "{{ reasoning_effort }}|{{ enable_thinking }}|{{ documents[0]['title'] }}"
    response = _ok(_post(trusting_app, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 1, "return_prompt_text": True, "chat_template": template,
        "reasoning_effort": "low", "documents": [{"title": "Atlas", "text": "..."}]}))
    assert response["prompt_text"] == "low|True|Atlas"


def test_a_reply_without_generation_prompt_takes_the_last_role(trusting_app):
    response = _ok(_post(trusting_app, "/v1/chat/completions",
                         {"messages": MESSAGES, "add_generation_prompt": False, "max_tokens": 2}))
    assert response["choices"][0]["message"]["role"] == "user"


# ---- prompts ---------------------------------------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_ones(app, offline):
    ids = _token_ids(offline, "one two three four five six seven eight")
    body = {"prompt": ids, "max_tokens": 3, "return_token_ids": True, **GREEDY}
    left = _ok(_post(app, "/v1/completions", {**body, "truncate_prompt_tokens": 4}))
    assert left["choices"][0]["prompt_token_ids"] == ids[-4:] and left["usage"]["prompt_tokens"] == 4
    assert left["choices"][0]["text"] == _ok(_post(app, "/v1/completions", {**body, "prompt": ids[-4:]}))[
        "choices"][0]["text"]
    right = _ok(_post(app, "/v1/completions", {**body, "truncate_prompt_tokens": 4, "truncation_side": "right"}))
    assert right["choices"][0]["prompt_token_ids"] == ids[:4]
    long_prompt = _ok(_post(app, "/v1/completions", {"prompt": ids * 40, "max_tokens": 1,
                                                      "truncate_prompt_tokens": -1}))
    assert long_prompt["usage"]["prompt_tokens"] == ENGINE_KWARGS["max_model_len"] - 1
    _error(_post(app, "/v1/completions", {**body, "truncate_prompt_tokens": 10_000}), "truncate_prompt_tokens",
           "maximum context length of 256")
    chat = _ok(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                   "truncate_prompt_tokens": 5}))
    assert chat["usage"]["prompt_tokens"] == 5


def test_allowed_token_ids_and_bad_words(app, offline):
    allowed = _token_ids(offline, " Paris London Rome")
    response = _ok(_post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "allowed_token_ids": allowed,
                                                   "return_token_ids": True, **GREEDY}))
    assert set(response["choices"][0]["token_ids"]) <= set(allowed)
    plain = _ok(_post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, **GREEDY}))["choices"][0]["text"]
    word = plain.split()[0]
    banned = _ok(_post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "bad_words": [word], **GREEDY}))
    assert word not in banned["choices"][0]["text"].split()
    _error(_post(app, "/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [10**7]}), "allowed_token_ids",
           "outside the vocabulary")


# ---- responses: token ids, usage, ids ----------------------------------------------------------------------------


def test_return_token_ids_streamed_or_not(app, offline):
    body = {"prompt": PROMPT, "max_tokens": 5, "return_token_ids": True, **GREEDY}
    whole = _ok(_post(app, "/v1/completions", body))["choices"][0]
    assert whole["prompt_token_ids"] == _token_ids(offline, PROMPT) and len(whole["token_ids"]) == 5
    events = _events(_post(app, "/v1/completions", {**body, "stream": True}))
    assert [t for event in events for c in event["choices"] for t in c["token_ids"]] == whole["token_ids"]
    prompt_ids = [c["prompt_token_ids"] for event in events for c in event["choices"]]
    assert prompt_ids[0] == whole["prompt_token_ids"] and all(p is None for p in prompt_ids[1:])

    chat = _ok(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, "return_token_ids": True,
                                                   **GREEDY}))
    chat_events = _events(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, "stream": True,
                                                              "return_token_ids": True, **GREEDY}))
    assert chat_events[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    streamed = [t for event in chat_events for c in event["choices"] for t in c.get("token_ids") or []]
    assert streamed == chat["choices"][0]["token_ids"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_usage_on_every_chunk(app, route):
    body = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES}
    events = _events(_post(app, route, {**body, "max_tokens": 5, "stream": True, **GREEDY,
                                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    counts = [event["usage"]["completion_tokens"] for event in events]
    assert counts == sorted(counts) and counts[-1] == 5
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == events[-1]["usage"][
        "prompt_tokens"] + 5
    without = _events(_post(app, route, {**body, "max_tokens": 5, "stream": True, **GREEDY,
                                         "stream_options": {"include_usage": True}}))
    assert all("usage" not in event for event in without[:-1]) and "usage" in without[-1]


def test_request_id_names_the_response(app):
    body = {"prompt": PROMPT, "max_tokens": 2, "request_id": "mine-1"}

    async def twice():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pagellm.test", timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json={"model": "tiny", **body})
                                          for _ in range(2)))

    # The same id twice at once: both are served (the engine's ids get a tail of their own).
    assert [_ok(r)["id"] for r in asyncio.run(twice())] == ["cmpl-mine-1"] * 2
    assert _ok(_post(app, "/v1/completions", body, {"X-Request-Id": "from-header"}))["id"] == "cmpl-from-header"
    chat = _ok(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "request_id": "c1"}))
    assert chat["id"] == "chatcmpl-c1"


# ---- beam search ------------------------------------------------------------------------------------------------


def test_beam_search_of_width_one_is_greedy_and_wider_beams_are_distinct(app):
    body = {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}
    greedy = _ok(_post(app, "/v1/completions", {**body, "temperature": 0}))["choices"][0]["text"]
    beam = _ok(_post(app, "/v1/completions", {**body, "use_beam_search": True, "n": 1}))
    assert beam["choices"][0]["text"] == greedy and beam["usage"]["completion_tokens"] == 5
    wide = _ok(_post(app, "/v1/completions", {**body, "use_beam_search": True, "n": 3, "logprobs": 1}))
    texts = [choice["text"] for choice in wide["choices"]]
    assert len(set(texts)) == 3 and [c["index"] for c in wide["choices"]] == [0, 1, 2]
    sums = [sum(choice["logprobs"]["token_logprobs"]) for choice in wide["choices"]]
    assert sums == sorted(sums, reverse=True)  # best first (all of one length: the scores are the sums)
    chat = _ok(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "use_beam_search": True,
                                                   "n": 2, "ignore_eos": True}))
    assert len(chat["choices"]) == 2
    _error(_post(app, "/v1/completions", {**body, "use_beam_search": True, "stream": True}), "use_beam_search",
           "cannot stream")


# ---- priority and cache_salt -------------------------------------------------------------------------------------


def test_priority_needs_the_priority_policy(app):
    _error(_post(app, "/v1/completions", {"prompt": PROMPT, "priority": 3}), "priority", "--scheduling-policy priority")
    _error(_post(app, "/v1/completions", {"prompt": PROMPT}, {"X-Vllm-Priority": "-1"}), "priority")
    assert _ok(_post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "priority": 0}))


def test_priority_reaches_the_engine_body_or_header(tiny_llama_dir, monkeypatch):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama_dir, scheduling_policy="priority",
                                                             **ENGINE_KWARGS))
    seen: list[int] = []
    add_request = engine.add_request

    def spy(request_id, prompt, params, priority=0, **more):
        seen.append(priority)
        return add_request(request_id, prompt, params, priority, **more)

    monkeypatch.setattr(engine, "add_request", spy)
    try:
        app = build_app(engine, ServerConfig(["tiny"], tiny_llama_dir))
        _ok(_post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "priority": 7}))
        _ok(_post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "priority": -2}))
        _ok(_post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "priority": 7},
                  {"X-Vllm-Priority": "-5"}))
        assert seen == [7, -2, -5]
    finally:
        engine.shutdown()


def test_cache_salt_keeps_prefix_cache_reuse_within_a_salt(app, offline):
    prompt = _token_ids(offline, "A long shared system prompt that fills a few blocks of the cache. " * 4)
    assert len(prompt) > 48

    def cached(salt: str | None) -> int:
        body = {"prompt": prompt, "max_tokens": 1} | ({} if salt is None else {"cache_salt": salt})
        return _ok(_post(app, "/v1/completions", body))["kv"]["cached_tokens"]

    cached("tenant-a")
    assert cached("tenant-a") >= 48  # the second request of a salt reuses the first's blocks
    assert cached("tenant-b") == 0 and cached(None) == 0  # another salt, or none, does not
    chat = {"messages": [{"role": "system", "content": "You are terse. " * 30}] + MESSAGES, "max_tokens": 1}
    _ok(_post(app, "/v1/chat/completions", {**chat, "cache_salt": "c"}))
    assert _ok(_post(app, "/v1/chat/completions", {**chat, "cache_salt": "c"}))["kv"]["cached_tokens"] >= 48
    assert _ok(_post(app, "/v1/chat/completions", {**chat, "cache_salt": "d"}))["kv"]["cached_tokens"] == 0
