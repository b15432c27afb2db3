"""POST /v1/chat/completions: messages through the model's chat template, then one completion per choice."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from pagellm.entrypoints.openai.beam_search import BeamSearchRequest, beam_search
from pagellm.entrypoints.openai.errors import bad_request, from_exception
from pagellm.entrypoints.openai.fields import refuse_unsupported, response_ids, stream_usage
from pagellm.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
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
    PromptInput,
    abort_on_disconnect,
    kv_info,
    merge_outputs,
    record,
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
from pagellm.outputs import RequestOutput


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


def _message(plan: ToolPlan | None, choice: Choice, role: str) -> tuple[ChatResponseMessage, str | None]:
    """The assistant message of a finished choice, and its finish_reason: tool_calls parsed from the constrained
    output, or the plain text when the output was cut short (max_tokens, a stop string) and does not parse;
    with tool_choice "auto", the calls the parser finds in the text and the text around them."""
    if plan is not None and plan.parser is not None:
        extracted = plan.parser.extract(choice.text)
        calls = [call.to_openai() for call in extracted.calls] or None
        finish_reason = _auto_finish_reason(choice.finish_reason, len(extracted.calls))
        return ChatResponseMessage(role=role, content=extracted.content, tool_calls=calls), finish_reason
    if plan is None or choice.finish_reason != "stop":
        return ChatResponseMessage(role=role, content=choice.text), choice.finish_reason
    try:
        calls = tool_calls_of(plan, choice.text)
    except ValueError:  # cut short by a stop string: what was generated is the answer, as text
        return ChatResponseMessage(role=role, content=choice.text), choice.finish_reason
    # OpenAI reports "stop" when the caller named the function, "tool_calls" when the model chose to call.
    return ChatResponseMessage(role=role, content=None, tool_calls=calls), "stop" if plan.named else "tool_calls"


def _auto_finish_reason(engine_finish_reason: str | None, num_calls: int) -> str | None:
    """A reply with calls ends with "tool_calls", unless it was cut short ("length": a later call may be lost);
    one without calls keeps the engine's reason."""
    return "tool_calls" if num_calls and engine_finish_reason == "stop" else engine_finish_reason


def _check_chat_supported(request: ChatCompletionRequest) -> None:
    if request.top_logprobs not in (None, 0) and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs=true.", "top_logprobs")
    if request.stream and request.prompt_logprobs not in (None, 0):
        raise bad_request("prompt_logprobs are not sent in a stream; drop stream or prompt_logprobs.",
                          "prompt_logprobs")
    if request.use_beam_search and request.stream:
        raise bad_request("use_beam_search cannot stream: the best beams are known only at the end; drop stream.",
                          "use_beam_search")
    if request.use_beam_search and request.prompt_logprobs is not None:
        raise bad_request("beam search does not compute prompt_logprobs; drop one of them.", "prompt_logprobs")
    if request.max_tokens is not None and request.max_completion_tokens is not None \
            and request.max_tokens != request.max_completion_tokens:
        raise bad_request(
            f"max_tokens={request.max_tokens} and max_completion_tokens={request.max_completion_tokens} disagree; "
            "pass only max_completion_tokens (max_tokens is its deprecated name).", "max_tokens",
        )


def _chat_template(serving: OpenAIServing, request: ChatCompletionRequest) -> str | None:
    """The request's chat template, when the server trusts requests with one (vLLM's rule: a template runs on the
    server, so only --trust-request-chat-template lets a client pass it)."""
    if request.chat_template is None:
        return None
    if not serving.config.trust_request_chat_template:
        raise bad_request("this server does not take chat templates from requests; drop chat_template (the server "
                          "uses its own), or start it with --trust-request-chat-template.", "chat_template")
    return request.chat_template


def _response_role(serving: OpenAIServing, request: ChatCompletionRequest) -> str:
    """A new message is the server's response role; without a generation prompt the reply goes on with the last
    message, in its role (as vLLM's get_chat_request_role)."""
    return serving.config.response_role if request.add_generation_prompt else request.messages[-1].role


def _echoed_content(request: ChatCompletionRequest, role: str) -> str:
    """vLLM's chat echo: the last message's content starts the reply when the reply is in its role."""
    last = request.messages[-1]
    if not request.echo or last.role != role or not last.content:
        return ""
    return last.content if isinstance(last.content, str) else "\n".join(part.text for part in last.content)


async def create_chat_completion(serving: OpenAIServing, request: ChatCompletionRequest, raw_request: Request):
    lora_request = serving.check_model(request.model)
    serving.check_stream_options(request)
    refuse_unsupported(request)
    _check_chat_supported(request)
    template = _chat_template(serving, request)
    max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
    plan, structured = _structured_outputs(request, serving.config.auto_tool_parser)
    if request.use_beam_search and structured is not None:
        raise bad_request("beam search takes no structured-output constraint or tool call; drop use_beam_search or "
                          "the constraint.", "use_beam_search")
    keeps_special_tokens = plan is not None and plan.parser is not None and plan.parser.marker_is_special_token
    if keeps_special_tokens and request.skip_special_tokens:
        request = request.model_copy(update={"skip_special_tokens": False})
    prompt = await serving.chat_prompt(
        request.messages, request.add_generation_prompt, request.chat_template_kwargs, chat_template=template,
        continue_final_message=request.continue_final_message, tools=request.tools, documents=request.documents,
        reasoning_effort=request.reasoning_effort, add_special_tokens=request.add_special_tokens,
    )
    prompt = serving.truncate(prompt, request.truncate_prompt_tokens, request.truncation_side)
    serving.check_length(prompt, max_tokens, "messages", max_tokens_param)
    num_top = serving.num_logprobs("top_logprobs", request.top_logprobs or 0) if request.logprobs else None
    prompt_logprobs = serving.num_logprobs("prompt_logprobs", request.prompt_logprobs)
    if prompt_logprobs is None and request.echo and not request.use_beam_search:
        # As vLLM: chat echo scores the prompt with top_logprobs (0 unless set) alternatives.
        prompt_logprobs = serving.num_logprobs("top_logprobs", request.top_logprobs or 0)
    role = _response_role(serving, request)
    response_id, engine_id = response_ids("chatcmpl", request, raw_request)
    priority = serving.priority(request, raw_request)
    if request.use_beam_search:
        choices = await _beam_search_choices(serving, request, raw_request, engine_id, prompt, max_tokens)
    else:
        params = serving.sampling_params(request, max_tokens, num_top, structured=structured,
                                         prompt_logprobs=prompt_logprobs)
        params.structured_grammar = await compiled_grammar(serving.engine, structured)
        choices = serving.submit(engine_id, [prompt], params, priority, request.cache_salt, lora_request)
        if request.stream:
            stream = _stream(serving, request, raw_request, response_id, choices, prompt, num_top, plan, role)
            return StreamingResponse(stream, media_type="text/event-stream")
        await serving.run_to_completion(raw_request, choices)

    echoed = _echoed_content(request, role)
    as_token_ids = bool(request.return_tokens_as_token_ids)
    response_choices = []
    for c in choices:
        message, finish_reason = _message(plan, c, role)
        if echoed:
            message.content = echoed + (message.content or "")
        logprobs = None if num_top is None else chat_logprobs(c.token_ids, c.logprobs, num_top, serving.tokenizer,
                                                              as_token_ids)
        response_choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason,
                                           stop_reason=c.stop_reason, logprobs=logprobs,
                                           token_ids=c.token_ids if request.return_token_ids else None))
    response = ChatCompletionResponse(
        id=response_id,
        model=serving.model_name,
        choices=response_choices,
        usage=UsageInfo.of(len(prompt.token_ids), sum(c.num_tokens for c in choices)),
        prompt_logprobs=prompt_logprobs_json(choices[0].prompt_logprobs),
        prompt_token_ids=prompt.token_ids if request.return_token_ids else None,
        prompt_text=await _prompt_text(serving, prompt) if request.return_prompt_text else None,
        kv=None if request.use_beam_search else kv_info(choices),
    )
    return JSONResponse(response.model_dump())


async def _prompt_text(serving: OpenAIServing, prompt: PromptInput) -> str:
    return prompt.text if prompt.text is not None else await serving.decode(prompt.token_ids)


async def _beam_search_choices(serving: OpenAIServing, request: ChatCompletionRequest, raw_request: Request,
                               engine_id: str, prompt: PromptInput, max_tokens: int | None) -> list[Choice]:
    """The beam_width (= n) best beams of the conversation as its choices."""
    search = BeamSearchRequest(beam_width=request.n,
                               max_tokens=serving.max_model_len - len(prompt.token_ids) if max_tokens is None
                               else max_tokens,
                               ignore_eos=request.ignore_eos, length_penalty=request.length_penalty,
                               include_stop_str_in_output=request.include_stop_str_in_output,
                               skip_special_tokens=request.skip_special_tokens, cache_salt=request.cache_salt)
    try:
        outputs = await beam_search(serving, raw_request, engine_id, prompt, search)
    except Exception as exc:  # the engine's verdict on a step request (queue full, dead engine)
        raise from_exception(exc) from exc
    choices = []
    for output in outputs:
        choice = Choice(output.index, 0, engine_id, None, sample_index=output.index)
        record(choice, RequestOutput(engine_id, prompt.text, prompt.token_ids, [output], True))
        choices.append(choice)
    return choices


async def _stream(
    serving: OpenAIServing,
    request: ChatCompletionRequest,
    raw_request: Request,
    response_id: str,
    choices: list[Choice],
    prompt: PromptInput,
    num_top: int | None,
    plan: ToolPlan | None,
    role: str,
) -> AsyncIterator[str]:
    """Chunks shaped as vLLM's: a role chunk per choice (with the prompt's ids and text when asked for), the echoed
    last message, then deltas; the last delta of a choice carries its finish_reason and stop_reason."""
    include_usage, continuous_usage = stream_usage(request)
    return_token_ids = bool(request.return_token_ids)
    as_token_ids = bool(request.return_tokens_as_token_ids)
    num_prompt = len(prompt.token_ids)
    created = int(time.time())
    # Each choice's token ids not yet sent (text held back sends no chunk; its ids go with the next one).
    unsent_ids: dict[int, list[int]] = {choice.index: [] for choice in choices}

    def chunk(choice_payload: dict | None, extra: dict | None = None, usage: dict | None = None) -> str:
        payload = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                   "model": serving.model_name, "choices": [] if choice_payload is None else [choice_payload]}
        payload.update(extra or {})
        if usage is not None:
            payload["usage"] = usage
        return sse(payload)

    def usage_so_far(choice: Choice) -> dict | None:
        if not continuous_usage:
            return None
        return {**UsageInfo.of(num_prompt, choice.num_tokens).counts(), "completion_tokens_details": None}

    def delta_chunk(choice: Choice, delta: dict, logprobs: dict | None = None, finish: str | None = None,
                    stop_reason=None) -> str:
        payload = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            payload["stop_reason"] = stop_reason
        ids = unsent_ids[choice.index]
        payload["token_ids"] = list(ids) if return_token_ids else None
        ids.clear()
        return chunk(payload, usage=usage_so_far(choice))

    auto_streams = {choice.index: plan.parser.stream() for choice in choices} if plan and plan.parser else {}
    echoed = _echoed_content(request, role)
    try:
        # The role comes first, as OpenAI sends it, before any token is ready.
        prompt_fields = {
            "prompt_token_ids": prompt.token_ids if return_token_ids else None,
            "prompt_text": await _prompt_text(serving, prompt) if request.return_prompt_text else None,
        }
        for choice in choices:
            role_payload = {"index": choice.index, "delta": {"role": role, "content": ""}, "logprobs": None,
                            "finish_reason": None}
            yield chunk(role_payload, prompt_fields, usage_so_far(choice))
        if echoed:
            for choice in choices:
                echo_payload = {"index": choice.index, "delta": {"content": echoed}, "logprobs": None,
                                "finish_reason": None}
                yield chunk(echo_payload, usage=usage_so_far(choice))
        async with abort_on_disconnect(raw_request, serving.engine, choices):
            async for choice, output in merge_outputs(serving.engine, choices):
                completion = output.outputs[0]
                choice.num_tokens += len(completion.token_ids)
                unsent_ids[choice.index].extend(completion.token_ids)
                logprobs = None
                if num_top is not None and completion.token_ids:
                    logprobs = chat_logprobs(completion.token_ids, completion.logprobs or [], num_top,
                                             serving.tokenizer, as_token_ids).model_dump()
                if auto_streams:
                    for delta in _auto_tool_deltas(auto_streams[choice.index], completion.text, output.finished,
                                                   logprobs):
                        yield delta_chunk(choice, delta, logprobs)
                        logprobs = None
                    if output.finished:
                        finish = _auto_finish_reason(completion.finish_reason, auto_streams[choice.index].num_calls)
                        yield delta_chunk(choice, {}, logprobs, finish, completion.stop_reason)
                    continue
                if plan is not None:
                    # Tool calls go out whole at the end: arguments are only known to parse once complete.
                    choice.text_parts.append(completion.text)
                    if output.finished:
                        choice.finish_reason = completion.finish_reason
                        message, finish = _message(plan, choice, role)
                        yield delta_chunk(choice, _tool_delta(message), logprobs)
                        yield delta_chunk(choice, {}, None, finish, completion.stop_reason)
                    continue
                if output.finished:
                    yield delta_chunk(choice, {"content": completion.text}, logprobs, completion.finish_reason,
                                      completion.stop_reason)
                elif completion.text or logprobs or (return_token_ids and completion.token_ids):
                    yield delta_chunk(choice, {"content": completion.text}, logprobs)
        if include_usage:
            usage = UsageInfo.of(num_prompt, sum(c.num_tokens for c in choices)).counts()
            yield chunk(None, {"kv": kv_info(choices).to_dict()}, usage)
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
