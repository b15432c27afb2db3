"""Structured outputs on the default model: validity under a JSON schema, and the cost of constraining.

1. Validity: `--num-valid` requests (default 100) sampled at temperature 1.0 under PERSON_SCHEMA (an object with a
   string, an integer, an enum and an array of strings); each output must parse and validate.
2. Overhead: a batch of `--batch` constrained requests, then the same batch unconstrained with each request's
   max_tokens set to the length its constrained twin produced (EOS ignored), so both runs decode the same
   tokens at the same batch sizes; tokens/s of each (best of interleaved repeats), their ratio, and the share of the constrained run's wall
   time spent in the grammar library (matcher advance + bitmask fill + applying the mask to the logits).

    .venv/bin/python benchmarks/structured.py                    # both parts, the default model
    .venv/bin/python benchmarks/structured.py --num-valid 20 --batch 8 --max-tokens 64   # a quick look

Prints a table and one JSON line (prefixed by nothing, so `grep '^{'` picks it out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pagellm.sample.sampler as sampler_module
from pagellm import LLM, SamplingParams
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output import matcher

COLORS = ["red", "green", "blue"]
# Bounded strings, integer and array: every output is short enough to finish inside max_tokens, so validity
# measures the constraint, not the budget.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": COLORS},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PROMPT = ("<|im_start|>user\nDescribe a fictional person as JSON with a name, an age, a favourite color and a few "
          "tags.<|im_end|>\n<|im_start|>assistant\n")


def person_error(text: str) -> str | None:
    """Why `text` is not a PERSON_SCHEMA instance, or None when it is."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if not isinstance(value, dict) or set(value) != {"name", "age", "color", "tags"}:
        return f"keys {sorted(value) if isinstance(value, dict) else type(value).__name__}"
    checks = {
        "name": isinstance(value["name"], str) and 1 <= len(value["name"]) <= 24,
        "age": type(value["age"]) is int and 0 <= value["age"] <= 150,
        "color": value["color"] in COLORS,
        "tags": isinstance(value["tags"], list) and len(value["tags"]) <= 4
        and all(isinstance(tag, str) and len(tag) <= 16 for tag in value["tags"]),
    }
    bad = [name for name, ok in checks.items() if not ok]
    return f"invalid {bad}" if bad else None


def constrained(seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=PERSON_SCHEMA))


class GrammarTimer:
    """Wall time inside the grammar library, by patching the three places the engine calls it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._patches = [
            (matcher.SequenceGrammar, "catch_up"),
            (matcher.SequenceGrammar, "fill_bitmask"),
            (sampler_module, "apply_token_bitmask"),
        ]
        self._originals = [getattr(owner, name) for owner, name in self._patches]

    def __enter__(self) -> GrammarTimer:
        for (owner, name), original in zip(self._patches, self._originals):
            setattr(owner, name, self._timed(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in zip(self._patches, self._originals):
            setattr(owner, name, original)

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def run(args) -> dict:
    llm = LLM(args.model, seed=0) if args.model else LLM(seed=0)
    # Cold compile of the schema (vocabulary index built on first use, then the grammar).
    start = time.perf_counter()
    llm.llm_engine.grammar_compiler.submit(StructuredOutputsParams(json=PERSON_SCHEMA)).wait().result()
    compile_s = time.perf_counter() - start

    outputs = llm.generate([PROMPT] * args.num_valid, [constrained(seed, args.max_tokens)
                                                        for seed in range(args.num_valid)], use_tqdm=False)
    errors = [(o.outputs[0].text, person_error(o.outputs[0].text)) for o in outputs]
    failures = [(text, error) for text, error in errors if error is not None]
    for text, error in failures[:5]:
        print(f"INVALID ({error}): {text!r}")

    prompts = [PROMPT] * args.batch
    constrained_params = [constrained(1000 + i, args.max_tokens) for i in range(args.batch)]
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, constrained_params, use_tqdm=False)]
    free_params = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=n, ignore_eos=True)
                   for i, n in enumerate(lengths)]
    # Interleaved repeats, best of each: on a shared machine a neighbour's load lands on either run alike.
    constrained_runs, free_runs, shares = [], [], []
    for _ in range(args.repeats):
        with GrammarTimer() as timer:
            constrained_runs.append(_timed_generate(llm, prompts, constrained_params))
        shares.append((timer.total / constrained_runs[-1], dict(timer.seconds)))
        free_runs.append(_timed_generate(llm, prompts, free_params))
    constrained_s, free_s = min(constrained_runs), min(free_runs)
    share, grammar_seconds = sorted(shares, key=lambda item: item[0])[len(shares) // 2]
    tokens = sum(lengths)
    result = {
        "valid": len(outputs) - len(failures), "num_valid_requests": len(outputs),
        "compile_ms": round(compile_s * 1e3, 1), "batch": args.batch, "tokens": tokens,
        "constrained_tok_s": round(tokens / constrained_s, 1), "unconstrained_tok_s": round(tokens / free_s, 1),
        "ratio": round(free_s / constrained_s, 3), "grammar_share": round(share, 4),
        "grammar_ms": {name: round(seconds * 1e3, 1) for name, seconds in grammar_seconds.items()},
    }
    return result


def _timed_generate(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def format_table(result: dict) -> str:
    rows = [
        ("valid outputs (temperature 1.0)", f"{result['valid']} / {result['num_valid_requests']}"),
        ("schema compile, cold (incl. vocabulary index)", f"{result['compile_ms']} ms"),
        (f"batch of {result['batch']}, constrained", f"{result['constrained_tok_s']} tok/s"),
        (f"batch of {result['batch']}, unconstrained (same lengths)", f"{result['unconstrained_tok_s']} tok/s"),
        ("constrained / unconstrained", f"{result['ratio']:.1%}"),
        ("grammar library share of constrained wall time (median run)", f"{result['grammar_share']:.2%}"),
        *((f"  {name}", f"{ms} ms") for name, ms in result["grammar_ms"].items()),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model path (default: the embedded SmolLM2)")
    parser.add_argument("--num-valid", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed runs of each batch (best kept)")
    args = parser.parse_args(argv)
    result = run(args)
    from pagellm.cpu_features import cpu_description

    result["cpu"] = cpu_description()
    print(f"CPU: {result['cpu']}")
    print(format_table(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
