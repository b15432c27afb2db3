"""Sampling parameters with vLLM's names and meanings, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

# Below this a temperature is treated as 0 (greedy), as vLLM does: dividing logits by it would overflow.
_SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    """What each RequestOutput of a request carries, as in vLLM."""

    CUMULATIVE = 0  # all text and tokens so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, one of several strings, an EBNF grammar or any
    JSON object (exactly one of them), with vLLM's names and meanings."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs sets {given or 'none'} of {list(_STRUCTURED_KINDS)}; set exactly one of them."
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json={self.json!r:.80} must be a JSON schema (a dict or a str).")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}={value!r:.80} must be a non-empty str.")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice={self.choice!r:.80} must be a non-empty list of str.")
            self.choice = list(self.choice)
            for option in self.choice:
                if not isinstance(option, str) or not option:
                    raise ValueError(f"structured_outputs.choice contains {option!r:.80}; every choice must be a "
                                     "non-empty str.")
                check_text("structured_outputs.choice", option)
        if self.json_object is not None:
            _check_bool("structured_outputs.json_object", self.json_object)

    @property
    def kind(self) -> str:
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False))


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Stop strings are matched on the detokenized text by the output processor; everything else
    (EOS, `stop_token_ids`, `max_tokens`, `min_tokens`) is enforced by the scheduler on token ids.
    """

    n: int = 1
    # Sequences to generate, of which the n with the highest cumulative log-probability are returned.
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Log-probabilities of the k most likely tokens (plus the chosen one) per generated / prompt token.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from the tokenizer/config; not user knobs.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # The compiled grammar of structured_outputs: a concurrent Future, compiling off the engine thread.
    structured_grammar: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Types first, strictly: a JSON "false" must not read as true, nor "abc" as ["abc"], in any route.
        for name in _BOOL_FIELDS:
            _check_bool(name, getattr(self, name))
        self.output_kind = _check_output_kind(self.output_kind)
        self.stop = _as_list("stop", self.stop, str)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids, int)
        if isinstance(self.top_k, int) and self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy ignores the truncation knobs; normalising them keeps the sampler's fast path simple.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        _check_int("n", self.n, lo=1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, lo=self.n, extra="(best_of must be >= n)")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name), f"-2 <= {name} <= 2", lambda v: -2 <= v <= 2)
        _check_real("repetition_penalty", self.repetition_penalty, "0 < repetition_penalty <= 10",
                    lambda v: 0 < v <= 10)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), lo=0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias={self.logit_bias!r} must be a dict of token id -> bias.")
            for token_id, bias in self.logit_bias.items():
                _check_int("logit_bias", token_id, lo=0)
                _check_real("logit_bias", bias, "-100 <= bias <= 100", lambda v: -100 <= v <= 100)
            self.logit_bias = {token_id: float(bias) for token_id, bias in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids, int)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids=[] would allow no token; pass at least one id, or None.")
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids", token_id, lo=0)
        if self.bad_words is not None:
            # A list only: a lone string here is more likely a mistake than one banned word.
            if not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(f"bad_words={self.bad_words!r:.80} must be a list of str.")
            self.bad_words = list(self.bad_words)
            for word in self.bad_words:
                if not isinstance(word, str) or not word.strip():
                    raise ValueError(f"bad_words={word!r:.80}: every bad word must be a non-blank str.")
                check_text("bad_words", word)
        if isinstance(self.structured_outputs, dict):  # as JSON routes (/generate) carry it
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}; allowed keys: {list(_STRUCTURED_KINDS)}.") from None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs={self.structured_outputs!r:.80} must be a StructuredOutputsParams "
                             "(or a dict of its fields).")
        _check_real("temperature", self.temperature, "temperature >= 0", lambda v: v >= 0)
        _check_real("top_p", self.top_p, "0 < top_p <= 1", lambda v: 0 < v <= 1)
        _check_int("top_k", self.top_k, lo=0, extra="(0 or -1 disables it)")
        _check_real("min_p", self.min_p, "0 <= min_p <= 1", lambda v: 0 <= v <= 1)
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not _INT64_MIN <= self.seed <= _INT64_MAX:
                # The generator takes 64 bits: a larger seed would alias a smaller one (2**64 samples as 0).
                raise ValueError(f"seed={self.seed} is out of range; allowed: {_INT64_MIN} <= seed <= {_INT64_MAX} "
                                 "(a signed 64-bit integer).")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} is greater than max_tokens={self.max_tokens}; "
                "allowed: 0 <= min_tokens <= max_tokens."
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, lo=0)
        for stop in self.stop:
            if not isinstance(stop, str) or stop == "":
                raise ValueError(f"stop={stop!r}: every stop string must be a non-empty str.")
            check_text("stop", stop)

    @property
    def num_sequences(self) -> int:
        """How many sequences the request generates (best_of, else n)."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0.0:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def __getstate__(self) -> dict:
        # The compiled grammar's Future (a lock inside) stays in this process: tensor-parallel ranks other than
        # rank 0 receive the params pickled, and take rank 0's sampled tokens rather than sample themselves.
        return {**self.__dict__, "structured_grammar": None}

    def clone(self) -> SamplingParams:
        copy = SamplingParams.__new__(SamplingParams)
        copy.__dict__.update(self.__dict__)
        copy.stop = list(self.stop)
        copy.stop_token_ids = list(self.stop_token_ids)
        copy.all_stop_token_ids = set(self.all_stop_token_ids)
        copy.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
        return copy


@dataclass
class BeamSearchParams:
    """Beam search settings, as vLLM's `LLM.beam_search` takes them.

    `early_stopping` follows transformers: True stops a prompt once beam_width hypotheses are
    finished, False stops when no running beam can beat the worst finished one at its current
    length, "never" only when none could at max length.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, lo=1)
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_real("temperature", self.temperature, "temperature = 0 (beam search here is deterministic)",
                    lambda v: v == 0)
        _check_real("length_penalty", self.length_penalty, "a finite number", lambda v: True)
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping={self.early_stopping!r}; allowed: True, False or 'never'.")


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")


def check_text(name: str, text: str) -> None:
    """Text must be encodable as UTF-8: JSON's "\\ud800" decodes to a lone surrogate, which the tokenizer
    cannot take (a TypeError deep inside it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} contains a lone surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}, which is "
            "not valid Unicode text; send valid UTF-8 (surrogates only in pairs) or remove it."
        ) from None


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r:.80} must be a bool (true or false).")


def _check_output_kind(value: object) -> RequestOutputKind:
    if isinstance(value, RequestOutputKind):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value in RequestOutputKind._value2member_map_:
        return RequestOutputKind(value)
    raise ValueError(f"output_kind={value!r:.80} must be a RequestOutputKind "
                     f"({', '.join(kind.name for kind in RequestOutputKind)}).")


def _as_list(name: str, value: object, item_type: type) -> list:
    """None -> [], a list/tuple/set -> list, a lone str -> [str]; anything else is a ValueError."""
    if value is None:
        return []
    if item_type is str and isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    raise ValueError(f"{name}={value!r} must be a list of {item_type.__name__}.")


def _check_int(name: str, value: object, lo: int | None = None, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an int{f' >= {lo}' if lo is not None else ''}. {extra}".strip())
    if lo is not None and value < lo:
        raise ValueError(f"{name}={value} is out of range; allowed: {name} >= {lo}. {extra}".strip())


def _check_real(name: str, value: object, allowed: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name}={value!r} must be a finite number; allowed: {allowed}.")
    if not ok(value):
        raise ValueError(f"{name}={value} is out of range; allowed: {allowed}.")
