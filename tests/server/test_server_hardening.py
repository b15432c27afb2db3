"""The HTTP server's own hardening (issues 23 and 27): API keys (any case of the Bearer scheme, several keys),
deadlines on reading a request (a client trickling its headers or body is cut; a slow stream is not), h11's
limits, TLS, CORS, --root-path and the docs switch.

The read deadlines are tested on a real socket against uvicorn running the server's protocol in a thread, with
a small ASGI app whose timing the test controls; the rest against pagellm's own app on the tiny model."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import select
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from pagellm.engine.arg_utils import AsyncEngineArgs
from pagellm.engine.async_llm_engine import AsyncLLMEngine
from pagellm.entrypoints.openai.api_server import ApiKeyMiddleware, build_app, uvicorn_config
from pagellm.entrypoints.openai.serving import ServerConfig
from tests.server.utils import wait_until

# Long enough that a loaded machine does not trip them by accident, short enough for a quick test.
SHORT_TIMEOUT_S = 1.0
# How long a trickling client keeps on before the test calls the server's deadline missing.
GIVE_UP_S = 60.0


def _config(**fields) -> ServerConfig:
    return ServerConfig(["tiny"], "tiny", **fields)


# ---- a server on a real socket -----------------------------------------------------------------------


@contextmanager
def serving(app, config: ServerConfig) -> Iterator[int]:
    """uvicorn as `pagellm serve` configures it (protocol, deadlines, h11 limits, TLS), in a thread, on a
    loopback socket bound here (no race for the port); yields the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, config, "127.0.0.1", port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 60, "uvicorn to start")
        assert server.started, "uvicorn exited at start-up"
        yield port
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


async def timing_app(scope, receive, send) -> None:
    """POST /echo answers the body's length once it has all arrived; GET /stream?chunks=N&gap=S streams N
    chunks S seconds apart (a slow, steady response)."""
    if scope["type"] == "lifespan":
        for phase in ("startup", "shutdown"):
            await receive()
            await send({"type": f"lifespan.{phase}.complete"})
        return
    if scope["path"] == "/stream":
        query = dict(part.split("=") for part in scope["query_string"].decode().split("&"))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for index in range(int(query["chunks"])):
            await asyncio.sleep(float(query["gap"]))  # the response's own pace is what is under test
            await send({"type": "http.response.body", "body": b"chunk %d\n" % index, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"received": size}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def _read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # the server closed with our unread bytes: what it sent before still counts
            return received
        if not chunk:
            return received
        received += chunk


def trickle(port: int, head: bytes, drip: bytes, interval: float = 0.05) -> tuple[bytes, float]:
    """Sends `head`, then `drip` one byte every `interval` seconds, for as long as the server listens; returns
    what the server answered when it closed the connection, and the seconds from connecting to then."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=GIVE_UP_S) as sock:
        sock.sendall(head)
        position = 0
        while time.monotonic() - started < GIVE_UP_S:
            readable, _, _ = select.select([sock], [], [], interval)
            if readable:
                return _read_until_closed(sock), time.monotonic() - started
            try:
                sock.send(drip[position % len(drip):][:1])
            except (BrokenPipeError, ConnectionResetError):
                return _read_until_closed(sock), time.monotonic() - started
            position += 1
    raise AssertionError(f"the server still read the trickle after {GIVE_UP_S:.0f} s")


def _status_and_body(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


@pytest.fixture(scope="module")
def timed_server() -> Iterator[int]:
    with serving(timing_app, _config(header_read_timeout=SHORT_TIMEOUT_S, body_read_timeout=SHORT_TIMEOUT_S)) as port:
        yield port


def test_headers_trickled_are_cut_at_the_header_deadline(timed_server):
    response, elapsed = trickle(timed_server, b"POST /echo HTTP/1.1\r\nhost: x\r\n", b"x-slow: " + b"a" * 64)
    status, body = _status_and_body(response)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert "header_read_timeout" in body["error"]["message"]
    assert b"connection: close" in response.lower()
    assert elapsed >= SHORT_TIMEOUT_S * 0.9  # the deadline, not earlier (the trickle never stopped)


def test_a_connection_that_sends_nothing_is_closed_quietly(timed_server):
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", timed_server), timeout=GIVE_UP_S) as sock:
        assert _read_until_closed(sock) == b""  # uvicorn alone would hold it open for as long as the client likes
    assert time.monotonic() - started >= SHORT_TIMEOUT_S * 0.9


def test_a_body_trickled_is_cut_at_the_body_deadline(timed_server):
    head = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n"
    response, elapsed = trickle(timed_server, head, b"a")
    status, body = _status_and_body(response)
    assert status == 408 and "body_read_timeout" in body["error"]["message"]
    assert elapsed >= SHORT_TIMEOUT_S * 0.9


def test_a_chunked_body_trickled_is_cut_too(timed_server):
    head = b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    response, _ = trickle(timed_server, head, b"1\r\na\r\n")
    assert _status_and_body(response)[0] == 408


def test_a_slow_steady_stream_is_not_cut_and_the_connection_serves_again(timed_server):
    # Eight chunks 0.25 s apart: the response lasts twice the deadlines, which bound reading requests only.
    connection = http.client.HTTPConnection("127.0.0.1", timed_server, timeout=GIVE_UP_S)
    connection.request("GET", "/stream?chunks=8&gap=0.25")
    first = connection.getresponse()
    assert first.status == 200
    assert first.read().decode().splitlines() == [f"chunk {index}" for index in range(8)]
    sock = connection.sock
    connection.request("POST", "/echo", body=b"x" * 5000, headers={"content-type": "application/octet-stream"})
    second = connection.getresponse()
    assert (second.status, json.loads(second.read())) == (200, {"received": 5000})
    assert connection.sock is sock  # the same keep-alive connection
    connection.close()


def test_h11_limits_refuse_a_huge_head():
    with serving(timing_app, _config(h11_max_incomplete_event_size=1024)) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=GIVE_UP_S) as sock:
            # h11 measures a head while it is incomplete: this one never ends, and is refused past 1 KiB.
            sock.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 4096)
            assert _read_until_closed(sock).startswith(b"HTTP/1.1 400 ")


# ---- pagellm's app: keys, CORS, root path, header count, docs, TLS --------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=512))
    yield engine
    engine.shutdown()


def _requests(app, *requests: tuple[str, str, dict]) -> list[httpx.Response]:
    """(method, path, httpx keyword arguments) each, in-process against `app`."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagellm.test",
                                     timeout=60) as client:
            return [await client.request(method, path, **kwargs) for method, path, kwargs in requests]

    return asyncio.run(run())


def test_any_of_several_keys_passes_with_the_scheme_in_any_case(engine, tiny_llama_dir):
    app = build_app(engine, ServerConfig(["tiny"], tiny_llama_dir, api_key=["key-one", "key-two"]))
    accepted = ["Bearer key-one", "bearer key-two", "BEARER key-one", "Bearer  key-two"]
    refused = ["", "Bearer", "Bearer key-three", "Bearer key-one key-two", "Basic key-one", "key-one",
               "Bearerkey-one", "Bearer key-on"]
    responses = _requests(app, *[("GET", "/v1/models", {"headers": {"Authorization": value}})
                                 for value in accepted + refused])
    assert [response.status_code for response in responses] == [200] * len(accepted) + [401] * len(refused)
    assert responses[-1].json()["error"]["code"] == "invalid_api_key"


def test_keys_come_from_the_environment_when_no_flag_names_one(monkeypatch):
    monkeypatch.delenv("PAGELLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _config().api_keys == []
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert _config().api_keys == ["from-vllm"]
    monkeypatch.setenv("PAGELLM_API_KEY", "from-pagellm")
    assert _config().api_keys == ["from-pagellm"]
    assert _config(api_key=["a", "b"]).api_keys == ["a", "b"]
    with pytest.raises(ValueError, match="list of keys"):
        _config(api_key="secret")  # not six one-letter keys


def test_the_key_check_is_the_same_for_every_key_and_needs_one():
    middleware = ApiKeyMiddleware(None, ["short", "a-much-longer-key"])
    assert middleware.accepts("Bearer short") and middleware.accepts("bearer a-much-longer-key")
    assert not middleware.accepts("Bearer shor") and not middleware.accepts("Bearer ")
    with pytest.raises(ValueError):
        ApiKeyMiddleware(None, [])


def test_cors_answers_preflights_for_the_allowed_origins_only(engine, tiny_llama_dir):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    app = build_app(engine, ServerConfig(["tiny"], tiny_llama_dir, api_key=["k"],
                                         allowed_origins=["https://ui.example"]))
    allowed, other, keyless, keyed = _requests(
        app,
        ("OPTIONS", "/v1/completions", {"headers": {"Origin": "https://ui.example", **preflight}}),
        ("OPTIONS", "/v1/completions", {"headers": {"Origin": "https://evil.example", **preflight}}),
        ("GET", "/v1/models", {"headers": {"Origin": "https://ui.example"}}),
        ("GET", "/v1/models", {"headers": {"Origin": "https://ui.example", "Authorization": "Bearer k"}}),
    )
    assert allowed.status_code == 200  # a preflight needs no key
    assert allowed.headers["access-control-allow-origin"] == "https://ui.example"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # The 401 carries the CORS headers too, so that the page can read why it was refused.
    assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == "https://ui.example"
    assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == "https://ui.example"
    # vLLM's default: no cross-origin access.
    (default,) = _requests(build_app(engine, ServerConfig(["tiny"], tiny_llama_dir)),
                           ("OPTIONS", "/v1/models", {"headers": {"Origin": "https://ui.example", **preflight}}))
    assert "access-control-allow-origin" not in default.headers


def test_root_path_serves_with_and_without_the_prefix(engine, tiny_llama_dir):
    app = build_app(engine, ServerConfig(["tiny"], tiny_llama_dir, api_key=["k"], root_path="/llm"))
    key = {"headers": {"Authorization": "Bearer k"}}
    prefixed, plain, health, keyless, openapi = _requests(
        app, ("GET", "/llm/v1/models", key), ("GET", "/v1/models", key), ("GET", "/llm/health", {}),
        ("GET", "/llm/v1/models", {}), ("GET", "/llm/openapi.json", key))
    assert prefixed.status_code == plain.status_code == 200
    assert prefixed.json()["data"][0]["id"] == "tiny"
    assert health.status_code == 200 and keyless.status_code == 401  # open paths stay open under the prefix
    assert openapi.json()["servers"] == [{"url": "/llm"}]
    for bad in ("llm", "/llm/"):
        with pytest.raises(ValueError, match="root_path"):
            _config(root_path=bad)


def test_too_many_headers_is_431_and_docs_can_be_switched_off(engine, tiny_llama_dir):
    app = build_app(engine, ServerConfig(["tiny"], tiny_llama_dir, h11_max_header_count=20,
                                         disable_fastapi_docs=True))
    many = {f"x-header-{index}": "1" for index in range(30)}
    crowded, docs, openapi, models = _requests(app, ("GET", "/v1/models", {"headers": many}),
                                               ("GET", "/docs", {}), ("GET", "/openapi.json", {}),
                                               ("GET", "/v1/models", {}))
    assert crowded.status_code == 431 and "--h11-max-header-count" in crowded.json()["error"]["message"]
    assert docs.status_code == openapi.status_code == 404 and models.status_code == 200
    (default_docs,) = _requests(build_app(engine, ServerConfig(["tiny"], tiny_llama_dir)), ("GET", "/docs", {}))
    assert default_docs.status_code == 200


def test_a_request_cannot_bring_its_own_chat_template(engine, tiny_llama_dir):
    # A template is code: nested loops of the sandbox's largest range render for hours on the tokenizer thread.
    hours = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    refused, tokenize, allowed = _requests(
        build_app(engine, ServerConfig(["tiny"], tiny_llama_dir)),
        ("POST", "/v1/chat/completions", {"json": {**chat, "chat_template_kwargs": {"chat_template": hours}}}),
        ("POST", "/v1/chat/completions", {"json": {**chat, "chat_template_kwargs": {"tokenize": True}}}),
        ("POST", "/v1/chat/completions", {"json": {**chat, "chat_template_kwargs": {"enable_thinking": False}}}))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs.chat_template"
    assert tokenize.status_code == 400 and tokenize.json()["error"]["param"] == "chat_template_kwargs.tokenize"
    assert allowed.status_code == 200


def test_json_nested_too_deeply_is_a_400_on_every_route(engine, tiny_llama_dir):
    deep = b"[" * 100_000 + b"]" * 100_000
    responses = _requests(build_app(engine, ServerConfig(["tiny"], tiny_llama_dir)),
                          *[("POST", path, {"content": deep, "headers": {"content-type": "application/json"}})
                            for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize")])
    assert [response.status_code for response in responses] == [400] * 4


def _self_signed_certificate(directory) -> tuple[str, str]:
    key, cert = str(directory / "key.pem"), str(directory / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return key, cert


def test_tls_serves_https_with_the_given_certificate(engine, tiny_llama_dir, tmp_path):
    key, cert = _self_signed_certificate(tmp_path)
    config = ServerConfig(["tiny"], tiny_llama_dir, ssl_keyfile=key, ssl_certfile=cert)
    with serving(build_app(engine, config), config) as port:
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=ssl.create_default_context(cafile=cert),
                          timeout=60) as client:
            assert client.get("/health").status_code == 200
            completion = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3})
            assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        with pytest.raises(httpx.ConnectError):  # a client that checks certificates does not trust this one
            httpx.get(f"https://127.0.0.1:{port}/health", timeout=10)


class ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def errors_logged() -> Iterator[list[str]]:
    """The ERROR records of pagellm and uvicorn (whose loggers do not reach the root's) while in the block."""
    handler = ErrorRecords()
    loggers = [logging.getLogger(name) for name in ("pagellm", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def test_pagellm_routes_answer_408_to_a_trickled_body_and_serve_on(engine, tiny_llama_dir):
    config = ServerConfig(["tiny"], tiny_llama_dir, header_read_timeout=SHORT_TIMEOUT_S,
                          body_read_timeout=SHORT_TIMEOUT_S)
    with errors_logged() as errors, serving(build_app(engine, config), config) as port:
        for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            head = (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    "content-length: 1000\r\n\r\n").encode()
            response, _ = trickle(port, head, b'{"model": "tiny", "prompt": "' + b"a" * 900)
            assert _status_and_body(response)[0] == 408, path
        chunked = b"POST /generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        assert _status_and_body(trickle(port, chunked, b"1\r\na\r\n")[0])[0] == 408
        completion = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                json={"model": "tiny", "prompt": "Hello", "max_tokens": 3})
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3
    # A client cut short is no server error: no traceback in the log.
    assert errors == []


def test_tls_settings_are_checked_before_serving(tmp_path):
    key, cert = _self_signed_certificate(tmp_path)
    with pytest.raises(ValueError, match="ssl_certfile"):
        _config(ssl_keyfile=key)
    with pytest.raises(ValueError, match="is not a file"):
        _config(ssl_certfile=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="ssl_ca_certs"):
        _config(ssl_certfile=cert, ssl_keyfile=key, ssl_cert_reqs=2)
    with pytest.raises(ValueError, match="header_read_timeout"):
        _config(header_read_timeout=0)
