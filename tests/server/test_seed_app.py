"""The seed's FastAPI example (shared/seeds/000_*.txt, second code block) runs on pagellm with only its import
changed: the engine is built at import time, outside any event loop, and starts on the first request."""

from __future__ import annotations

import asyncio
import pathlib

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.server.utils import REPO_ROOT

SNIPPET = pathlib.Path(__file__).with_name("seed_fastapi_app.py.txt")
SEED = REPO_ROOT.parent / "shared" / "seeds" / "000_a05cba6d37c4854e.txt"


def _seed_block() -> str:
    text = SEED.read_text()
    start = text.index("from fastapi import FastAPI")
    end = text.index('return {"text": final_output.outputs[0].text}', start)
    return text[start:end] + 'return {"text": final_output.outputs[0].text}\n'


@pytest.mark.skipif(not SEED.exists(), reason=f"the seed file {SEED} is not in this checkout")
def test_snippet_is_the_seed_with_only_the_import_changed():
    assert SNIPPET.read_text() == _seed_block().replace("from vllm.", "from pagellm.")


@pytest.fixture(scope="module")
def seed_module(tiny_llama_dir):
    """Runs the snippet as a module, with the 8B model swapped for the tiny one and a small KV pool."""
    source = SNIPPET.read_text()
    model_line = 'model="meta-llama/Llama-3-8B",'
    assert source.count(model_line) == 1
    source = source.replace(model_line, f"model={tiny_llama_dir!r}, kv_cache_memory_bytes=16 << 20,")
    namespace: dict = {"__name__": "seed_fastapi_app"}
    exec(compile(source, str(SNIPPET), "exec"), namespace)
    yield namespace
    namespace["engine"].shutdown()


def test_the_seed_app_answers_generate(seed_module):
    engine = seed_module["engine"]
    assert not engine.is_running  # built at import time; no loop existed to start it
    with TestClient(seed_module["app"]) as client:
        response = client.post("/generate", params={"prompt": "The capital of France is"})
    assert response.status_code == 200
    assert isinstance(response.json()["text"], str) and response.json()["text"]
    assert engine.is_running and engine.get_stats().kv_cache.num_used_blocks == 0


def test_the_seed_app_serves_concurrent_requests(seed_module):
    async def run():
        transport = httpx.ASGITransport(app=seed_module["app"])
        async with httpx.AsyncClient(transport=transport, base_url="http://seed.test", timeout=120) as client:
            return await asyncio.gather(*(client.post("/generate", params={"prompt": f"Story number {i}:"})
                                          for i in range(3)))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 3
    assert all(r.json()["text"] for r in responses)
    assert seed_module["engine"].get_stats().kv_cache.num_used_blocks == 0
