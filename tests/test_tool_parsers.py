"""Tool-call parsers (tool_choice "auto"): each format, several calls, text around calls, malformed calls, and
streaming with the text cut at every boundary: the deltas add up to the whole reply's parse, and no marker
text ever reaches the content."""

from __future__ import annotations

import json
import random

import pytest

from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ExtractedToolCalls, get_tool_parser

WEATHER = {"city": "Paris", "unit": "C"}


def _hermes(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", _hermes("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    ("hermes", "Let me look that up.\n" + _hermes("get_weather", WEATHER) + "\n" + _hermes("get_time", {"zone": "UTC"}),
     "Let me look that up.", [("get_weather", WEATHER), ("get_time", {"zone": "UTC"})]),
    ("hermes", "Before " + _hermes("get_time", {}) + " and after.", "Before and after.", [("get_time", {})]),
    # SmolLM2's prompt asks for a list of calls in one block; arguments as JSON text are read as well.
    ("hermes", '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": "{\\"y\\": 2}"}]'
               "</tool_call>", None, [("a", {"x": 1}), ("b", {"y": 2})]),
    # A model that ends right after the JSON, without the closing tag.
    ("hermes", 'Sure. <tool_call>{"name": "a", "arguments": {"x": 1}}', "Sure.", [("a", {"x": 1})]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.\n", "No tools needed: 2 < 3 and <tool is not a tag.\n",
     []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', None,
     [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", {"x": 1}), ("b", {})]),
    ("llama3_json", '  \n{"name": "a", "arguments": {"x": [1, 2]}}', None, [("a", {"x": [1, 2]})]),
    ("llama3_json", 'The call would be {"name": "a", "parameters": {}}', 'The call would be {"name": "a", "parameters": {}}',
     []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]', None,
     [("get_weather", WEATHER)]),
    ("mistral", 'Checking. [TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"q": "[x]"}}]',
     "Checking.", [("a", {}), ("b", {"q": "[x]"})]),
    # Tokenizer v11 and later: name[ARGS]arguments, one marker per call.
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}[TOOL_CALLS]b[ARGS]{}', None,
     [("get_weather", WEATHER), ("b", {})]),
    ("mistral", "Just text with [brackets] and TOOL_CALLS.", "Just text with [brackets] and TOOL_CALLS.", []),
]

# Malformed calls come back as the text the model wrote (vLLM's answer), never as an error.
MALFORMED = [
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": </tool_call>'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "a", "arguments": [1]}</tool_call> then text'),
    ("hermes", "<tool_call>[]</tool_call>"),
    ("hermes", '<tool_call>{"name": "a", "argu'),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}} trailing words'),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1'),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}'),
    ("mistral", "[TOOL_CALLS]not json"),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g{"y": 2}'),
]


MARKERS = {"hermes": ["<tool_call>", "</tool_call>"], "llama3_json": ["<|python_tag|>"], "mistral": ["[TOOL_CALLS]"]}


def _calls(result: ExtractedToolCalls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in result.calls]


@pytest.mark.parametrize("parser_name, text, content, calls", CASES)
def test_whole_reply(parser_name, text, content, calls):
    result = get_tool_parser(parser_name).extract(text)
    assert result.content == content
    assert _calls(result) == calls
    assert not any(marker in (result.content or "") for marker in MARKERS[parser_name])
    assert all(call.id.startswith("call_") and len(call.id) == 29 for call in result.calls)
    assert len({call.id for call in result.calls}) == len(result.calls)


@pytest.mark.parametrize("parser_name, text", MALFORMED)
def test_malformed_call_is_the_text(parser_name, text):
    result = get_tool_parser(parser_name).extract(text)
    assert result.calls == [] and result.content == text


def test_a_malformed_call_beside_a_good_one_keeps_both():
    bad = '<tool_call>{"name": oops}</tool_call>'
    result = get_tool_parser("hermes").extract(_hermes("a", {}) + "\n" + bad)
    assert _calls(result) == [("a", {})] and result.content == bad


def _streamed(parser_name: str, pieces: list[str]) -> ExtractedToolCalls:
    stream = get_tool_parser(parser_name).stream()
    contents, calls = [], []
    for piece in pieces:
        delta = stream.feed(piece)
        contents.append(delta.content)
        calls += delta.calls
    final = stream.finish()
    contents.append(final.content)
    calls += final.calls
    return ExtractedToolCalls.of("".join(contents), calls)


def _check_stream(parser_name: str, text: str, pieces: list[str]) -> None:
    """The streamed deltas add up to the whole reply's parse (so no marker of a parsed call leaks: see
    test_whole_reply), with the calls in order."""
    whole = get_tool_parser(parser_name).extract(text)
    streamed = _streamed(parser_name, pieces)
    assert streamed.content == whole.content, pieces
    assert _calls(streamed) == _calls(whole), pieces


@pytest.mark.parametrize("parser_name, text", [(case[0], case[1]) for case in CASES + MALFORMED])
def test_stream_split_at_every_boundary(parser_name, text):
    for cut in range(len(text) + 1):
        _check_stream(parser_name, text, [text[:cut], text[cut:]])
    _check_stream(parser_name, text, list(text))


@pytest.mark.parametrize("seed", range(20))
def test_stream_in_random_pieces(seed):
    rng = random.Random(seed)
    parser_name, text, *_ = rng.choice(CASES + [(*case, None, None) for case in MALFORMED])
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    _check_stream(parser_name, text, pieces)


def test_text_is_passed_on_as_it_comes_and_only_a_possible_marker_is_held():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hello world").content == "Hello world"
    assert stream.feed(" <tool").content == ""  # " <tool" could open a call: held back
    assert stream.feed("box> is a word").content == " <toolbox> is a word"
    assert stream.finish().content == ""


def test_registry_names_and_unknown_parser():
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="'qwen9'.*allowed: \\['hermes', 'llama3_json', 'mistral'\\]"):
        get_tool_parser("qwen9")
