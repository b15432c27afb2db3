"""The HTTP server: one AsyncLLMEngine behind the OpenAI-compatible routes and the seed's /generate."""

from __future__ import annotations

import logging
import secrets
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Receive, Scope, Send

import pagellm
from pagellm.engine.async_llm_engine import AsyncLLMEngine
from pagellm.entrypoints import api_server
from pagellm.entrypoints.openai import routes
from pagellm.entrypoints.openai.errors import OpenAIError, install_error_handlers
from pagellm.entrypoints.openai.serving import OpenAIServing, ServerConfig
from pagellm.metrics import PrometheusStatLogger

logger = logging.getLogger(__name__)

# Probes and scrapers must reach these without the API key.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class ApiKeyMiddleware:
    """Refuses requests without `Authorization: Bearer <key>` before their body is even read.

    Plain ASGI rather than BaseHTTPMiddleware, which would sit between a streaming response and the
    client and hide disconnects from it."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if secrets.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        reason = "no API key was sent" if not given else "the API key is wrong"
        error = OpenAIError(401, f"{reason}; send the server's --api-key as 'Authorization: Bearer <key>'.",
                            None, "invalid_api_key")
        await error.response()(scope, receive, send)


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """A FastAPI app serving `engine`. Its metrics live in a registry of its own, so that several apps
    in one process (tests, or two models) never collide on prometheus_client's global registry."""
    registry = CollectorRegistry()
    engine.add_stat_logger(PrometheusStatLogger(config.served_model_names[0], registry))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield

    app = FastAPI(title="pagellm", version=pagellm.__version__, lifespan=lifespan)
    app.state.serving = OpenAIServing(engine, config)
    app.state.metrics_registry = registry
    install_error_handlers(app)
    app.include_router(routes.router)
    app.include_router(api_server.router)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app


def run_server(engine: AsyncLLMEngine, config: ServerConfig, host: str, port: int, log_level: str = "info") -> None:
    app = build_app(engine, config)
    logger.info("Serving %s on http://%s:%d (OpenAI API under /v1)", config.served_model_names[0], host, port)
    try:
        # A short grace on shutdown: an open stream would otherwise hold the process up to its last token.
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
