"""POST /v1/responses, GET /v1/responses/{id} and POST /v1/responses/{id}/cancel: the OpenAI Responses API
as vLLM's server answers it, on the chat route's building blocks (chat template, sampling parameters,
structured output, tool plans and tool-call parsers).

One code path makes a response: the model's text deltas go through `OutputItems`, which builds the output
items and the stream events that announce them; a plain response is the same run with its events dropped,
so a streamed response and a plain one with the same seed hold the same output.

Finished responses are kept in memory (store=true, OpenAI's default) for previous_response_id and GET, in a
store bounded in entries and bytes that forgets the least recently used first.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from pagellm.entrypoints.openai.errors import OpenAIError, bad_request, from_exception
from pagellm.entrypoints.openai.logprobs import chat_logprobs
from pagellm.entrypoints.openai.protocol import ChatMessage, SamplingFields, TokenLogprob
from pagellm.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    check_supported,
    item_messages,
)
from pagellm.entrypoints.openai.serving import (
    Choice,
    OpenAIServing,
    PromptInput,
    abort_on_disconnect,
    kv_info,
    merge_outputs,
)
from pagellm.entrypoints.openai.structured import (
    ToolPlan,
    compiled_grammar,
    named_constraint,
    plan_tools,
    requested_structured_outputs,
    tool_calls_of,
)
from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCall
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


# ---- the store ---------------------------------------------------------------------------------------


@dataclass
class StoredResponse:
    response: dict
    # The conversation the response answered, without its instructions (they do not carry over to the next).
    messages: list[dict]
    num_bytes: int


class ResponseStore:
    """Finished responses by id, at most `max_entries` of them and `max_bytes` of their JSON; reading one marks
    it recently used, and the least recently used go first."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"the responses store needs max_entries >= 0 and max_bytes >= 0 (got {max_entries}, "
                             f"{max_bytes}).")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response: dict, messages: list[dict]) -> bool:
        """Keeps the response (False when it alone is over the byte bound, or the store holds nothing)."""
        num_bytes = len(json.dumps([response, messages], ensure_ascii=False).encode())
        if num_bytes > self.max_bytes or self.max_entries == 0:
            logger.warning("Response %s (%d bytes) is not stored: the store holds at most %d bytes and %d entries",
                           response["id"], num_bytes, self.max_bytes, self.max_entries)
            return False
        self._drop(response["id"])
        self._entries[response["id"]] = StoredResponse(response, messages, num_bytes)
        self.num_bytes += num_bytes
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes

    def not_found(self, response_id: str, param: str) -> OpenAIError:
        return OpenAIError(
            404, f"no stored response has the id {response_id!r}: it was never created here, was created with "
                 f"store=false, or was evicted (this server keeps the latest {self.max_entries} responses within "
                 f"{self.max_bytes} bytes; raise --responses-store-max-entries / --responses-store-max-bytes, or "
                 "send the conversation as input).", param, "response_not_found")


# ---- preparing a request -------------------------------------------------------------------------------


@dataclass
class PreparedResponse:
    """A request ready to run: its prompt and parameters, and what the response reports about them."""

    request: ResponsesRequest
    response_id: str
    created_at: int
    prompt: PromptInput
    params: SamplingParams
    plan: ToolPlan | None
    # Top log-probabilities per output token, when the request includes them; None: no log-probabilities.
    num_top: int | None
    # The conversation kept for a later previous_response_id: earlier turns and this input, no instructions.
    history: list[dict]
    max_output_tokens: int


async def prepare_response(serving: OpenAIServing, request: ResponsesRequest,
                           store: ResponseStore) -> PreparedResponse:
    serving.check_model(request.model)
    check_supported(request)
    history = _conversation(request, store)
    instructions = [{"role": "system", "content": request.instructions}] if request.instructions else []

    tools = chat_tools(request.tools)
    plan, structured = _output_constraint(request, tools, serving.config.auto_tool_parser)
    num_top = (request.top_logprobs or 0) if request.wants_logprobs else None
    if num_top is not None and plan is not None:
        raise bad_request(f"include={request.include!r} with tools is not supported: log-probabilities are given for "
                          "message text only; drop the include or the tools.", "include", "unsupported_parameter")
    fields = request.sampling_fields()
    if plan is not None and plan.parser is not None and plan.parser.marker_is_special_token:
        # The call marker is a special token, which the parser must see in the text.
        fields = fields.model_copy(update={"skip_special_tokens": False})
    template_kwargs = dict(request.chat_template_kwargs or {})
    if tools:
        template_kwargs.setdefault("tools", tools)
    messages = [ChatMessage.model_validate(message) for message in instructions + history]
    prompt = await serving.chat_prompt(messages, True, template_kwargs)
    serving.check_length(prompt, request.max_output_tokens, "input", "max_output_tokens")
    params = serving.sampling_params(fields, request.max_output_tokens, num_top, structured=structured)
    params.structured_grammar = await compiled_grammar(serving.engine, structured)
    max_output_tokens = request.max_output_tokens or serving.max_model_len - len(prompt.token_ids)
    return PreparedResponse(request, f"resp_{uuid.uuid4().hex}", int(time.time()), prompt, params, plan, num_top,
                            history, max_output_tokens)


def _conversation(request: ResponsesRequest, store: ResponseStore) -> list[dict]:
    """The chat messages before the model's answer, without the instructions: the previous response's
    conversation and output (when chained), then this input."""
    history: list[dict] = []
    if request.previous_response_id is not None:
        previous = store.get(request.previous_response_id)
        if previous is None:
            raise store.not_found(request.previous_response_id, "previous_response_id")
        # Copied: folding this input's calls into the last assistant message must not change the stored one.
        history = item_messages(previous.response["output"], "previous_response_id", copy.deepcopy(previous.messages))
    if isinstance(request.input, str):
        return history + [{"role": "user", "content": request.input}]
    if not request.input:
        raise bad_request("input is an empty list; pass at least one item, or the text as a string.", "input")
    return item_messages(request.input, "input", history)


def _output_constraint(request: ResponsesRequest, tools: list[dict],
                       auto_tool_parser: str | None) -> tuple[ToolPlan | None, StructuredOutputsParams | None]:
    """The tool plan and the output constraint: a constrained tool call, text.format or structured_outputs."""
    structured = _requested_format(request)
    choice = chat_tool_choice(request.tool_choice)
    if not tools and choice in ("none", "auto"):
        return None, structured
    if tools and choice == "auto" and auto_tool_parser is None:
        raise bad_request(
            "tool_choice='auto' (the default with tools) needs the server started with --enable-auto-tool-choice and "
            f"--tool-call-parser NAME (the model's tool-call format, one of {sorted(TOOL_PARSERS)}); or pass "
            "tool_choice='required' or {\"type\": \"function\", \"name\": ...} (the arguments are then constrained "
            "to the function's parameters), or 'none'.", "tool_choice", "unsupported_parameter")
    plan = plan_tools(tools, choice, auto_tool_parser)
    if choice == "required" and not request.parallel_tool_calls:
        # One call, constrained as such: the model cannot start a second one and be cut short in it.
        one_call = {**plan.structured.json, "maxItems": 1}
        plan = ToolPlan(named_constraint(StructuredOutputsParams(json=one_call), "tools", "tools"))
    if plan is not None and plan.structured is not None:
        if structured is not None:
            raise bad_request("a tool call (tool_choice) and a structured output (text.format / structured_outputs) "
                              "both constrain the output; pass one of them.", "tool_choice")
        structured = plan.structured
    return plan, structured


def _requested_format(request: ResponsesRequest) -> StructuredOutputsParams | None:
    """text.format (json_object / json_schema), or vLLM's structured_outputs; not both."""
    fmt = request.text.format if request.text is not None else None
    kind = fmt.get("type") if fmt is not None else "text"
    from_text = None
    if kind == "json_object":
        from_text = StructuredOutputsParams(json_object=True)
    elif kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request('text.format.schema is required with type "json_schema": {"type": "json_schema", '
                              '"name": ..., "schema": {...}}.', "text.format.schema")
        from_text = StructuredOutputsParams(json=schema)
    elif kind != "text":
        raise bad_request(f"text.format.type={kind!r} is not a format; allowed: 'text', 'json_object', "
                          "'json_schema'.", "text.format.type")
    from_vllm = None
    if request.structured_outputs is not None:
        from_vllm = requested_structured_outputs(
            SamplingFields.model_construct(structured_outputs=request.structured_outputs))
    if from_text is not None and from_vllm is not None:
        raise bad_request("text.format and structured_outputs both constrain the output; pass only one of them.",
                          "structured_outputs")
    if from_text is not None:
        return named_constraint(from_text, "text.format", "text.format")
    return from_vllm


# ---- output items and their events -------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The response's output items as the model's text comes in (a message, function calls), and the stream
    events that announce each: added, its deltas, done. Events carry no sequence numbers; the stream adds them."""

    def __init__(self, with_logprobs: bool, parallel_tool_calls: bool) -> None:
        self.items: list[dict] = []
        self.num_calls = 0
        self._with_logprobs = with_logprobs
        self._parallel_tool_calls = parallel_tool_calls
        self._message_index: int | None = None
        self._text: list[str] = []
        self._logprobs: list[dict] = []

    def add_text(self, text: str, logprobs: list[TokenLogprob] | None = None) -> list[dict]:
        if not text and not logprobs:
            return []
        events = self._open_message() if self._message_index is None else []
        self._text.append(text)
        self._logprobs += [logprob.model_dump() for logprob in logprobs or []]
        item = self.items[self._message_index]
        events.append({"type": "response.output_text.delta", "item_id": item["id"],
                       "output_index": self._message_index, "content_index": 0, "delta": text,
                       "logprobs": [_delta_logprob(logprob) for logprob in logprobs or []]})
        return events

    def add_calls(self, calls: list[ToolCall]) -> list[dict]:
        if not calls:
            return []
        events = self._close_message("completed")
        for call in calls:
            if self.num_calls and not self._parallel_tool_calls:
                break  # parallel_tool_calls=false: the first call only, as vLLM answers
            self.num_calls += 1
            item = {"id": _new_id("fc"), "type": "function_call", "status": "completed", "call_id": call.id,
                    "name": call.name, "arguments": call.arguments}
            index = len(self.items)
            self.items.append(item)
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "arguments": "", "status": "in_progress"}},
                {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index,
                 "delta": call.arguments},
                {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                 "name": call.name, "arguments": call.arguments},
                {"type": "response.output_item.done", "output_index": index, "item": item},
            ]
        return events

    def finish(self, cut_short: bool) -> list[dict]:
        """Closes the open message; a reply without any item gets an empty message, as a plain reply would."""
        status = "incomplete" if cut_short else "completed"
        events = self._close_message(status)
        if not self.items:
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": status, "content": []}
            self.items.append(item)
            events += [{"type": "response.output_item.added", "output_index": 0,
                        "item": {**item, "status": "in_progress"}},
                       {"type": "response.output_item.done", "output_index": 0, "item": item}]
        return events

    def _open_message(self) -> list[dict]:
        self._message_index = len(self.items)
        item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        self.items.append(item)
        self._text, self._logprobs = [], []
        return [{"type": "response.output_item.added", "output_index": self._message_index, "item": dict(item)},
                {"type": "response.content_part.added", "item_id": item["id"], "output_index": self._message_index,
                 "content_index": 0, "part": _text_part("", [])}]

    def _close_message(self, status: str) -> list[dict]:
        index = self._message_index
        if index is None:
            return []
        self._message_index = None
        text = "".join(self._text)
        part = _text_part(text, self._logprobs if self._with_logprobs else None)
        item = {**self.items[index], "status": status, "content": [part]}
        self.items[index] = item
        return [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "text": text, "logprobs": part["logprobs"] or []},
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "part": part},
                {"type": "response.output_item.done", "output_index": index, "item": item}]


def _text_part(text: str, logprobs: list[dict] | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _delta_logprob(logprob: TokenLogprob) -> dict:
    """A delta event's log-probability: OpenAI's shape there has no bytes."""
    return {"token": logprob.token, "logprob": logprob.logprob,
            "top_logprobs": [{"token": top.token, "logprob": top.logprob} for top in logprob.top_logprobs]}


# ---- running ----------------------------------------------------------------------------------------------

_STATUS_OF_FINISH = {"length": "incomplete", "abort": "cancelled"}


@dataclass
class ResponseRun:
    """One response being generated: the events as they come, then the finished response object."""

    serving: OpenAIServing
    prepared: PreparedResponse
    choices: list[Choice]
    output: OutputItems = field(init=False)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.output = OutputItems(self.prepared.num_top is not None, self.prepared.request.parallel_tool_calls)

    async def events(self, raw_request: Request) -> AsyncIterator[dict]:
        plan, num_top, tokenizer = self.prepared.plan, self.prepared.num_top, self.serving.tokenizer
        auto_calls = plan.parser.stream() if plan is not None and plan.parser is not None else None
        constrained_text: list[str] = []
        async with abort_on_disconnect(raw_request, self.serving.engine, self.choices):
            async for _, output in merge_outputs(self.serving.engine, self.choices):
                completion = output.outputs[0]
                self.num_output_tokens += len(completion.token_ids)
                self.num_cached_tokens = output.num_cached_tokens
                if output.finished:
                    self.finish_reason = completion.finish_reason
                if auto_calls is not None:
                    parsed = auto_calls.feed(completion.text, final=output.finished)
                    events = self.output.add_text(parsed.content) + self.output.add_calls(parsed.calls)
                elif plan is not None:
                    constrained_text.append(completion.text)  # a call is only known to parse once complete
                    events = []
                else:
                    logprobs = None
                    if num_top is not None and completion.token_ids:
                        logprobs = chat_logprobs(completion.token_ids, completion.logprobs or [], num_top,
                                                 tokenizer).content
                    events = self.output.add_text(completion.text, logprobs)
                for event in events:
                    yield event
        if plan is not None and auto_calls is None:
            for event in self._constrained_calls("".join(constrained_text)):
                yield event
        for event in self.output.finish(self.finish_reason == "length"):
            yield event

    def _constrained_calls(self, text: str) -> list[dict]:
        """tool_choice "required" or named: the calls in the constrained JSON; the text as it is when the output
        was cut short (max_output_tokens, a stop string) and does not parse."""
        if self.finish_reason != "stop":
            return self.output.add_text(text)
        try:
            calls = tool_calls_of(self.prepared.plan, text)
        except ValueError:
            return self.output.add_text(text)
        return self.output.add_calls([ToolCall(call["function"]["name"], call["function"]["arguments"], call["id"])
                                      for call in calls])

    @property
    def status(self) -> str:
        return _STATUS_OF_FINISH.get(self.finish_reason, "completed")

    def usage(self) -> dict:
        num_input = len(self.prepared.prompt.token_ids)
        return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": self.num_cached_tokens},
                "output_tokens": self.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": num_input + self.num_output_tokens}

    def response(self) -> dict:
        body = response_object(self.serving, self.prepared, self.status, self.output.items, self.usage())
        body["kv"] = kv_info(self.choices).to_dict()
        return body


def response_object(serving: OpenAIServing, prepared: PreparedResponse, status: str, output: list[dict],
                    usage: dict | None, error: dict | None = None) -> dict:
    """The Response object, with the fields OpenAI's and vLLM's carry."""
    request, params = prepared.request, prepared.params
    return {
        "id": prepared.response_id,
        "object": "response",
        "created_at": prepared.created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": prepared.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "metadata": request.metadata,
        "model": serving.model_name,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "prompt": None,
        "reasoning": None,
        "service_tier": request.service_tier,
        "store": request.store,
        "temperature": params.temperature if request.temperature is None else request.temperature,
        "text": request.text.model_dump() if request.text is not None else {"format": {"type": "text"}},
        # As vLLM reports it: "auto" without tools chooses nothing.
        "tool_choice": request.tool_choice if request.tools or request.tool_choice != "auto" else "none",
        "tools": request.tools,
        "top_logprobs": prepared.num_top,
        "top_p": params.top_p if request.top_p is None else request.top_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "truncation": request.truncation,
        "usage": usage,
        "user": request.user,
    }


# ---- the routes -------------------------------------------------------------------------------------------


async def create_response(serving: OpenAIServing, store: ResponseStore, request: ResponsesRequest,
                          raw_request: Request):
    prepared = await prepare_response(serving, request, store)
    choices = serving.submit(prepared.response_id, [prepared.prompt], prepared.params,
                             lora_request=serving.check_model(request.model))
    run = ResponseRun(serving, prepared, choices)
    if request.stream:
        return StreamingResponse(_stream(run, store, raw_request), media_type="text/event-stream")
    try:
        async for _ in run.events(raw_request):
            pass
    except Exception as exc:  # the engine's verdict on the request (bad input, failed step, dead engine)
        raise from_exception(exc) from exc
    response = run.response()
    _keep(store, prepared, response)
    return JSONResponse(response)


async def _stream(run: ResponseRun, store: ResponseStore, raw_request: Request) -> AsyncIterator[str]:
    sequence_numbers = itertools.count()

    def sse(event: dict) -> str:
        event["sequence_number"] = next(sequence_numbers)
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    prepared = run.prepared
    started = response_object(run.serving, prepared, "in_progress", [], None)
    yield sse({"type": "response.created", "response": started})
    yield sse({"type": "response.in_progress", "response": started})
    try:
        async for event in run.events(raw_request):
            yield sse(event)
    except Exception as exc:  # headers are out: the failure travels in the stream, as OpenAI sends it
        error = from_exception(exc)
        failed = response_object(run.serving, prepared, "failed", run.output.items, None,
                                 {"code": error.code or "server_error", "message": error.message})
        yield sse({"type": "response.failed", "response": failed})
        return
    response = run.response()
    _keep(store, prepared, response)
    yield sse({"type": "response.completed", "response": response})


def _keep(store: ResponseStore, prepared: PreparedResponse, response: dict) -> None:
    if prepared.request.store:
        store.put(response, prepared.history)


def retrieve_response(store: ResponseStore, response_id: str, stream: bool) -> JSONResponse:
    if stream:
        raise bad_request("stream=true replays a background response's events; this server has no background mode, "
                          "so GET returns the finished response: drop stream.", "stream", "unsupported_parameter")
    entry = store.get(response_id)
    if entry is None:
        raise store.not_found(response_id, "response_id")
    return JSONResponse(entry.response)


def cancel_response(store: ResponseStore, response_id: str) -> JSONResponse:
    """As vLLM: only a background response can be cancelled, and every response here finished in its request."""
    if store.get(response_id) is None:
        raise store.not_found(response_id, "response_id")
    raise bad_request(f"response {response_id!r} cannot be cancelled: it is not a background response (this server "
                      "has no background mode; a response finishes in the request that creates it).", "response_id")
