"""Mistral's calls: the [TOOL_CALLS] control token, then a JSON list of {"name", "arguments"} objects that runs
to the end of the output: [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]."""

from __future__ import annotations

import json

from pagellm.entrypoints.openai.tool_parsers.base import MarkerToolParser, ToolCall, calls_from_json


class MistralToolParser(MarkerToolParser):
    name = "mistral"
    start_marker = "[TOOL_CALLS]"
    # A control token: decoding would drop it with the other special tokens.
    marker_is_special_token = True

    def parse_body(self, body: str) -> list[ToolCall]:
        return calls_from_json(json.loads(body))
