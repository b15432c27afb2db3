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


def test_throughput_benchmark_runs_tp2_and_profiles_all_reduce(tiny_4kv_dir, capsys):
    import json

    from benchmarks import throughput

    throughput.main(["--model", tiny_4kv_dir, "--dtype", "float32", "--num-prompts", "3", "--input-len", "8",
                     "--output-len", "4", "--tensor-parallel-size", "2"])
    out = capsys.readouterr().out
    (line,) = [json.loads(text) for text in out.splitlines() if text.startswith("{")]
    assert line["tensor_parallel_size"] == 2 and line["num_output_tokens"] > 0
    # 3 layers x 2 row-parallel layers per forward, one forward per step.
    assert line["num_all_reduces"] > 0 and line["num_all_reduces"] % 6 == 0
    assert 0 < line["all_reduce_s"] < line["step_s"]
    assert "all-reduce" in out
