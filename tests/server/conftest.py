"""Server fixtures: a real `pagellm serve` on the tiny model, its log attached to every failing test."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.utils import API_KEY, AUTH, ServerProcess

# Small limits keep a server cheap: a 16 MiB KV pool holds ~680 blocks of the tiny model.
TINY_SERVER_ARGS = ["--dtype", "float32", "--kv-cache-memory-bytes", "16MiB", "--max-model-len", "512",
                    "--max-num-batched-tokens", "512", "--seed", "0", "--served-model-name", "tiny", "tiny-alias"]


@pytest.fixture(scope="module")
def start_server(tiny_llama_dir, tmp_path_factory):
    """Starts servers on the tiny model (extra flags as arguments) and stops them after the module."""
    servers: list[ServerProcess] = []

    def start(*extra_args: str) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(tiny_llama_dir, [*TINY_SERVER_ARGS, *extra_args], log_path)
        servers.append(server)
        server.wait_healthy()
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    """A tiny-model server with the default flags; a module that needs other flags defines its own `server`."""
    return start_server()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    """The official openai client of `server`."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def keyed_server(start_server) -> ServerProcess:
    """A tiny-model server behind `--api-key API_KEY`, for the modules that check errors and auth."""
    return start_server("--api-key", API_KEY)


@pytest.fixture(scope="module")
def http(keyed_server):
    """An httpx client of `keyed_server` that presents the key."""
    with httpx.Client(base_url=keyed_server.url, headers=AUTH, timeout=120) as client:
        yield client


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, ServerProcess):
                report.sections.append((f"server log ({value.log_path})", value.log_tail()))
