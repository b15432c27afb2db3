"""response_format, vLLM's guided_* / structured_outputs and tool calls through a real server and the openai client."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel

MESSAGES = [{"role": "user", "content": "Pick a color."}]
# Finite languages: the tiny random model always ends them (EOS is the only token left once complete).
PICK_SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                   "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


def _chat(client, **kwargs):
    return client.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, "max_tokens": 40,
                                             "temperature": 1.0, "seed": 3, "n": 2, **kwargs})


def test_response_format_json_schema_and_json_object(client):
    response = _chat(client, response_format={"type": "json_schema",
                                              "json_schema": {"name": "pick", "schema": PICK_SCHEMA}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        Pick.model_validate_json(choice.message.content)
    response = _chat(client, response_format={"type": "json_object"}, max_tokens=200)
    for choice in response.choices:
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model="tiny", messages=MESSAGES, max_tokens=40, response_format=Pick)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Pick)


def test_completions_take_response_format_and_vllm_extras(client):
    prompt = "Answer:"
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, n=2, seed=1,
                                         extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                             "name": "pick", "schema": PICK_SCHEMA}}})
    for choice in response.choices:
        Pick.model_validate_json(choice.text)
    extras = {
        "guided_regex": (r"[a-z]{2,4}-[0-9]{1,2}", lambda text: re.fullmatch(r"[a-z]{2,4}-[0-9]{1,2}", text)),
        "guided_choice": (["alpha", "beta gamma"], lambda text: text in ("alpha", "beta gamma")),
        "guided_grammar": ('root ::= "x" ("y" | "zz")', lambda text: text in ("xy", "xzz")),
        "guided_json": (PICK_SCHEMA, Pick.model_validate_json),
    }
    for field, (value, is_valid) in extras.items():
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, seed=2,
                                             extra_body={field: value})
        assert is_valid(response.choices[0].text), (field, response.choices[0].text)
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, stream=True,
                                         extra_body={"structured_outputs": {"choice": ["alpha", "beta gamma"]}})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) in ("alpha", "beta gamma")


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}}},
     "response_format", "cannot be compiled"),
    ({"guided_regex": "(ab"}, "guided_regex", "guided_regex='(ab' cannot be compiled"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "pass only one"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "schema"),
    ({"tools": [WEATHER_TOOL]}, "tool_choice", "tool_choice='auto'"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope'"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools.0", "function"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "pass one of them"),
])
def test_bad_structured_requests_are_400_naming_the_part(server, body, param, fragment):
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": MESSAGES, "stream": True, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_named_tool_call_plain_and_streamed(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = _chat(client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice)
    for item in response.choices:
        assert item.finish_reason == "stop" and item.message.content is None
        (call,) = item.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert set(json.loads(call.function.arguments)) == {"city", "unit"}
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, stream=True,
                                                tools=[WEATHER_TOOL], tool_choice=choice):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta_call.index, {"name": "", "arguments": ""})
            entry["name"] += delta_call.function.name or ""
            entry["arguments"] += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"])["unit"] in ("C", "F")


def test_required_tool_choice_picks_among_the_tools(client):
    response = _chat(client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", max_tokens=120)
    for item in response.choices:
        assert item.finish_reason == "tool_calls", item
        assert item.message.tool_calls
        for call in item.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert call.function.name in ("get_weather", "get_time")
            assert set(arguments) == ({"city", "unit"} if call.function.name == "get_weather" else {"zone"})


def test_a_tool_call_cut_short_comes_back_as_text(client):
    response = _chat(client, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=3, n=1)
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("[")
