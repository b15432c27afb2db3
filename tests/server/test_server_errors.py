"""Bad input gets an OpenAI-style error with the right status, and the server goes on serving."""

from __future__ import annotations

import httpx
import openai
import pytest

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--api-key", API_KEY)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


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
    ({"model": "tiny", "prompt": "Hi", "max_token": 5}, 400, "max_token", ["unknown field"]),
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
    ({"model": "tiny", "prompt": "Hi", "logprobs": 21}, 400, "logprobs", ["less than or equal to 20"]),
    ({"model": "tiny", "prompt": "Hi", "logprobs": 1, "echo": True}, 400, "echo", ["drop echo or logprobs"]),
    ({"model": "tiny", "prompt": "Hi", "logit_bias": {"ten": 1}}, 400, "logit_bias", ["not a token id"]),
    ({"model": "tiny", "prompt": "Hi", "logit_bias": {"99999": 1}}, 400, "logit_bias", ["outside the vocabulary"]),
    ({"model": "tiny", "prompt": "Hi", "logit_bias": {"42": 500}}, 400, "logit_bias", ["-100 <= bias <= 100"]),
    ({"model": "tiny", "prompt": "Hi", "best_of": 3}, 400, "best_of", ["not supported yet"]),
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
     400, "top_logprobs", ["less than or equal to 20"]),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]},
     400, "tools", ["not supported yet"]),
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


def test_api_key_is_required_on_api_routes_only(server, http):
    for headers, fragment in [({}, "no API key"), ({"Authorization": "Bearer wrong"}, "wrong")]:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/generate"),
                             ("POST", "/tokenize")]:
            response = httpx.request(method, f"{server.url}{path}", headers=headers, json={"prompt": "Hi"})
            _assert_error(response, 401, None, fragment)
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{server.url}{path}").status_code == 200
    _assert_serving(http)


def test_the_openai_client_sees_typed_errors(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="Hi", temperature=9)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text is not None
