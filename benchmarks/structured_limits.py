"""Parse and compile times of the costliest grammars pagellm's structured-output limits accept, one of each
shape (pagellm/structured_output/limits.py), and of a few just over a limit (refused before xgrammar sees them).

    PYTHONPATH=. python benchmarks/structured_limits.py [--shapes NAME ...]

Compiles against the default model's vocabulary (49,152 tokens), one grammar at a time on one thread, as the
server's compile threads do. Each shape is the largest of its kind under the limits (found by growing it
until the size check refuses it).
"""

from __future__ import annotations

import argparse
import os
import time

from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.grammar import grammar_spec, parse_grammar
from pagellm.structured_output.limits import GrammarLimits, GrammarTooLarge


def _items(depth: int, leaf: dict) -> dict:
    for _ in range(depth):
        leaf = {"type": "array", "items": leaf}
    return leaf


def _objects(depth: int, leaf: dict) -> dict:
    for _ in range(depth):
        leaf = {"type": "object", "properties": {"a": leaf}, "required": ["a"]}
    return leaf


def _fields(count: int, schema: dict, required: bool = True) -> dict:
    names = [f"field_{i}" for i in range(count)]
    return {"type": "object", "properties": {name: schema for name in names}, **({"required": names} if required else {})}


# name -> (kind, the grammar of size k)
SHAPES = {
    "array chains": ("json", lambda k: {"anyOf": [_items(61, {"const": i}) for i in range(k)]}),
    "object chains": ("json", lambda k: {"anyOf": [_objects(30, {"const": i}) for i in range(k)]}),
    "required strings": ("json", lambda k: _fields(k, {"type": "string"})),
    "optional strings": ("json", lambda k: _fields(k, {"type": "string"}, required=False)),
    "enum": ("json", lambda k: {"enum": [f"value-{i}" for i in range(k)]}),
    "oneOf objects": ("json", lambda k: {"oneOf": [_fields(1, {"const": i}) for i in range(k)]}),
    "email formats": ("json", lambda k: _fields(k, {"type": "string", "format": "email"})),
    "uri-template formats": ("json", lambda k: _fields(k, {"type": "string", "format": "uri-template"})),
    "counted pattern": ("json", lambda k: {"type": "string", "pattern": f"[a-z]{{1,{k}}}"}),
    "patterns": ("json", lambda k: _fields(k, {"type": "string", "pattern": "^[a-z]+$"})),
    "regex optional run": ("regex", lambda k: "a?" * k),
    "EBNF optional run": ("grammar", lambda k: "root ::= " + '"a"? ' * k),
    "regex alternation": ("regex", lambda k: "(" + "|".join(f"w{i}x" for i in range(k)) + ")"),
}
STEPS = {"required strings": 50, "optional strings": 8, "enum": 200, "oneOf objects": 20, "counted pattern": 50,
         "regex alternation": 2000}
REFUSED = {
    "objects 200 deep": ("json", _objects(200, {"type": "string"})),
    "pattern (a|b|c|d){1,10000}": ("json", {"type": "string", "pattern": "(a|b|c|d){1,10000}"}),
    "regex of 300 a?": ("regex", "a?" * 300),
}


def _params(kind: str, grammar: object) -> StructuredOutputsParams:
    return StructuredOutputsParams(**{kind: grammar})


def largest(kind: str, make, step: int) -> int:
    """The largest k (a multiple of step) whose grammar the limits accept."""
    k = step
    while True:
        try:
            grammar_spec(_params(kind, make(k + step)), GrammarLimits(), "x")
        except GrammarTooLarge:
            return k
        k += step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()

    import xgrammar as xgr

    from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    print(f"{'accepted (largest of its shape)':<26}{'k':>6}{'size':>8}{'parse s':>9}{'compile s':>11}{'MiB':>7}")
    for name in args.shapes:
        kind, make = SHAPES[name]
        k = largest(kind, make, STEPS.get(name, 1))
        spec = grammar_spec(_params(kind, make(k)), GrammarLimits(), name)
        started = time.perf_counter()
        grammar = parse_grammar(spec.kind, spec.text, any_whitespace=True)
        parsed = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        done = time.perf_counter()
        size = spec.size.weighted if kind == "json" else spec.size.chars
        print(f"{name:<26}{k:>6}{size:>8}{parsed - started:>9.3f}{done - parsed:>11.3f}"
              f"{compiled.memory_size_bytes / 2**20:>7.2f}", flush=True)
    print("refused before parsing")
    for name, (kind, grammar) in REFUSED.items():
        started = time.perf_counter()
        try:
            grammar_spec(_params(kind, grammar), GrammarLimits(), name)
            outcome = "accepted?"
        except GrammarTooLarge as exc:
            outcome = str(exc)[:90]
        print(f"  {name:<28}{(time.perf_counter() - started) * 1000:6.2f} ms  {outcome}")


if __name__ == "__main__":
    main()
