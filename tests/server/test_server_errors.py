"""Bad input gets an OpenAI-style error with the right status, and the server goes on serving."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.server.utils import API_KEY, AUTH


def _assert_error(response: httpx.Response, status: int, param: str | None, *fragments: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


def _assert_serving(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 3


BAD_COMPLETIONS = [
    # (body, status, param, fragments of the message)
    ({"model": "tiny", "prompt": 123}, 400, "prompt", []),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens", ["valid integer"]),
    ({"model": "tiny", "prompt": "Hi", "temperature": "hot"}, 400, "temperature", []),
    ({"model": "tiny", "prompt": "Hi", "stream": "yes please"}, 400, "stream", []),
    ({"model": "tiny"}, 400, "prompt", ["required"]),
    ({"model": "tiny", "prompt": ""}, 400, "prompt", ["empty"]),
    ({"model": "tiny", "prompt": []}, 400, "prompt", ["empty"]),
    ({"model": "tiny", "prompt": "Hi " * 600}, 400, "prompt", ["512", "at most 511"]),
    ({"model": "tiny", "prompt": "Hello", "max_tokens": 600}, 400, "max_tokens", ["512", "601", "at most 511"]),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", ["max_tokens >= 1"]),
    ({"model": "tiny", "prompt": "Hi", "temperature": 3}, 400, "temperature", ["less than or equal to 2"]),
    ({"model": "tiny", "prompt": "Hi", "top_p": 0}, 400, "top_p", ["greater than 0"]),
    ({"model": "tiny", "prompt": "Hi", "top_p": 1.5}, 400, "top_p", ["less than or equal to 1"]),
    ({"model": "tiny", "prompt": "Hi", "n": 0}, 400, "n", ["greater than or equal to 1"]),
    ({"model": "tiny", "prompt": "Hi", "top_k": -5}, 400, "top_k", ["top_k >= 0"]),
    ({"model": "tiny", "prompt": "Hi", "min_p": 2}, 400, "min_p", ["0 <= min_p <= 1"]),
    ({"model": "tiny", "prompt": [10**9]}, 400, "prompt", ["outside the vocabulary", "49152"]),
    ({"model": "tiny", "prompt": "Hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", ["outside the vocabulary"]),
    ({"model": "tiny", "prompt": "Hi", "presence_penalty": 3}, 400, "presence_penalty", ["less than or equal to 2"]),
    ({"model": "tiny", "prompt": "Hi", "frequency_penalty": -2.5}, 400, "frequency_penalty", ["greater than or equal to -2"]),
    ({"model": "tiny", "prompt": "Hi", "repetition_penalty": 0}, 400, "repetition_penalty", ["0 < repetition_penalty"]),
    ({"model": "tiny", "prompt": "Hi", "logprobs": 21}, 400, "logprobs", ["max_logprobs=20"]),
    ({"model": "tiny", "prompt": "Hi", "logit_bias": {"ten": 1}}, 400, "logit_bias", ["not a token id"]),
    ({"model": "tiny", "prompt": "Hi", "logit_bias": {"99999": 1}}, 400, "logit_bias", ["outside the vocabulary"]),
    ({"model": "tiny", "prompt": "Hi", "logit_bias": {"42": 500}}, 400, "logit_bias", ["-100 <= bias <= 100"]),
    ({"model": "tiny", "prompt": "Hi", "best_of": 3, "stream": True}, 400, "best_of", ["cannot stream"]),
    ({"model": "tiny", "prompt": "Hi", "n": 3, "best_of": 2}, 400, "best_of", ["best_of must be >= n"]),
    ({"model": "tiny", "prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options", []),
    ({"model": "gpt-4", "prompt": "Hi"}, 404, "model", ["gpt-4", "does not exist", "tiny"]),
]


@pytest.mark.parametrize(("body", "status", "param", "fragments"), BAD_COMPLETIONS,
                         ids=[f"{b.get('prompt', '-')!s:.12}|{sorted(set(b) - {'model', 'prompt'})}" for b, *_ in BAD_COMPLETIONS])
def test_bad_completion_requests(http, body, status, param, fragments):
    _assert_error(http.post("/v1/completions", json=body), status, param, *fragments)
    _assert_serving(http)


BAD_CHATS = [
    ({"model": "tiny", "messages": []}, 400, "messages", []),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages.0.role", []),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content", []),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 600},
     400, "max_completion_tokens", ["512", "at most"]),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 3}, 400, "top_logprobs", ["logprobs=true"]),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 30},
     400, "top_logprobs", ["max_logprobs=20"]),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]},
     400, "tools.0", ["function"]),
    ({"model": "nope", "messages": [{"role": "user", "content": "Hi"}]}, 404, "model", ["nope"]),
]


@pytest.mark.parametrize(("body", "status", "param", "fragments"), BAD_CHATS)
def test_bad_chat_requests(http, body, status, param, fragments):
    _assert_error(http.post("/v1/chat/completions", json=body), status, param, *fragments)
    _assert_serving(http)


@pytest.mark.parametrize("raw", [b'{"model": "tiny", "prompt": "Hi"', b"not json", b'["a list"]', b""])
def test_malformed_bodies(http, raw):
    response = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    _assert_serving(http)


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"max_tokens": 4}, "prompt", "must be a string"),
    ({"prompt": "Hi", "max_tokens": -1}, "max_tokens", "max_tokens >= 1"),
    ({"prompt": "Hi", "n": 2}, "n", "use /v1/completions with n"),
    ({"prompt": "Hi", "logprobs": 2}, "logprobs", "use /v1/completions"),
    ({"prompt": "Hi", "allowed_token_ids": [10**6]}, "allowed_token_ids", "outside the vocabulary"),
    ({"prompt": "Hi", "logit_bias": [1]}, "logit_bias", "must be an object"),
    ({"prompt": "Hi", "bogus": 1}, "bogus", "unknown field"),
    ({"prompt": "Hi", "stream": "no"}, "stream", "true or false"),
    ({"prompt": "Hello", "max_tokens": 600}, "max_tokens", "at most 511"),
])
def test_bad_generate_requests(http, body, param, fragment):
    _assert_error(http.post("/generate", json=body), 400, param, fragment)
    _assert_error(http.post("/generate", content=b"{oops"), 400, None, "not valid JSON")
    assert http.post("/generate", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_api_key_is_required_on_api_routes_only(keyed_server, http):
    for headers, fragment in [({}, "no API key"), ({"Authorization": "Bearer wrong"}, "wrong")]:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/generate"),
                             ("POST", "/tokenize")]:
            response = httpx.request(method, f"{keyed_server.url}{path}", headers=headers, json={"prompt": "Hi"})
            _assert_error(response, 401, None, fragment)
    for path in ("/health", "/ping", "/load", "/metrics", "/version"):
        assert httpx.get(f"{keyed_server.url}{path}").status_code == 200
    _assert_serving(http)


def test_the_openai_client_sees_typed_errors(keyed_server):
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="Hi", temperature=9)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text is not None


# ---- one schema, types included, on every route (issue 13, item 1) --------------------------------

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
MISTYPED = [
    # (route, body, the field named). Each would have been coerced ("false" read as true, "abc" as ["abc"]).
    ("/generate", {"prompt": "Hi", "skip_special_tokens": "false"}, "skip_special_tokens"),
    ("/generate", {"prompt": "Hi", "ignore_eos": "false"}, "ignore_eos"),
    ("/generate", {"prompt": "Hi", "bad_words": "abc"}, "bad_words"),
    ("/generate", {"prompt": "Hi", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ("/generate", {"prompt": "Hi", "max_tokens": 4.0}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "skip_special_tokens": "false"}, "skip_special_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "ignore_eos": "false"}, "ignore_eos"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "echo": 0}, "echo"),
    ("/v1/chat/completions", {**CHAT, "ignore_eos": "false"}, "ignore_eos"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "true"}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "temperature": "0"}, "temperature"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": "false"}, "add_special_tokens"),
]


@pytest.mark.parametrize(("route", "body", "param"), MISTYPED, ids=[f"{r}|{p}" for r, _, p in MISTYPED])
def test_a_mistyped_field_is_a_400_and_its_neighbours_finish(keyed_server, route, body, param):
    async def run():
        async with httpx.AsyncClient(base_url=keyed_server.url, headers=AUTH, timeout=60) as client:
            neighbour = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
            neighbours = [client.post("/generate", json=neighbour) for _ in range(4)]
            return await asyncio.gather(client.post(route, json=body), *neighbours)

    bad, *neighbours = asyncio.run(run())
    _assert_error(bad, 400, param)
    assert all(r.status_code == 200 and r.json()["finish_reason"] == "length" for r in neighbours), \
        [r.text for r in neighbours]


# ---- text that is not Unicode (issue 13, item 2) --------------------------------------------------

LONE_SURROGATE = "\ud800abc"


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/completions", {"model": "tiny", "prompt": LONE_SURROGATE}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["fine", LONE_SURROGATE]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "stop": [LONE_SURROGATE]}, "stop"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": LONE_SURROGATE}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": LONE_SURROGATE}]}]}, "messages.0.content"),
    ("/generate", {"prompt": LONE_SURROGATE}, "prompt"),
    ("/tokenize", {"prompt": LONE_SURROGATE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE_SURROGATE}]}, "messages.0.content"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(http, route, body, param):
    # JSON's escape "\ud800" is how a client sends one (Python's json writes it so).
    raw = json.dumps(body).encode()
    response = http.post(route, content=raw, headers={"content-type": "application/json"})
    _assert_error(response, 400, param, "lone surrogate", "U+D800")
    _assert_serving(http)


# ---- request size (issue 13, item 5) --------------------------------------------------------------


def test_an_oversized_body_is_a_413_naming_its_size_the_limit_and_the_flag(http):
    # The server's max_model_len is 512: the limit is the 1 MiB floor.
    body = json.dumps({"model": "tiny", "prompt": "Hi " * 400_000}).encode()
    sized = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    error = _assert_error(sized, 413, None, str(len(body)), "1048576", "--max-request-body-bytes", "max_model_len=512")
    assert error["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is found while reading
        for start in range(0, len(body), 1 << 16):
            yield body[start : start + (1 << 16)]

    chunked = http.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    _assert_error(chunked, 413, None, "1048576", "--max-request-body-bytes")
    small_chunked = http.post("/generate", content=iter([b'{"prompt": "Hi",', b' "max_tokens": 2}']))
    assert small_chunked.status_code == 200, small_chunked.text
    _assert_serving(http)
