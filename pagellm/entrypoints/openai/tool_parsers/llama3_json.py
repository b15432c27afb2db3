"""Llama 3.1/3.2's JSON calls: a reply that is (after optional <|python_tag|>) one or more
{"name": ..., "parameters": {...}} objects separated by ";". Only a reply that starts so is a call, as in vLLM:
a JSON object in the middle of prose is prose."""

from __future__ import annotations

import json

from pagellm.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser, call_from_json

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    marker_is_special_token = True

    def find_start(self, text: str, at_output_start: bool) -> tuple[int, int] | None:
        if not at_output_start:
            return None
        at = len(text) - len(text.lstrip())
        if text.startswith(PYTHON_TAG, at):
            return at, at + len(PYTHON_TAG)
        if text.startswith("{", at):
            return at, at  # the brace is part of the body
        return None

    def partial_start_len(self, text: str, at_output_start: bool) -> int:
        # At the start, whitespace and a beginning of <|python_tag|> may still open a call.
        if at_output_start and PYTHON_TAG.startswith(text.lstrip()):
            return len(text)
        return 0

    def parse_body(self, body: str) -> list[ToolCall]:
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        at = 0
        while True:
            at = len(body) - len(body[at:].lstrip())
            value, at = decoder.raw_decode(body, at)
            calls.append(call_from_json(value, ("parameters", "arguments")))
            rest = body[at:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                raise ValueError(f"calls must be separated by ';', not {rest[:20]!r}")
            at = len(body) - len(rest) + 1
