"""serving.py: its metric arithmetic on synthetic timestamps, and whole runs against a fake OpenAI server."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from dataclasses import dataclass, field

import pytest

from benchmarks import serving
from benchmarks.serving import RequestRecord, StreamError, apply_event, arrival_offsets, parse_sse_line, summarize
from benchmarks.workload import WorkloadSpec, generate_workload

# ---- a fake OpenAI-compatible server -----------------------------------------------------------------


@dataclass
class FakeServerBehaviour:
    # Completion requests, numbered from 0 in the order the server receives them.
    fail: frozenset[int] = frozenset()
    stall: frozenset[int] = frozenset()
    tokens_per_chunk: int = 1
    send_usage: bool = True


@dataclass
class FakeOpenAIServer:
    """A raw asyncio HTTP/1.1 server on a free loopback port, in its own thread.

    /v1/models lists one model; /v1/completions streams one SSE chunk per `tokens_per_chunk` tokens
    ("t0 t1 ..."), a finish chunk, a usage chunk and [DONE]; it answers 500 to the requests numbered
    in `fail` and never answers those in `stall` (until shutdown).
    """

    behaviour: FakeServerBehaviour = field(default_factory=FakeServerBehaviour)
    model: str = "fake-model"
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    def __enter__(self) -> FakeOpenAIServer:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._shutdown.set)
        self._thread.join()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self, ready: threading.Event) -> None:
        async def main() -> None:
            self._shutdown = asyncio.Event()
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            async with server:
                await self._shutdown.wait()

        self._loop.run_until_complete(main())
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, headers, body = await _read_request(reader)
            if method == "GET" and path == "/v1/models":
                _write_json(writer, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
            elif method == "POST" and path == "/v1/completions":
                number = len(self.bodies)
                self.bodies.append(body)
                self.headers.append(headers)
                await self._complete(writer, number, body)
            else:
                _write_json(writer, 404, {"error": {"message": f"no route {method} {path}"}})
            await writer.drain()
        except ConnectionError:
            pass  # the client hung up (cancelled at its timeout)
        finally:
            writer.close()

    async def _complete(self, writer: asyncio.StreamWriter, number: int, body: dict) -> None:
        if number in self.behaviour.fail:
            _write_json(writer, 500, {"error": {"message": "injected failure"}})
            return
        if number in self.behaviour.stall:
            await self._shutdown.wait()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        tokens = [f"t{i} " for i in range(body["max_tokens"])]
        step = self.behaviour.tokens_per_chunk
        for start in range(0, len(tokens), step):
            _write_event(writer, {"choices": [{"index": 0, "text": "".join(tokens[start : start + step]),
                                               "finish_reason": None}]})
            await writer.drain()
        _write_event(writer, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if self.behaviour.send_usage:
            prompt = body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            _write_event(writer, {"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                           "completion_tokens": len(tokens)}})
        writer.write(b"data: [DONE]\n\n")


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], dict]:
    method, path, _ = (await reader.readline()).decode().split(" ", 2)
    headers = {}
    while (line := (await reader.readline()).decode().strip()):
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", 0))
    body = json.loads(await reader.readexactly(length)) if length else {}
    return method, path, headers, body


def _write_json(writer: asyncio.StreamWriter, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                 "Connection: close\r\n\r\n".encode() + data)


def _write_event(writer: asyncio.StreamWriter, payload: dict) -> None:
    writer.write(f"data: {json.dumps(payload)}\n\n".encode())


WORKLOAD_ARGS = ["--num-prompts", "6", "--input-len", "20", "--output-len", "5", "--range-ratio", "0.5", "--seed", "1"]


@dataclass
class Run:
    summary: serving.ServingSummary
    json_line: dict
    stdout: str


def run_main(capsys, argv: list[str]) -> Run:
    summary = serving.main(argv)
    stdout = capsys.readouterr().out
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    return Run(summary, json.loads(lines[-1]), stdout)


# ---- end to end --------------------------------------------------------------------------------------


def test_all_requests_complete_with_exact_token_counts(capsys):
    with FakeOpenAIServer() as server:
        run = run_main(capsys, ["--base-url", server.base_url + "/v1/", "--api-key", "k", *WORKLOAD_ARGS])
    summary, line = run.summary, run.json_line
    # Lengths depend on the seed alone, not on the vocabulary the ids come from.
    workload = generate_workload(WorkloadSpec.from_args(serving.parse_args(WORKLOAD_ARGS)), range(100, 200))
    assert (summary.num_completed, summary.num_failed) == (6, 0)
    assert line["model"] == "fake-model" and line["completed"] == 6 and line["failed"] == 0
    assert summary.prompt_tokens == workload.num_prompt_tokens
    assert summary.output_tokens == workload.num_output_tokens
    assert summary.num_length_mismatches == summary.num_without_usage == 0
    # Every request's tokens after the first are one ITL each; TTFT and E2E one per request.
    assert summary.itl_ms.count == workload.num_output_tokens - 6
    assert summary.ttft_ms.count == summary.e2e_ms.count == summary.tpot_ms.count == 6
    assert summary.ttft_ms.median <= summary.e2e_ms.median
    for body, headers in zip(server.bodies, server.headers):
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0 and body["model"] == "fake-model"
        assert isinstance(body["prompt"], list) and headers["authorization"] == "Bearer k"
    sent = sorted((len(b["prompt"]), b["max_tokens"]) for b in server.bodies)
    assert sent == sorted((r.prompt_len, r.output_len) for r in workload.requests)


def test_failed_requests_are_counted_and_named(capsys):
    with FakeOpenAIServer(FakeServerBehaviour(fail=frozenset({2, 4}))) as server:
        run = run_main(capsys, ["--base-url", server.base_url, "--max-concurrency", "2", *WORKLOAD_ARGS])
    summary, line = run.summary, run.json_line
    assert (summary.num_completed, summary.num_failed) == (4, 2)
    assert line["failed"] == 2
    [(error, count)] = summary.errors.items()
    assert count == 2 and error.startswith("HTTP 500") and "injected failure" in error
    assert f"failed x2: {error}" in run.stdout


def test_requests_still_running_at_the_timeout_fail(capsys):
    with FakeOpenAIServer(FakeServerBehaviour(stall=frozenset({1}))) as server:
        summary = run_main(capsys, ["--base-url", server.base_url, "--timeout", "3", *WORKLOAD_ARGS]).summary
    assert (summary.num_completed, summary.num_failed) == (5, 1)
    assert summary.errors == {"not finished within --timeout=3 s": 1}
    assert summary.duration_s >= 3


def test_text_prompts_poisson_arrivals_and_multi_token_chunks(capsys):
    behaviour = FakeServerBehaviour(tokens_per_chunk=2)
    with FakeOpenAIServer(behaviour) as server:
        run = run_main(capsys, ["--base-url", server.base_url, "--model", "named", "--prompt-format", "text",
                                "--request-rate", "200", *WORKLOAD_ARGS])
    summary, line = run.summary, run.json_line
    assert summary.num_completed == 6 and line["model"] == "named"
    assert all(isinstance(b["prompt"], str) and b["model"] == "named" for b in server.bodies)
    # The server's usage is what counts: here, whitespace-separated words of the text prompt.
    assert summary.prompt_tokens == sum(len(b["prompt"].split()) for b in server.bodies)
    assert summary.output_tokens == sum(b["max_tokens"] for b in server.bodies)
    assert summary.itl_ms.count == sum(math.ceil(b["max_tokens"] / 2) - 1 for b in server.bodies)


def test_streams_without_usage_fall_back_to_chunks_and_say_so(capsys):
    with FakeOpenAIServer(FakeServerBehaviour(send_usage=False)) as server:
        run = run_main(capsys, ["--base-url", server.base_url, *WORKLOAD_ARGS])
    assert run.summary.num_without_usage == 6
    assert run.summary.output_tokens == sum(b["max_tokens"] for b in server.bodies)
    assert "6 streams carried no usage" in run.stdout


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(SystemExit, match="cannot reach the server"):
        serving.main(["--base-url", "http://127.0.0.1:1", *WORKLOAD_ARGS])


# ---- metric arithmetic ---------------------------------------------------------------------------------


def synthetic_record(index: int = 0, completed: bool = True) -> RequestRecord:
    record = RequestRecord(index, prompt_len=10, expected_output_len=4, sent_at=10.0,
                           chunk_times=[10.5, 10.7, 11.0], finished_at=11.1, prompt_tokens=10, completion_tokens=4)
    record.completed = completed
    return record


def test_ttft_tpot_itl_from_timestamps():
    record = synthetic_record()
    assert record.ttft == pytest.approx(0.5)
    assert record.e2e == pytest.approx(1.1)
    # (e2e - ttft) / (output tokens - 1): the last chunk carried two tokens.
    assert record.tpot == pytest.approx(0.6 / 3)
    assert record.itls == pytest.approx([0.2, 0.3])


def test_one_token_has_no_tpot():
    record = RequestRecord(0, 3, 1, sent_at=0.0, chunk_times=[0.25], finished_at=0.5, completion_tokens=1)
    assert record.tpot is None and record.itls == [] and record.ttft == 0.25


def test_summary_counts_only_completed_requests():
    failed = RequestRecord(1, 10, 4, error="HTTP 500: boom")
    summary = summarize([synthetic_record(), failed], duration_s=2.0)
    assert (summary.num_completed, summary.num_failed, summary.errors) == (1, 1, {"HTTP 500: boom": 1})
    assert (summary.prompt_tokens, summary.output_tokens) == (10, 4)
    assert summary.request_throughput == 0.5 and summary.output_throughput == 2.0 and summary.total_throughput == 7.0
    assert summary.ttft_ms.mean == pytest.approx(500) and summary.tpot_ms.mean == pytest.approx(200)
    assert summary.itl_ms.median == pytest.approx(250) and summary.e2e_ms.p99 == pytest.approx(1100)
    json.dumps(summary.as_json())


def test_summary_of_all_failed_has_no_latencies():
    summary = summarize([RequestRecord(0, 5, 5, error="x")], duration_s=1.0)
    assert summary.num_completed == 0 and summary.ttft_ms.mean is None
    assert json.loads(json.dumps(summary.as_json()))["mean_ttft_ms"] is None


def test_sse_parsing():
    assert parse_sse_line("") is None and parse_sse_line(": keep-alive") is None
    assert parse_sse_line("data: [DONE]") == {"done": True}
    assert parse_sse_line('data: {"choices": []}') == {"choices": []}
    with pytest.raises(StreamError):
        parse_sse_line("data: {not json")
    record = RequestRecord(0, 1, 2, sent_at=0.0)
    assert not apply_event(record, {"choices": [{"text": ""}]}, 1.0)  # no text: not a token arrival
    assert not apply_event(record, {"choices": [{"text": "a"}]}, 2.0)
    assert not apply_event(record, {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}, 3.0)
    assert apply_event(record, {"done": True}, 4.0)
    assert record.chunk_times == [2.0] and record.completion_tokens == 2
    with pytest.raises(StreamError, match="overloaded"):
        apply_event(record, {"error": {"message": "overloaded"}}, 5.0)


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    assert arrival_offsets(4, math.inf, 0) == [0.0] * 4
    offsets = arrival_offsets(20_000, 5.0, seed=3)
    assert offsets == arrival_offsets(20_000, 5.0, seed=3) != arrival_offsets(20_000, 5.0, seed=4)
    assert offsets[0] == 0 and all(a <= b for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(1 / 5.0, rel=0.03)


def test_base_url_normalization():
    assert serving.normalize_base_url("http://h:1/v1/") == serving.normalize_base_url("http://h:1") == "http://h:1"


# ---- side by side ------------------------------------------------------------------------------------


def test_servers_and_rates_side_by_side_in_one_table(capsys):
    with FakeOpenAIServer() as first, FakeOpenAIServer(FakeServerBehaviour(fail=frozenset({0}))) as second:
        run = run_main(capsys, ["--server", f"one={first.base_url}", "--server", f"two={second.base_url}/v1",
                                "--request-rate", "200", "inf", *WORKLOAD_ARGS])
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [(line["server"], line["request_rate"]) for line in lines] == [
        ("one", "200.0"), ("one", "inf"), ("two", "200.0"), ("two", "inf")]
    from pagellm.cpu_features import cpu_description

    assert all(line["cpu"] == cpu_description() and line["loadavg"] >= 0 for line in lines)
    # Servers named by URL were not started here: their CPU seconds are unknown; the client's are counted.
    assert all(line["server_cpu_s"] is None and line["client_cpu_s"] > 0 for line in lines)
    assert f"CPU: {cpu_description()}" in run.stdout
    # Each server saw the whole workload once per rate; the second failed its first request only.
    assert len(first.bodies) == len(second.bodies) == 12
    assert [line["completed"] for line in lines] == [6, 6, 5, 6]
    # Each rate sends its own prompts (no prefix-cache hits on the rate before), the same to both servers.
    prompts = lambda server, start: sorted(map(tuple, (b["prompt"] for b in server.bodies[start:start + 6])))  # noqa: E731
    assert prompts(first, 0) != prompts(first, 6)
    assert prompts(first, 0) == prompts(second, 0) and prompts(first, 6) == prompts(second, 6)
    table = run.stdout[run.stdout.index("server  "):]
    assert "TTFT p99" in table and "TPOT p50" in table
    assert [row.split()[:3] for row in table.splitlines()[2:6]] == [
        ["one", "200/s", "6/6"], ["one", "inf", "6/6"], ["two", "200/s", "5/6"], ["two", "inf", "6/6"]]


def test_a_launched_server_that_exits_early_is_a_clear_error():
    with pytest.raises(SystemExit, match="broken: the server command exited with status 3"):
        serving.main(["--launch", "broken=python3 -c 'raise SystemExit(3)'", "--ready-timeout", "30", *WORKLOAD_ARGS])


# A session leader that burns CPU itself, then in a child that exits and is reaped, reporting each step and
# waiting for the test's reading before the next.
SESSION_WORK = """
import os, sys, time

def burn(seconds):
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass

sys.stdin.readline()
burn(0.3)
print("burned", flush=True)
sys.stdin.readline()
child = os.fork()
if child == 0:
    burn(0.3)
    os._exit(0)
os.waitpid(child, 0)
print("reaped", flush=True)
sys.stdin.readline()
"""


def test_session_cpu_seconds_count_the_whole_session_including_exited_processes():
    import subprocess
    import sys

    # A session of its own: no other process of the machine comes or goes in it while the test reads.
    leader = subprocess.Popen([sys.executable, "-c", SESSION_WORK], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        readings = [serving.session_cpu_seconds(leader.pid)]
        for step in ("burned", "reaped"):
            leader.stdin.write("\n")
            leader.stdin.flush()
            assert leader.stdout.readline().strip() == step
            readings.append(serving.session_cpu_seconds(leader.pid))
    finally:
        leader.stdin.close()
        leader.wait(timeout=60)
    # /proc counts 10 ms ticks: 0.3 s burned shows as at least 0.29.
    assert readings[1] - readings[0] >= 0.29  # the live leader's own seconds
    assert readings[2] - readings[1] >= 0.29  # the child's, after it exited and was reaped
    assert serving.session_cpu_seconds(-1) == 0.0  # no process is in a session that does not exist


def test_named_entries_need_a_name_and_a_value():
    with pytest.raises(SystemExit):
        serving.parse_args(["--server", "http://127.0.0.1:8000"])
