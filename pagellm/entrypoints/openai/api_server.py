"""The HTTP server: one AsyncLLMEngine behind the OpenAI-compatible routes and the seed's /generate.

Around the routes: a bound on the number of headers (431), CORS, the API keys, a limit on request bodies (413
before a byte of an oversized body is parsed), and admission: on SIGINT/SIGTERM new requests get 503 while
running ones finish, for up to --shutdown-timeout; then open streams end with an error event and [DONE], and
the process exits cleanly. Below them, uvicorn's h11 protocol with deadlines on reading a request
(http_timeouts.py), and TLS when a certificate is given.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import signal
import ssl
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagellm
from pagellm.engine.async_llm_engine import AsyncLLMEngine
from pagellm.entrypoints import api_server, kv_map
from pagellm.entrypoints.openai import routes
from pagellm.entrypoints.openai.errors import OpenAIError, install_error_handlers
from pagellm.entrypoints.openai.http_timeouts import ReadTimeoutConfig
from pagellm.entrypoints.openai.server_load import ServerLoadTracker
from pagellm.entrypoints.openai.serving import OpenAIServing, ServerConfig
from pagellm.lora import serving as lora_serving
from pagellm.metrics import PrometheusStatLogger, StructuredOutputCacheCollector, cache_config_info, server_registry

logger = logging.getLogger(__name__)

# Probes and scrapers must reach these without the API key.
OPEN_PATHS = frozenset({"/health", "/ping", "/load", "/metrics", "/version"}) | kv_map.OPEN_PATHS
# Health probes: answered while the server drains too (with 503), so that balancers stop sending requests.
HEALTH_PATHS = frozenset({"/health", "/ping"})

# The default body limit: generous per token of context (a token is ~4 characters of text, up to 12 bytes
# once JSON escapes a non-ASCII one, 6 as an id in a list, plus a chat's framing), and never below 1 MiB.
BODY_BYTES_PER_TOKEN = 64
MIN_DEFAULT_BODY_BYTES = 1 << 20


def default_max_request_body_bytes(max_model_len: int) -> int:
    return max(MIN_DEFAULT_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def route_path(scope: Scope) -> str:
    """The path the routes match: behind --root-path a request may come with the prefix or without it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


class BodySizeLimit:
    """Answers 413 to a body over `limit` bytes: at once when Content-Length says so, else as soon as the
    chunks read exceed it. A prompt that could never fit the context is refused before it is parsed."""

    def __init__(self, app: ASGIApp, limit: int, how_derived: str) -> None:
        self.app = app
        self.limit = limit
        self.how_derived = how_derived

    def _error(self, size: str) -> OpenAIError:
        return OpenAIError(413, f"the request body has {size} bytes, more than the limit of {self.limit} bytes "
                                f"({self.how_derived}); send a smaller request, or raise --max-request-body-bytes.",
                           None, "request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._error(length.decode()).response()(scope, receive, send)
            return
        if length is not None:
            await self.app(scope, receive, send)
            return
        # A chunked body: read it here, within the limit, and hand it on whole.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left (or its body timed out): nothing to serve
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                await self._error(f"more than {size}").response()(scope, receive, send)
                return
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def receive_replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, receive_replayed, send)


class Admission:
    """Counts the API requests in flight, and refuses new ones (503) once the server drains."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.draining = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope) if scope["type"] == "http" else ""
        if scope["type"] != "http" or (path in OPEN_PATHS and path not in HEALTH_PATHS):
            await self.app(scope, receive, send)
            return
        if self.draining:
            error = OpenAIError(503, "the server is shutting down and takes no new requests; retry on another "
                                     "replica or after it restarts.", None, "server_shutting_down")
            await error.response()(scope, receive, send)
            return
        if path in HEALTH_PATHS:
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self._idle is not None:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no API request is in flight; False if some still are after `timeout` seconds."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


class ShuttingDownError(OpenAIError):
    def __init__(self, timeout: float) -> None:
        super().__init__(503, f"the server shut down before this request finished (it waited --shutdown-timeout="
                              f"{timeout:g} s for running requests); retry it.", None, "server_shutting_down")


async def drain(admission: Admission, engine: AsyncLLMEngine, timeout: float) -> None:
    """Stops admitting, lets running requests finish for up to `timeout` seconds, then ends the rest
    (their streams get an error event and [DONE]) and waits for their responses to close."""
    admission.draining = True
    logger.info("Shutting down: refusing new requests, waiting up to %g s for %d running ones",
                timeout, admission.in_flight)
    if await admission.wait_idle(timeout):
        return
    logger.warning("Ending %d requests still running after --shutdown-timeout=%g s", admission.in_flight, timeout)
    engine.fail_all_requests(ShuttingDownError(timeout))
    await admission.wait_idle(CLOSE_TIMEOUT_S)


# After the requests were ended, how long their responses may take to close.
CLOSE_TIMEOUT_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGINT/SIGTERM drains (see `drain`) before it exits; a second one
    exits at once. The signal is not raised again afterwards: the process ends with status 0, and no
    KeyboardInterrupt traceback."""

    def __init__(self, config: uvicorn.Config, admission: Admission, engine: AsyncLLMEngine,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.admission = admission
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self.admission.draining or self.should_exit:
            logger.info("Second %s: exiting now", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        logger.info("Received %s", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self.admission, self.engine, self.shutdown_timeout)
        finally:
            self.should_exit = True


class ApiKeyMiddleware:
    """Refuses requests without `Authorization: Bearer <key>`, for any one of the keys, before their body is
    even read. The scheme is case-insensitive (RFC 7235: "bearer" is as good as "Bearer"). Keys are compared
    as SHA-256 digests, each one, in constant time: neither a key's length nor which key nearly matched
    shows in the time taken.

    Plain ASGI rather than BaseHTTPMiddleware, which would sit between a streaming response and the
    client and hide disconnects from it."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        if not api_keys:
            raise ValueError("ApiKeyMiddleware needs at least one API key")
        self.app = app
        self.key_digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    def accepts(self, authorization: str) -> bool:
        scheme, _, credentials = authorization.partition(" ")
        digest = hashlib.sha256(credentials.strip(" ").encode()).digest()
        matched = False
        for key_digest in self.key_digests:
            matched |= secrets.compare_digest(digest, key_digest)
        return matched and scheme.lower() == "bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization", "")
        if self.accepts(given):
            await self.app(scope, receive, send)
            return
        reason = "no API key was sent" if not given else "the API key is wrong"
        error = OpenAIError(401, f"{reason}; send the server's --api-key as 'Authorization: Bearer <key>'.",
                            None, "invalid_api_key")
        await error.response()(scope, receive, send)


class HeaderCountLimit:
    """Answers 431 to a request with more than `limit` headers (vLLM's --h11-max-header-count)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and len(scope["headers"]) > self.limit:
            error = OpenAIError(431, f"the request has {len(scope['headers'])} headers, more than the limit of "
                                     f"{self.limit}; send fewer, or raise --h11-max-header-count.",
                                None, "request_header_fields_too_large")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """A FastAPI app serving `engine`. Its metrics live in a registry of its own, so that several apps
    in one process (tests, or two models) never collide on prometheus_client's global registry."""
    registry = server_registry()
    engine.add_stat_logger(PrometheusStatLogger(config.served_model_names[0], engine.max_model_len, registry,
                                                cache_config_info(engine.engine)))
    registry.register(StructuredOutputCacheCollector(config.served_model_names[0], engine.engine.grammar_compiler.stats))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield

    docs = dict(openapi_url=None, docs_url=None, redoc_url=None) if config.disable_fastapi_docs else {}
    app = FastAPI(title="pagellm", version=pagellm.__version__, lifespan=lifespan, **docs)
    # As vLLM sets it: FastAPI puts it in each request's scope, and Starlette's routing then matches a path with
    # or without the prefix (a proxy may strip it or not). uvicorn's own root_path would prefix every path.
    app.root_path = config.root_path or ""
    app.state.serving = OpenAIServing(engine, config)
    app.state.metrics_registry = registry
    install_error_handlers(app)
    app.include_router(routes.router)
    app.include_router(api_server.router)
    lora_serving.install(app)
    kv_map.install(app, engine)
    # Outermost last: the header count is checked first, then CORS (its preflights need no key, and its headers
    # go on the errors below too, which a browser can then read), the key, the body's size, then admission.
    app.state.server_load_metrics = 0
    if config.enable_server_load_tracking:
        app.add_middleware(ServerLoadTracker)
    app.add_middleware(Admission)
    limit = config.max_request_body_bytes
    how = "--max-request-body-bytes"
    if limit is None:
        limit = default_max_request_body_bytes(engine.max_model_len)
        how = (f"the default: {BODY_BYTES_PER_TOKEN} bytes per token of max_model_len={engine.max_model_len}, "
               f"at least {MIN_DEFAULT_BODY_BYTES}")
    app.add_middleware(BodySizeLimit, limit=limit, how_derived=how)
    if config.api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=config.api_keys)
    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
                       allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials)
    app.add_middleware(HeaderCountLimit, limit=config.h11_max_header_count)
    return app


def admission_of(app: FastAPI) -> Admission:
    """The app's Admission middleware (built when the app first starts)."""
    app.middleware_stack = app.middleware_stack or app.build_middleware_stack()
    layer = app.middleware_stack
    while not isinstance(layer, Admission):
        layer = layer.app
    return layer


def uvicorn_config(app: ASGIApp, config: ServerConfig, host: str, port: int,
                   log_level: str = "info") -> ReadTimeoutConfig:
    """uvicorn's configuration for `config`: TLS, h11's limits and the request read deadlines."""
    return ReadTimeoutConfig(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
        access_log=not config.disable_uvicorn_access_log,
        header_read_timeout=config.header_read_timeout, body_read_timeout=config.body_read_timeout,
        h11_max_incomplete_event_size=config.h11_max_incomplete_event_size,
        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile, ssl_ca_certs=config.ssl_ca_certs,
        ssl_cert_reqs=config.ssl_cert_reqs,
    )


def run_server(engine: AsyncLLMEngine, config: ServerConfig, host: str, port: int, log_level: str = "info") -> None:
    try:
        app = build_app(engine, config)
    except ValueError as exc:  # an adapter of --lora-modules that cannot load
        engine.shutdown()
        raise SystemExit(f"pagellm serve: {exc}") from None
    server_config = uvicorn_config(app, config, host, port, log_level)
    try:
        server_config.load()  # builds the TLS context: a bad certificate or key is refused before serving
    except (OSError, ssl.SSLError) as exc:
        engine.shutdown()
        raise SystemExit(f"pagellm serve: cannot use the TLS certificate {config.ssl_certfile!r} with the key "
                         f"{config.ssl_keyfile!r} (--ssl-certfile, --ssl-keyfile): {exc}") from None
    scheme = "https" if config.ssl_certfile else "http"
    logger.info("Serving %s on %s://%s:%d%s (OpenAI API under /v1)", config.served_model_names[0], scheme, host, port,
                config.root_path or "")
    server = DrainingServer(server_config, admission_of(app), engine, config.shutdown_timeout)
    try:
        server.run()
    finally:
        engine.shutdown()
    logger.info("Shut down")
