"""The benchmark workload and the metric arithmetic that throughput.py, serving.py and memory.py share.

The workload has the shape of vLLM's `random` dataset: each request's prompt length is drawn uniformly
from [floor(input_len * (1 - r)), ceil(input_len * (1 + r))] and its output length from
[max(1, floor(output_len * (1 - r))), ceil(output_len * (1 + r))], both ends included, r = range ratio.

The defaults, input_len=288, output_len=144, r=7/9, give prompts of 64-512 tokens and outputs of 32-256
tokens. The ratio is kept as an exact fraction: in floating point 288 * (1 + 0.7777...) can land a hair
above 512 and its ceiling would widen the range to 513.

Prompts are token ids drawn uniformly from the tokenizer's vocabulary minus its special and added tokens
(so no prompt carries a chat-template marker or an EOS), seeded, so a prompt is exactly as long as drawn.
"""

from __future__ import annotations

import argparse
import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

DEFAULT_NUM_PROMPTS = 64
DEFAULT_INPUT_LEN = 288
DEFAULT_OUTPUT_LEN = 144
DEFAULT_RANGE_RATIO = Fraction(7, 9)
DEFAULT_SEED = 0


# ---- workload ------------------------------------------------------------------------------------


def parse_ratio(text: str) -> Fraction:
    """A range ratio from the command line: a decimal ("0.5") or an exact fraction ("7/9"), 0 <= r < 1."""
    try:
        ratio = Fraction(text)
    except (ValueError, ZeroDivisionError) as error:
        raise argparse.ArgumentTypeError(f"range ratio {text!r} is not a number or a fraction like 7/9") from error
    if not 0 <= ratio < 1:
        raise argparse.ArgumentTypeError(f"range ratio {text} is out of range; allowed: 0 <= r < 1")
    return ratio


@dataclass(frozen=True)
class LengthRange:
    low: int
    high: int

    def __contains__(self, length: int) -> bool:
        return self.low <= length <= self.high

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


def length_range(mean: int, ratio: Fraction, minimum: int = 1) -> LengthRange:
    """vLLM's random-dataset bounds around `mean`, computed exactly, never below `minimum`."""
    low = max(minimum, math.floor(mean * (1 - ratio)))
    high = max(low, math.ceil(mean * (1 + ratio)))
    return LengthRange(low, high)


@dataclass(frozen=True)
class WorkloadSpec:
    num_prompts: int = DEFAULT_NUM_PROMPTS
    input_len: int = DEFAULT_INPUT_LEN
    output_len: int = DEFAULT_OUTPUT_LEN
    range_ratio: Fraction = DEFAULT_RANGE_RATIO
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is out of range; allowed: an int >= 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio={self.range_ratio} is out of range; allowed: 0 <= r < 1")

    @property
    def prompt_range(self) -> LengthRange:
        return length_range(self.input_len, Fraction(self.range_ratio))

    @property
    def output_range(self) -> LengthRange:
        return length_range(self.output_len, Fraction(self.range_ratio))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkloadSpec:
        return cls(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    # Exactly this many tokens are generated: every benchmark ignores EOS.
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    requests: list[BenchRequest]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(request.prompt_len for request in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(request.output_len for request in self.requests)

    @property
    def max_total_len(self) -> int:
        return max(request.total_len for request in self.requests)

    def describe(self) -> str:
        spec = self.spec
        return (
            f"{len(self.requests)} requests, prompts of {spec.prompt_range} tokens, outputs of "
            f"{spec.output_range} tokens (input_len={spec.input_len}, output_len={spec.output_len}, "
            f"range_ratio={spec.range_ratio}, seed={spec.seed}): {self.num_prompt_tokens:,} prompt and "
            f"{self.num_output_tokens:,} output tokens"
        )


def sampleable_token_ids(tokenizer, model_vocab_size: int | None = None) -> np.ndarray:
    """Ids a random prompt may use: the whole vocabulary except special and added tokens, and below the model's
    embedding size where that is smaller than the tokenizer (a shape benchmark's config with a short vocabulary)."""
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    limit = len(tokenizer) if model_vocab_size is None else min(len(tokenizer), model_vocab_size)
    return np.array([i for i in range(limit) if i not in excluded], dtype=np.int64)


def model_vocab_size(name: str | None) -> int | None:
    """vocab_size from an HF directory's config.json; None for anything else."""
    config = pathlib.Path(name).expanduser() / "config.json" if name else None
    if config is None or not config.is_file():
        return None
    import json

    return json.loads(config.read_text()).get("vocab_size")


def generate_workload(spec: WorkloadSpec, token_ids: Sequence[int] | np.ndarray) -> Workload:
    """The seeded workload: lengths first, then all prompt tokens in one draw, so each depends only on the seed."""
    vocabulary = np.asarray(token_ids, dtype=np.int64)
    if vocabulary.size == 0:
        raise ValueError("no token ids to draw prompts from")
    rng = np.random.default_rng(spec.seed)
    prompts, outputs = spec.prompt_range, spec.output_range
    prompt_lens = rng.integers(prompts.low, prompts.high + 1, size=spec.num_prompts)
    output_lens = rng.integers(outputs.low, outputs.high + 1, size=spec.num_prompts)
    drawn = vocabulary[rng.integers(0, vocabulary.size, size=int(prompt_lens.sum()))]
    ends = np.cumsum(prompt_lens)
    requests = [
        BenchRequest(drawn[end - length : end].tolist(), int(output_len))
        for end, length, output_len in zip(ends, prompt_lens, output_lens)
    ]
    return Workload(spec, requests)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload (vLLM's random dataset shape)")
    group.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS,
                       help="number of requests (default: %(default)s)")
    group.add_argument("--input-len", type=int, default=DEFAULT_INPUT_LEN,
                       help="mean prompt length in tokens; prompts are drawn uniformly from "
                            "[floor(L*(1-r)), ceil(L*(1+r))] (default: %(default)s, with r=7/9: 64-512)")
    group.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT_LEN,
                       help="mean output length in tokens, drawn like the prompt length, at least 1; EOS is "
                            "ignored so each request generates exactly its drawn length "
                            "(default: %(default)s, with r=7/9: 32-256)")
    group.add_argument("--range-ratio", type=parse_ratio, default=DEFAULT_RANGE_RATIO,
                       help="r, how far lengths spread around their means, 0 <= r < 1, as a decimal or an exact "
                            "fraction (default: 7/9)")
    group.add_argument("--seed", type=int, default=DEFAULT_SEED,
                       help="seed for lengths and prompt token ids; the same seed gives the same workload "
                            "(default: %(default)s)")


def load_tokenizer(name: str | None):
    """The tokenizer of a local HF directory or .gguf file; None means the default model's (SmolLM2)."""
    # pagellm's GGUF reader is imported only for GGUF models, so that another engine's environment
    # (vLLM's, for --engine vllm) can build the same workload from an HF directory without pagellm.
    if name is None or name in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer

        return load_gguf_tokenizer(default_model_path())
    path = pathlib.Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from pagellm.models.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "tokenizer_config.json").is_file() and len(ggufs) == 1:
            from pagellm.models.gguf_loader import load_gguf_tokenizer

            return load_gguf_tokenizer(ggufs[0])
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    raise ValueError(f"tokenizer/model {name!r} is not a local directory or .gguf file; pass a local path")


# ---- metrics -------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between order statistics, as numpy's default does."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} is out of range; allowed: 0 <= q <= 100")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


@dataclass(frozen=True)
class Distribution:
    """Mean, median and p99 of a metric; all None when nothing was measured (e.g. every request failed)."""

    mean: float | None
    median: float | None
    p99: float | None
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(None, None, None, 0)
        return cls(sum(values) / len(values), percentile(values, 50), percentile(values, 99), len(values))

    def scaled(self, factor: float) -> Distribution:
        def scale(value: float | None) -> float | None:
            return None if value is None else value * factor

        return Distribution(scale(self.mean), scale(self.median), scale(self.p99), self.count)


@dataclass(frozen=True)
class ThroughputResult:
    """One engine's run of a workload: useful tokens only (padding is not output)."""

    engine: str
    dtype: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    seconds: float

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.seconds

    def as_json(self) -> dict:
        return {
            "engine": self.engine,
            "dtype": self.dtype,
            "num_requests": self.num_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "elapsed_s": round(self.seconds, 4),
            "requests_per_s": round(self.requests_per_s, 4),
            "output_tokens_per_s": round(self.output_tokens_per_s, 3),
            "total_tokens_per_s": round(self.total_tokens_per_s, 3),
        }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(
            value.ljust(width) if i == 0 else value.rjust(width) for i, (value, width) in enumerate(zip(row, widths))
        ).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
