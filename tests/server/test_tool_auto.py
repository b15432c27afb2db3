"""tool_choice "auto" through a real server and the openai client: the tools written into the prompt by the
chat template, the model's hermes-format calls read back as OpenAI tool_calls, plain and streamed.

A random tiny model never writes a tool call by itself, so each test makes it write one the honest way: a
regex (vLLM's structured_outputs) constrains its free text to a hermes call. The server does not know why
the text looks so; it parses it as it would any model's, through the same parser and streaming path."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from transformers import AutoTokenizer

from pagellm.entrypoints.cli import main
from tests.server.conftest import TINY_SERVER_ARGS
from tests.server.utils import ServerProcess

# A Qwen2.5-like template, cut down: tools in the system turn, calls as <tool_call> blocks, tool results.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call, reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{%- if message.role == 'assistant' and message.tool_calls %}
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}
{%- elif message.role == 'tool' %}
<tool_response>{{ message.content }}</tool_response>
{%- else %}
{{ message.content }}
{%- endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris or Oslo?"}]
CALL_REGEX = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def tools_model_dir(tiny_llama_dir, module_tmp_path_factory) -> str:
    path = module_tmp_path_factory.mktemp("tiny-tools")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tool_server(tools_model_dir, module_tmp_path_factory):
    log_path = module_tmp_path_factory.mktemp("server") / "server.log"
    server = ServerProcess(tools_model_dir, [*TINY_SERVER_ARGS, "--enable-auto-tool-choice",
                                             "--tool-call-parser", "hermes"], log_path)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, regex: str, **kwargs):
    return client.chat.completions.create(**{
        "model": "tiny", "messages": MESSAGES, "tools": [WEATHER_TOOL], "max_tokens": 60, "temperature": 1.0,
        "seed": 5, "extra_body": {"structured_outputs": {"regex": regex}}, **kwargs})


def _arguments(call) -> dict:
    return json.loads(call.function.arguments)


def test_auto_call_with_text_before_it(client):
    # tool_choice absent with tools is "auto", as in OpenAI's API.
    response = _chat(client, "Let me check\\. " + CALL_REGEX, n=2)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        assert _arguments(call)["city"] in ("Paris", "Oslo")


def test_tools_are_rendered_into_the_prompt(client, tools_model_dir):
    response = _chat(client, CALL_REGEX, tool_choice="auto")
    tokenizer = AutoTokenizer.from_pretrained(tools_model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert "get_weather" in prompt
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert response.choices[0].message.content is None and len(response.choices[0].message.tool_calls) == 1


def test_two_calls_streamed_never_leak_the_marker(client):
    regex = "On it\\.\\n" + CALL_REGEX + "\\n" + CALL_REGEX
    plain = _chat(client, regex, max_tokens=120)
    stream = _chat(client, regex, stream=True, max_tokens=120)
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert "<" not in (delta.content or ""), delta.content
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "On it."
    assert sorted(calls) == [0, 1] and calls[0]["id"] != calls[1]["id"]
    # The same seed samples the same text: the streamed calls are the plain response's.
    assert [(entry["name"], json.loads(entry["arguments"])) for entry in calls.values()] == \
           [(call.function.name, _arguments(call)) for call in plain.choices[0].message.tool_calls]


def test_plain_text_and_malformed_calls_are_content(client):
    response = _chat(client, "It is sunny\\.")
    assert response.choices[0].message.content == "It is sunny."
    assert response.choices[0].message.tool_calls is None and response.choices[0].finish_reason == "stop"
    broken = '<tool_call>{"name": get_weather}</tool_call>'
    for stream in (False, True):
        response = _chat(client, broken.replace("{", "\\{").replace("}", "\\}"), stream=stream)
        if stream:
            chunks = list(response)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
            assert not any(chunk.choices[0].delta.tool_calls for chunk in chunks)
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            text = response.choices[0].message.content
            assert response.choices[0].message.tool_calls is None
        assert text == broken
    # Cut short inside a call: the text so far, and "length".
    response = _chat(client, CALL_REGEX, max_tokens=8)
    assert response.choices[0].finish_reason == "length" and response.choices[0].message.tool_calls is None
    calls = [f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}</tool_call>'
             for city in ("Paris", "Oslo")]
    content = response.choices[0].message.content
    assert content and any(call.startswith(content) for call in calls), content  # 8 tokens of one of them


def test_multi_turn_with_tool_calls_and_results(client, tools_model_dir):
    arguments = json.dumps({"city": "Paris"})
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    response = _chat(client, "It is 18 C in Paris\\.", messages=messages)
    assert response.choices[0].message.content == "It is 18 C in Paris."
    # The template got the arguments as an object (as transformers' templates expect), not as quoted text.
    tokenizer = AutoTokenizer.from_pretrained(tools_model_dir)
    expected = [*messages[:1], {**messages[1], "content": "", "tool_calls": [
        {**messages[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        messages[2]]
    prompt = tokenizer.apply_chat_template(expected, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert '"arguments": {"city": "Paris"}' in prompt
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_auto_tool_choice_flags_are_checked_before_loading(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--enable-auto-tool-choice"])
    assert "--enable-auto-tool-choice needs --tool-call-parser" in str(exit_info.value)
    assert "'hermes', 'llama3_json', 'mistral'" in str(exit_info.value)
    with pytest.raises(SystemExit):
        main(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "qwen9"])
    assert "invalid choice: 'qwen9'" in capsys.readouterr().err
