"""The /kv page in real headless Chromium: it follows a run and ends up agreeing with /kv/state and /metrics.

Needs Debian's `chromium` (apt-get install -y chromium, or `make browser`) and Playwright (the test extra);
Playwright drives the system browser, so `playwright install` (a download) is never needed. Set
PAGELLM_KV_SCREENSHOT=path to keep the screenshot taken mid-run (docs/kv_map.png is made that way).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import threading

import httpx
import numpy as np
import pytest

from tests.server.utils import metric_value, wait_until

CHROMIUM = os.environ.get("PAGELLM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no Chromium binary (install Debian's `chromium` package, e.g. with `make browser`, or set "
                "PAGELLM_CHROMIUM to one)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install '.[test]')")

API_KEY = "browser-secret"
COUNTS = ("used_blocks", "cached_blocks", "free_blocks", "shared_blocks", "cow_copies", "preemptions", "running",
          "waiting")
# 64 shared prompt tokens (four full blocks), then a few of each prompt's own; four samples each.
SHARED_PREFIX = list(range(9000, 9064))


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--api-key", API_KEY)


@pytest.fixture(scope="module")
def page(server):
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1000, "height": 560})
        yield page
        browser.close()


def page_counts(page) -> dict[str, int]:
    return {name: int(re.sub(r"\D", "", page.inner_text(f"#{name}")) or -1) for name in COUNTS}


def run_shared_prefix_requests(server, num_prompts: int, max_tokens: int) -> list[httpx.Response]:
    """Prompts sharing a prefix, n=4 each, all at once (each in its own thread)."""
    responses: list[httpx.Response] = []

    def send(index: int) -> None:
        body = {"model": "tiny", "prompt": SHARED_PREFIX + [500 + index] * (3 + index), "n": 4,
                "max_tokens": max_tokens, "temperature": 1.0, "seed": index, "ignore_eos": True}
        responses.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=300,
                                    headers={"Authorization": f"Bearer {API_KEY}"}))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(num_prompts)]
    for thread in threads:
        thread.start()
    return responses, threads


def test_the_page_follows_a_run_and_agrees_with_the_server(server, page, tmp_path):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    page.goto(f"{server.url}/kv#key={API_KEY}")
    page.wait_for_function("window.kvMap && window.kvMap.draws > 0", timeout=30_000)
    assert page_counts(page)["used_blocks"] == 0
    # A first, short request leaves its prompt's blocks in the prefix cache (free, cached).
    warm_up = {"model": "tiny", "prompt": list(range(9500, 9600)), "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/completions", json=warm_up, headers=auth, timeout=120).status_code == 200

    responses, threads = run_shared_prefix_requests(server, num_prompts=6, max_tokens=200)
    seen_used = []
    screenshot = tmp_path / "kv_map.png"

    def busy() -> bool:
        seen_used.append(page_counts(page)["used_blocks"])
        return seen_used[-1] >= 200 or not any(t.is_alive() for t in threads)

    wait_until(busy, 120, "the page to show the run's blocks", interval=0.05)
    # Hovering a block in use names its state and its owner.
    box = page.locator("#canvas").bounding_box()
    used, x, y = page.evaluate("""() => {
        const {states, layout} = window.kvMap, dpr = window.devicePixelRatio || 1;
        const i = states.findIndex((s) => s >= 2);
        return [i, ((i % layout.cols) + 0.5) * layout.cell / dpr, (Math.floor(i / layout.cols) + 0.5) * layout.cell / dpr];
    }""")
    page.mouse.move(box["x"] + x, box["y"] + y)
    tip = page.inner_text("#tip")
    page.screenshot(path=str(screenshot))
    if os.environ.get("PAGELLM_KV_SCREENSHOT"):
        shutil.copy(screenshot, os.environ["PAGELLM_KV_SCREENSHOT"])
    for thread in threads:
        thread.join(timeout=300)
    assert [r.status_code for r in responses] == [200] * 6
    assert max(seen_used) >= 200, f"the page never showed the run's blocks in use: {seen_used[-20:]}"
    assert re.fullmatch(rf"block {used}: (used by one sequence|shared by \d+ sequences) · cmpl-[0-9a-f]+-\d+", tip), tip

    # Idle again: the page settles on the engine's last picture, which /kv/state and /metrics also show.
    state = httpx.get(f"{server.url}/kv/state", headers=auth, params={"blocks": False}).json()
    wait_until(lambda: page.evaluate("window.kvMap.state.taken_at") == state["taken_at"] and state["running"] == 0,
               30, "the page to show the idle snapshot")
    assert page_counts(page) == {name: state[name] for name in COUNTS}
    assert state["cached_blocks"] > 0 and state["cow_copies"] > 0
    metrics = httpx.get(f"{server.url}/metrics").text
    assert metric_value(metrics, "vllm:kv_cache_usage_perc") * state["num_blocks"] == state["used_blocks"]
    assert metric_value(metrics, "pagellm:kv_cache_cow_copies_total") == state["cow_copies"]
    assert metric_value(metrics, "vllm:num_preemptions_total") == state["preemptions"]
    assert metric_value(metrics, "vllm:num_requests_running") == state["running"]
    # The first cell is drawn in its block's colour: cached (blue) or free (grey), never a used colour.
    rgb = page.evaluate("Array.from(document.getElementById('canvas').getContext('2d').getImageData(1, 1, 1, 1).data)")
    first = page.evaluate("window.kvMap.states[0]")
    assert rgb[:3] == ([150, 196, 230] if first == 1 else [228, 228, 228])
    assert screenshot.stat().st_size > 0


@pytest.mark.parametrize("num_blocks", [100_000, 1_000_000])
def test_large_pools_draw_fast_and_aggregate_below_a_pixel(server, page, num_blocks):
    """A synthetic /kv/state (the route intercepted in the browser) for pools the tiny server cannot have."""
    states = np.zeros(num_blocks, dtype=np.uint8)
    states[: num_blocks // 2] = 2  # the first half in use, a quarter of it shared by 4
    states[: num_blocks // 8] = 5
    owners = np.where(states > 0, 7, -1).astype("<i4")
    state = {"taken_at": 1.0, "snapshot_ms": 0.1, "block_size": 16, "num_blocks": num_blocks,
             "used_blocks": num_blocks // 2, "cached_blocks": 0, "free_blocks": num_blocks - num_blocks // 2,
             "shared_blocks": num_blocks // 8, "stored_tokens": 0, "waste_slots": 0, "waste": 0.0, "cow_copies": 0,
             "prefix_cache_hits": 0, "prefix_cache_queries": 0, "preemptions": 0, "running": 1, "waiting": 0,
             "states": base64.b64encode(states.tobytes()).decode(),
             "owners": base64.b64encode(owners.tobytes()).decode(), "owner_ids": {"7": "cmpl-big"}}
    body = json.dumps(state)
    page.route("**/kv/state*", lambda route: route.fulfill(status=200, content_type="application/json", body=body))
    try:
        page.goto(f"{server.url}/kv")
        page.wait_for_function("window.kvMap && window.kvMap.draws > 0", timeout=30_000)
        layout = page.evaluate("window.kvMap.layout")
        width = page.evaluate("document.getElementById('canvas').width")
        height = page.evaluate("document.getElementById('canvas').height")
        # Every block is drawn: one cell each while they fit the canvas, else runs of blocks per pixel.
        assert layout["cols"] * layout["rows"] * layout["perCell"] >= num_blocks
        assert layout["rows"] * layout["cell"] <= height and layout["cols"] * layout["cell"] <= width
        assert (layout["perCell"] > 1) == (num_blocks > width * height)
        assert page.evaluate("window.kvMap.drawMs") < 1000
        assert page.inner_text("#used_blocks") == f"{num_blocks // 2:,}"
        box = page.locator("#canvas").bounding_box()
        page.mouse.move(box["x"] + 1, box["y"] + 1)
        assert "cmpl-big" in page.inner_text("#tip")
    finally:
        page.unroute("**/kv/state*")
