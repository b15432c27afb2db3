"""`pagellm serve -tp 2`: serves over HTTP, and Ctrl-C (SIGINT) stops it with its worker, leaving nothing."""

from __future__ import annotations

import signal

import httpx

from tests.distributed.conftest import children_of, is_running, shared_memory_entries
from tests.server.utils import ServerProcess, wait_until


def test_serve_tp2_answers_and_ctrl_c_leaves_no_process(tiny_4kv_dir, tmp_path):
    shm_before = shared_memory_entries()
    server = ServerProcess(tiny_4kv_dir, ["-tp", "2", "--dtype", "float32", "--kv-cache-memory-bytes", "16MiB",
                                          "--max-model-len", "256"], tmp_path / "server.log")
    try:
        server.wait_healthy()
        workers = children_of(server.process.pid)
        assert len(workers) == 1, server.log_tail()
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": tiny_4kv_dir, "prompt": "Hello", "max_tokens": 5, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 5
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(60) == 0, server.log_tail()
        wait_until(lambda: not is_running(workers[0]), 10, "the worker to exit")
        assert "pinned to cores" in server.log_tail()
        assert shared_memory_entries() <= shm_before
    finally:
        server.stop()
