"""Hermes-style calls, as Qwen2.5/Qwen3, Hermes 2/3 and SmolLM3's chat templates ask for them:
<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>, one block per call.
SmolLM2's function-calling prompt puts a JSON list of calls in one block; that is read too."""

from __future__ import annotations

import json

from pagellm.entrypoints.openai.tool_parsers.base import MarkerToolParser, ToolCall, calls_from_json


class HermesToolParser(MarkerToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def parse_body(self, body: str) -> list[ToolCall]:
        return calls_from_json(json.loads(body))
