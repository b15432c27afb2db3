"""Server fixtures: a real `pagellm serve` on the tiny model, its log attached to every failing test."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.utils import API_KEY, AUTH, ServerProcess

# Small limits keep a server cheap: a 16 MiB KV pool holds ~680 blocks of the tiny model.
TINY_SERVER_ARGS = ["--dtype", "float32", "--kv-cache-memory-bytes", "16MiB", "--max-model-len", "512",
                    "--max-num-batched-tokens", "512", "--seed", "0", "--served-model-name", "tiny", "tiny-alias"]


def _server_starter(tiny_llama_dir, tmp_path_factory):
    """A `start(*extra_args)` that starts servers on the tiny model, and the list of those it started."""
    servers: list[ServerProcess] = []

    def start(*extra_args: str) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(tiny_llama_dir, [*TINY_SERVER_ARGS, *extra_args], log_path)
        servers.append(server)
        server.wait_healthy()
        return server

    return start, servers


@pytest.fixture(scope="module")
def start_server(tiny_llama_dir, tmp_path_factory):
    """Starts servers on the tiny model (extra flags as arguments) and stops them after the module: for a module
    that needs its own flags or a fresh server (counters from zero, an empty prefix cache, a shutdown)."""
    start, servers = _server_starter(tiny_llama_dir, tmp_path_factory)
    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def shared_servers(tiny_llama_dir, tmp_path_factory):
    """One server per set of flags for the whole session (per xdist worker), started on first use: a start-up
    costs seconds of CPU, and the modules that use these only assert on their own requests and on counter
    deltas or idle gauges, never on a fresh server's state."""
    start, servers = _server_starter(tiny_llama_dir, tmp_path_factory)
    by_flags: dict[tuple[str, ...], ServerProcess] = {}

    def shared(*extra_args: str) -> ServerProcess:
        if extra_args not in by_flags:
            by_flags[extra_args] = start(*extra_args)
        return by_flags[extra_args]

    yield shared
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def server(shared_servers) -> ServerProcess:
    """The session's tiny-model server with the default flags; a module that needs other flags defines its own
    `server`."""
    return shared_servers()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    """The official openai client of `server`."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def keyed_server(shared_servers) -> ServerProcess:
    """The session's tiny-model server behind `--api-key API_KEY`, for the modules that check errors and auth."""
    return shared_servers("--api-key", API_KEY)


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
