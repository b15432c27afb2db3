"""Mistral's calls: the [TOOL_CALLS] control token, then the calls, running to the end of the output. Before
tokenizer v11, a JSON list of {"name", "arguments"} objects: [TOOL_CALLS][{"name": "f", "arguments": {...}}];
from v11 on, name[ARGS]arguments per call, each after its own marker: [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}."""

from __future__ import annotations

import json

from pagellm.entrypoints.openai.tool_parsers.base import MarkerToolParser, ToolCall, call_from_json, calls_from_json

ARGS_MARKER = "[ARGS]"


class MistralToolParser(MarkerToolParser):
    name = "mistral"
    start_marker = "[TOOL_CALLS]"
    # A control token: decoding would drop it with the other special tokens.
    marker_is_special_token = True

    def parse_body(self, body: str) -> list[ToolCall]:
        if body.lstrip().startswith(("[", "{")):
            return calls_from_json(json.loads(body))
        calls = []
        for part in body.split(self.start_marker):
            name, marker, arguments = part.partition(ARGS_MARKER)
            if not marker:
                raise ValueError(f"no {ARGS_MARKER} after the function name in {part[:40]!r}")
            calls.append(call_from_json({"name": name.strip(), "arguments": json.loads(arguments)}))
        return calls
