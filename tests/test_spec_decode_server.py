"""`pagellm serve --speculative-config`: completions unchanged, vLLM's spec-decode counters in /metrics."""

from __future__ import annotations

import json

import httpx

from tests.server.conftest import TINY_SERVER_ARGS
from tests.server.utils import ServerProcess, metric_value


def test_server_speculates_and_exports_the_counters(tiny_llama_dir, tmp_path):
    config = {"method": "suffix", "num_speculative_tokens": 4}
    server = ServerProcess(tiny_llama_dir, [*TINY_SERVER_ARGS, "--speculative-config", json.dumps(config)],
                           tmp_path / "server.log")
    try:
        server.wait_healthy()
        body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}
        texts = []
        for _ in range(2):  # the second is drafted from the first's output, kept in the global suffix trie
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
        assert texts[0] == texts[1]
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        drafts = metric_value(metrics, "vllm:spec_decode_num_drafts_total")
        accepted = metric_value(metrics, "vllm:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 < accepted <= metric_value(metrics, "vllm:spec_decode_num_draft_tokens_total")
        assert metric_value(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"}) > 0
    finally:
        server.stop()
