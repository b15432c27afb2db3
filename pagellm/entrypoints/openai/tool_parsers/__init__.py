"""Tool-call parsers for tool_choice "auto": each finds calls in a model family's own output format
(--tool-call-parser NAME, vLLM's names)."""

from __future__ import annotations

from pagellm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedDelta,
    ToolCall,
    ToolCallStream,
    ToolParser,
    openai_tool_call,
)
from pagellm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagellm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagellm.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser={name!r} is not a known parser; allowed: {sorted(TOOL_PARSERS)}.")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ParsedDelta", "ToolCall", "ToolCallStream", "ToolParser",
           "get_tool_parser", "openai_tool_call"]
