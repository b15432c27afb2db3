"""The server's KV views (issue 14): the `kv` object beside `usage`, /kv/state, and the /kv page's files."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np

from tests.server.utils import metric_value, wait_until


def kv_state(http, blocks: bool = True) -> dict:
    response = http.get("/kv/state", params={"blocks": blocks})
    assert response.status_code == 200, response.text
    return response.json()


def idle_state(http) -> dict:
    """/kv/state once the engine published its idle picture (nothing running or waiting)."""
    wait_until(lambda: kv_state(http, False)["running"] + kv_state(http, False)["waiting"] == 0, 60, "an idle engine")
    return kv_state(http)


def test_completion_with_n4_reports_its_blocks(http):
    body = {"model": "tiny", "prompt": list(range(7000, 7040)), "n": 4, "max_tokens": 20, "temperature": 1.0,
            "seed": 3, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    # Hand-computed in tests/test_kv_accounting.py for the same shape: 40 prompt tokens, n=4, 20 tokens each.
    assert response.json()["kv"] == {"peak_blocks": 10, "shared_blocks": 3, "cow_copies": 3, "cached_tokens": 0,
                                     "preemptions": 0, "peak_waste_slots": 60}


def test_chat_and_the_last_streamed_chunk_carry_kv(http):
    messages = [{"role": "user", "content": "Tell me about paged attention."}]
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["kv"]["peak_blocks"] >= 1
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    # The same prompt again: its full blocks come from the prefix cache.
    assert chunks[-1]["usage"] is not None and chunks[-1]["kv"]["cached_tokens"] > 0
    assert all("kv" not in chunk for chunk in chunks[:-1])


def test_kv_state_needs_the_key_and_the_page_does_not(keyed_server, http):
    assert httpx.get(f"{keyed_server.url}/kv/state").status_code == 401
    page = httpx.get(f"{keyed_server.url}/kv")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/kv/kv_map.js">' in page.text and "http" not in page.text.split("<body>")[1]
    script = httpx.get(f"{keyed_server.url}/kv/kv_map.js")
    assert script.status_code == 200 and "/kv/state" in script.text


def test_kv_state_describes_every_block_and_agrees_with_metrics(http):
    http.post("/v1/completions", json={"model": "tiny", "prompt": list(range(8000, 8050)), "max_tokens": 3})
    state = idle_state(http)
    states = np.frombuffer(base64.b64decode(state["states"]), dtype=np.uint8)
    owners = np.frombuffer(base64.b64decode(state["owners"]), dtype="<i4")
    assert len(states) == len(owners) == state["num_blocks"]
    assert state["used_blocks"] + state["cached_blocks"] + state["free_blocks"] == state["num_blocks"]
    assert (state["used_blocks"], state["running"], state["waiting"]) == (0, 0, 0)
    assert int((states == 1).sum()) == state["cached_blocks"] > 0  # the prompts' full blocks stay cached
    assert (owners == -1).all() and state["owner_ids"] == {}
    metrics = http.get("/metrics").text
    assert metric_value(metrics, "vllm:kv_cache_usage_perc") == 0.0
    assert metric_value(metrics, "pagellm:kv_cache_cow_copies_total") == state["cow_copies"] >= 3
    assert metric_value(metrics, "vllm:num_preemptions_total") == state["preemptions"]
    assert metric_value(metrics, "vllm:prefix_cache_hits_total") == state["prefix_cache_hits"]
    assert "states" not in kv_state(http, blocks=False)
