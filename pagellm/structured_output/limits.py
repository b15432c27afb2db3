"""How big a user-supplied grammar may be, checked in Python before xgrammar sees it.

xgrammar's JSON-schema conversion grows about cubically with nesting depth, a `pattern` with a large counted
repetition is unrolled, and compiling against the vocabulary is slow for patterns, string formats and optional
properties; none of it can be interrupted once started. So a grammar over these limits is refused at once: the
worst accepted one parses well under a second, and compiles in seconds at most (figures, and the machine they
were measured on: README, "Structured outputs"). The checks stop at the first limit passed, so their own work
is bounded too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING: objects and arrays nested in the schema document (the root is 1).
MAX_JSON_DEPTH = 64
# The schema's values (objects, arrays, scalars), each counted once per level it is nested at: the cost of
# xgrammar's conversion grows with depth times breadth, so a wide shallow schema and a narrow deep one both fit.
MAX_JSON_SIZE = 10_000
# The repetitions the schema's `pattern`s unroll to: each counted quantifier's bound, times those of the
# quantified groups around it, summed over the patterns ("[a-z]{1,64}@[a-z]{1,64}" is 128); parse time grows
# with the square of it.
MAX_PATTERN_REPETITIONS = 1_000
# What makes compiling against the vocabulary slow, per occurrence in the schema: a `pattern` (or
# patternProperties key), a string `format` (email, uri, date-time, ...: a large automaton each), and a property
# an object does not require (xgrammar's cost grows with the square of an object's optional properties).
MAX_JSON_PATTERNS = 64
# String formats are weighted by what each costs to compile (about 10 ms a unit, measured on the machine the
# README names); a format not listed weighs 1.
MAX_JSON_FORMAT_WEIGHT = 160
FORMAT_WEIGHTS = {"uri-template": 40, "email": 10, "uri": 10, "uri-reference": 10, "hostname": 4, "json-pointer": 2,
                  "relative-json-pointer": 2}
MAX_OPTIONAL_PROPERTIES = 256
# Optional items (?, *, {0,n}) of a regex, an EBNF grammar, or a JSON schema's patterns together: a run of
# them compiles in time that grows about cubically with its length (RegexCost).
MAX_OPTIONAL_ITEMS = 48
# Characters of a regex, an EBNF grammar or the choices' EBNF; of the strings (keys and values) of a JSON schema.
MAX_TEXT_CHARS = 64 * 1024
MAX_JSON_CHARS = 256 * 1024

_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")


@dataclass(frozen=True)
class GrammarSize:
    """What the limits measure of one grammar; errors name it."""

    kind: str
    chars: int
    depth: int = 0
    values: int = 0
    weighted: int = 0

    def describe(self) -> str:
        if self.kind == "json":
            return f"a JSON schema nested {self.depth} deep, {self.values} values, size {self.weighted}"
        return f"{self.chars} characters"


@dataclass(frozen=True)
class GrammarLimits:
    max_json_depth: int = MAX_JSON_DEPTH
    max_json_size: int = MAX_JSON_SIZE
    max_pattern_repetitions: int = MAX_PATTERN_REPETITIONS
    max_json_patterns: int = MAX_JSON_PATTERNS
    max_json_format_weight: int = MAX_JSON_FORMAT_WEIGHT
    max_optional_properties: int = MAX_OPTIONAL_PROPERTIES
    max_optional_items: int = MAX_OPTIONAL_ITEMS
    max_text_chars: int = MAX_TEXT_CHARS
    max_json_chars: int = MAX_JSON_CHARS


class GrammarTooLarge(ValueError):
    """A grammar over one of the limits, refused before parsing."""


def measure_text(kind: str, text: str, limits: GrammarLimits, name: str) -> GrammarSize:
    """The size of a regex, EBNF grammar or choices' EBNF; GrammarTooLarge naming it and the limit if too long,
    or (regex, EBNF) with too many optional items."""
    if len(text) > limits.max_text_chars:
        raise GrammarTooLarge(f"{name} is {len(text)} characters long, more than the limit of {limits.max_text_chars}; "
                              "shorten it.")
    if kind in ("regex", "grammar"):
        optional = regex_cost(text, ebnf=kind == "grammar").optional
        if optional > limits.max_optional_items:
            raise GrammarTooLarge(_too_many_optional(name, optional, limits))
    return GrammarSize(kind, len(text))


def _too_many_optional(name: str, optional: int, limits: GrammarLimits) -> str:
    return (f"{name} has {optional} optional items (?, * or {{0,n}}, those inside a counted repetition counted once "
            f"per repetition), more than the limit of {limits.max_optional_items}: compiling a run of them takes time "
            "that grows about with the cube of their number; simplify it.")


def measure_schema(schema: object, limits: GrammarLimits, name: str) -> GrammarSize:
    """The size of a JSON schema document; GrammarTooLarge naming the size and the limit as soon as it passes
    one. Walks without recursion (a deep document must not overflow the stack), and counts an object's or
    array's children before listing them, so that a huge one is refused in constant time."""
    walk = _SchemaWalk(limits, name)
    stack: list[tuple[object, int]] = [(schema, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, str):
            walk.chars += len(value)
        elif isinstance(value, (dict, list)):
            walk.enter(value, level, schema)
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, level + 1) for child in children)
        if walk.chars > limits.max_json_chars:
            raise GrammarTooLarge(f"{name}: the JSON schema's strings (keys and values) are more than "
                                  f"{limits.max_json_chars} characters, the limit; shorten them.")
    return GrammarSize("json", walk.chars, walk.depth, walk.values, walk.weighted)


class _SchemaWalk:
    """What measure_schema has counted so far, and the checks against the limits."""

    def __init__(self, limits: GrammarLimits, name: str) -> None:
        self.limits, self.name = limits, name
        self.values = self.weighted = 1
        self.depth = self.chars = self.patterns = self.formats = self.optional = 0
        self.regex = _NONE

    def enter(self, value: dict | list, level: int, document: object) -> None:
        limits = self.limits
        self.depth = max(self.depth, level)
        if level > limits.max_json_depth:
            self._refuse(f"nests objects and arrays {_nesting(document, limits.max_json_size)} levels deep, more than "
                         f"the limit of {limits.max_json_depth}; flatten it, e.g. with $defs and $ref")
        self.values += len(value)
        self.weighted += len(value) * (level + 1)
        if self.weighted > limits.max_json_size:
            self._refuse(f"is larger than the limit of size {limits.max_json_size} (its values, each counted once per "
                         f"level it is nested at: at least {self.weighted} here, {self.values} values, nested "
                         f"{self.depth} deep); split it or simplify it")
        if isinstance(value, dict):
            self.chars += sum(len(key) for key in value)
            self._keywords(value)

    def _keywords(self, schema: dict) -> None:
        limits = self.limits
        patterns = [schema["pattern"]] if isinstance(schema.get("pattern"), str) else []
        if isinstance(schema.get("patternProperties"), dict):
            patterns.extend(schema["patternProperties"])
        self.patterns += len(patterns)
        if self.patterns > limits.max_json_patterns:
            self._refuse(f"has more than {limits.max_json_patterns} patterns (pattern and patternProperties), the "
                         "limit; each compiles into its own automaton")
        for pattern in patterns:
            self.regex += regex_cost(pattern)
            if self.regex.repetitions > limits.max_pattern_repetitions:
                self._refuse(f"has patterns that repeat up to {self.regex.repetitions} times (counted repetitions such "
                             f"as {{1,N}}, multiplied where they nest; here, at {pattern[:80]!r}), more than the limit "
                             f"of {limits.max_pattern_repetitions}; use * or + instead of large counts, or a maxLength")
            if self.regex.optional > limits.max_optional_items:
                name = f"{self.name}: the JSON schema's patterns"
                raise GrammarTooLarge(_too_many_optional(name, self.regex.optional, limits))
        if isinstance(schema.get("format"), str) and _may_be_string(schema):
            self.formats += FORMAT_WEIGHTS.get(schema["format"], 1)
            if self.formats > limits.max_json_format_weight:
                self._refuse(f"has string formats of weight {self.formats} or more, more than the limit of "
                             f"{limits.max_json_format_weight} (each compiles into an automaton; weights: "
                             f"{FORMAT_WEIGHTS}, any other format 1)")
        properties, required = schema.get("properties"), schema.get("required")
        if isinstance(properties, dict):
            required = set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) else ()
            self.optional += sum(name not in required for name in properties)
            if self.optional > limits.max_optional_properties:
                self._refuse(f"has more than {limits.max_optional_properties} optional properties (not listed in "
                             "their object's required), the limit; compiling them takes time that grows with the "
                             "square of their number: list them in required, or split the schema")

    def _refuse(self, reason: str) -> None:
        raise GrammarTooLarge(f"{self.name}: the JSON schema {reason}.")


def _may_be_string(schema: dict) -> bool:
    """Whether a schema admits strings: only then is its format an automaton ("int64" on an integer is not)."""
    kind = schema.get("type")
    return kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)


def _nesting(document: object, budget: int) -> str:
    """How deep a document nests objects and arrays, looking at no more than `budget` of its containers:
    "400", or "at least 1234" where the budget ran out."""
    depth, seen = 0, 0
    stack: list[tuple[object, int]] = [(document, 1)]
    while stack and seen < budget:
        value, level = stack.pop()
        seen += 1
        depth = max(depth, level)
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return f"at least {depth}" if stack else str(depth)


@dataclass(frozen=True)
class RegexCost:
    """What makes a regex (or EBNF) slow for xgrammar. `repetitions`: how many times its counted repetitions
    unroll, each {n}, {n,} or {m,n} contributing its bound times the repetitions inside what it repeats (at
    least 1); a JSON schema pattern's conversion is quadratic in it. `optional`: its optional items (?, *,
    {0,n}), those inside a counted repetition counted once per repetition; compiling a run of them against the
    vocabulary grows about cubically with its length (a regex of 300 "a?" took a minute)."""

    repetitions: int
    optional: int

    def __add__(self, other: RegexCost) -> RegexCost:
        return RegexCost(self.repetitions + other.repetitions, self.optional + other.optional)


_NONE = RegexCost(0, 0)


def regex_cost(text: str, ebnf: bool = False) -> RegexCost:
    """The RegexCost of a regex, or with ebnf=True of an EBNF grammar (its "..." literals are single items)."""
    frames = [_NONE]  # the cost of each open group's content so far
    atom: RegexCost | None = None  # the cost of the item just read, until a quantifier may apply to it
    i = 0
    while i < len(text):
        char = text[i]
        quantifier = _QUANTIFIER.match(text, i) if char == "{" and atom is not None else None
        if quantifier is not None:
            low, high = int(quantifier.group(1)), quantifier.group(2)
            bound = int(high) if high else low
            atom = RegexCost(bound * max(1, atom.repetitions), bound * atom.optional + (low == 0))
            i = quantifier.end()
            continue
        if char in "*+?" and atom is not None:
            atom = atom if char == "+" else RegexCost(atom.repetitions, atom.optional + 1)
            i += 1
            continue
        frames[-1] += atom or _NONE
        atom = None
        if char == "(":
            frames.append(_NONE)
        elif char == ")" and len(frames) > 1:
            atom = frames.pop()
        elif char == "\\":
            atom, i = _NONE, i + 1
        elif char == "[":
            atom, i = _NONE, _class_end(text, i)
        elif char == '"' and ebnf:
            atom, i = _NONE, _literal_end(text, i)
        elif char not in "|?*+":
            atom = _NONE
        i += 1
    total = atom or _NONE
    for frame in frames:
        total += frame
    return total


def _literal_end(text: str, start: int) -> int:
    """The index of the quote that closes the EBNF string literal opening at `start` (or the last index)."""
    i = start + 1
    while i < len(text) and text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    return min(i, len(text) - 1)


def _class_end(pattern: str, start: int) -> int:
    """The index of the `]` that closes the character class opening at `start` (or the last index)."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1  # a leading ] is a literal
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return min(i, len(pattern) - 1)
