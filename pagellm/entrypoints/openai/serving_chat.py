"""POST /v1/chat/completions: messages through the model's chat template, then one completion per choice."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from pagellm.entrypoints.openai.errors import bad_request, from_exception
from pagellm.entrypoints.openai.logprobs import chat_logprobs
from pagellm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    UsageInfo,
)
from pagellm.entrypoints.openai.serving import (
    SSE_DONE,
    Choice,
    OpenAIServing,
    abort_on_disconnect,
    kv_info,
    merge_outputs,
    sse,
)
from pagellm.entrypoints.openai.structured import (
    ToolPlan,
    compiled_grammar,
    plan_tools,
    requested_structured_outputs,
    tool_calls_of,
)
from pagellm.entrypoints.openai.tool_parsers import ToolCallStream


def _structured_outputs(request: ChatCompletionRequest, auto_tool_parser: str | None) -> tuple[ToolPlan | None, object]:
    """The tool plan and the output constraint of a chat request: a constrained tool call or response_format,
    not both (tool_choice "auto" constrains nothing, so a structured output may shape its free text)."""
    plan = plan_tools(request.tools, request.tool_choice, auto_tool_parser)
    structured = requested_structured_outputs(request)
    if plan is not None and plan.structured is not None:
        if structured is not None:
            raise bad_request("a tool call (tool_choice) and a structured output (response_format / guided_*) both "
                              "constrain the output; pass one of them.", "tool_choice")
        structured = plan.structured
    return plan, structured


def _message(plan: ToolPlan | None, choice: Choice) -> tuple[ChatResponseMessage, str | None]:
    """The assistant message of a finished choice, and its finish_reason: tool_calls parsed from the constrained
    output, or the plain text when the output was cut short (max_tokens, a stop string) and does not parse;
    with tool_choice "auto", the calls the parser finds in the text and the text around them."""
    if plan is not None and plan.parser is not None:
        extracted = plan.parser.extract(choice.text)
        calls = [call.to_openai() for call in extracted.calls] or None
        finish_reason = _auto_finish_reason(choice.finish_reason, len(extracted.calls))
        return ChatResponseMessage(content=extracted.content, tool_calls=calls), finish_reason
    if plan is None or choice.finish_reason != "stop":
        return ChatResponseMessage(content=choice.text), choice.finish_reason
    try:
        calls = tool_calls_of(plan, choice.text)
    except ValueError:  # cut short by a stop string: what was generated is the answer, as text
        return ChatResponseMessage(content=choice.text), choice.finish_reason
    # OpenAI reports "stop" when the caller named the function, "tool_calls" when the model chose to call.
    return ChatResponseMessage(content=None, tool_calls=calls), "stop" if plan.named else "tool_calls"


def _auto_finish_reason(engine_finish_reason: str | None, num_calls: int) -> str | None:
    """A reply with calls ends with "tool_calls", unless it was cut short ("length": a later call may be lost);
    one without calls keeps the engine's reason."""
    return "tool_calls" if num_calls and engine_finish_reason == "stop" else engine_finish_reason


def _check_chat_supported(request: ChatCompletionRequest) -> None:
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs=true.", "top_logprobs")
    if request.max_tokens is not None and request.max_completion_tokens is not None \
            and request.max_tokens != request.max_completion_tokens:
        raise bad_request(
            f"max_tokens={request.max_tokens} and max_completion_tokens={request.max_completion_tokens} disagree; "
            "pass only max_completion_tokens (max_tokens is its deprecated name).", "max_tokens",
        )


async def create_chat_completion(serving: OpenAIServing, request: ChatCompletionRequest, raw_request: Request):
    serving.check_model(request.model)
    serving.check_stream_options(request)
    _check_chat_supported(request)
    max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
    plan, structured = _structured_outputs(request, serving.config.auto_tool_parser)
    keeps_special_tokens = plan is not None and plan.parser is not None and plan.parser.marker_is_special_token
    if keeps_special_tokens and request.skip_special_tokens:
        request = request.model_copy(update={"skip_special_tokens": False})
    template_kwargs = dict(request.chat_template_kwargs or {})
    if request.tools:
        template_kwargs.setdefault("tools", request.tools)
    prompt = await serving.chat_prompt(request.messages, request.add_generation_prompt, template_kwargs)
    serving.check_length(prompt, max_tokens, "messages", max_tokens_param)
    num_top = (request.top_logprobs or 0) if request.logprobs else None
    params = serving.sampling_params(request, max_tokens, num_top, structured=structured)
    params.structured_grammar = await compiled_grammar(serving.engine, structured)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    choices = serving.submit(request_id, [prompt], params)
    prompt_tokens = len(prompt.token_ids)
    if request.stream:
        stream = _stream(serving, request, raw_request, request_id, choices, prompt_tokens, num_top, plan)
        return StreamingResponse(stream, media_type="text/event-stream")

    await serving.run_to_completion(raw_request, choices)
    response_choices = []
    for c in choices:
        message, finish_reason = _message(plan, c)
        logprobs = None if num_top is None else chat_logprobs(c.token_ids, c.logprobs, num_top, serving.tokenizer)
        response_choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason,
                                           stop_reason=c.stop_reason, logprobs=logprobs))
    response = ChatCompletionResponse(
        id=request_id,
        model=serving.model_name,
        choices=response_choices,
        usage=UsageInfo.of(prompt_tokens, sum(c.num_tokens for c in choices)),
        kv=kv_info(choices),
    )
    return JSONResponse(response.model_dump())


async def _stream(
    serving: OpenAIServing,
    request: ChatCompletionRequest,
    raw_request: Request,
    request_id: str,
    choices: list[Choice],
    prompt_tokens: int,
    num_top: int | None,
    plan: ToolPlan | None,
) -> AsyncIterator[str]:
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    created = int(time.time())

    def chunk(index: int | None, delta: dict, finish: str | None = None, stop_reason=None,
              usage: UsageInfo | None = None, logprobs: dict | None = None) -> str:
        choice_payloads = [] if index is None else [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}
        ]
        payload = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                   "model": serving.model_name, "choices": choice_payloads}
        if include_usage:
            payload["usage"] = usage.model_dump() if usage else None
        if usage:
            payload["kv"] = kv_info(choices).to_dict()
        return sse(payload)

    auto_streams = {choice.index: plan.parser.stream() for choice in choices} if plan and plan.parser else {}
    try:
        # The role comes first, as OpenAI sends it, before any token is ready.
        for choice in choices:
            yield chunk(choice.index, {"role": "assistant", "content": ""})
        async with abort_on_disconnect(raw_request, serving.engine, choices):
            async for choice, output in merge_outputs(serving.engine, choices):
                completion = output.outputs[0]
                choice.num_tokens += len(completion.token_ids)
                logprobs = None
                if num_top is not None and completion.token_ids:
                    logprobs = chat_logprobs(completion.token_ids, completion.logprobs or [], num_top,
                                             serving.tokenizer).model_dump()
                if auto_streams:
                    for delta in _auto_tool_deltas(auto_streams[choice.index], completion.text, output.finished,
                                                   logprobs):
                        yield chunk(choice.index, delta, logprobs=logprobs)
                        logprobs = None
                    if output.finished:
                        finish = _auto_finish_reason(completion.finish_reason, auto_streams[choice.index].num_calls)
                        yield chunk(choice.index, {}, finish, completion.stop_reason)
                    continue
                if plan is not None:
                    # Tool calls go out whole at the end: arguments are only known to parse once complete.
                    choice.text_parts.append(completion.text)
                elif completion.text or logprobs:
                    yield chunk(choice.index, {"content": completion.text}, logprobs=logprobs)
                if output.finished:
                    finish = completion.finish_reason
                    if plan is not None:
                        choice.finish_reason = finish
                        message, finish = _message(plan, choice)
                        yield chunk(choice.index, _tool_delta(message), logprobs=logprobs)
                    yield chunk(choice.index, {}, finish, completion.stop_reason)
        if include_usage:
            yield chunk(None, {}, usage=UsageInfo.of(prompt_tokens, sum(c.num_tokens for c in choices)))
    except Exception as exc:  # headers are out: the error travels in the stream
        yield sse(from_exception(exc).body())
    yield SSE_DONE


def _auto_tool_deltas(stream: ToolCallStream, text: str, finished: bool, logprobs: dict | None) -> list[dict]:
    """The deltas one piece of text makes under tool_choice "auto": content as it comes (a possible call marker
    held back), then each call whole, once it is complete and parses, numbered across the reply."""
    first_index = stream.num_calls
    parsed = stream.feed(text, final=finished)
    deltas = [{"content": parsed.content}] if parsed.content or (logprobs and not parsed.calls) else []
    deltas += [{"tool_calls": [{"index": first_index + offset, **call.to_openai()}]}
               for offset, call in enumerate(parsed.calls)]
    return deltas


def _tool_delta(message: ChatResponseMessage) -> dict:
    if message.tool_calls is None:
        return {"content": message.content}
    return {"tool_calls": [{"index": index, **call} for index, call in enumerate(message.tool_calls)]}
