"""Run `pagellm serve` in a subprocess on a free loopback port, and wait on conditions, never on the clock."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# Enough for torch's import and a model load on a busy 2-core machine; a server that needs longer is broken.
STARTUP_TIMEOUT_S = 180.0
# The key of `keyed_server` (tests/server/conftest.py), and the header that presents it.
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# uvicorn's words when the port was taken between free_port() and the server's bind, and the starts allowed.
ADDRESS_IN_USE = "address already in use"
BIND_ATTEMPTS = 3


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class ServerProcess:
    """`pagellm serve MODEL ARGS...`, its log in a file that tests show when they fail."""

    def __init__(self, model: str, args: list[str], log_path: pathlib.Path) -> None:
        self.model, self.args, self.log_path = model, args, log_path
        self._log = open(log_path, "wb")
        self._start()

    def _start(self) -> None:
        self._log.flush()
        self._log_start = self._log.tell()  # where this start's output begins in the log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", self.model, "--host", "127.0.0.1",
                   "--port", str(self.port), *self.args]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        # The port is free when chosen, but the server binds it only after loading the engine: meanwhile another
        # process's outgoing connection may take it as its ephemeral port. Then the server is started again on
        # another port (the bind is the last step of start-up, so nothing else can have failed).
        for attempt in range(BIND_ATTEMPTS):
            try:
                self._wait_healthy(timeout)
                return
            except AssertionError:
                if attempt == BIND_ATTEMPTS - 1 or self.process.poll() is None or not self._lost_its_port():
                    raise
                self._start()

    def _lost_its_port(self) -> bool:
        self._log.flush()
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            return ADDRESS_IN_USE in log.read().decode(errors="replace")

    def _wait_healthy(self, timeout: float) -> None:
        def healthy() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout, f"{self.url}/health", interval=0.2)

    def log_tail(self, max_chars: int = 20_000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-max_chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self._log.close()


def metric_value(metrics_text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The value of one sample in Prometheus text format."""
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        sample, _, label_text = head.partition("{")
        if sample != name:
            continue
        if labels and not all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            continue
        return float(value)
    raise AssertionError(f"no sample {name} {labels or ''} in the metrics:\n{metrics_text[:2000]}")


class StepFault:
    """Wraps an engine's model: the next `remaining` forward passes raise, as a failing kernel would mid-step,
    and while `gate` is cleared, forward passes wait on it (a step that takes as long as the test needs)."""

    def __init__(self, model) -> None:
        self.model = model
        self._forward = model.forward
        self.remaining = 0
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()
        model.forward = self

    def __call__(self, *args, **kwargs):
        if not self.gate.is_set():
            self.waiting.set()
            if not self.gate.wait(timeout=120):
                raise RuntimeError("StepFault.gate was never opened again")
            self.waiting.clear()
        if self.remaining > 0:
            self.remaining -= 1
            raise RuntimeError("injected fault in the model's forward pass")
        return self._forward(*args, **kwargs)
