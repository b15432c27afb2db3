"""vLLM's server-load figure, read at GET /load: how many generating requests are in flight.

As vLLM counts it (`--enable-server-load-tracking`): a request to a generating route counts from its arrival
until its response has been sent to the end (a stream until its last event) or the client went away."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

# The routes whose requests occupy the engine; /render, /tokenize and the probes are not counted, as in vLLM.
TRACKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
_RESPONSES_PREFIX = "/v1/responses/"
_UNTRACKED = frozenset({"/v1/responses/render"})


def is_tracked(path: str) -> bool:
    """The generating routes, and GET /v1/responses/{id} and its /cancel, which vLLM counts too."""
    return path in TRACKED_PATHS or (path.startswith(_RESPONSES_PREFIX) and path not in _UNTRACKED)


class ServerLoadTracker:
    """Keeps `app.state.server_load_metrics` (vLLM's name) at the number of tracked requests in flight."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_tracked(scope["path"]):
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        state.server_load_metrics += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.server_load_metrics -= 1
