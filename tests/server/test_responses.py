"""POST /v1/responses (the OpenAI Responses API) through a real server and the official openai client, plain and
streamed, with function tools and previous_response_id; vLLM's /ping, /load and /render endpoints beside it.

One server serves the whole module: the tiny random model with a hermes-style chat template (so that tools
and tool calls reach the prompt), tool_choice "auto" on, load tracking and the render endpoints on. Greedy
sampling keeps every answer deterministic, so a streamed response must equal the plain one."""

from __future__ import annotations

import asyncio
import json
import shutil
from types import SimpleNamespace

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pagellm.entrypoints.cli import main
from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.protocol_responses import item_messages
from pagellm.entrypoints.openai.server_load import ServerLoadTracker
from pagellm.entrypoints.openai.serving import ServerConfig
from pagellm.entrypoints.openai.serving_render import check_enabled
from pagellm.entrypoints.openai.serving_responses import ResponseStore
from tests.server.conftest import TINY_SERVER_ARGS
from tests.server.test_tool_auto import CALL_REGEX, HERMES_TEMPLATE
from tests.server.utils import ServerProcess, wait_until

# A finite language: the constrained arguments always end.
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                               "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER_TOOL = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}
PICK_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
               "required": ["color"], "additionalProperties": False}
GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 12}
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta"]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, module_tmp_path_factory) -> str:
    path = module_tmp_path_factory.mktemp("tiny-responses")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir, module_tmp_path_factory):
    log_path = module_tmp_path_factory.mktemp("server") / "server.log"
    # Compact JSON: with vLLM's default whitespace the tiny random model rarely closes an object in time.
    server = ServerProcess(model_dir, [*TINY_SERVER_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                       "--enable-server-load-tracking", "--enable-scale-out",
                                       "--structured-outputs-config", '{"disable_any_whitespace": true}'], log_path)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def prompt_tokens(model_dir):
    """The number of prompt tokens the template makes of chat messages (and tools), counted independently."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def count(messages: list[dict], tools: list[dict] | None = None) -> int:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count


def _events(stream) -> list:
    events = list(stream)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events


# ---- text ---------------------------------------------------------------------------------------------


def test_text_response_plain_and_streamed(client, prompt_tokens):
    request = {**GREEDY, "input": "Tell me a story.", "instructions": "Be brief."}
    response = client.responses.create(**request)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.model == "tiny"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and response.output_text == message.content[0].text
    usage = response.usage
    expected = prompt_tokens([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Tell me a story."}])
    assert usage.input_tokens == expected and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert response.instructions == "Be brief." and response.max_output_tokens == 12 and response.temperature == 0
    if usage.output_tokens == 12:
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"

    events = _events(client.responses.create(**request, stream=True))
    types = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert types == STREAM_ORDER[:-1] + [event.type for event in deltas] + TEXT_END
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(event.delta for event in deltas) == response.output_text
    assert len({event.item_id for event in deltas}) == 1 and events[-4].text == response.output_text
    final = events[-1].response
    assert final.output_text == response.output_text and final.usage.output_tokens == usage.output_tokens
    assert final.output[0].id == events[2].item.id and final.status == response.status


def test_input_items_become_the_conversation(client, prompt_tokens):
    arguments = json.dumps({"city": "Paris"})
    items = [
        {"role": "developer", "content": "You report weather."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in"},
                                                         {"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
    ]
    response = client.responses.create(**GREEDY, input=items, tools=[WEATHER_TOOL], tool_choice="none")
    messages = [
        {"role": "developer", "content": "You report weather."},
        {"role": "user", "content": "Weather in\nParis?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    assert response.usage.input_tokens == prompt_tokens(messages, [CHAT_WEATHER_TOOL])
    assert response.output[0].type == "message" and response.tool_choice == "none"


def test_logprobs_are_included_on_request(client):
    response = client.responses.create(**GREEDY, input="Hi", include=["message.output_text.logprobs"], top_logprobs=2)
    part = response.output[0].content[0]
    assert len(part.logprobs) == response.usage.output_tokens
    assert "".join(entry.token for entry in part.logprobs) == part.text
    for entry in part.logprobs:
        # Greedy: the chosen token is the most likely one.
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    assert client.responses.create(**GREEDY, input="Hi").output[0].content[0].logprobs is None


def test_text_format_json_schema(client):
    response = client.responses.create(**{**GREEDY, "max_output_tokens": 40}, input="Pick a color.",
                                       text={"format": {"type": "json_schema", "name": "pick", "schema": PICK_SCHEMA}})
    assert response.status == "completed"
    assert json.loads(response.output_text)["color"] in ("red", "green", "blue")


# ---- previous_response_id and the store -----------------------------------------------------------------


def test_previous_response_id_chains_the_conversation(client, prompt_tokens):
    first = client.responses.create(**GREEDY, input="Hello there.", instructions="Answer in French.")
    second = client.responses.create(**GREEDY, input="And then?", previous_response_id=first.id)
    # Instructions do not carry over to the next response; the earlier turn and its answer do.
    history = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": first.output_text}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_tokens(history + [{"role": "user", "content": "And then?"}])
    streamed = _events(client.responses.create(**GREEDY, input="More.", previous_response_id=second.id, stream=True))
    third = streamed[-1].response
    history += [{"role": "user", "content": "And then?"}, {"role": "assistant", "content": second.output_text}]
    assert third.usage.input_tokens == prompt_tokens(history + [{"role": "user", "content": "More."}])
    # A streamed response is stored too, and GET returns what was answered.
    assert client.responses.retrieve(third.id).output_text == third.output_text
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()


def test_store_false_and_unknown_ids(client, http):
    unstored = client.responses.create(**GREEDY, input="Hi", store=False)
    assert unstored.store is False
    for response_id in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as error:
            client.responses.retrieve(response_id)
        assert error.value.body["param"] == "response_id" and "store=false" in error.value.body["message"]
        with pytest.raises(openai.NotFoundError) as error:
            client.responses.create(**GREEDY, input="Hi", previous_response_id=response_id)
        assert error.value.body["param"] == "previous_response_id"
    stored = client.responses.create(**GREEDY, input="Hi")
    # As vLLM: only a background response can be cancelled, and this server has none.
    body = http.post(f"/v1/responses/{stored.id}/cancel")
    assert body.status_code == 400 and body.json()["error"]["param"] == "response_id"
    assert http.post("/v1/responses/resp_unknown/cancel").status_code == 404
    replay = http.get(f"/v1/responses/{stored.id}", params={"stream": "true"})
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"


def test_store_keeps_the_most_recently_used_within_its_bounds():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for name in "abc":
        assert store.put({"id": name, "output": []}, [{"role": "user", "content": name}])
    assert store.get("a") is None and len(store) == 2
    store.get("b")  # now the most recently used: "c" goes first
    store.put({"id": "d", "output": []}, [])
    assert store.get("c") is None and store.get("b") is not None and store.get("d") is not None
    small = ResponseStore(max_entries=10, max_bytes=200)
    assert not small.put({"id": "big", "output": ["x" * 300]}, [])
    small.put({"id": "one", "output": ["x" * 90]}, [])
    small.put({"id": "two", "output": ["x" * 90]}, [])
    assert small.get("one") is None and small.get("two") is not None and small.num_bytes <= 200
    assert ResponseStore(0, 1000).put({"id": "x", "output": []}, []) is False


def test_output_items_fold_into_the_assistant_message():
    calls = [{"type": "function_call", "call_id": f"call_{i}", "name": "f", "arguments": "{}"} for i in range(2)]
    messages = item_messages([{"type": "message", "role": "assistant", "status": "completed",
                               "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
                              *calls], "input")
    assert messages == [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(2)]}]


# ---- function tools --------------------------------------------------------------------------------------


# "required" with parallel_tool_calls=false is constrained to one call (else greedy decoding of the random model
# goes on adding calls until max_output_tokens).
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_constrained_function_call_plain_and_streamed(client, prompt_tokens, tool_choice):
    request = {**GREEDY, "max_output_tokens": 40, "input": "Weather in Paris or Oslo?", "tools": [WEATHER_TOOL],
               "tool_choice": tool_choice, "parallel_tool_calls": False}
    response = client.responses.create(**request)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert response.usage.input_tokens == prompt_tokens([{"role": "user", "content": request["input"]}],
                                                        [CHAT_WEATHER_TOOL])
    events = _events(client.responses.create(**request, stream=True))
    assert [event.type for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[2].item.status == "in_progress" and events[2].item.arguments == ""
    assert events[4].arguments == call.arguments and events[5].item.arguments == call.arguments
    assert events[-1].response.output[0].call_id == events[5].item.call_id


def test_auto_tool_call_then_its_result_in_the_next_turn(client, prompt_tokens):
    request = {**GREEDY, "max_output_tokens": 60, "input": "Weather in Paris or Oslo?", "tools": [WEATHER_TOOL],
               "extra_body": {"structured_outputs": {"regex": "Let me check\\. " + CALL_REGEX}}}
    response = client.responses.create(**request)
    message, call = response.output
    assert message.type == "message" and message.content[0].text == "Let me check."
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    events = _events(client.responses.create(**request, stream=True))
    types = [event.type for event in events]
    assert types.index("response.output_text.done") < types.index("response.function_call_arguments.done")
    streamed = events[-1].response
    assert [item.type for item in streamed.output] == ["message", "function_call"]
    assert streamed.output[1].arguments == call.arguments and streamed.output[0].content[0].text == "Let me check."

    result = client.responses.create(**GREEDY, previous_response_id=response.id, tools=[WEATHER_TOOL],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "18 C"}])
    assert result.output[0].type == "message"
    messages = [{"role": "user", "content": request["input"]},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": json.loads(call.arguments)}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}]
    assert result.usage.input_tokens == prompt_tokens(messages, [CHAT_WEATHER_TOOL])


# ---- what is refused ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "web_search_preview"}]}, "tools.0.type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools.0.type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["file_search_call.results"]}, "include.0"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": []}, "input"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_output_tokens": 600}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_unsupported_requests_are_refused_naming_the_field(http, extra, param):
    body = http.post("/v1/responses", json={"model": "tiny", "input": "Hi", **extra})
    assert body.status_code == 400, body.text
    assert body.json()["error"]["param"] == param, body.json()


# ---- /ping, /load, /render ---------------------------------------------------------------------------------


def test_ping_answers_as_health(http):
    for method in ("GET", "POST"):
        answer = http.request(method, "/ping")
        assert answer.status_code == 200 and answer.content == b""


def test_load_counts_requests_in_flight(http):
    wait_until(lambda: http.get("/load").json() == {"server_load": 0}, 30, "an idle server's load of 0")
    http.post("/v1/responses", json={**GREEDY, "input": "Hi"})
    wait_until(lambda: http.get("/load").json() == {"server_load": 0}, 30, "the load back at 0")


def test_server_load_tracker_counts_until_the_response_ends():
    async def scenario() -> None:
        state = SimpleNamespace(server_load_metrics=0)
        release, started = asyncio.Event(), asyncio.Event()

        async def inner(scope, receive, send):
            started.set()
            await release.wait()
            if scope["path"] == "/v1/responses":
                raise RuntimeError("a failing handler")

        tracker = ServerLoadTracker(inner)

        async def call(path: str):
            scope = {"type": "http", "path": path, "app": SimpleNamespace(state=state)}
            return await tracker(scope, None, None)

        for path, fails in (("/v1/chat/completions", False), ("/v1/responses", True)):
            release.clear(), started.clear()
            task = asyncio.create_task(call(path))
            await started.wait()
            assert state.server_load_metrics == 1
            release.set()
            if fails:
                with pytest.raises(RuntimeError):
                    await task
            else:
                await task
            assert state.server_load_metrics == 0
        release.set()
        await call("/v1/completions/render")
        await call("/tokenize")
        assert state.server_load_metrics == 0

    asyncio.run(scenario())


def test_render_gives_the_token_ids_and_parameters_without_generating(http):
    prompts = ["Hello", "Hello there"]
    rendered = http.post("/v1/completions/render", json={"model": "tiny", "prompt": prompts, "max_tokens": 5,
                                                         "temperature": 0})
    assert rendered.status_code == 200, rendered.text
    for entry, prompt in zip(rendered.json(), prompts):
        assert entry["token_ids"] == http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert entry["request_id"].startswith("cmpl-") and entry["request_id"].endswith(f"-{prompts.index(prompt)}")
        assert entry["sampling_params"]["max_tokens"] == 5 and entry["sampling_params"]["temperature"] == 0
        assert entry["model"] == "tiny" and entry["stream"] is False and entry["priority"] == 0
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/v1/chat/completions/render", json={"model": "tiny", "messages": messages}).json()
    assert chat["token_ids"] == http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat["request_id"].startswith("chatcmpl-")
    assert chat["sampling_params"]["max_tokens"] == 512 - len(chat["token_ids"])
    response = http.post("/v1/responses/render", json={"model": "tiny", "input": "Hi", "text": {
        "format": {"type": "json_schema", "name": "pick", "schema": PICK_SCHEMA}}}).json()
    assert response["token_ids"] == chat["token_ids"]
    assert response["sampling_params"]["structured_outputs"] == {"json": PICK_SCHEMA}
    # Refused as the generating route refuses it.
    refused = http.post("/v1/chat/completions/render", json={"model": "tiny", "messages": messages, "max_tokens": 600})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_render_is_off_without_scale_out():
    serving = SimpleNamespace(config=ServerConfig(["tiny"], "tiny"))
    with pytest.raises(OpenAIError) as error:
        check_enabled(serving)
    assert error.value.status == 403 and "--enable-scale-out" in error.value.message


def test_store_bound_flag_is_checked_before_loading():
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--responses-store-max-entries", "-1"])
    assert "responses_store_max_entries=-1 is out of range; allowed: >= 0" in str(exit_info.value)
