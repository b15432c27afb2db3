"""What every tool-call parser shares: the calls it finds, and one incremental scanner that turns a model's
streamed text into content deltas and whole tool calls, whatever the format's markers are.

A format (see hermes.py, llama3_json.py, mistral.py) says only where a call starts, where it ends (or that it
runs to the end of the output) and how its body reads as calls. The scanner does the rest the same way for
every format, so the non-streamed answer is by construction what the streamed deltas add up to.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    """One entry of OpenAI's message.tool_calls (arguments as JSON text)."""
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    # JSON text of an object, as OpenAI's function.arguments carries it.
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return openai_tool_call(self.name, self.arguments, self.id)


@dataclass
class ParsedDelta:
    """What one piece of model text adds to the reply: text outside any call, and the calls it completed."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A whole reply: its text outside the calls (None when there is none beside calls), and the calls."""

    content: str | None
    calls: list[ToolCall]

    @classmethod
    def of(cls, content: str, calls: list[ToolCall]) -> ExtractedToolCalls:
        """From the text and calls a stream gave: empty text beside calls is no content (OpenAI's null)."""
        return cls(None if calls and not content else content, calls)


class ToolParser(ABC):
    """A model family's tool-call format. Stateless: one instance serves every request."""

    # The name of --tool-call-parser, as vLLM names the same format.
    name: ClassVar[str]
    # True when the call marker is a special token, which decoding must then keep (skip_special_tokens=False).
    marker_is_special_token: ClassVar[bool] = False
    # The text that closes a call; None: a call runs to the end of the output.
    end_marker: ClassVar[str | None] = None

    @abstractmethod
    def find_start(self, text: str, at_output_start: bool) -> tuple[int, int] | None:
        """(where the opening marker begins, where the call's body begins) in `text`, or None.
        at_output_start: nothing but whitespace came before `text` (some formats call only there)."""

    @abstractmethod
    def partial_start_len(self, text: str, at_output_start: bool) -> int:
        """How many characters at the end of `text` could still grow into an opening marker (held back)."""

    @abstractmethod
    def parse_body(self, body: str) -> list[ToolCall]:
        """The calls a complete body holds; ValueError when it is not a well-formed call."""

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def extract(self, text: str) -> ExtractedToolCalls:
        whole = self.stream().feed(text, final=True)
        return ExtractedToolCalls.of(whole.content, whole.calls)


class MarkerToolParser(ToolParser):
    """A format whose calls open with a fixed marker that may appear anywhere in the output."""

    start_marker: ClassVar[str]

    def find_start(self, text: str, at_output_start: bool) -> tuple[int, int] | None:
        at = text.find(self.start_marker)
        return None if at < 0 else (at, at + len(self.start_marker))

    def partial_start_len(self, text: str, at_output_start: bool) -> int:
        return marker_prefix_len(text, self.start_marker)


def marker_prefix_len(text: str, marker: str) -> int:
    """The longest proper prefix of `marker` that `text` ends with."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class ToolCallStream:
    """One reply's scanner: feed it the text deltas as they come, then finish() once the output ends.

    Text is passed on as content until an opening marker; the call's text is then held until the call is
    complete (its end marker, or the end of the output) and comes out as whole ToolCalls, or, if its body is
    not a well-formed call, as the original text (content, as vLLM answers malformed calls). Only a tail that
    could still become a marker is held back from the content. Whitespace around calls is dropped, except
    one run of it between text before and text after a call; a reply without calls comes out unchanged."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._pending = ""  # text not yet passed on, outside any call
        self._call_text: str | None = None  # the current call's text after its marker; None outside a call
        self._marker = ""  # the text that opened the current call
        self._held_space = ""  # whitespace that a call may follow (then dropped) or text (then passed on)
        self._after_call = False  # whitespace right after a call is dropped too
        self._seen_text = False
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        """What `text` adds; final: the output ends with it, so an open call is parsed as it stands and held
        text is passed on."""
        delta = ParsedDelta()
        self._pending += text
        self._scan(delta)
        if final:
            if self._call_text is not None:
                self._close_call(delta, self._call_text, "")
                self._scan(delta)
            self._emit_text(delta, self._pending, final=True)
            self._pending = ""
        return delta

    def finish(self) -> ParsedDelta:
        """The rest, once the output has ended."""
        return self.feed("", final=True)

    def _scan(self, delta: ParsedDelta) -> None:
        parser = self._parser
        while True:
            if self._call_text is None:
                found = parser.find_start(self._pending, not self._seen_text)
                if found is None:
                    keep = parser.partial_start_len(self._pending, not self._seen_text)
                    cut = len(self._pending) - keep
                    self._emit_text(delta, self._pending[:cut])
                    self._pending = self._pending[cut:]
                    return
                marker_at, body_at = found
                self._emit_text(delta, self._pending[:marker_at])
                self._marker = self._pending[marker_at:body_at]
                self._call_text, self._pending = "", self._pending[body_at:]
            self._call_text += self._pending
            self._pending = ""
            end = parser.end_marker
            at = -1 if end is None else self._call_text.find(end)
            if at < 0:
                return
            body, self._pending = self._call_text[:at], self._call_text[at + len(end):]
            self._close_call(delta, body, end)

    def _close_call(self, delta: ParsedDelta, body: str, end: str) -> None:
        self._call_text = None
        try:
            calls = self._parser.parse_body(body)
        except ValueError:
            self._emit_text(delta, self._marker + body + end)
            return
        delta.calls += calls
        self.num_calls += len(calls)
        self._after_call = True

    def _emit_text(self, delta: ParsedDelta, text: str, final: bool = False) -> None:
        # Trailing whitespace is held: dropped if the reply ends after a call, passed on once text follows.
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        text = self._held_space + text
        if final:
            delta.content += text if self.num_calls == 0 else text.rstrip()
            self._held_space = ""
            return
        kept = text.rstrip()
        if kept:
            self._seen_text = True
        delta.content += kept
        self._held_space = text[len(kept):]


def call_from_json(value: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall:
    """A ToolCall from {"name": ..., "arguments": {...}} (or the format's other key for the arguments);
    arguments given as JSON text are accepted when they hold an object. ValueError otherwise."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        raise ValueError(f"not a call: {value!r:.80}")
    arguments = next((value[key] for key in arguments_keys if key in value), {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of {value['name']!r} are not an object: {arguments!r:.80}")
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def calls_from_json(value: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[ToolCall]:
    """One call object, or a non-empty list of them."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError("an empty list of calls")
    return [call_from_json(item, arguments_keys) for item in items]
