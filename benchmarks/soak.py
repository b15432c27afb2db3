"""Soak test: minutes of mixed traffic against a `pagellm serve` this script starts on a free loopback port.

    PYTHONPATH=. python benchmarks/soak.py --minutes 10

Traffic (seeded): greedy completions and chats, streamed or not; seeded n=3 samples; long prompts; clients
that disconnect mid-stream; requests aborted by a client timeout; bad inputs (mistyped fields, lone
surrogates, unknown fields, best_of past its cap or past max_num_seqs, seeds outside int64, oversized
bodies); slow clients that trickle their headers or body and stall (closed after the server's read
timeout); structured outputs with a JSON schema nested 200 objects deep (a 400) or at the limits of
depth and size (served), /health timed while each is handled; and --schema-clients clients that send a new
JSON schema with every request (each one compiled, and the compiled-grammar cache evicting). Every request
has a deadline and the run is bounded in time and count.
At the end it asserts:

- 0 requests running or waiting and 0 KV blocks in use (the server's /metrics), once the traffic stops;
- every good deterministic request (greedy, or seeded) answered exactly as the same request answered alone
  before the traffic started; every bad input refused with its 4xx;
- /health answered within --max-health-s while a hostile schema was being handled, and the compiled-grammar
  cache within its bounds (pagellm:structured_output_cache_entries / _bytes);
- server RSS flat after warm-up: VmRSS of the server process (/proc/PID/status), sampled every 5 s; the
  mean of the last fifth of the samples exceeds the first sample after warm-up (the first fifth of the run)
  by less than --max-rss-growth-mib.

Not part of `make test` (it runs for minutes). By default it serves the tests' tiny random Llama (built here
with the default model's tokenizer), fast enough on a CPU for thousands of requests; --model serves another.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from pagellm.structured_output.grammar import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUEST_TIMEOUT_S = 120.0
PROMPTS = [
    "Hello", "The capital of France is", "def fibonacci(n):", "Once upon a time",
    "In a hole in the ground there lived a hobbit.", "1, 2, 3, 4,", "The quick brown fox", "SELECT * FROM",
]
LONG_PROMPT = " ".join(f"item {i} is {i * i}." for i in range(40))  # ~380 tokens of a 512-token context
BAD_BODIES = [
    ("/v1/completions", {"model": "m", "prompt": "Hi", "skip_special_tokens": "false"}, 400),
    ("/v1/completions", {"model": "m", "prompt": "\ud800abc"}, 400),
    ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 1, "max_token": 3}, 200),  # ignored, as vLLM
    ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 1, "best_of": 20000}, 400),
    ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 1, "n": 2, "best_of": 128}, 400),
    ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 1, "seed": 2**64}, 400),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "seed": -2**63 - 1}, 400),
    ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 10**6}, 400),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "\udfff"}]}, 400),
    ("/generate", {"prompt": "Hi", "ignore_eos": "false"}, 400),
    ("/generate", {"prompt": "Hi", "bad_words": "abc"}, 400),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": "no"}, 400),
]


# The server's --header-read-timeout and --body-read-timeout here, and how much later a stalled client's
# connection must be closed.
READ_TIMEOUT_S = 2.0
SLOW_CLIENT_GRACE_S = 10.0


def nested_schema(depth: int) -> dict:
    schema: dict = {"enum": ["x", "y"]}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def items_chains(chains: int, depth: int) -> dict:
    """`chains` arrays nested `depth` deep, side by side: near the limits of depth and size, the slowest to parse."""
    branches = []
    for i in range(chains):
        schema: dict = {"const": i}
        for _ in range(depth):
            schema = {"type": "array", "items": schema}
        branches.append(schema)
    return {"anyOf": branches}


# Too deep (refused at once, naming its depth), and the costliest to parse that the limits accept.
HOSTILE_SCHEMAS = [(nested_schema(200), 400), (items_chains(2, 61), 200)]


def distinct_schema(index: int) -> dict:
    """A ~16 KB schema of 450 string fields, new with each index (one field name says which), as a client that
    varies a property name sends them: ~2.5 MiB compiled against the default model's vocabulary, so that the
    grammar cache (128 MiB) fills within the warm-up of a 10-minute run."""
    names = [f"field_{i}" for i in range(449)] + [f"variant_{index}"]
    return {"type": "object", "properties": {name: {"type": "string", "maxLength": 12} for name in names},
            "required": names}


def structured_body(schema: dict) -> dict:
    return {"model": "m", "prompt": "JSON:", "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_tiny_model(directory: str) -> str:
    sys.path.insert(0, REPO_ROOT)
    from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer
    from tests.conftest import _save_tiny

    return _save_tiny(directory, load_gguf_tokenizer(default_model_path()))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


@dataclass(frozen=True)
class Good:
    """A deterministic request: its answer must equal the answer it got alone."""

    route: str
    body: dict

    def key(self) -> str:
        return json.dumps([self.route, self.body], sort_keys=True)


def good_requests() -> list[Good]:
    requests = []
    for i, prompt in enumerate(PROMPTS):
        requests.append(Good("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 8 + 4 * i,
                                                 "temperature": 0, "ignore_eos": True}))
        requests.append(Good("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": prompt}],
                                                      "max_tokens": 12, "temperature": 0, "ignore_eos": True}))
        requests.append(Good("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 10, "n": 3,
                                                 "temperature": 0.8, "seed": i, "ignore_eos": True}))
    requests.append(Good("/v1/completions", {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 16,
                                             "temperature": 0, "ignore_eos": True}))
    requests.append(Good("/generate", {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True}))
    return requests


def answer_of(route: str, payload: dict) -> list[str]:
    if route == "/generate":
        return [payload["text"]]
    choices = sorted(payload["choices"], key=lambda c: c["index"])
    return [c["message"]["content"] if "message" in c else c["text"] for c in choices]


async def streamed_answer(client: httpx.AsyncClient, good: Good) -> list[str]:
    texts: dict[int, str] = collections.defaultdict(str)
    async with client.stream("POST", good.route, json={**good.body, "stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise AssertionError(f"stream error: {chunk['error']}")
            for choice in chunk["choices"]:
                texts[choice["index"]] += choice.get("text") or choice.get("delta", {}).get("content") or ""
    return [texts[i] for i in sorted(texts)]


@dataclass
class Tally:
    counts: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    # The slowest /health answer while a hostile schema was being handled.
    health_max_s: float = 0.0

    def fail(self, kind: str, message: str) -> None:
        self.counts[f"{kind}: FAILED"] += 1
        if len(self.failures) < 20:
            self.failures.append(f"{kind}: {message}")


async def one_request(client: httpx.AsyncClient, rng: random.Random, goods: list[Good], expected: dict,
                      tally: Tally, body_limit: int) -> None:
    roll = rng.random()
    good = rng.choice(goods)
    kind = "?"
    try:
        if roll < 0.35:
            kind = "good"
            response = await client.post(good.route, json=good.body)
            response.raise_for_status()
            if answer_of(good.route, response.json()) != expected[good.key()]:
                return tally.fail(kind, f"{good.body} answered differently than alone")
        elif roll < 0.55 and good.route != "/generate":
            kind = "good stream"
            if await streamed_answer(client, good) != expected[good.key()]:
                return tally.fail(kind, f"{good.body} streamed differently than alone")
        elif roll < 0.65:
            kind = "disconnect mid-stream"
            body = {"model": "m", "prompt": rng.choice(PROMPTS), "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= rng.randint(1, 5):
                        break
        elif roll < 0.72:
            kind = "abort by client timeout"
            body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 80, "ignore_eos": True}
            try:
                await client.post("/v1/completions", json=body, timeout=rng.uniform(0.05, 0.5))
            except httpx.TimeoutException:
                pass
        elif roll < 0.74:
            kind = "hostile schema"
            schema, status = rng.choice(HOSTILE_SCHEMAS)
            handled = asyncio.ensure_future(client.post("/v1/completions", json=structured_body(schema)))
            while not handled.done():
                started = time.monotonic()
                (await client.get("/health")).raise_for_status()
                tally.health_max_s = max(tally.health_max_s, time.monotonic() - started)
            response = await handled
            if response.status_code != status:
                return tally.fail(kind, f"got {response.status_code}, expected {status}: {response.text[:200]}")
        elif roll < 0.75:
            kind = "slow client"
            if not await slow_client_closed(client.base_url, rng.random() < 0.5):
                return tally.fail(kind, f"the connection was still open {SLOW_CLIENT_GRACE_S} s after the server's "
                                        f"{READ_TIMEOUT_S} s read timeout")
        elif roll < 0.97:
            kind = "bad input"
            route, body, status = rng.choice(BAD_BODIES)
            content = json.dumps(body).encode()  # json escapes lone surrogates as "\ud800", as clients send them
            response = await client.post(route, content=content, headers={"content-type": "application/json"})
            if response.status_code != status:
                return tally.fail(kind, f"{route} {body} got {response.status_code}, expected {status}")
        else:
            kind = "oversized body"
            content = json.dumps({"model": "m", "prompt": "x " * (body_limit // 2 + 10)}).encode()
            response = await client.post("/v1/completions", content=content,
                                         headers={"content-type": "application/json"})
            if response.status_code != 413:
                return tally.fail(kind, f"got {response.status_code}, expected 413")
        tally.counts[kind] += 1
    except Exception as exc:  # noqa: BLE001 - every failure is counted and shown, none stops the soak
        tally.fail(kind, repr(exc)[:300])


async def slow_client_closed(base_url: httpx.URL, in_body: bool) -> bool:
    """A client that trickles a request (its headers, or a body shorter than its Content-Length) and then stalls:
    whether the server closed the connection within its read timeout and a grace period."""
    reader, writer = await asyncio.open_connection(base_url.host, base_url.port)
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\ncontent-type: application/json\r\n"
        writer.write(head + (b"content-length: 100\r\n\r\n{\"model\": " if in_body else b"x-slow: "))
        await writer.drain()
        try:
            async with asyncio.timeout(READ_TIMEOUT_S + SLOW_CLIENT_GRACE_S):
                while await reader.read(4096):  # a 408, then the end of the stream
                    pass
        except TimeoutError:
            return False
        return True
    finally:
        writer.close()


async def soak(url: str, pid: int, args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    goods = good_requests()
    limits = httpx.Limits(max_connections=args.concurrency + args.schema_clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        expected = {}
        for good in goods:  # each alone: the answers every later copy must equal
            response = await client.post(good.route, json=good.body)
            response.raise_for_status()
            expected[good.key()] = answer_of(good.route, response.json())
        body_limit = args.body_limit
        tally = Tally()
        started = time.monotonic()
        deadline = started + args.minutes * 60
        rss: list[tuple[float, float]] = []
        # (seconds, RSS MiB) when the grammar cache first evicted: full, from then on it must not grow.
        cache_full: tuple[float, float] | None = None
        issued = 0

        async def worker(worker_rng: random.Random) -> None:
            nonlocal issued
            while time.monotonic() < deadline and issued < args.max_requests:
                issued += 1
                await one_request(client, worker_rng, goods, expected, tally, body_limit)

        async def schema_client(index: int) -> None:
            sent = 0
            while time.monotonic() < deadline:
                sent += 1
                try:
                    response = await client.post("/v1/completions", json=structured_body(distinct_schema(
                        index * 1_000_000 + sent)))
                    response.raise_for_status()
                    tally.counts["distinct schema"] += 1
                except Exception as exc:  # noqa: BLE001 - counted and shown like every other failure
                    tally.fail("distinct schema", repr(exc)[:300])

        async def sample_rss() -> None:
            nonlocal cache_full
            while time.monotonic() < deadline:
                rss.append((time.monotonic() - started, rss_mib(pid)))
                if cache_full is None and args.schema_clients:
                    text = (await client.get("/metrics")).text
                    evictions = metric(text, "pagellm:structured_output_cache_evictions_total")
                    cache_full = rss[-1] if evictions > 0 else None
                await asyncio.sleep(5)

        workers = [worker(random.Random(rng.random())) for _ in range(args.concurrency)]
        schema_clients = [schema_client(i) for i in range(args.schema_clients)]
        await asyncio.gather(sample_rss(), *workers, *schema_clients)
        elapsed = time.monotonic() - started

        # The traffic has stopped: everything must drain to zero (aborts are processed within a step).
        settle_deadline = time.monotonic() + 60
        while True:
            text = (await client.get("/metrics")).text
            running = metric(text, "vllm:num_requests_running")
            waiting = metric(text, "vllm:num_requests_waiting")
            usage = metric(text, "vllm:kv_cache_usage_perc")
            if (running, waiting, usage) == (0, 0, 0) or time.monotonic() > settle_deadline:
                break
            await asyncio.sleep(0.2)
        rss.append((time.monotonic() - started, rss_mib(pid)))
        cache = {name: metric(text, f"pagellm:structured_output_cache_{name}")
                 for name in ("entries", "bytes", "hits_total", "misses_total", "evictions_total")}

    warm = [mib for t, mib in rss if t >= elapsed / 5]
    tail = warm[-max(1, len(warm) // 5):]
    growth = statistics.mean(tail) - warm[0]
    total = sum(tally.counts.values())
    print(f"\nsoak: {elapsed / 60:.1f} min, {total} requests ({total / elapsed:.1f}/s), concurrency {args.concurrency}")
    print(f"{'kind':<32}{'count':>8}")
    for kind, count in sorted(tally.counts.items()):
        print(f"{kind:<32}{count:>8}")
    print(f"{'after: running / waiting':<32}{running:>5.0f} / {waiting:.0f}")
    print(f"{'after: KV blocks in use':<32}{usage * 100:>7.2f}%")
    print(f"{'server RSS (MiB) start of warm':<32}{warm[0]:>8.1f}")
    print(f"{'server RSS (MiB) end (mean)':<32}{statistics.mean(tail):>8.1f}  (growth {growth:+.1f}, "
          f"limit {args.max_rss_growth_mib})")
    print(f"{'server RSS (MiB) min / max':<32}{min(m for _, m in rss):>8.1f} / {max(m for _, m in rss):.1f}")
    print(f"{'grammar cache entries / MiB':<32}{cache['entries']:>8.0f} / {cache['bytes'] / 2**20:.1f}  (limits "
          f"{DEFAULT_CACHE_ENTRIES} / {DEFAULT_CACHE_BYTES / 2**20:.0f})")
    print(f"{'grammar cache hits/misses/evicted':<32}{cache['hits_total']:>8.0f} / {cache['misses_total']:.0f} / "
          f"{cache['evictions_total']:.0f}")
    print(f"{'/health max, hostile schema':<32}{tally.health_max_s:>8.2f} s  (limit {args.max_health_s})")
    if cache_full is not None:
        print(f"{'server RSS (MiB) cache full':<32}{cache_full[1]:>8.1f}  (at {cache_full[0]:.0f} s; end "
              f"{rss[-1][1]:.1f})")
    elif args.schema_clients:
        print("the grammar cache never filled: run longer to see the server's RSS with a full cache")
    per_minute = {int(t // 60): mib for t, mib in rss}  # the last sample of each minute
    print("server RSS (MiB) by minute: " + " ".join(f"{m}:{mib:.0f}" for m, mib in sorted(per_minute.items())))
    for failure in tally.failures:
        print("  FAILURE", failure)
    problems = []
    if any("FAILED" in kind for kind in tally.counts):
        problems.append("some requests failed")
    if (running, waiting, usage) != (0, 0, 0):
        problems.append(f"not idle after the traffic: running={running} waiting={waiting} kv usage={usage}")
    if cache["entries"] > DEFAULT_CACHE_ENTRIES or cache["bytes"] > DEFAULT_CACHE_BYTES:
        problems.append(f"the grammar cache outgrew its bounds: {cache}")
    if tally.health_max_s >= args.max_health_s:
        problems.append(f"/health took {tally.health_max_s:.2f} s while a hostile schema was handled")
    if growth >= args.max_rss_growth_mib:
        problems.append(f"RSS grew by {growth:.1f} MiB after warm-up")
    print("PASS" if not problems else "FAIL: " + "; ".join(problems))
    return 0 if not problems else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default=None, help="model to serve (default: the tests' tiny random Llama)")
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--max-requests", type=int, default=200_000, help="bound on requests issued")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    parser.add_argument("--body-limit", type=int, default=1 << 20, help="the server's --max-request-body-bytes")
    parser.add_argument("--schema-clients", type=int, default=1,
                        help="clients sending a new JSON schema with every request, besides --concurrency")
    parser.add_argument("--max-health-s", type=float, default=5.0,
                        help="the slowest /health answer allowed while a hostile schema is handled")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pagellm-soak-") as workdir:
        model = args.model or build_tiny_model(os.path.join(workdir, "tiny"))
        port = free_port()
        log_path = os.path.join(workdir, "server.log")
        command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", model, "--host", "127.0.0.1",
                   "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--seed", "0",
                   "--kv-cache-memory-bytes", "64MiB", "--max-num-seqs", "32", "--served-model-name", "m",
                   "--max-request-body-bytes", str(args.body_limit), "--uvicorn-log-level", "warning",
                   "--header-read-timeout", str(READ_TIMEOUT_S), "--body-read-timeout", str(READ_TIMEOUT_S)]
        env = {**os.environ, "PYTHONPATH": REPO_ROOT}
        with open(log_path, "wb") as log:
            server = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                if server.poll() is not None:
                    sys.exit(f"the server exited with {server.returncode}:\n{open(log_path).read()[-3000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    sys.exit("the server did not become healthy within 300 s")
                time.sleep(0.5)
            status = asyncio.run(soak(url, server.pid, args))
        finally:
            server.terminate()
            server.wait(timeout=60)
        log_text = open(log_path).read()
        tracebacks = log_text.count("Traceback")
        print(f"server log: {tracebacks} tracebacks, exit status {server.returncode} after SIGTERM")
        if server.returncode != 0:
            status = 1
    sys.exit(status)


if __name__ == "__main__":
    main()
