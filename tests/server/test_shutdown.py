"""Ctrl-C on a real `pagellm serve` with a stream open: the stream ends with an error event and [DONE], the
process exits 0, and its log has no traceback (issue 13, item 7)."""

from __future__ import annotations

import json
import signal

import httpx

from tests.server.conftest import TINY_SERVER_ARGS
from tests.server.utils import ServerProcess


def test_sigint_ends_open_streams_with_an_error_event_and_done(tiny_llama_dir, tmp_path):
    server = ServerProcess(tiny_llama_dir, [*TINY_SERVER_ARGS, "--shutdown-timeout", "0"], tmp_path / "server.log")
    try:
        server.wait_healthy()
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutting_down" and "--shutdown-timeout=0" in error["message"]
    log = server.log_path.read_text()
    assert "Received SIGINT" in log and "Shut down" in log
    assert "Traceback" not in log and "CancelledError" not in log, log[-5000:]
