"""Structured-output requests -> compiled xgrammar grammars, parsed at once (a bad schema is a ValueError
naming it) and compiled against the vocabulary in a thread pool, once per distinct grammar."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from pagellm.sampling_params import StructuredOutputsParams

_XGRAMMAR_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")

# Compiling walks the whole vocabulary per grammar state; two threads keep a slow schema from delaying the
# next one while leaving the cores to the forward pass.
_COMPILE_THREADS = 2


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """What identifies a grammar: its kind and its text (a JSON schema in canonical key order)."""
    kind = params.kind
    value = getattr(params, kind)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json={_preview(value)} is not valid JSON ({exc}); pass a JSON "
                                 "schema as a dict or as JSON text.") from None
        value = json.dumps(value, sort_keys=True)
    elif kind == "choice":
        value = json.dumps(value)
    elif kind == "json_object":
        value = ""
    return kind, value


def choice_ebnf(choices: list[str]) -> str:
    """One of the strings exactly: an EBNF alternation of JSON-quoted literals (xgrammar reads its escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def parse_grammar(params: StructuredOutputsParams, name: str | None = None):
    """The tokenizer-independent xgrammar.Grammar; a ValueError naming the part xgrammar could not take
    (`name` says where the grammar came from, structured_outputs.<kind> by default)."""
    import xgrammar as xgr

    kind, text = grammar_key(params)
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(text, any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        # xgrammar prefixes its messages with a time and its C++ source line, which tell a client nothing.
        reason = _XGRAMMAR_PREFIX.sub("", " ".join(str(exc).split()))[:500]
        raise ValueError(
            f"{name or 'structured_outputs.' + kind}={_preview(getattr(params, kind))} cannot be compiled: {reason}. "
            f"Supported: JSON Schema (json), regular expressions (regex), lists of strings (choice), EBNF in "
            "xgrammar/GBNF syntax (grammar) and json_object."
        ) from None


def _preview(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return repr(text if len(text) <= 120 else text[:117] + "...")


class GrammarCompiler:
    """Compiled grammars by key, each compiled once in a background thread; requests hold its Future."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="pagellm-grammar")
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self._compiled: dict[tuple[str, str], Future] = {}
        self._compiler = None

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The Future of the compiled grammar; a ValueError now if the grammar cannot be parsed."""
        key = grammar_key(params)
        with self._lock:
            future = self._compiled.get(key)
            if future is not None:
                return future
        grammar = parse_grammar(params)
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._pool.submit(self._compile, grammar)
                self._compiled[key] = future
            return future

    def _compile(self, grammar):
        import xgrammar as xgr

        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            compiler = self._compiler
        return compiler.compile_grammar(grammar)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
