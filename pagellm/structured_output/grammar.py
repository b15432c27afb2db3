"""Structured-output requests -> compiled xgrammar grammars, never on the event loop or the engine thread.

`GrammarCompiler.submit` checks a grammar's size against limits.py at once (a ValueError over a limit) and
looks it up in a bounded LRU cache; a new grammar is parsed (tokenizer-independent) and then compiled against
the vocabulary in a small thread pool, once. The caller waits for the parse, at most `timeout_s`, to report a
grammar xgrammar refuses as a ValueError before the request starts; the request then holds a Future of the
compiled grammar that settles within another `timeout_s`, so that it never waits forever. xgrammar releases
the GIL while it parses and compiles, so the threads that wait meanwhile keep running.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.limits import GrammarLimits, GrammarSize, GrammarTooLarge, measure_schema, measure_text

_XGRAMMAR_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")

# Compiling walks the whole vocabulary per grammar state; two threads keep a slow schema from delaying the
# next one while leaving the cores to the forward pass.
_COMPILE_THREADS = 2
# The cache of compiled grammars keeps at most this many, and this many bytes of them (xgrammar's own
# measure, CompiledGrammar.memory_size_bytes), evicting the least recently used first: a ~4 KB schema compiles
# to 0.2-2 MiB against a 49k-token vocabulary, so ~100-600 of them. A request in flight holds its own reference
# to its grammar, evicted or not.
DEFAULT_CACHE_ENTRIES = 512
DEFAULT_CACHE_BYTES = 128 * 1024**2
DEFAULT_TIMEOUT_S = 10.0
# A JSON schema given as text longer than this many times max_json_chars is refused before it is decoded.
_JSON_TEXT_SLACK = 4


class GrammarError(ValueError):
    """xgrammar refused the grammar; the message is its reason."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the pool parses: the kind, and the text xgrammar reads (a JSON schema keeps its property order)."""

    kind: str
    text: str
    size: GrammarSize

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.text


def grammar_spec(params: StructuredOutputsParams, limits: GrammarLimits, name: str) -> GrammarSpec:
    """The spec of a request's grammar; a ValueError naming `name` if its text is malformed or over a limit.

    A JSON schema is keyed and compiled as compact JSON text in the order it was given: key order is property
    order in the output, so {"zeta", "alpha"} and {"alpha", "zeta"} are different grammars; only formatting
    (spaces, a dict or its JSON text) is made canonical."""
    kind = params.kind
    if kind == "json":
        schema = _decode_schema(params.json, limits, name)
        size = measure_schema(schema, limits, name)
        return GrammarSpec(kind, json.dumps(schema, separators=(",", ":")), size)
    if kind == "json_object":
        return GrammarSpec(kind, '{"type":"object"}', GrammarSize(kind, 0))
    text = choice_ebnf(params.choice) if kind == "choice" else getattr(params, kind)
    return GrammarSpec(kind, text, measure_text(kind, text, limits, name))


def _decode_schema(value: str | dict, limits: GrammarLimits, name: str) -> object:
    if not isinstance(value, str):
        return value
    if len(value) > _JSON_TEXT_SLACK * limits.max_json_chars:
        raise GrammarTooLarge(f"{name} is {len(value)} characters of JSON, more than the limit of "
                              f"{_JSON_TEXT_SLACK * limits.max_json_chars}; shorten it.")
    try:
        return json.loads(value)
    except RecursionError:
        raise GrammarTooLarge(f"{name}: the JSON schema nests objects and arrays more than "
                              f"{limits.max_json_depth} levels deep (the limit); flatten it, e.g. with $defs and "
                              "$ref.") from None
    except ValueError as exc:
        raise ValueError(f"{name}={_preview(value)} is not valid JSON ({exc}); pass a JSON schema as a dict or as "
                         "JSON text.") from None


def choice_ebnf(choices: list[str]) -> str:
    """One of the strings exactly: an EBNF alternation of JSON-quoted literals (xgrammar reads its escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def parse_grammar(kind: str, text: str, any_whitespace: bool):
    """The tokenizer-independent xgrammar.Grammar of a spec's kind and text; GrammarError with xgrammar's reason.
    JSON (json, json_object) allows whitespace between tokens unless any_whitespace is False, then it is
    compact, as vLLM's disable_any_whitespace makes it."""
    import xgrammar as xgr

    try:
        if kind in ("json", "json_object"):
            return xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace,
                                                separators=None if any_whitespace else (",", ":"))
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError, TypeError (and nanobind's own) alike
        # xgrammar prefixes its messages with a time and its C++ source line, which tell a client nothing.
        raise GrammarError(_XGRAMMAR_PREFIX.sub("", " ".join(str(exc).split()))[:500]) from None


def failure_message(params: StructuredOutputsParams, name: str, reason: object) -> str:
    return (f"{name}={_preview(getattr(params, params.kind))} cannot be compiled: {reason}. Supported: JSON Schema "
            "(json), regular expressions (regex), lists of strings (choice), EBNF in xgrammar/GBNF syntax (grammar) "
            "and json_object.")


def _preview(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return repr(text if len(text) <= 120 else text[:117] + "...")


@dataclass(frozen=True)
class GrammarCacheStats:
    entries: int
    bytes: int
    hits: int
    misses: int
    evictions: int


@dataclass(eq=False)
class _Entry:
    """One distinct grammar: its parse (None or GrammarError) and its compiled grammar, each a Future that the
    pool settles."""

    spec: GrammarSpec
    parsed: Future = field(default_factory=Future)
    compiled: Future = field(default_factory=Future)
    # Requests that have not given up on it: when every one timed out before the pool reached it, it is skipped.
    claims: int = 0
    num_bytes: int = 0

    def __post_init__(self) -> None:
        # Running from the start: nothing (an asyncio wrapper included) can cancel a Future others share.
        self.parsed.set_running_or_notify_cancel()
        self.compiled.set_running_or_notify_cancel()

    def fail(self, exc: BaseException) -> None:
        _settle(self.parsed, exc=exc)
        _settle(self.compiled, exc=exc)


def _settle(future: Future, result: object = None, exc: BaseException | None = None) -> None:
    """Sets a Future's outcome unless another thread set it first (a deadline and a compile may race)."""
    try:
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)
    except InvalidStateError:
        pass


class GrammarCompiler:
    """Compiled grammars by key, in a bounded LRU cache, each parsed and compiled once in a thread pool."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, any_whitespace: bool = True,
                 limits: GrammarLimits = GrammarLimits(), max_entries: int = DEFAULT_CACHE_ENTRIES,
                 max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self.timeout_s = timeout_s
        self.any_whitespace = any_whitespace
        self.limits = limits
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="pagellm-grammar")
        self._deadlines = _Deadlines()
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._bytes = self._hits = self._misses = self._evictions = 0
        self._compiler_lock = threading.Lock()
        self._compiler = None

    def submit(self, params: StructuredOutputsParams, name: str | None = None) -> GrammarRequest:
        """One request's claim on its grammar, parsed and compiled in the pool; a ValueError now (naming `name`,
        structured_outputs.<kind> by default) if it is over a size limit. A cached grammar is never parsed again."""
        name = name or f"structured_outputs.{params.kind}"
        spec = grammar_spec(params, self.limits, name)
        with self._lock:
            entry = self._entries.get(spec.key)
            if entry is not None:
                self._entries.move_to_end(spec.key)
                self._hits += 1
            else:
                self._misses += 1
                entry = self._entries[spec.key] = _Entry(spec)
                self._evict_locked()
                self._pool.submit(self._build, entry)
            entry.claims += 1
        return GrammarRequest(self, entry, params, name)

    def stats(self) -> GrammarCacheStats:
        with self._lock:
            return GrammarCacheStats(len(self._entries), self._bytes, self._hits, self._misses, self._evictions)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._deadlines.stop()

    # ---- the pool -------------------------------------------------------------------------------------

    def _build(self, entry: _Entry) -> None:
        with self._lock:
            abandoned = entry.claims == 0
            if abandoned:
                self._forget_locked(entry)
        if abandoned:
            entry.fail(GrammarError("every request for this grammar stopped waiting before it was parsed"))
            return
        try:
            grammar = parse_grammar(entry.spec.kind, entry.spec.text, self.any_whitespace)
        except GrammarError as exc:
            entry.fail(exc)  # cached as it is: the same grammar sent again fails at once, unparsed
            return
        _settle(entry.parsed)
        try:
            compiled = self._xgrammar_compiler().compile_grammar(grammar)
        except Exception as exc:  # one grammar's failure (xgrammar, memory) ends its requests only
            with self._lock:
                self._forget_locked(entry)  # not cached: it may compile another time
            _settle(entry.compiled, exc=exc)
            return
        with self._lock:
            entry.num_bytes = compiled.memory_size_bytes
            if self._entries.get(entry.spec.key) is entry:
                self._bytes += entry.num_bytes
                self._evict_locked()
        _settle(entry.compiled, compiled)

    def _xgrammar_compiler(self):
        import xgrammar as xgr

        with self._compiler_lock:
            if self._compiler is None:
                info = _tokenizer_info(self._tokenizer, self._vocab_size, self._stop_token_ids)
                # xgrammar's own cache would keep every compiled grammar a second time, with no bound.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _evict_locked(self) -> None:
        while self._entries and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
            _, entry = self._entries.popitem(last=False)
            self._bytes -= entry.num_bytes
            self._evictions += 1

    def _forget_locked(self, entry: _Entry) -> None:
        if self._entries.get(entry.spec.key) is entry:
            del self._entries[entry.spec.key]
            self._bytes -= entry.num_bytes

    def _give_up(self, entry: _Entry) -> None:
        with self._lock:
            entry.claims -= 1


def _tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int] | None):
    import xgrammar as xgr

    from pagellm.tokenization.compact_bpe import CompactBPETokenizer

    if isinstance(tokenizer, CompactBPETokenizer):
        # xgrammar reads the vocabulary's kind from a fast tokenizer's Rust pipeline, which this one has not;
        # these are the kinds from_huggingface detects for the fast tokenizers of the two pipelines it implements
        # (<0xXX> bytes, or GPT-2's byte characters; no added space).
        vocab = tokenizer.get_vocab()
        encoded = [""] * vocab_size
        for token, token_id in vocab.items():
            if token_id < vocab_size:
                encoded[token_id] = token
        kind = xgr.VocabType.BYTE_LEVEL if tokenizer.pipeline == "byte_level" else xgr.VocabType.BYTE_FALLBACK
        return xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                                 add_prefix_space=False)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


@dataclass(eq=False)
class GrammarRequest:
    """One request's claim on a grammar: wait for its parse (a ValueError if xgrammar refuses it or does not
    finish within the timeout), then hand `future()` to the engine as SamplingParams.structured_grammar."""

    compiler: GrammarCompiler
    entry: _Entry
    params: StructuredOutputsParams
    name: str

    def wait(self) -> Future:
        """Blocks the calling thread (never the engine's) for the parse; returns the compiled grammar's Future."""
        wait_futures([self.entry.parsed], timeout=self.compiler.timeout_s)
        return self._parsed()

    async def wait_async(self) -> Future:
        """`wait` for an event loop: the loop keeps serving while the pool parses."""
        parsed = asyncio.wrap_future(self.entry.parsed)
        try:
            await asyncio.wait([parsed], timeout=self.compiler.timeout_s)
        except asyncio.CancelledError:  # the client left
            self.compiler._give_up(self.entry)
            raise
        finally:
            # The outcome is read from the shared Future below. Cancelling this loop's copy cannot cancel the
            # shared one, which is running from the start.
            if parsed.done():
                parsed.exception()
            else:
                parsed.cancel()
        return self._parsed()

    def future(self) -> Future:
        """The compiled grammar's Future for this request: done within timeout_s from now, with the grammar or
        an exception that says why not."""
        compiled = self.entry.compiled
        if compiled.done() and compiled.exception() is None:
            return compiled
        mine: Future = Future()
        mine.set_running_or_notify_cancel()
        compiled.add_done_callback(lambda done: self._copy_outcome(done, mine))
        if not mine.done():
            self.compiler._deadlines.add(time.monotonic() + self.compiler.timeout_s, mine, TimeoutError(
                f"{self.name}: the grammar ({self.entry.spec.size.describe()}) did not compile against the vocabulary "
                f"within structured_outputs_timeout={self.compiler.timeout_s:g} s; simplify it, or raise the timeout."
            ))
        return mine

    def _parsed(self) -> Future:
        parsed = self.entry.parsed
        if not parsed.done():
            self.compiler._give_up(self.entry)
            raise ValueError(
                f"{self.name}: the grammar ({self.entry.spec.size.describe()}) was not parsed within "
                f"structured_outputs_timeout={self.compiler.timeout_s:g} s (the compile threads may be busy with "
                "others); simplify it, retry, or raise the timeout."
            )
        if parsed.exception() is not None:
            raise ValueError(failure_message(self.params, self.name, parsed.exception()))
        return self.future()

    def _copy_outcome(self, compiled: Future, mine: Future) -> None:
        exc = compiled.exception()
        if isinstance(exc, GrammarError):
            exc = ValueError(failure_message(self.params, self.name, exc))
        _settle(mine, None if exc is not None else compiled.result(), exc)


class _Deadlines:
    """Fails Futures still pending at their deadline, from one daemon thread started at the first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Future, BaseException]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def add(self, deadline: float, future: Future, error: BaseException) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._order), future, error))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pagellm-grammar-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stopping:
                    return
                _, _, future, error = heapq.heappop(self._heap)
            _settle(future, exc=error)
