"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from pagellm.entrypoints.openai.errors import bad_request, from_exception, not_supported
from pagellm.entrypoints.openai.logprobs import completion_logprobs
from pagellm.entrypoints.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from pagellm.entrypoints.openai.serving import (
    SSE_DONE,
    Choice,
    OpenAIServing,
    PromptInput,
    abort_on_disconnect,
    kv_info,
    merge_outputs,
    sse,
)
from pagellm.entrypoints.openai.structured import compiled_grammar, requested_structured_outputs


async def create_completion(serving: OpenAIServing, request: CompletionRequest, raw_request: Request):
    serving.check_model(request.model)
    serving.check_stream_options(request)
    if request.best_of is not None and request.best_of > request.n and request.stream:
        raise bad_request(f"best_of={request.best_of} > n={request.n} cannot stream: which n completions are "
                          "returned is known only at the end; drop stream or best_of.", "best_of")
    if request.suffix is not None:
        raise not_supported("suffix", request.suffix)
    if request.echo and request.logprobs is not None:
        raise bad_request("echo with logprobs would need the prompt's log-probabilities, which this server does "
                          "not return yet; drop echo or logprobs.", "echo", "unsupported_parameter")
    prompts = await serving.completion_prompts(request.prompt)
    for prompt in prompts:
        serving.check_length(prompt, request.max_tokens, "prompt")
    params = serving.sampling_params(request, request.max_tokens, request.logprobs, request.best_of,
                                     requested_structured_outputs(request))
    params.structured_grammar = await compiled_grammar(serving.engine, params.structured_outputs)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    choices = serving.submit(request_id, prompts, params)
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    if request.stream:
        stream = _stream(serving, request, raw_request, request_id, prompts, choices, prompt_tokens)
        return StreamingResponse(stream, media_type="text/event-stream")

    await serving.run_to_completion(raw_request, choices)
    response_choices = []
    for c in choices:
        logprobs = None
        if request.logprobs is not None:
            logprobs = completion_logprobs(c.token_ids, c.logprobs, request.logprobs, 0, serving.tokenizer)
        echo = await _echo_text(serving, prompts[c.prompt_index]) if request.echo else ""
        response_choices.append(CompletionChoice(index=c.index, text=echo + c.text, logprobs=logprobs,
                                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    response = CompletionResponse(id=request_id, model=serving.model_name, choices=response_choices,
                                  usage=UsageInfo.of(prompt_tokens, sum(c.num_tokens for c in choices)),
                                  kv=kv_info(choices))
    return JSONResponse(response.model_dump())


async def _stream(
    serving: OpenAIServing,
    request: CompletionRequest,
    raw_request: Request,
    request_id: str,
    prompts: list[PromptInput],
    choices: list[Choice],
    prompt_tokens: int,
) -> AsyncIterator[str]:
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    created = int(time.time())

    def chunk(choice_payloads: list[dict], usage: UsageInfo | None = None) -> str:
        payload = {"id": request_id, "object": "text_completion", "created": created, "model": serving.model_name,
                   "choices": choice_payloads}
        if include_usage:
            payload["usage"] = usage.model_dump() if usage else None
        if usage:
            payload["kv"] = kv_info(choices).to_dict()
        return sse(payload)

    echo_pending = {c.index for c in choices} if request.echo else set()
    # Where each choice's next token text starts, for logprobs' text_offset.
    text_offsets = {c.index: 0 for c in choices}
    try:
        async with abort_on_disconnect(raw_request, serving.engine, choices):
            async for choice, output in merge_outputs(serving.engine, choices):
                completion = output.outputs[0]
                choice.num_tokens += len(completion.token_ids)
                text = completion.text
                if choice.index in echo_pending:
                    echo_pending.discard(choice.index)
                    text = await _echo_text(serving, prompts[choice.prompt_index]) + text
                logprobs = None
                if request.logprobs is not None and completion.token_ids:
                    logprobs = completion_logprobs(completion.token_ids, completion.logprobs or [], request.logprobs,
                                                   text_offsets[choice.index], serving.tokenizer)
                    text_offsets[choice.index] += sum(len(token) for token in logprobs.tokens)
                if not text and logprobs is None and not output.finished:
                    continue  # held back (a partial character, or what may begin a stop string)
                finish = completion.finish_reason if output.finished else None
                yield chunk([{"index": choice.index, "text": text,
                              "logprobs": logprobs.model_dump() if logprobs else None, "finish_reason": finish,
                              "stop_reason": completion.stop_reason if output.finished else None}])
        if include_usage:
            yield chunk([], UsageInfo.of(prompt_tokens, sum(c.num_tokens for c in choices)))
    except Exception as exc:  # headers are out: the error travels in the stream
        yield sse(from_exception(exc).body())
    yield SSE_DONE


async def _echo_text(serving: OpenAIServing, prompt: PromptInput) -> str:
    return prompt.text if prompt.text is not None else await serving.decode(prompt.token_ids)
