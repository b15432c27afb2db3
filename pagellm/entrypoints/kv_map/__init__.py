"""The live KV-cache map: GET /kv (a page drawing every block on a canvas) and GET /kv/state (its JSON).

The engine thread publishes a `BlockMap` after an iteration, at most every `interval_s` (and always when
the engine goes idle, so the last picture is the true one); the route only reads the latest and encodes
it once per snapshot, however many pages poll. Nothing here runs inside a step.
"""

from __future__ import annotations

import base64
import threading
import time
from importlib import resources

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse

from pagellm.core.block_map import BlockMap, take_block_map

# The page and its script carry no data: they load without the API key (which the page sends with
# its /kv/state polls); /kv/state itself is guarded like every API route.
PAGE_PATH = "/kv"
SCRIPT_PATH = "/kv/kv_map.js"
OPEN_PATHS = frozenset({PAGE_PATH, SCRIPT_PATH})
DEFAULT_INTERVAL_S = 0.2

_STATIC = resources.files(__package__) / "static"


class KVMapPublisher:
    """A stat logger (called on the engine thread after each iteration) that keeps the latest BlockMap."""

    def __init__(self, scheduler, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.scheduler = scheduler
        self.interval_s = interval_s
        self.latest: BlockMap = take_block_map(scheduler)
        self._published_at = time.monotonic()
        self._lock = threading.Lock()
        self._encoded: tuple[BlockMap, bool, bytes] | None = None

    def record(self, scheduler_stats, iteration_stats) -> None:
        now = time.monotonic()
        idle = scheduler_stats.num_running == 0 and scheduler_stats.num_waiting == 0
        if idle or now - self._published_at >= self.interval_s:
            self.latest = take_block_map(self.scheduler)
            self._published_at = now

    def state_json(self, include_blocks: bool) -> bytes:
        """The latest snapshot as /kv/state's JSON, encoded once per snapshot."""
        snapshot = self.latest
        with self._lock:
            cached = self._encoded
            if cached is not None and cached[0] is snapshot and cached[1] == include_blocks:
                return cached[2]
            body = JSONResponse(state_dict(snapshot, include_blocks)).body
            self._encoded = (snapshot, include_blocks, body)
            return body


def state_dict(snapshot: BlockMap, include_blocks: bool = True) -> dict:
    """/kv/state's fields (documented in the README)."""
    kv = snapshot.kv_cache
    cached = snapshot.num_cached_free_blocks
    state = {
        "taken_at": snapshot.taken_at,
        "snapshot_ms": round(snapshot.build_seconds * 1e3, 3),
        "block_size": kv.block_size,
        "num_blocks": kv.num_blocks,
        "used_blocks": kv.num_used_blocks,
        "cached_blocks": cached,
        "free_blocks": kv.num_free_blocks - cached,
        "shared_blocks": kv.num_shared_blocks,
        "stored_tokens": kv.num_stored_tokens,
        "waste_slots": kv.num_used_blocks * kv.block_size - kv.num_stored_tokens,
        "waste": kv.waste,
        "cow_copies": kv.num_cow_copies,
        "prefix_cache_hits": kv.prefix_cache_hits,
        "prefix_cache_queries": kv.prefix_cache_queries,
        "preemptions": snapshot.num_preemptions,
        "running": snapshot.num_running,
        "waiting": snapshot.num_waiting,
    }
    if include_blocks:
        state["states"] = base64.b64encode(snapshot.states.tobytes()).decode()
        state["owners"] = base64.b64encode(snapshot.owners.astype("<i4").tobytes()).decode()
        state["owner_ids"] = {str(serial): label for serial, label in snapshot.owner_ids.items()}
    return state


router = APIRouter()


@router.get(PAGE_PATH)
async def kv_page() -> HTMLResponse:
    return HTMLResponse((_STATIC / "kv.html").read_text(encoding="utf-8"))


@router.get(SCRIPT_PATH)
async def kv_script() -> Response:
    return Response((_STATIC / "kv_map.js").read_text(encoding="utf-8"), media_type="text/javascript")


@router.get("/kv/state")
async def kv_state(raw_request: Request, blocks: bool = True) -> Response:
    publisher: KVMapPublisher = raw_request.app.state.kv_map
    return Response(publisher.state_json(blocks), media_type="application/json",
                    headers={"Cache-Control": "no-store"})


def install(app: FastAPI, engine) -> KVMapPublisher:
    """Adds the /kv routes to `app`, fed by `engine`'s thread (an AsyncLLMEngine)."""
    publisher = KVMapPublisher(engine.engine.core.scheduler)
    engine.add_stat_logger(publisher)
    app.state.kv_map = publisher
    app.include_router(router)
    return publisher
